"""gptforge's own node agent (`distributed.launcher: gptforge`, the default): starts this node's ranks of a stage
with the environment a launcher gives them, and waits for them.

    python -m gptforge.pipeline.launch.agent --nproc-per-node 2 --nnodes 1 --node-rank 0 --master 127.0.0.1:29500 \\
        -m gptforge.stages.pretrain --config CONFIG --out DIR --input tokenize=DIR

Why a launcher of our own: a stage's ranks should start at once. The deepspeed launcher imports DeepSpeed in its
runner and again in its per-node `launch.py` (about 5 s of CPU before any rank starts), and torchrun's agent imports
torch and starts its workers in sessions of their own, where killing the stage's process group misses them. This
agent imports nothing but the standard library and the stage itself (warm ranks, below), keeps its ranks in its own
process group, and hosts nothing: the ranks join the TCPStore that the pipeline hosts at master_addr:master_port as
its clients (`TORCHELASTIC_USE_AGENT_STORE`, as ranks of torchrun's agent do), so no node's hostname decides where
they meet.

Each rank gets what torchrun's workers get (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT), DeepSpeed's names for the same (CROSS_RANK, CROSS_SIZE, LOCAL_SIZE), and OMP_NUM_THREADS=1 where
several share a node and it is unset (as torchrun does; gptforge.model.train.distributed gives each its share of the
cores). The first rank that fails ends the others (SIGTERM, then SIGKILL after a grace period) and the agent exits
with its code; SIGTERM and SIGINT sent to the agent reach every rank.

Warm ranks: on a node without an accelerator (DS_ACCELERATOR=cpu, which the pipeline sets there), the agent
imports the stage's module once (torch, transformers, DeepSpeed, gptforge: about 6 s of a CPU core), and what its
ranks will import as they run (gptforge.stages.entry.preload: the modelling code of the config's models, a TRL
trainer's modules), and forks each rank from itself, which then runs the module as `python -u -m` would, with its
own environment and stdin: the ranks' imports cost one core once instead of every core at once (bench/startup.py
times the start). On a GPU node each
rank starts as a process of its own: a process forked from one that has touched the CUDA driver (DeepSpeed asks
for the devices as it is imported) cannot use it. GPTFORGE_WARM_RANKS=0 turns it off; a module that does not
import here starts its ranks as processes too, which then report the error themselves. A forked rank dies with
its agent. On a CPU host the pipeline forks the agent itself from its fork server
(gptforge.pipeline.launch.fork_server), which has imported the stage already: then the agent's own import costs
nothing.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import io
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
import typing
import warnings

GRACE_S = 5.0  # between SIGTERM and SIGKILL of the ranks left when one failed


def rank_env(base: dict[str, str], nproc: int, nnodes: int, node_rank: int, local_rank: int, master_addr: str,
             master_port: int) -> dict[str, str]:
    """The environment of one rank."""
    world = nproc * nnodes
    env = dict(base)
    env.update(RANK=str(node_rank * nproc + local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(node_rank), ROLE_RANK=str(node_rank * nproc + local_rank),
               ROLE_WORLD_SIZE=str(world), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
               CROSS_RANK=str(node_rank), CROSS_SIZE=str(nnodes), LOCAL_SIZE=str(nproc),
               TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def end(procs: list, grace: float = GRACE_S) -> None:
    """SIGTERM every rank still running, then SIGKILL what is left after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def exit_code(status: int) -> int:
    """A shell's exit code for a child's wait status: its own code, or 128 + the signal that ended it."""
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def warm(module: str, args: list[str], nproc: int) -> bool:
    """Import the stage's module here, for its ranks (started with `args`) to fork from (see the module's
    docstring): whether they can."""
    if os.environ.get("DS_ACCELERATOR") != "cpu" or os.environ.get("GPTFORGE_WARM_RANKS", "1") == "0":
        return False
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # what each rank's torch is imported under (rank_env)
    if not preimport(module, args):
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def preimport(module: str, args: list[str]) -> bool:
    """Import the stage `module`, DeepSpeed where its ranks join a process group, and what its processes (started
    with `args`) import as they run (gptforge.stages.entry.preload): whether the module imported. Here for the warm
    agent, and in the fork server (gptforge.pipeline.launch.fork_server) for the agents it forks."""
    try:
        stage = importlib.import_module(module)
        if "gptforge.model.train.distributed" in sys.modules:  # its ranks join a process group: DeepSpeed's import too
            sys.modules["gptforge.model.train.distributed"].import_deepspeed()
    except BaseException:  # noqa: BLE001 - each rank, started on its own, imports it again and reports the error
        return False
    if "gptforge.stages.entry" in sys.modules:  # a stage: what its ranks import as they run, too
        try:
            sys.modules["gptforge.stages.entry"].preload(stage, args)
        except (Exception, SystemExit):  # noqa: BLE001 - each rank imports what it needs itself, and reports it
            pass
    return True


def fork_rank(module: str, args: list[str], env: dict[str, str]) -> int:
    """Fork a rank that runs `module` as `python -u -m module args...` would, under `env`; its pid. The rank dies
    with the agent, however the agent ends."""
    pid = os.fork()
    if pid:
        return pid
    try:
        die_with_parent()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    except BaseException:  # noqa: BLE001
        os._exit(1)
    run_module(module, args, env)


def die_with_parent(parent: int | None = None) -> None:
    """In a process just forked: be sent SIGKILL when the process that forked it ends (Linux's
    PR_SET_PDEATHSIG), and end now if `parent` (its pid, when known) is gone already."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def run_module(module: str, args: list[str], env: dict[str, str]) -> typing.NoReturn:
    """In a forked process: run `module` as `python -u -m module args...` would, under `env` and on the file
    descriptors 0, 1 and 2 it has, then exit with its code."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env, PYTHONUNBUFFERED="1")
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        for name in ("stdout", "stderr"):  # unbuffered, as under -u
            stream = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(io.FileIO(stream.fileno(), "w", closefd=False), write_through=True,
                                                encoding=stream.encoding, errors=stream.errors))
        sys.argv = [module, *args]
        # runpy warns that the module it runs as __main__ is imported already: here, by design (its code runs
        # again as __main__, on the imports it made)
        warnings.filterwarnings("ignore", f"'{module}' found in sys.modules", RuntimeWarning)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class Forked:
    """A forked rank, handled as a Popen is (poll, wait, send_signal, kill; returncode)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                return self.returncode
            if pid:
                self.returncode = exit_code(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(cmd: list[str], nproc: int, nnodes: int, node_rank: int, master_addr: str, master_port: int) -> int:
    """Start the node's ranks of `cmd` (`python -u -m MODULE ARG...`) and wait for all; the first failure's exit
    code, or 0."""
    envs = [rank_env(os.environ, nproc, nnodes, node_rank, r, master_addr, master_port) for r in range(nproc)]
    module, args = cmd[3], cmd[4:]
    if warm(module, args, nproc):
        procs = [Forked(fork_rank(module, args, env)) for env in envs]
    else:
        procs = [subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL) for env in envs]
    by_pid = {p.pid: p for p in procs}

    def forward(signum, frame):  # a cancelled stage: every rank goes, then this agent
        end(procs)
        leave(128 + signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    running = set(by_pid)
    while running:
        pid, status = os.wait()  # whichever rank ends first
        if pid not in running:
            continue
        running.discard(pid)
        by_pid[pid].returncode = code = exit_code(status)
        if code != 0:
            end(procs)
            return code
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m gptforge.pipeline.launch.agent",
                                     usage="%(prog)s [options] -m MODULE [ARG ...]",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the stage")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank (node 0 holds rank 0)")
    parser.add_argument("--master", required=True, metavar="ADDR:PORT", help="the rendezvous store the ranks join")
    if "-m" not in argv or argv.index("-m") == len(argv) - 1:
        parser.error("-m MODULE is required: the module each rank runs, then its arguments")
    i = argv.index("-m")
    args = parser.parse_args(argv[:i])
    addr, _, port = args.master.rpartition(":")
    return run([sys.executable, "-u", "-m", *argv[i + 1:]], args.nproc_per_node, args.nnodes, args.node_rank,
               addr.strip("[]"), int(port))


def leave(code: int):
    """Exit at once: an agent that has imported a stage (warm ranks) would otherwise spend a second tearing down
    torch and DeepSpeed, and it holds nothing to close."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
