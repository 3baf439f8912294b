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
import time
from pathlib import Path
from typing import Callable

from pipeline.config import PipelineConfig
from pipeline.store import section_of

SINGLE_PROCESS = {"tokenize"}


def stage_module(stage: str) -> str:
    return f"stages.{stage if section_of(stage) != 'preference' else 'preference'}"


def stage_command(cfg: PipelineConfig, stage: str, config_path: Path) -> list[str]:
    """The command line that runs a stage under the configured launcher."""
    module = stage_module(stage)
    args = ["--config", str(config_path)]
    if stage != module.split(".")[1]:
        args += ["--stage", stage]
    if stage in SINGLE_PROCESS:
        return [sys.executable, "-m", module, *args]
    d = cfg.distributed
    if d.launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={d.nproc_per_node}",
               f"--nnodes={d.nnodes}", f"--node_rank={d.node_rank}", f"--master_addr={d.master_addr}",
               f"--master_port={d.master_port}"]
    elif d.launcher == "accelerate":
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


_PROGRESS = re.compile(r"\d+%\|")


def run_streaming(cmd: list[str], log: Callable[[str], None], env: dict | None = None,
                  progress_every: float = 10.0) -> int:
    """Run cmd in its own process group, passing each output line to `log`; progress-bar redraws are
    passed at most every `progress_every` seconds. The whole group is killed if we are interrupted."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    last_progress = 0.0
    buf = b""
    try:
        while True:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = re.split(rb"[\r\n]", buf)
            for raw in lines:
                line = raw.decode("utf-8", "replace").rstrip()
                if not line:
                    continue
                if _PROGRESS.search(line):
                    if time.monotonic() - last_progress < progress_every and "100%" not in line:
                        continue
                    last_progress = time.monotonic()
                log(line)
        if buf.strip():
            log(buf.decode("utf-8", "replace").rstrip())
        return proc.wait()
    except BaseException:
        kill_group(proc)
        raise


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
