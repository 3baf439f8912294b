"""Joining the process group that a launcher (deepspeed, torchrun, accelerate) set up, and the few collectives
the stages need for their metrics."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
import types
from datetime import timedelta

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed(dist=None, reserve: int = 0) -> tuple[int, int, torch.device]:
    """Join the process group the launcher set up (or make a group of one): (rank, world, device).
    On a machine without a GPU, DeepSpeed's CPU accelerator and gloo; cores shared among local ranks. The group's
    timeout is `dist.timeout_minutes` (the `distributed` section; 30 without one): a collective that a rank stops
    answering raises on the others after it (`hung_rank` names that rank), and NCCL's heartbeat monitor, which
    ends a process whose watchdog is stuck, waits a minute longer. `reserve`: cores of a CPU node the local ranks
    leave to other processes (async rollout workers), where the node has enough for both."""
    cuda = torch.cuda.is_available()
    timeout = timedelta(minutes=dist.timeout_minutes if dist is not None else 30)
    os.environ.setdefault("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(int(timeout.total_seconds()) + 60))
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")
    no_integrations()
    if "RANK" not in os.environ:  # no launcher: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    deepspeed = import_deepspeed()

    if not cuda:
        # DeepSpeed's shared-memory all-reduce op serves its inference all-reduce only. Its JIT build
        # (once per machine) holds a file lock that a run killed meanwhile leaves behind, and every later
        # run then waits on it forever. Training does not use it: gloo does the reductions.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    else:  # each local rank gets its own share of the cores, pinned: no oversubscription, no migration
        # (DeepSpeed's per-node launcher names it LOCAL_SIZE: read as the world, its ranks across 2 nodes of 1
        # process each took half their node's cores, 0.6x torchrun's tokens a second; bench/two_hosts.py)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
                          or os.environ.get("WORLD_SIZE", "1"))
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= local_world + reserve:
            cpus = cpus[:len(cpus) - reserve]
        share = max(1, len(cpus) // local_world)
        if len(cpus) >= local_world:
            os.sched_setaffinity(0, cpus[local_rank * share:(local_rank + 1) * share])
        torch.set_num_threads(share)
        # and no more later: accelerate's state, where OMP_NUM_THREADS is unset, sets the host's cores a process
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False, timeout=timeout)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device


def no_integrations() -> None:
    """The environment transformers and TRL are imported under in a stage's processes: transformers' MLflow callback
    and TRL's profiling import MLflow when it is installed (seconds of each rank's start); gptforge tracks to MLflow
    itself (gptforge.model.train.tracking) and reports nothing through them."""
    os.environ.setdefault("DISABLE_MLFLOW_INTEGRATION", "TRUE")


MUON = "deepspeed.runtime.zero.muon"  # its modules muon_optimizer and original_muon


def _not_muon(*args, **kwargs):
    raise RuntimeError("DeepSpeed's Muon optimizer is not loaded in gptforge's stages "
                       "(gptforge.model.train.distributed)")


def import_deepspeed():
    """`import deepspeed`, without two imports that cost every rank seconds of its start and serve nothing
    gptforge uses:
    - the MLflow import its autotuner makes at import time when MLflow is installed (3 of the 5 s DeepSpeed's
      import takes on a CPU core; gptforge never autotunes). MLflow imports as usual afterwards.
    - its Muon optimizer's modules, which the ZeRO optimizers import at their start and in every backward only to
      ask `isinstance(optimizer, MuonWithAuxAdam)` or to hold `muon_update` for Muon's parameters, and which
      compile their kernels with torch.compile as they are imported, importing Inductor (2 s a rank). An engine
      that steps AdamW (gptforge.model.train.engine's by default, and the TRL Trainer's) asks modules whose class
      nothing is an instance of, and whose update is never called: these answer the same. An engine with
      `optimizer: muon` loads the real ones first (`load_muon`)."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError, which DeepSpeed takes as not installed
    try:
        import deepspeed
    finally:
        if hide:
            del sys.modules["mlflow"]
    for name, attrs in (("muon_optimizer", {"MuonWithAuxAdam": type("MuonWithAuxAdam", (), {})}),
                        ("original_muon", {"muon_update": _not_muon})):
        stand_in = types.ModuleType(f"{MUON}.{name}", "Stands in for DeepSpeed's (gptforge.model.train.distributed).")
        stand_in.__dict__.update(attrs)
        sys.modules.setdefault(f"{MUON}.{name}", stand_in)
    return deepspeed


def load_muon() -> None:
    """DeepSpeed's own Muon modules in place of import_deepspeed's stand-ins, for an engine that steps Muon
    (`optimizer: muon`): the ZeRO optimizers import them inside their functions, so they find these from now on."""
    import importlib

    for name in ("muon_optimizer", "original_muon"):
        module = sys.modules.get(f"{MUON}.{name}")
        if module is not None and (module.__doc__ or "").startswith("Stands in"):
            del sys.modules[f"{MUON}.{name}"]
    importlib.import_module(f"{MUON}.muon_optimizer")


def return_freed_memory(threshold: int = 8 << 20) -> None:
    """Have glibc map every host allocation of `threshold` bytes or more on its own and unmap it when freed. By
    default glibc raises that threshold as large blocks are freed (up to 32 MiB), and then serves them from a heap
    it rarely returns: ZeRO-3, which gathers and frees every layer's parameters each step, then held about twice its
    model states in resident memory (a 152M-parameter model on 2 CPU processes: 3.2 GiB a process instead of 2.3).
    Each such allocation gets fresh zeroed pages, a tax that at 1 MiB took 14% of a ZeRO-3 CPU step
    (bench/pretrain.py --set distributed.zero_stage=3: 9.1k tokens/s against 10.5k without); at 8 MiB, what a
    layer's gathered matrices and ZeRO's buckets are, it is within noise (10.7k) and the peak stays bounded (2.35
    GiB, bench/zero3.py). Only ZeRO-3 asks for it (gptforge.model.train.engine.zero_config)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator has its own policy
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, threshold)
    libc.mallopt(M_TRIM_THRESHOLD, threshold)


def end_distributed() -> None:
    """Leave the process group, once this process's stage has finished. Without this, gloo's worker threads
    outlive the interpreter and a process that exits before its peers can abort at exit ("terminate called
    without an active exception", exit -6), failing a stage that had finished (pytorch/pytorch#190489).
    Called only after a stage succeeded: a rank that failed may have peers waiting in a collective."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def barrier() -> None:
    torch.distributed.barrier()


def all_mean(value: float, device: torch.device) -> float:
    """The mean of a number over all ranks."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.item() / torch.distributed.get_world_size()


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sums of numbers over all ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.tolist()


HEARTBEAT = "gptforge/heartbeat/"


def heartbeat(rank: int, where: str) -> None:
    """Tell the rendezvous store where this rank is (its host, `where`, the time), for `hung_rank` to read
    should a collective time out; a few bytes to the store per call."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        from torch.distributed.distributed_c10d import _get_default_store

        _get_default_store().set(f"{HEARTBEAT}{rank}", json.dumps(
            {"host": socket.gethostname(), "where": where, "time": time.time()}))


def is_timeout(e: BaseException) -> bool:
    """Whether `e` is a collective that timed out (gloo, NCCL) or lost a peer that was ended meanwhile."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "timed out", "timeout", "connection closed by peer", "connection reset by peer", "watchdog"))


def hung_rank(e: BaseException, timeout_minutes: float) -> str:
    """One line for a collective that timed out: the rank and host heard from least recently (from the
    heartbeats in the store), what it was doing, and the collective this rank waited in (from the traceback)."""
    waited = next((f.name for f in reversed(traceback.extract_tb(e.__traceback__))
                   if "torch/distributed" in f.filename.replace("\\", "/") or "deepspeed/comm" in f.filename), None)
    me = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    beats = {}
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        store.set_timeout(timedelta(seconds=5))
        for r in range(torch.distributed.get_world_size()):
            if store.check([f"{HEARTBEAT}{r}"]):
                beats[r] = json.loads(store.get(f"{HEARTBEAT}{r}"))
    except Exception:  # the store is gone with its host: name what we can
        beats = {}
    others = {r: b for r, b in beats.items() if r != me}
    if others:
        r, b = min(others.items(), key=lambda rb: rb[1]["time"])
        who = (f"rank {r} (host {b['host']}) stopped answering: last heard from {time.time() - b['time']:.0f} s "
               f"ago, at {b['where']}")
    else:
        who = "a rank stopped answering"
    return (f"{who}; rank {me} waited distributed.timeout_minutes={timeout_minutes:g} in "
            f"{waited or 'a collective'} ({str(e).splitlines()[0][:160]}); the stage stopped, a retry resumes from "
            "its newest checkpoint")
