"""DeepSpeed engines as every training stage builds them: the ZeRO config from configs/deepspeed, AdamW (or
DeepSpeed's Muon on the hidden matrices) with decay on matrices only, warmup then cosine decay to min_lr
(transformers' `cosine_with_min_lr`, the one the TRL stages use too) or warmup-stable-decay, and one clear message
when memory runs out at start-up."""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable

import torch

from gptforge.core.errors import UserError
from gptforge.model.train.distributed import load_muon, return_freed_memory
from gptforge.core.files import CONFIGS

DS_CONFIGS = CONFIGS / "deepspeed"


def zero_config(dist, device: torch.device, hidden_size: int | None = None) -> dict:
    """configs/deepspeed/zero<N>.json with CPU offload and bf16 as the `distributed` section asks; batch
    sizes, clipping and the optimizer are left "auto" (the Trainer fills them) or to `deepspeed_config`.
    Given the model's hidden size, ZeRO-3's buckets are sized to it as transformers sizes its "auto" ones
    (hidden² elements), and the parameters it keeps gathered (live, or kept for reuse) to under a layer's
    (10·hidden², DeepSpeed's 1e9 at most), and the optimizer steps a layer's worth (12·hidden²) at a time, so that
    a small model does not hold buffers meant for a large one, nor stay gathered whole between forward and
    backward, nor step its whole partition's temporaries at once. Under ZeRO-3 this process's allocator is also
    made to return freed blocks (`return_freed_memory`)."""
    cfg = json.loads((DS_CONFIGS / f"zero{dist.zero_stage}.json").read_text())
    if dist.zero_stage == 3:  # every ZeRO-3 model of a stage is set up from this config, before it is built
        return_freed_memory()
    if dist.zero_stage == 3 and hidden_size:
        cfg["zero_optimization"].update(reduce_bucket_size=hidden_size * hidden_size,
                                        stage3_prefetch_bucket_size=int(0.9 * hidden_size * hidden_size),
                                        stage3_param_persistence_threshold=10 * hidden_size,
                                        stage3_max_live_parameters=min(10**9, 10 * hidden_size * hidden_size),
                                        stage3_max_reuse_distance=min(10**9, 10 * hidden_size * hidden_size),
                                        sub_group_size=min(10**9, 12 * hidden_size * hidden_size))
    if dist.offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
        cfg["zero_force_ds_cpu_optimizer"] = False  # torch AdamW on the CPU: no cpu_adam build
    if uses_bf16(dist, device):
        cfg["bf16"] = {"enabled": True}
    return cfg


def uses_bf16(dist, device: torch.device) -> bool:
    return device.type == "cuda" and dist.precision in ("auto", "bf16")


def deepspeed_config(dist, train, world: int, device: torch.device, hidden_size: int | None = None) -> dict:
    """The ZeRO config with the section's batch, AdamW and clipping filled in (ZeRO-3's buckets sized to the
    model's hidden size, when given)."""
    cfg = zero_config(dist, device, hidden_size)
    cfg.update(
        train_batch_size=train.global_batch_size,
        train_micro_batch_size_per_gpu=train.micro_batch_size,
        gradient_accumulation_steps=train.global_batch_size // (train.micro_batch_size * world),
        gradient_clipping=train.grad_clip,
        optimizer=optimizer_config(train),
    )
    if cfg["optimizer"]["type"] == "Muon":
        # DeepSpeed's ZeRO Muon orthogonalises whole matrices, which a reduce-scatter would leave in slices; and its
        # ZeRO 1-3 take the norm to clip by after the orthogonalisation, so that each matrix's update (norm about
        # the square root of its smaller side) would be clipped down to a tenth of Muon's step at this model's
        # width. Muon's update has its scale by construction: no clipping (measured: the same step as ZeRO-0's).
        cfg["zero_optimization"]["reduce_scatter"] = False
        cfg["gradient_clipping"] = 0.0
        if "bf16" in cfg:  # DeepSpeed's bf16 Muon accumulates its gradients in fp32
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def optimizer_config(train) -> dict:
    """DeepSpeed's optimizer block: AdamW (torch's); or, with `optimizer: muon`, DeepSpeed's Muon
    (`MuonWithAuxAdam`): deepspeed.initialize tags the 2-D weights that are neither embeddings nor the head
    `use_muon`, Muon (Newton-Schulz orthogonalised Nesterov momentum) steps them at `muon_lr`, and torch's AdamW the
    rest at `lr`. Under ZeRO 1 and 2 each matrix's gradient is orthogonalised whole where its partition is filled
    (the slices of a matrix split over ranks all-gathered first), under ZeRO-3 in the optimizer's sub-group loop; the
    momentum is partitioned as Adam's moments are, and saved in the same checkpoints. A section without the
    setting (the online stages' own) trains with AdamW."""
    adam = {"lr": train.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": train.weight_decay, "torch_adam": True}
    if getattr(train, "optimizer", "adamw") == "muon":
        return {"type": "Muon", "params": {**adam, "muon_lr": train.muon_lr, "momentum": train.muon_momentum}}
    return {"type": "AdamW", "params": {**adam, "foreach": True}}


def build_config(config: dict) -> dict:
    """The config that builds a model (zero.Init, from_pretrained under ZeRO-3) before the engine exists, and so
    before any sequence-parallel groups: without the batch sizes, which DeepSpeed then counts over the whole world
    itself."""
    return {k: v for k, v in config.items() if k not in ("train_batch_size", "gradient_accumulation_steps")}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on biases, norms). A parameter partitioned by ZeRO-3 at build time holds
    an empty tensor: its shape is `ds_shape`."""
    def matrix(p) -> bool:
        return len(getattr(p, "ds_shape", p.shape)) >= 2

    decay = [p for p in model.parameters() if p.requires_grad and matrix(p)]
    no_decay = [p for p in model.parameters() if p.requires_grad and not matrix(p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def min_lr_rate(train) -> float:
    """min_lr as a fraction of lr, never above 1: a schedule never decays upwards."""
    return min(1.0, train.min_lr / train.lr)


def lr_factor(step: int, warmup: int, total: int, rate: float, decay: float | None = None) -> float:
    """The learning rate over its peak at `step`: linear warmup from 0 over `warmup` steps, then cosine decay to
    `rate` at `total`. The factor of transformers' `cosine_with_min_lr` schedule, which the TRL stages take, written
    here because importing transformers' schedules imports its Trainer's utilities (and PEFT) in every rank. With
    `decay` (a share of `total`), warmup-stable-decay (WSD, MiniCPM's): the peak held until the last `decay` of the
    steps, then a linear decay to `rate` at `total`; a run's stable phase does not depend on where it ends. Its
    warmup starts at `rate`, as transformers' `warmup_stable_decay` (the TRL stages') does."""
    if decay is not None:
        if step < warmup:
            return rate + (1 - rate) * step / warmup
        start = max(warmup, total - round(decay * total))
        return 1.0 if step < start else max(rate, 1 - (1 - rate) * (step - start) / max(1, total - start))
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)) * (1 - rate) + rate)


def lr_schedule(optimizer, train):
    """Linear warmup from 0 over warmup_steps, then cosine decay to min_lr at max_steps (or, with `schedule: wsd`,
    the peak held, then a linear decay over the last decay_fraction of the steps). Each parameter group's own peak
    (Muon's muon_lr, AdamW's lr) is scaled by the same factor."""
    wsd = getattr(train, "schedule", "cosine") == "wsd"
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, warmup=train.warmup_steps, total=train.max_steps, rate=min_lr_rate(train),
        decay=train.decay_fraction if wsd else None))


def inference_config(dist, device: torch.device, world: int, hidden_size: int | None, partition: bool) -> dict:
    """The config of models only run forward (`frozen`) outside a training stage: ZeRO-3 when `partition`, else
    ZeRO-0; the distributed section's precision; one sequence a micro-batch (DeepSpeed wants a batch)."""
    cfg = zero_config(dist.model_copy(update={"zero_stage": 3 if partition else 0, "offload_optimizer": False}),
                      device, hidden_size)
    cfg.update(train_batch_size=world, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    return cfg


@contextlib.contextmanager
def partitioned(config: dict):
    """Under ZeRO-3, the models built in the block (from_pretrained, from_config) are partitioned as they are
    built: transformers reads the DeepSpeed config and builds under deepspeed.zero.Init, and from_pretrained
    reads the weights on rank 0 only (memory-mapped), a module at a time, handing each rank its partition. No
    rank holds the whole model. Other stages: a plain block."""
    if config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    hf_config = HfDeepSpeedConfig(config)  # transformers holds it by a weak reference: kept alive for the block
    try:
        yield
    finally:
        del hf_config
        unset_hf_deepspeed_config()


def frozen(model, config: dict, device: torch.device):
    """A model that is only run forward (a reference or reward model, a sampler) as the training engines hold
    theirs: under ZeRO-3 a DeepSpeed engine without an optimizer over the partitioned model (build it inside
    `partitioned`); otherwise the model on the device, in the engines' precision."""
    model.eval().requires_grad_(False)
    if config["zero_optimization"]["stage"] != 3:
        return model.to(device, torch.bfloat16) if config.get("bf16", {}).get("enabled") else model.to(device)
    import deepspeed

    inference = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler", "gradient_clipping")}
    inference["zero_optimization"] = {k: v for k, v in config["zero_optimization"].items()
                                      if not k.startswith("offload_optimizer")}
    engine, *_ = deepspeed.initialize(model=model, config=inference)
    engine.eval()  # DeepSpeedEngine.train returns None, not the engine
    return engine


def unwrap(model):
    """The transformers model inside a DeepSpeed engine (for generate), or the model itself."""
    return getattr(model, "module", model)


def init_engine(model, config: dict, train, dist, universal: bool = False, verdict: Callable[[], str] | None = None,
                mpu=None):
    """deepspeed.initialize with `config` (from deepspeed_config: AdamW, the section's batch), decay on matrices
    only and warmup+cosine lr; `universal`: to load a universal checkpoint (an elastic resume); `verdict`: the
    planner's, for an out-of-memory message; `mpu`: sequence-parallel groups (gptforge.model.train.sequence_parallel).
    Returns (engine, scheduler, gradient accumulation steps)."""
    import deepspeed

    if universal:
        config = {**config, "checkpoint": {"load_universal": True}}
    muon = config["optimizer"]["type"] == "Muon"
    if muon:
        load_muon()
    with startup_oom(dist, train, verdict=verdict), muon_matrices(model) if muon else contextlib.nullcontext():
        engine, _, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, train.weight_decay), config=config,
            lr_scheduler=lambda opt: lr_schedule(opt, train), mpu=mpu)
    if muon and engine.global_rank == 0:
        sizes = [(getattr(p, "ds_numel", p.numel()), p.use_muon) for p in model.parameters() if p.requires_grad]
        matrices = sum(n for n, on in sizes if on)
        rest = sum(n for n, _ in sizes) - matrices
        print(f"[{section_name(train)}] Muon on {sum(on for _, on in sizes)} matrices ({matrices / 1e6:.2f}M "
              f"parameters, lr {train.muon_lr:g}), AdamW on the rest ({rest / 1e6:.2f}M, lr {train.lr:g})", flush=True)
    return engine, scheduler, config["gradient_accumulation_steps"]


def section_name(train) -> str:
    """The config section of a section object: pretrain, sft, reward, ..."""
    return type(train).__name__.removesuffix("Section").lower()


def embedding_params(model) -> set[int]:
    """The ids of the model's embedding tables and of its head, whatever it is (a language model's, tied or not, a
    reward model's `score`): every parameter outside the transformers model's backbone (`base_model`; under PEFT,
    that of the model it wraps). What Muon leaves to AdamW."""
    inner = unwrap(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    backbone = {id(p) for p in getattr(inner, "base_model", inner).parameters()}
    tables = [p for m in inner.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()]
    return {id(p) for p in tables} | {id(p) for p in inner.parameters() if id(p) not in backbone}


@contextlib.contextmanager
def muon_matrices(model):
    """Inside the block, deepspeed.initialize tags Muon's parameters as DeepSpeed does (2-D, not named `embed` or
    `lm_head`), and then every embedding table and the head AdamW's whatever their names: GPT-2's `wte` and `wpe`
    (and the head tied to `wte`) are matrices DeepSpeed's names would give to Muon."""
    import deepspeed

    tag = deepspeed.set_optimizer_flags
    tables = embedding_params(model)

    def flags(config_class, module):
        tag(config_class, module)
        for p in module.parameters():
            if id(p) in tables:
                p.use_muon = False

    deepspeed.set_optimizer_flags = flags
    try:
        yield
    finally:
        deepspeed.set_optimizer_flags = tag


def is_oom(err: BaseException) -> bool:
    """A GPU out-of-memory error, or the CPU allocator's."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


@contextlib.contextmanager
def startup_oom(dist, train, active: bool = True, verdict: Callable[[], str] | None = None):
    """Running out of memory inside the block (engine set-up, the first step) ends the stage with one
    message naming the settings to change and the planner's verdict (`verdict()`), instead of an allocator
    traceback."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not (active and is_oom(e)):
            raise
        name = section_name(train)
        raise UserError(
            f"out of memory at start-up ({e.__class__.__name__}) with distributed.zero_stage={dist.zero_stage}, "
            f"distributed.offload_optimizer={dist.offload_optimizer}, "
            f"{name}.micro_batch_size={train.micro_batch_size}; "
            "raise distributed.zero_stage, set distributed.offload_optimizer or distributed.activation_checkpointing, "
            f"or lower {name}.micro_batch_size" + (f"; {verdict()}" if verdict else "")) from None


def grad_norm(engine) -> float | None:
    """The global gradient norm of the engine's last optimizer step, before clipping."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)
