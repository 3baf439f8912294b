"""What every DeepSpeed training stage shares: process-group setup, the DeepSpeed config, step
checkpoints with exact-resume state, the metrics log, and Hugging Face export."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import socket
import sys
from pathlib import Path

import numpy as np
import torch

DS_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "deepspeed"
COMPLETE = "complete.json"


# --- processes ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join the process group the launcher set up (or make a group of one): (rank, world, device).
    On a machine without a GPU, DeepSpeed's CPU accelerator and gloo; cores shared among local ranks."""
    cuda = torch.cuda.is_available()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")
    if "RANK" not in os.environ:  # no launcher: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    import deepspeed

    if not cuda:
        # DeepSpeed's shared-memory all-reduce op serves its inference all-reduce only. Its JIT build
        # (once per machine) holds a file lock that a run killed meanwhile leaves behind, and every later
        # run then waits on it forever. Training does not use it: gloo does the reductions.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    else:  # each local rank gets its own share of the cores, pinned: no oversubscription, no migration
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        cpus = sorted(os.sched_getaffinity(0))
        share = max(1, len(cpus) // local_world)
        if len(cpus) >= local_world:
            os.sched_setaffinity(0, cpus[local_rank * share:(local_rank + 1) * share])
        torch.set_num_threads(share)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device


def barrier() -> None:
    torch.distributed.barrier()


def all_mean(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.item() / torch.distributed.get_world_size()


def all_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.tolist()


# --- DeepSpeed config --------------------------------------------------------------------------


def deepspeed_config(dist, train, world: int, device: torch.device) -> dict:
    """configs/deepspeed/zero<N>.json with the batch, optimizer, clipping, precision and offload filled in."""
    cfg = json.loads((DS_CONFIGS / f"zero{dist.zero_stage}.json").read_text())
    cfg.update(
        train_batch_size=train.global_batch_size,
        train_micro_batch_size_per_gpu=train.micro_batch_size,
        gradient_accumulation_steps=train.global_batch_size // (train.micro_batch_size * world),
        gradient_clipping=train.grad_clip,
        optimizer={"type": "AdamW", "params": {"lr": train.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                               "weight_decay": train.weight_decay, "torch_adam": True, "foreach": True}},
    )
    if dist.offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
        cfg["zero_force_ds_cpu_optimizer"] = False  # torch AdamW on the CPU: no cpu_adam build
    if device.type == "cuda" and dist.precision in ("auto", "bf16"):
        cfg["bf16"] = {"enabled": True}
    return cfg


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on biases, norms)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(train):
    """lr multiplier at a step: linear warmup, then cosine decay to min_lr/lr at max_steps."""
    floor = min(1.0, train.min_lr / train.lr)  # never decay upwards

    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        progress = min(1.0, (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def init_engine(model, train, dist, world: int, device: torch.device):
    """deepspeed.initialize with AdamW (decay on matrices), warmup+cosine lr and the section's batch.
    Returns (engine, scheduler, gradient accumulation steps)."""
    import deepspeed

    config = deepspeed_config(dist, train, world, device)
    with startup_oom(dist, train):
        engine, _, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, train.weight_decay), config=config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(train)))
    return engine, scheduler, config["gradient_accumulation_steps"]


def is_oom(err: BaseException) -> bool:
    """A GPU out-of-memory error, or the CPU allocator's."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


@contextlib.contextmanager
def startup_oom(dist, train, active: bool = True):
    """Running out of memory inside the block (engine set-up, the first step) ends the stage with one
    message naming the settings to change, instead of an allocator traceback."""
    from pipeline.errors import UserError

    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not (active and is_oom(e)):
            raise
        name = type(train).__name__.removesuffix("Section").lower()  # the config section: pretrain, sft, ...
        raise UserError(
            f"out of memory at start-up ({e.__class__.__name__}) with distributed.zero_stage={dist.zero_stage}, "
            f"distributed.offload_optimizer={dist.offload_optimizer}, {name}.micro_batch_size={train.micro_batch_size}; "
            "raise distributed.zero_stage, set distributed.offload_optimizer or distributed.activation_checkpointing, "
            f"or lower {name}.micro_batch_size") from None


# --- step checkpoints ----------------------------------------------------------------------------


def tag_of(step: int) -> str:
    return f"step-{step:08d}"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": list(np.random.get_state()), "torch": torch.get_rng_state()}
    state["numpy"][1] = state["numpy"][1].tolist()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def save_step(engines: dict, ckpt_root: Path, step: int, client_state: dict, rank: int, keep_last: int) -> None:
    """A step checkpoint: each DeepSpeed engine's weights, optimizer and scheduler shards under
    step-N/<name>/, the client state, and this rank's RNG states. Rank 0 marks it complete (every file
    with its size) once all ranks have written, then prunes the oldest."""
    d = ckpt_root / tag_of(step)
    for name, engine in engines.items():
        engine.save_checkpoint(str(d), tag=name, client_state=client_state)
    torch.save(rng_state(), d / f"rng-rank{rank}.pt")
    barrier()
    if rank == 0:
        files = {str(f.relative_to(d)): f.stat().st_size for f in sorted(d.rglob("*")) if f.is_file()}
        tmp = d / f".{COMPLETE}.tmp"
        tmp.write_text(json.dumps({"step": step, "files": files}))
        os.replace(tmp, d / COMPLETE)
        for old in sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()


def checkpoint_is_valid(d: Path) -> str | None:
    """None if the checkpoint is complete, else why not."""
    try:
        files = json.loads((d / COMPLETE).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return "not marked complete"
    for rel, size in files.items():
        f = d / rel
        if not f.is_file():
            return f"missing {rel}"
        if f.stat().st_size != size:
            return f"truncated {rel} ({f.stat().st_size} of {size} bytes)"
    return None


def newest_valid_checkpoint(ckpt_root: Path, rank: int) -> Path | None:
    """The newest complete step checkpoint; invalid newer ones are skipped with a warning."""
    for d in sorted((p for p in ckpt_root.glob("step-*") if p.is_dir()), reverse=True):
        problem = checkpoint_is_valid(d)
        if problem is None:
            return d
        if rank == 0:
            print(f"warning: skipping checkpoint {d}: {problem}", file=sys.stderr, flush=True)
    return None


def resume(engines: dict, ckpt_root: Path, rank: int, stage: str) -> dict | None:
    """Load the newest valid step checkpoint, if any, and say so; return its client state."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    ckpt = newest_valid_checkpoint(ckpt_root, rank)
    if ckpt is None:
        return None
    for name, engine in engines.items():
        _, client_state = engine.load_checkpoint(str(ckpt), tag=name, load_optimizer_states=True,
                                                 load_lr_scheduler_states=True)
    set_rng_state(torch.load(ckpt / f"rng-rank{rank}.pt", weights_only=True))
    if rank == 0:
        print(f"[{stage}] resumed from {ckpt} at step {client_state['step']}", flush=True)
    return client_state


# --- metrics log ---------------------------------------------------------------------------------


class MetricsLog:
    """Rank 0 writes each record as a JSONL line and TensorBoard scalars (`logs/metrics.jsonl`, `logs/tb`)."""

    def __init__(self, log_dir: Path, rank: int, resume_step: int = 0):
        self.rank = rank
        if rank != 0:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        if self.path.exists():  # drop what a killed run logged after the checkpoint we resume from
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(log_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, **metrics) -> None:
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and v is not None:
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.rank == 0:
            self.tb.close()


# --- export ----------------------------------------------------------------------------------------


def full_state_dict(model: torch.nn.Module, zero_stage: int, rank: int) -> dict | None:
    """The whole model's weights on rank 0 (ZeRO-3 partitions gathered); None on other ranks."""
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            sd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if rank == 0 else None
        return sd
    return {k: v.detach().cpu() for k, v in model.state_dict().items()} if rank == 0 else None


def export_hf(model, state_dict: dict, tokenizer, out: Path, stop_token_ids: list[int]) -> None:
    """A Hugging Face directory: safetensors weights, config, tokenizer with chat template, and a
    generation config that stops at any of `stop_token_ids` (end of turn, end of text)."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=stop_token_ids, pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=tokenizer.bos_token_id, max_new_tokens=64).save_pretrained(out)
