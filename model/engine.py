"""DeepSpeed engines as every training stage builds them: the ZeRO config from configs/deepspeed, AdamW with
decay on matrices only, warmup then cosine decay to min_lr (transformers' schedule, the one the TRL stages
use too), and one clear message when memory runs out at start-up."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from gptforge.core.errors import UserError

DS_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "deepspeed"


def zero_config(dist, device: torch.device) -> dict:
    """configs/deepspeed/zero<N>.json with CPU offload and bf16 as the `distributed` section asks; batch
    sizes, clipping and the optimizer are left "auto" (the Trainer fills them) or to `deepspeed_config`."""
    cfg = json.loads((DS_CONFIGS / f"zero{dist.zero_stage}.json").read_text())
    if dist.offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
        cfg["zero_force_ds_cpu_optimizer"] = False  # torch AdamW on the CPU: no cpu_adam build
    if uses_bf16(dist, device):
        cfg["bf16"] = {"enabled": True}
    return cfg


def uses_bf16(dist, device: torch.device) -> bool:
    return device.type == "cuda" and dist.precision in ("auto", "bf16")


def deepspeed_config(dist, train, world: int, device: torch.device) -> dict:
    """The ZeRO config with the section's batch, AdamW and clipping filled in."""
    cfg = zero_config(dist, device)
    cfg.update(
        train_batch_size=train.global_batch_size,
        train_micro_batch_size_per_gpu=train.micro_batch_size,
        gradient_accumulation_steps=train.global_batch_size // (train.micro_batch_size * world),
        gradient_clipping=train.grad_clip,
        optimizer={"type": "AdamW", "params": {"lr": train.lr, "betas": [0.9, 0.95], "eps": 1e-8, "foreach": True,
                                               "weight_decay": train.weight_decay, "torch_adam": True}},
    )
    return cfg


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on biases, norms)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def min_lr_rate(train) -> float:
    """min_lr as a fraction of lr, never above 1: a schedule never decays upwards."""
    return min(1.0, train.min_lr / train.lr)


def lr_schedule(optimizer, train):
    """Linear warmup from 0 over warmup_steps, then cosine decay to min_lr at max_steps."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, train.warmup_steps, train.max_steps,
                                                        min_lr_rate=min_lr_rate(train))


def init_engine(model, train, dist, world: int, device: torch.device, universal: bool = False):
    """deepspeed.initialize with AdamW (decay on matrices), warmup+cosine lr and the section's batch; `universal`:
    to load a universal checkpoint (an elastic resume). Returns (engine, scheduler, gradient accumulation steps)."""
    import deepspeed

    config = deepspeed_config(dist, train, world, device)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    with startup_oom(dist, train):
        engine, _, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, train.weight_decay), config=config,
            lr_scheduler=lambda opt: lr_schedule(opt, train))
    return engine, scheduler, config["gradient_accumulation_steps"]


def is_oom(err: BaseException) -> bool:
    """A GPU out-of-memory error, or the CPU allocator's."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


@contextlib.contextmanager
def startup_oom(dist, train, active: bool = True):
    """Running out of memory inside the block (engine set-up, the first step) ends the stage with one
    message naming the settings to change, instead of an allocator traceback."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not (active and is_oom(e)):
            raise
        name = type(train).__name__.removesuffix("Section").lower()  # the config section: pretrain, sft, ...
        raise UserError(
            f"out of memory at start-up ({e.__class__.__name__}) with distributed.zero_stage={dist.zero_stage}, "
            f"distributed.offload_optimizer={dist.offload_optimizer}, "
            f"{name}.micro_batch_size={train.micro_batch_size}; "
            "raise distributed.zero_stage, set distributed.offload_optimizer or distributed.activation_checkpointing, "
            f"or lower {name}.micro_batch_size") from None


def grad_norm(engine) -> float | None:
    """The global gradient norm of the engine's last optimizer step, before clipping."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)
