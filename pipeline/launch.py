"""Running a stage: reuse its complete output, or start its processes under the configured launcher as a
child process group, stream their output, and record the output complete once they all exit cleanly.

The child gets its own session (process group), so cancelling the pipeline kills the stage and every
process its launcher started, not only the launcher itself.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from gptforge.core.config import PipelineConfig
from gptforge.core.errors import UserError
from gptforge.pipeline.store import (RunRecord, check_inputs, complete, locate, module_of, now, read_manifest,
                                     read_result, stage_entry)
from gptforge.stages.cli import stage_args

# TRL trainers need accelerate's launcher to see the world size (see gptforge/model/hf_trainer.py).
ACCELERATE_ONLY = {"dpo", "grpo", "rloo"}


def single_process(step: str) -> bool:
    """Tokenizing (its own worker pool) and evaluation run as one process, without a launcher."""
    return step == "tokenize" or step.startswith("eval-")


def stage_command(cfg: PipelineConfig, stage: str, config_path: Path, out_dir: Path,
                  inputs: dict[str, Path]) -> list[str]:
    """The command line that runs a stage into `out_dir` on `inputs` under the configured launcher."""
    module, args = f"gptforge.stages.{module_of(stage)}", stage_args(config_path, out_dir, inputs)
    if single_process(stage):
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


class StageFailed(UserError):
    """A stage process exited non-zero; its output stays incomplete and is never consumed."""


@contextmanager
def stage_lock(out_dir: Path):
    """Exclusive lock on a stage output, so two runs never write it at once (the second fails)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(out_dir.name + ".lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another run is writing {out_dir}; wait for it to finish") from None
        yield


def run_stage(cfg: PipelineConfig, stage: str, config_path: Path, record: RunRecord, log: Callable[[str], None],
              on_progress: Callable[[float], None] | None = None, recompute: bool = False) -> dict:
    """Reuse or compute one stage (or evaluation step); return its manifest. `recompute` (--from) removes a
    complete output first, under the stage's lock."""
    out_dir, fingerprint, inputs = locate(cfg, stage)
    started = time.perf_counter()
    manifest = None if recompute else read_manifest(out_dir)
    if manifest is not None:
        log(f"{stage}: reused complete output {out_dir} (fingerprint {fingerprint[:16]})")
        record.update(stage, output=str(out_dir), action="reused", status="complete", started_at=now(),
                      finished_at=now(), seconds=round(time.perf_counter() - started, 2), metrics=manifest["metrics"])
        return manifest
    check_inputs(stage, inputs)
    with stage_lock(out_dir):  # everything that writes the output happens under the lock, --from's removal too
        if recompute and out_dir.exists():
            shutil.rmtree(out_dir)
        action = "resumed" if (out_dir / "checkpoints").is_dir() else "computed"
        record.update(stage, output=str(out_dir), action=action, status="running", started_at=now())
        log(f"{stage}: {'resuming' if action == 'resumed' else 'running'} -> {out_dir}")
        began = now()
        cmd = stage_command(cfg, stage, config_path, out_dir, {up: d for up, (d, _) in inputs.items()})
        errors: list[str] = []

        def log_line(line: str) -> None:
            if "error: " in line:
                errors.append(line.split("error: ", 1)[1])  # (after a progress bar's carriage returns)
            log(line)

        try:
            rc = run_streaming(cmd, log_line, env=stage_env(), on_progress=on_progress)
        except BaseException as e:  # cancelled (SIGTERM), interrupted, or we failed
            record.update(stage, status="cancelled" if isinstance(e, (Terminated, KeyboardInterrupt))
                          or type(e).__name__ == "TerminationSignal" else "crashed", finished_at=now())
            raise
        result = read_result(out_dir)
        if rc != 0 or result is None:
            record.update(stage, status="failed", finished_at=now())
            why = errors[-1] if errors else f"exit code {rc}"
            raise StageFailed(f"stage {stage} failed: {why} (its output {out_dir} is left incomplete)")
        manifest = complete(cfg, stage, out_dir, fingerprint, inputs, stage_entry(stage)[1], result, began)
    record.update(stage, status="complete", finished_at=now(), metrics=manifest["metrics"],
                  seconds=round(time.perf_counter() - started, 2))
    return manifest


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
    guard = watchdog(proc.pid, group=True)
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
        guard.kill()
        guard.wait()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


WATCHDOG = """
import os, signal, sys, time
parent, target, group = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "group"
kill = os.killpg if group else os.kill
while os.getppid() == parent:  # reparented once the process that started us is gone, however it went
    time.sleep(1)
    try:
        kill(target, 0)
    except ProcessLookupError:
        sys.exit(0)  # what we guard ended by itself
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        kill(target, sig)
    except ProcessLookupError:
        sys.exit(0)
    time.sleep(5)
"""


def watchdog(target: int, group: bool) -> subprocess.Popen:
    """A small process that kills `target` (a process group, or one process) once this process is gone, even by
    SIGKILL, which no handler of ours sees: a stage's ranks never train on without the run that started them."""
    return subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid()), str(target),
                             "group" if group else "pid"], start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


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
