"""Running a stage: reuse its complete output, or start its processes on every node (gptforge.pipeline.launch.nodes),
each command as a child process group, stream their output, and record the output complete once they all exit
cleanly; if one fails, the others are stopped and the stage fails with that one's own error line.

Each child gets its own session (process group), so cancelling the pipeline kills the stage and every process
its launcher started, not only the launcher itself; a watchdog does the same if this process is killed.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from gptforge.core.config import PipelineConfig
from gptforge.core.errors import StageFailed, UserError
from gptforge.pipeline.launch import fork_server
from gptforge.pipeline.preflight import check_devices
from gptforge.pipeline.launch.nodes import hosts_rendezvous, node_commands, node_env, rendezvous
from gptforge.pipeline.team.pools import gpu_slots
from gptforge.pipeline.store import RunRecord, check_inputs, complete, locate, now, read_result, reuse
from gptforge.core.declarations import STAGES


@contextmanager
def stage_lock(out_dir: Path, wait: bool = False, log: Callable[[str], None] = print):
    """Exclusive lock on a stage output, so two runs never write it at once. The second waits for the first
    (`wait`), or fails at once (a `--from`, which would remove what the other is writing)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(out_dir.name + ".lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise UserError(f"another run is writing {out_dir}; wait for it to finish") from None
            log(f"another run is writing {out_dir}; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def run_stage(cfg: PipelineConfig, stage: str, config_path: Path, record: RunRecord, log: Callable[[str], None],
              on_progress: Callable[[float], None] | None = None, recompute: bool = False) -> dict:
    """Reuse or compute one stage (or evaluation step); return its manifest. `recompute` (--from) removes a
    complete output first, under the stage's lock."""
    out_dir, fingerprint, inputs = locate(cfg, stage)
    started = time.perf_counter()

    def reused(manifest: dict) -> dict:
        record.update(stage, output=str(out_dir), action="reused", status="complete", started_at=now(),
                      finished_at=now(), seconds=round(time.perf_counter() - started, 2), metrics=manifest["metrics"])
        return manifest

    if not recompute and (manifest := reuse(stage, out_dir, log)) is not None:
        return reused(manifest)
    check_inputs(stage, inputs)
    check_devices(cfg, [stage], here=True)  # on the host it starts on: a worker's, where a pool sent it
    # everything that writes the output happens under the lock, --from's removal too
    with stage_lock(out_dir, wait=not recompute, log=log):
        if not recompute and (manifest := reuse(stage, out_dir, log)) is not None:  # the run we waited for made it
            return reused(manifest)
        if recompute and out_dir.exists():
            shutil.rmtree(out_dir)
        action = "resumed" if (out_dir / "checkpoints").is_dir() else "computed"
        record.update(stage, output=str(out_dir), action=action, status="running", started_at=now())
        log(f"{stage}: {'resuming' if action == 'resumed' else 'running'} -> {out_dir}")
        began = now()
        errors: list[str] = []

        def log_line(line: str) -> None:
            if "error: " in line:
                errors.append(line.split("error: ", 1)[1])  # (after a progress bar's carriage returns)
            log(line)

        try:
            env = node_env(cfg, stage)
            with gpu_slots(cfg, stage, log), rendezvous(cfg, stage) as port:
                record.update(stage, processes_started_at=now())  # (after any wait for slots)
                cmds = node_commands(cfg, stage, config_path, out_dir, {up: d for up, (d, _) in inputs.items()},
                                     port, env)
                # The accelerate launcher starts its own store on node 0: the other nodes start once it listens,
                # or one of theirs, started first on this host, takes the port that node 0 then finds taken.
                first = ((cfg.distributed.master_addr, port) if len(cmds) > 1 and port
                         and not hosts_rendezvous(cfg, stage) else None)
                rc = run_streaming(cmds, log_line, env=env, on_progress=on_progress, first_listens_at=first)
                record.update(stage, processes_finished_at=now())  # (before its slots are given back)
        except BaseException as e:  # cancelled (SIGTERM), interrupted, or we failed
            record.update(stage, status="cancelled" if isinstance(e, (Terminated, KeyboardInterrupt))
                          or type(e).__name__ == "TerminationSignal" else "crashed", finished_at=now())
            raise
        result = read_result(out_dir)
        if rc != 0 or result is None:
            record.update(stage, status="failed", finished_at=now())
            why = errors[-1] if errors else f"exit code {rc}"
            raise StageFailed(f"stage {stage} failed: {why} (its output {out_dir} is left incomplete)")
        manifest = complete(cfg, stage, out_dir, fingerprint, inputs, STAGES[stage].outputs, result, began)
    record.update(stage, status="complete", finished_at=now(), metrics=manifest["metrics"],
                  seconds=round(time.perf_counter() - started, 2))
    return manifest


_PROGRESS = re.compile(rb"(\d+)%\|")
# A whole tqdm bar, "desc:  50%|#####     | 3/6 [00:01<00:01,  2.1it/s]": what a process prints after a redraw,
# which ends without a newline (a warning, say), follows the bar's closing bracket on the same line.
_BAR = re.compile(rb"\d+%\|[^|]*\|[^\]]*\]")


def wait_listening(address: tuple[str, int], proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Wait until something accepts connections at `address`, `proc` exits, or `timeout` passes."""
    import socket

    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(address, timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)


_running: set[subprocess.Popen] = set()  # every stage process group this process has started and not yet reaped
_killed: set[subprocess.Popen] = set()  # those kill_running ended


def kill_running() -> None:
    """Kill every stage process group this process started (its flow was cancelled while stages ran in threads,
    where no signal reaches them); the stages they belong to end as cancelled."""
    for proc in list(_running):
        _killed.add(proc)
        kill_group(proc)


def run_streaming(cmds: list[list[str]], log: Callable[[str], None], env: dict | None = None,
                  on_progress: Callable[[float], None] | None = None, progress_every: float = 10.0,
                  first_listens_at: tuple[str, int] | None = None) -> int:
    """Run each command in its own process group, passing every output line to `log` (prefixed by its node when
    there are several); progress-bar redraws are logged (and passed to `on_progress` as a percentage) at most
    every `progress_every` seconds. Returns 0 once all exit cleanly, or the first failure's exit code, the
    others killed. If we are interrupted or sent SIGTERM (a cancelled flow run), every group is killed.
    `first_listens_at`: the others start once the first command listens at this address (or has exited)."""

    def start(cmd):
        whole = {**os.environ, **(env or {})}
        if (forked := fork_server.start(cmd, whole)) is not None:  # on a CPU host: from one import of the stages
            return forked
        ssh = cmd[0] == "ssh"  # a node over ssh: its channel stays open while the run lives (launch/on_node.py)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if ssh else subprocess.DEVNULL, env=whole,
                                start_new_session=True)
        if ssh:
            proc.stdin.write(json.dumps(env or {}).encode() + b"\n")  # the node's environment, off the command line
            proc.stdin.flush()
        return proc

    procs = [start(cmds[0])]
    _running.add(procs[0])
    if first_listens_at and len(cmds) > 1:
        wait_listening(first_listens_at, procs[0])
    procs += [start(cmd) for cmd in cmds[1:]]
    _running.update(procs)
    guards = [watchdog(p.pid, group=True) for p in procs]
    previous = None
    # A cancelled flow run gets SIGTERM; the stage runs in its own session and would survive it. Inside a
    # flow run Prefect's own handler is installed: it raises TerminationSignal here, which kills the group
    # on its way out, and it must stay installed, or the runner's cancel is not acknowledged and the run
    # ends Crashed instead of Cancelled. Without one, ours does the same.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    last_progress = 0.0
    buffers = {p.stdout.fileno(): (n, p, [b""]) for n, p in enumerate(procs)}
    selector = selectors.DefaultSelector()
    for fd in buffers:
        selector.register(fd, selectors.EVENT_READ)

    def emit(n: int, raw: bytes) -> None:
        nonlocal last_progress
        if not raw.strip():
            return
        bar = _BAR.search(raw)
        if bar and raw[bar.end():].strip():  # a line printed after the bar: never held back with it
            emit(n, raw[:bar.end()])
            emit(n, raw[bar.end():])
            return
        progress = _PROGRESS.search(raw)
        if progress:
            if time.monotonic() - last_progress < progress_every and progress.group(1) != b"100":
                return
            last_progress = time.monotonic()
            if on_progress:
                on_progress(float(progress.group(1)))
        log((f"[node {n}] " if len(procs) > 1 else "") + raw.decode("utf-8", "replace").rstrip())

    try:
        while buffers:
            for key, _ in selector.select():
                n, proc, buf = buffers[key.fd]
                chunk = os.read(key.fd, 65536)
                if chunk:
                    *lines, buf[0] = re.split(rb"[\r\n]", buf[0] + chunk)
                    for raw in lines:
                        emit(n, raw)
                    continue
                emit(n, buf[0])  # the end of this node's output
                selector.unregister(key.fd)
                del buffers[key.fd]
                rc = proc.wait()
                if rc != 0:
                    lost(cmds, procs, n, log)
                    for other in procs:
                        kill_group(other)
                    if proc in _killed:  # by kill_running: this run was cancelled, it did not fail
                        raise Terminated("the run was cancelled")
                    return rc
        return 0
    except BaseException:
        for proc in procs:
            kill_group(proc)
        raise
    finally:
        _running.difference_update(procs)
        _killed.difference_update(procs)
        selector.close()
        for guard in guards:
            guard.kill()
            guard.wait()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def lost(cmds: list[list[str]], procs: list[subprocess.Popen], failed: int, log: Callable[[str], None]) -> None:
    """When a node over ssh fails, name the host that was lost: ssh ends with 255 when its connection does (the
    host, its sshd or the network went down). Another node's ranks may notice first, in a collective: the others'
    ssh get a few seconds to show it before they are killed."""
    deadline = time.monotonic() + 3.0
    for n in [failed, *(i for i in range(len(procs)) if i != failed)]:
        if cmds[n][0] != "ssh":
            continue
        try:
            rc = procs[n].wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            continue
        if rc == 255:
            log(f"error: node {n} ({cmds[n][-2]}) was lost: its ssh connection ended (the host, its sshd or the "
                "network to it went down); the stage's processes on the other nodes were ended")
            return


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
