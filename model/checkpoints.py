"""Step checkpoints with everything an exact resume needs: each DeepSpeed engine's weights, optimizer and
scheduler (ZeRO shards as DeepSpeed writes them), the loop's own state (step, loader position) and every
rank's RNG states. A checkpoint counts only once rank 0 has marked it complete, listing every file."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from gptforge.model.distributed import barrier

COMPLETE = "complete.json"


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
