"""Step checkpoints with everything an exact resume needs: each DeepSpeed engine's weights, optimizer and
scheduler (ZeRO shards as DeepSpeed writes them), the loop's own state (step, loader position) and every
rank's RNG states. An adapter stage's checkpoints hold its adapters and their optimizer, not the frozen base.

A checkpoint counts only once it is marked complete: `complete.json` lists every file with its size and sha256
(each rank hashes its share). A checkpoint whose files do not match it is skipped, with a warning, for the one
before it; the TRL stages' Trainer checkpoints are recorded and checked the same way. Nothing in a checkpoint
can run code: every load goes through `torch.load(weights_only=True)` (`no_pickled_code`), which builds tensors,
containers and the few types DeepSpeed and the Trainer store, and refuses anything else.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from gptforge.core.errors import UserError, storage_error
from gptforge.core.files import sha256_file, write_json_atomic
from gptforge.model.train.distributed import barrier

COMPLETE = "complete.json"


def _safe_globals() -> list:
    """What DeepSpeed's ZeRO checkpoints and the Trainer's RNG files hold besides tensors and containers."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    dtypes = [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32)]
    return [ZeroStageEnum, LossScaler, fragment_address, np._core.multiarray._reconstruct, np.ndarray, np.dtype,
            *dtypes]


@contextlib.contextmanager
def no_pickled_code():
    """Inside the block every `torch.load` is `weights_only=True` with the allow-list above, whatever its caller
    asked (DeepSpeed's checkpoint engine asks for weights_only=False). A file that holds anything else (a pickled
    callable) is refused with one error naming it, instead of running it."""
    original = torch.load

    def load(f, *args, weights_only=None, **kwargs):
        try:
            with torch.serialization.safe_globals(_safe_globals()):
                return original(f, *args, weights_only=True, **kwargs)
        except torch.serialization.pickle.UnpicklingError as e:
            raise UserError(f"{f}: refused to load, it holds more than tensors and plain data "
                            f"({str(e).splitlines()[-1] if str(e) else e}); delete the checkpoint") from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def _gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    parts = [None] * world
    torch.distributed.all_gather_object(parts, obj)
    return parts


def record_complete(d: Path, step: int, rank: int, world: int) -> None:
    """Mark a checkpoint complete once every rank has written: every file with its size and sha256, each rank
    hashing every world-th file, rank 0 writing complete.json atomically."""
    if world > 1:
        barrier()
    files = sorted(str(f.relative_to(d)) for f in d.rglob("*") if f.is_file() and f.name != COMPLETE)
    mine = {rel: {"size": (d / rel).stat().st_size, "sha256": sha256_file(d / rel)} for rel in files[rank::world]}
    records = {k: v for part in _gather(mine, world) for k, v in part.items()}
    if rank == 0:
        write_json_atomic(d / COMPLETE, {"step": step, "world": world, "files": dict(sorted(records.items()))})
    if world > 1:
        barrier()


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


@contextlib.contextmanager
def without_frozen_weights(engine):
    """For the block, the engine's module state (what a step checkpoint stores of the model) without any frozen
    weight under any of its names: DeepSpeed's exclude_frozen_parameters drops frozen parameters by
    `named_parameters()`, which names a tied weight (an output head tied to the embeddings) once, so the frozen
    embedding stayed in every checkpoint under the head's name."""
    module = engine.module
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    if not frozen:
        yield
        return

    def module_state_dict(destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        state = module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return {k: v for k, v in state.items() if k.removeprefix(prefix) not in frozen}

    engine.module_state_dict = module_state_dict  # an instance attribute, over DeepSpeed's method
    try:
        yield
    finally:
        del engine.module_state_dict


def save_step(engines: dict, ckpt_root: Path, step: int, client_state: dict, rank: int, world: int,
              keep_last: int, rank_state: dict | None = None) -> None:
    """A step checkpoint: each DeepSpeed engine's weights, optimizer and scheduler shards under step-N/<name>/,
    the client state, this rank's RNG states and its own `rank_state` (plain data: the rollouts in flight of
    gptforge.model.sampling.workers); marked complete once all ranks have written, then the oldest pruned."""
    d = ckpt_root / tag_of(step)
    try:
        for name, engine in engines.items():
            # an adapter stage's frozen base is not saved: it is the stage's input, loaded again on resume
            with without_frozen_weights(engine):
                engine.save_checkpoint(str(d), tag=name, client_state=client_state, exclude_frozen_parameters=True)
        torch.save(rng_state(), d / f"rng-rank{rank}.pt")
        if rank_state is not None:
            torch.save(rank_state, d / f"state-rank{rank}.pt")
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        shutil.rmtree(d, ignore_errors=True)  # never marked complete: the previous checkpoint stays the newest
        full = isinstance(e, RuntimeError) and "write" in str(e) and shutil.disk_usage(ckpt_root).free < 1 << 30
        error = storage_error(OSError(28, "", str(d))) if full else storage_error(e) if isinstance(e, OSError) else None
        if error is None:
            raise
        raise error from None
    record_complete(d, step, rank, world)
    if rank == 0:
        for old in sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()


def checkpoint_problem(d: Path, rank: int = 0, world: int = 1) -> str | None:
    """None if the checkpoint is complete and its files are what complete.json recorded, else why not (every
    rank checks every world-th file; all ranks get the same answer)."""
    try:
        files = json.loads((d / COMPLETE).read_text())["files"]
    except (OSError, ValueError, KeyError):
        files = None
    problem = "not marked complete" if files is None else None
    for rel in sorted(files or {})[rank::world]:
        f, want = d / rel, files[rel]
        if not f.is_file():
            problem = f"missing {rel}"
        elif f.stat().st_size != want["size"]:
            problem = f"truncated {rel} ({f.stat().st_size} of {want['size']} bytes)"
        elif sha256_file(f) != want["sha256"]:
            problem = f"{rel} changed since it was written (sha256 mismatch)"
        if problem:
            break
    return next((p for p in _gather(problem, world) if p), None)


def newest_valid_checkpoint(ckpt_root: Path, rank: int = 0, world: int = 1, pattern: str = "step-*") -> Path | None:
    """The newest complete checkpoint (`pattern` names them; their number orders them); invalid newer ones are
    skipped with a warning."""
    found = [p for p in ckpt_root.glob(pattern) if p.is_dir() and p.name.rpartition("-")[2].isdigit()]
    for d in sorted(found, key=lambda p: int(p.name.rpartition("-")[2]), reverse=True):
        problem = checkpoint_problem(d, rank, world)
        if problem is None:
            return d
        if rank == 0:
            print(f"warning: skipping checkpoint {d}: {problem}", file=sys.stderr, flush=True)
    return None


def find_checkpoint(ckpt_root: Path, rank: int, world: int) -> tuple[Path | None, bool]:
    """The newest valid step checkpoint (None: start from scratch) and whether another number of processes wrote
    it: then it is resumed elastically, through DeepSpeed's universal checkpoint (`init_engine(universal=True)`)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    ckpt = newest_valid_checkpoint(ckpt_root, rank, world)
    if ckpt is None:
        return None, False
    return ckpt, json.loads((ckpt / COMPLETE).read_text()).get("world", world) != world


def to_universal(ckpt: Path, names, rank: int) -> None:
    """Rank 0 converts each engine's ZeRO shards of `ckpt` into DeepSpeed's universal checkpoint (parameters and
    optimizer states whole, for any number of processes) beside them, `<name>-universal/`; the others wait."""
    if rank == 0:
        from argparse import Namespace

        from deepspeed.checkpoint import ds_to_universal

        for name in names:
            out = ckpt / f"{name}-universal"
            if not (out / ".done").is_file():
                shutil.rmtree(out, ignore_errors=True)
                with no_pickled_code():  # in this process (one worker): the same guard as every other load
                    ds_to_universal.main(Namespace(input_folder=str(ckpt / name), output_folder=str(out),
                                                   num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                                   strict=True, inject_missing_state=True))
                (out / ".done").touch()
    barrier()


def resume(engines: dict, ckpt: Path | None, elastic: bool, rank: int, world: int, stage: str) -> dict | None:
    """Load a step checkpoint from `find_checkpoint`, if any, and say so; return its client state. An elastic
    resume loads the universal checkpoint; the ranks the old run did not have start their RNGs afresh."""
    if ckpt is None:
        return None
    if elastic:
        to_universal(ckpt, engines, rank)
    with no_pickled_code():
        for name, engine in engines.items():
            frozen = any(not p.requires_grad for p in engine.module.parameters())
            _, client_state = engine.load_checkpoint(str(ckpt), tag=f"{name}-universal" if elastic else name,
                                                     load_optimizer_states=True, load_lr_scheduler_states=True,
                                                     load_module_strict=not frozen)
        if (ckpt / f"rng-rank{rank}.pt").is_file():
            set_rng_state(torch.load(ckpt / f"rng-rank{rank}.pt"))
        # this rank's own state (save_step's rank_state): not where another number of processes wrote it
        if not elastic and (ckpt / f"state-rank{rank}.pt").is_file():
            client_state = {**client_state, "rank_state": torch.load(ckpt / f"state-rank{rank}.pt",
                                                                      weights_only=True)}
    if rank == 0:
        how = f" (written by {json.loads((ckpt / COMPLETE).read_text())['world']} processes, now {world})" \
            if elastic else ""
        print(f"[{stage}] resumed from {ckpt} at step {client_state['step']}{how}", flush=True)
    return client_state
