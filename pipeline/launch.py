"""Starting a stage as a child process group and streaming its output.

The child gets its own session (process group), so cancelling the pipeline kills the stage and every
process its launcher started, not only the launcher itself.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from pipeline.config import PipelineConfig

SINGLE_PROCESS = {"tokenize"}
# TRL trainers need accelerate's launcher to see the world size (see model/hf_trainer.py).
ACCELERATE_ONLY = {"dpo", "grpo", "rloo"}


def stage_command(cfg: PipelineConfig, stage: str, config_path: Path) -> list[str]:
    """The command line that runs a stage under the configured launcher."""
    module, args = f"stages.{stage}", ["--config", str(config_path)]
    if stage in SINGLE_PROCESS:
        return [sys.executable, "-m", module, *args]
    d = cfg.distributed
    launcher = "accelerate" if stage in ACCELERATE_ONLY else d.launcher
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={d.nproc_per_node}",
               f"--nnodes={d.nnodes}", f"--node_rank={d.node_rank}", f"--master_addr={d.master_addr}",
               f"--master_port={d.master_port}"]
    elif launcher == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed",
               "--zero_stage", str(d.zero_stage), "--num_processes", str(d.world_size),
               "--num_machines", str(d.nnodes), "--machine_rank", str(d.node_rank),
               "--main_process_ip", d.master_addr, "--main_process_port", str(d.master_port)]
        if d.nnodes > 1:
            cmd += ["--deepspeed_multinode_launcher", "standard"]
    else:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(d.master_port)]
        if d.hostfile:
            cmd += ["--hostfile", d.hostfile, "--master_addr", d.master_addr]
        else:
            cmd += ["--num_nodes", "1", "--num_gpus", str(d.nproc_per_node)]
        return [*cmd, "--module", module, *args]
    return [*cmd, "-m", module, *args]


def stage_env() -> dict[str, str]:
    """Environment for stage processes: DeepSpeed's CPU accelerator where there is no GPU."""
    import torch

    return {} if torch.cuda.is_available() else {"DS_ACCELERATOR": "cpu"}


_PROGRESS = re.compile(rb"(\d+)%\|")


def run_streaming(cmd: list[str], log: Callable[[str], None], env: dict | None = None,
                  on_progress: Callable[[float], None] | None = None, progress_every: float = 10.0) -> int:
    """Run cmd in its own process group, passing each output line to `log`; progress-bar redraws are
    logged (and passed to `on_progress` as a percentage) at most every `progress_every` seconds.
    If we are interrupted or sent SIGTERM (a cancelled flow run), the whole group is killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    previous = None
    # A cancelled flow run gets SIGTERM; the stage runs in its own session and would survive it. Inside a
    # flow run Prefect's own handler is installed: it raises TerminationSignal here, which kills the group
    # on its way out, and it must stay installed, or the runner's cancel is not acknowledged and the run
    # ends Crashed instead of Cancelled. Without one, ours does the same.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    last_progress = 0.0
    buf = b""
    try:
        while chunk := os.read(proc.stdout.fileno(), 65536):
            *lines, buf = re.split(rb"[\r\n]", buf + chunk)
            for raw in lines:
                if not raw.strip():
                    continue
                progress = _PROGRESS.search(raw)
                if progress:
                    if time.monotonic() - last_progress < progress_every and progress.group(1) != b"100":
                        continue
                    last_progress = time.monotonic()
                    if on_progress:
                        on_progress(float(progress.group(1)))
                log(raw.decode("utf-8", "replace").rstrip())
        if buf.strip():
            log(buf.decode("utf-8", "replace").rstrip())
        return proc.wait()
    except BaseException:
        kill_group(proc)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """SIGTERM received while a stage was running."""


def _raise_terminated(signum, frame):
    raise Terminated("terminated")  # unwinds into run_streaming's `except`, which kills the group


def kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after `grace` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
