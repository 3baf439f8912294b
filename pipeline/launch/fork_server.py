"""A fork server for the stage processes a pipeline starts on a host without an accelerator: a process that has
imported what stages import (torch, transformers, DeepSpeed, PEFT, gptforge's modelling code), and forks each
stage's node agent (gptforge.pipeline.launch.agent), or its one process where it has no launcher (an evaluation), from
itself. The agent then forks its ranks as it does on a CPU node (warm ranks), on the imports it was born with.

Why: a short stage's processes spend most of their CPU importing (6-7 s of a core for each agent), once per stage.
With the server they import once per pipeline process: `gptforge run`'s, a flow run's, or the test session's.

What the launcher (pipeline/launch/stage.py: run_streaming) gets is what `subprocess.Popen(cmd, start_new_session=True)`
would have given it, as it sees the process (`Forked`, handled as a Popen):
- the process leads a session and process group of its own: killing the group ends it and the ranks it forked;
- its stdin, stdout and stderr are the launcher's (passed over a Unix socket); its environment, working folder and
  command line (/proc/PID/cmdline, what ps shows, written over the server's own) are the command's;
- its exit status comes back through the server, which is its parent, as a Popen's returncode.
The server dies with the process that started it (its socket's end closes): it kills what it forked and exits.
What it forked dies with it (PR_SET_PDEATHSIG), and each rank with its agent.

A server serves one environment: the modules it imported read theirs as they were imported (the hub's cache,
DeepSpeed's accelerator, OMP_NUM_THREADS), so a command with another environment gets a server of its own (at most
MAX_SERVERS live; past that, a server with nothing running is closed). Variables set per stage and read only as a
stage runs (RUNTIME) do not count. On a GPU node nothing forks: a process forked from one that touched the CUDA
driver cannot use it. GPTFORGE_FORK_SERVER=0 (or GPTFORGE_WARM_RANKS=0) starts every process with its own Python.
"""

from __future__ import annotations

import atexit
import fnmatch
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading

from gptforge.model.train.tracking import PARENT_ENV

# The commands forked: a node's agent, and an evaluation (`python -m MODULE ARG...`).
FORKED = ("gptforge.pipeline.launch.agent", "gptforge.stages.evaluate")
# Variables that differ between the stages of one environment, read only as a stage runs: the accelerate launcher's,
# the rendezvous's (pipeline/launch/nodes.py: node_env), the MLflow parent run, the guard's drills, Inductor's cache
# (which torch sets to its default once it has compiled anything), and pytest's name for the running test.
RUNTIME = ("ACCELERATE_*", "TORCHELASTIC_*", PARENT_ENV, "GPTFORGE_FAULTS", "TORCHINDUCTOR_CACHE_DIR",
           "PYTEST_CURRENT_TEST")
MAX_SERVERS = 2
CMDLINE_ROOM = 16384  # bytes of command line the server starts with, for what it forks to write theirs over
_HEADER = struct.Struct("!I")


def forkable(cmd: list[str], env: dict[str, str]) -> bool:
    """Whether `cmd`, started under `env`, runs forked from a server."""
    return (len(cmd) > 2 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2] in FORKED
            and env.get("DS_ACCELERATOR") == "cpu" and env.get("GPTFORGE_FORK_SERVER", "1") != "0"
            and env.get("GPTFORGE_WARM_RANKS", "1") != "0")


def key(env: dict[str, str]) -> tuple:
    """What a server's environment must match: all of it but RUNTIME, and the working folder."""
    kept = sorted((k, v) for k, v in env.items() if not any(fnmatch.fnmatchcase(k, p) for p in RUNTIME))
    return os.getcwd(), tuple(kept)


_servers: dict[tuple, Server] = {}
_lock = threading.Lock()


@atexit.register
def close_all() -> None:
    """Close every server, and wait for each to exit (as it would by itself, a moment after this process)."""
    with _lock:
        while _servers:
            _servers.popitem()[1].close()


def start(cmd: list[str], env: dict[str, str]) -> Forked | None:
    """Start `cmd` under `env` (the whole environment) forked from the server for `env`, started if need be; None
    where it does not fork (`forkable`), or the server could not start it: the caller starts it as a process."""
    if not forkable(cmd, env):
        return None
    with _lock:
        k = key(env)
        server = _servers.get(k)
        if server is not None and not server.alive():
            _servers.pop(k).close()
            server = None
        if server is None:
            for other in [kk for kk, s in _servers.items() if not s.alive() or not s.busy()]:
                if len(_servers) < MAX_SERVERS:
                    break
                _servers.pop(other).close()
            if len(_servers) >= MAX_SERVERS:  # each one busy with a stage of its own environment
                return None
            server = _servers[k] = Server(env)
        try:
            return server.fork(cmd, env)
        except OSError:  # the server is gone (it failed to start, or was killed): this one starts as a process
            _servers.pop(k).close()
            return None


class Server:
    """The launcher's side of one fork server."""

    def __init__(self, env: dict[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = ours
        self.children: list[Forked] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "gptforge.pipeline.launch.fork_server",
                                      str(theirs.fileno()), " " * CMDLINE_ROOM], env=env, pass_fds=(theirs.fileno(),),
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def busy(self) -> bool:
        return any(c.poll() is None for c in self.children)

    def fork(self, cmd: list[str], env: dict[str, str]) -> Forked:
        """Send the server `cmd`, `env`, this folder and the process's stdin and stdout (a new pipe, its stderr too),
        and a socket for its pid and exit status; a Popen-like handle on what it forked."""
        out_r, out_w = os.pipe()
        mine, for_server = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            message = json.dumps({"argv": cmd, "env": env, "cwd": os.getcwd()}).encode()
            socket.send_fds(self.sock, [_HEADER.pack(len(message))], [null, out_w, for_server.fileno()])
            self.sock.sendall(message)
        except OSError:
            os.close(out_r)
            mine.close()
            raise
        finally:
            os.close(null)
            os.close(out_w)
            for_server.close()
        stdout = os.fdopen(out_r, "rb", buffering=0)
        try:
            proc = Forked(cmd, mine, stdout)
        except OSError:
            stdout.close()
            mine.close()
            raise
        self.children = [c for c in self.children if c.poll() is None] + [proc]
        return proc

    def close(self) -> None:
        """The server exits once its socket closes (killing what it forked that still runs)."""
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Forked:
    """A process forked by the server, handled as a subprocess.Popen is (pid, stdout, poll, wait, send_signal,
    terminate, kill; returncode)."""

    def __init__(self, args: list[str], status: socket.socket, stdout):
        self.args, self.stdin, self.stdout, self.returncode = args, None, stdout, None
        self._status, self._read = status, b""
        self.pid = int(self._line(None))

    def _line(self, timeout: float | None) -> str:
        """The server's next line on this process (its pid, then its exit status); OSError where the server ended
        first."""
        self._status.settimeout(timeout)
        while b"\n" not in self._read:
            chunk = self._status.recv(64)
            if not chunk:
                raise ConnectionResetError("the fork server ended")
            self._read += chunk
        line, self._read = self._read.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.wait(0)
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = int(self._line(timeout))
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            except OSError:  # the server was killed, and what it forked with it (PR_SET_PDEATHSIG)
                self.returncode = -signal.SIGKILL
            self._status.close()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# The server's side


def serve(sock: socket.socket) -> None:
    """Fork what the launcher sends until its end of `sock` closes; then kill the process groups of what is still
    running, and return."""
    from gptforge.pipeline.launch import agent

    children: dict[int, socket.socket] = {}  # pid -> its status socket
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "launcher")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    while True:
        for k, _ in selector.select():
            if k.data == "child":
                os.read(wake_r, 4096)
            else:
                request = receive(sock)
                if request is None:  # the launcher is gone
                    for pid in children:
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    return
                message, (stdin, stdout, status) = request
                argv, me = message["argv"], os.getpid()
                at = argv.index("-m", 3) + 1 if argv[2] == "gptforge.pipeline.launch.agent" else 2  # the stage's module
                agent.preimport(argv[at], argv[at + 1:])  # once here, for every stage after this one too
                pid = os.fork()
                if pid == 0:
                    become(argv, message["env"], message["cwd"], stdin, stdout, me)
                for fd in (stdin, stdout):
                    os.close(fd)
                status_sock = socket.socket(fileno=status)
                children[pid] = status_sock
                try:
                    status_sock.sendall(f"{pid}\n".encode())
                except OSError:
                    pass
        while children:  # reap what ended, and tell each one's launcher
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            status_sock = children.pop(pid, None)
            if status_sock is not None:
                try:
                    status_sock.sendall(f"{os.waitstatus_to_exitcode(code)}\n".encode())
                except OSError:
                    pass
                status_sock.close()


def receive(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """One request (its message and its three file descriptors), or None once the launcher's end is closed."""
    try:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 3)
    except OSError:
        return None
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return json.loads(body), fds


def become(argv: list[str], env: dict[str, str], cwd: str, stdin: int, stdout: int, server: int):
    """In the forked process: take the launcher's session rules, descriptors, folder and command line, then run
    `argv`'s module (the agent's, or the evaluation's) as `python -m` would, and exit."""
    from gptforge.pipeline.launch import agent

    try:
        os.setsid()
        agent.die_with_parent(server)
        signal.set_wakeup_fd(-1)
        for signum, handler in ((signal.SIGCHLD, signal.SIG_DFL), (signal.SIGTERM, signal.SIG_DFL),
                                (signal.SIGINT, signal.default_int_handler), (signal.SIGHUP, signal.SIG_DFL)):
            signal.signal(signum, handler)
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.dup2(stdout, 2)
        os.closerange(3, 65536)
        os.chdir(cwd)
        write_cmdline(argv)
    except BaseException:  # noqa: BLE001
        os._exit(1)
    agent.run_module(argv[2], argv[3:], env)


def write_cmdline(argv: list[str]) -> None:
    """Write `argv` over this process's command line (the server's, and its room: CMDLINE_ROOM), which
    /proc/PID/cmdline and ps show, as setproctitle does; what does not fit is cut."""
    import ctypes

    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: the stat fields 48 and 49
    text = b"\0".join(a.encode() for a in argv)[:end - start - 1]
    ctypes.memmove(start, text + b"\0" * (end - start - len(text)), end - start)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # it ends with its launcher, not with a terminal's ^C
    serve(sock)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # nothing to tear down: what it imported holds nothing to close
