"""Model-written code, run in a sandbox: bubblewrap's namespaces, an unprivileged uid of its own, rlimits and a
size-limited scratch file system; never a `subprocess.run` with a timeout alone.

What a program run here gets (`run`):
- no network: a network namespace of its own, with only its own loopback (the host's 127.0.0.1 is not it);
- a read-only view of /usr (the host's Python at /usr/bin/python3, its standard library), and nothing else of the
  host's files: no /etc, /home, /root, /work, no checkout, no run outputs, no reward answers;
- a private scratch directory, /scratch (its working directory, HOME and TMPDIR), a tmpfs of `disk_mb` that goes
  with the call, and nothing else writable (its root is read-only);
- no inherited environment variables (PATH, HOME, TMPDIR and LANG only: no HF_TOKEN, no credentials);
- its own PID namespace, user namespace and session, as a uid of its own (one of a pool, leased host-wide: one a
  call, across every process and run on the host, clear of the host's users and /etc/subuid ranges), so that it sees
  and signals no other process and its process limit is its own;
- limits: wall time (`wall_s`, then everything in it is killed), CPU time (RLIMIT_CPU), address space (RLIMIT_AS,
  `memory_mb`), processes (RLIMIT_NPROC for its uid), and where the host lets this process make cgroups, one a call
  (`cgroups_of`: the memory and number of all its processes together, its cores, one process's CPU weight), open
  files (RLIMIT_NOFILE), the size of any file it writes (RLIMIT_FSIZE) and of the scratch file system, and of what
  it prints (`output_bytes`: past it, it is killed and the output cut);
- nothing of it outlives the call: killing the namespace's first process (through a pidfd: only the process this
  call started, never one that took its pid) ends every process in it; this process is a child subreaper, so what
  the call leaves is reaped here, and a uid goes back to the pool only once no task of it, zombie included, exists.

What it does not guarantee: it is not a virtual machine. The kernel is the host's, so a kernel exploit escapes it;
CPU time is limited per process (and memory too where no cgroup can be made), not shared fairly with training (the
rollout workers' pinned cores bound that: gptforge.model.agents.concurrency); side channels (timing,
/proc/cpuinfo-like facts through /usr) are not closed.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import pwd
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gptforge.core.config.training import SandboxSection as Limits  # the limits, declared once (preference.sandbox)
from gptforge.core.errors import ConfigError

PYTHON = "/usr/bin/python3"  # the host's Python, under the read-only /usr
POOL = 256  # the sandbox's uids: one a call in flight on the host
FIRST_UID = 1_900_000_000  # far above the users a host makes (and moved past any /etc/subuid or /etc/subgid range)
LEASES = Path("/tmp/gptforge-sandbox")  # a lock file a uid: held (flock) by the call using it, in any process
_subreaper = threading.Lock()
_reaping = False


def taken_ranges() -> list[range]:
    """The uids the host has given away: its users', and its /etc/subuid and /etc/subgid ranges (other users' user
    namespaces, whose processes a sandbox uid must never share)."""
    out = [range(u.pw_uid, u.pw_uid + 1) for u in pwd.getpwall()]
    for path in ("/etc/subuid", "/etc/subgid"):
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.strip().split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                out.append(range(int(parts[1]), int(parts[1]) + int(parts[2])))
    return out


def pool_uids() -> range:
    """POOL uids from FIRST_UID on, moved past every range the host has given away."""
    start, taken = FIRST_UID, taken_ranges()
    while clash := [r for r in taken if r.start < start + POOL and start < r.stop]:
        start = max(r.stop for r in clash)
    return range(start, start + POOL)


UIDS = pool_uids()


@dataclass
class Result:
    stdout: str
    stderr: str
    exit_status: int | None  # None: killed by the sandbox (`reason` says why)
    reason: str = ""  # wall time, output, or the signal that ended it
    truncated: bool = False

    def text(self, cut: int) -> str:
        """What a tool returns to the model: the status, then stdout and stderr, cut to `cut` characters."""
        status = f"exit status {self.exit_status}" if self.exit_status is not None else f"killed ({self.reason})"
        out = f"{status}\nstdout:\n{self.stdout}" + (f"\nstderr:\n{self.stderr}" if self.stderr else "")
        return out if len(out) <= cut else out[:cut] + f"\n[cut at {cut} characters]"


def missing() -> str | None:
    """What the host lacks to run the sandbox (bubblewrap, setpriv, the Python), named with its package."""
    for tool, package in (("bwrap", "bubblewrap"), ("setpriv", "util-linux")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package})"
    if not os.access(PYTHON, os.X_OK):
        return f"{PYTHON} is not installed (apt-get install python3)"
    return None


def require(key: str) -> None:
    """The sandbox runs here: its tools are installed, and a trivial program runs in it and prints what it should
    (a host that drops CAP_SETUID, or refuses user namespaces, fails now, not as a score of 0 at the first call)."""
    why = missing()
    if why:
        raise ConfigError(f"{key} runs model-written code in a sandbox, but {why}; .ci/run and make install it")
    result = run([PYTHON, "-I", "-c", "print(6 * 7)"], limits=Limits(wall_s=30))
    if (result.exit_status, result.stdout) != (0, "42\n"):
        raise ConfigError(f"{key} runs model-written code in a sandbox, but a trivial program does not run in it "
                          f"here ({result.text(300)!r}); docs/sandbox.md says what the sandbox needs of the host")


class SandboxError(RuntimeError):
    """The sandbox did not start (the host could not run it): a failure of the call, never the program's result."""


START = "\x1f"  # what a sandboxed program's launcher writes first: without it, the sandbox never started
LAUNCH = ("import sys\nsys.stdout.write(" + repr(START) + ")\nsys.stdout.flush()\n"
          "exec(compile(sys.stdin.read(), '<program>', 'exec'), {'__name__': '__main__'})")


def started(result: Result, limits: Limits) -> Result:
    """`result` without its start marker, or a SandboxError where the sandbox never started the program."""
    if not result.stdout.startswith(START):
        why = (f"it was killed ({result.reason}) before it started" if result.reason
               else repr((result.stderr or result.stdout).strip()[:200]))
        raise SandboxError(f"the sandbox did not start a program: {why}")
    result.stdout = result.stdout[len(START):]
    return result


# --- the seccomp filter: what a program in the sandbox may not ask of the kernel ---------------------------------

# namespaces (the sandbox's own are made before the filter loads), mounts, other processes' memory, the kernel's
# attack surfaces that a program has no use for (io_uring, bpf, keyrings, perf, userfaultfd, modules, kexec)
DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsmount",
          "fsconfig", "fspick", "mount_setattr", "ptrace", "process_vm_readv", "process_vm_writev", "bpf", "keyctl",
          "add_key", "request_key", "io_uring_setup", "io_uring_enter", "io_uring_register", "perf_event_open",
          "userfaultfd", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
          "open_by_handle_at", "name_to_handle_at", "sched_setaffinity", "personality", "acct", "swapon", "swapoff",
          "reboot", "syslog")
CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
_filter: bytes | None = None


class _ArgCmp(ctypes.Structure):  # libseccomp's struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def seccomp_filter() -> bytes:
    """The sandbox's seccomp program (BPF, as bwrap's --seccomp loads it), built once a process with libseccomp:
    DENIED fails with EPERM, clone with any CLONE_NEW* flag too, and clone3 with ENOSYS (its flags lie in memory a
    filter cannot read; the C library falls back to clone)."""
    global _filter
    if _filter is None:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(_ArgCmp)]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        allow, eperm, enosys, masked_eq = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 7
        ctx = lib.seccomp_init(allow)
        try:
            def deny(name: str, action: int, *args: _ArgCmp) -> None:
                number = lib.seccomp_syscall_resolve_name(name.encode())
                if number < 0:  # not a system call of this architecture
                    return
                array = (_ArgCmp * len(args))(*args) if args else None
                if lib.seccomp_rule_add_array(ctx, action, number, len(args), array) != 0:
                    raise OSError(f"seccomp: cannot add a rule for {name}")

            for name in DENIED:
                deny(name, eperm)
            for flag in CLONE_NEW:
                deny("clone", eperm, _ArgCmp(0, masked_eq, flag, flag))
            deny("clone3", enosys)
            with tempfile.TemporaryFile() as f:
                if lib.seccomp_export_bpf(ctx, f.fileno()) != 0:
                    raise OSError("seccomp: cannot export the filter")
                f.seek(0)
                _filter = f.read()
        finally:
            lib.seccomp_release(ctx)
    return _filter


def command(uid: int, limits: Limits, argv: list[str], seccomp_fd: int) -> list[str]:
    """setpriv to the call's uid, then bwrap: every namespace of its own and no new ones (--disable-userns, the
    seccomp filter), a read-only root with /usr, a /dev of device nodes that is read-only but for a /dev/shm as
    small as the scratch folder, the scratch tmpfs, a clean environment."""
    disk = str(limits.disk_mb << 20)
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--",
            "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--clearenv",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev", "--size", disk, "--tmpfs",
            "/dev/shm", "--remount-ro", "/dev", "--size", disk, "--tmpfs", "/scratch", "--remount-ro", "/",
            "--chdir", "/scratch", "--seccomp", str(seccomp_fd),
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/scratch", "--setenv", "TMPDIR", "/scratch",
            "--setenv", "LANG", "C.UTF-8", "--", *argv]


def run(argv: list[str], stdin: str = "", limits: Limits = Limits()) -> Result:
    """`argv` (e.g. [PYTHON, "-c", code]) in the sandbox, `stdin` its input; its output, status and why it ended."""
    become_subreaper()
    uid, lease = lease_uid()
    groups: list[Path] = []
    try:
        groups = cgroups_of(uid, limits)
        return _run(uid, argv, stdin, limits, groups)
    finally:
        settle(uid)
        release(groups)
        os.close(lease)  # the lock goes with it


def become_subreaper() -> None:
    """Make this process the child subreaper of what it starts: bubblewrap's first process exits before the
    namespace's init it started, which would otherwise wait as a zombie of the sandbox's uid, counted against the
    uid's process limit, for the host's init to reap it (and a container's init may never)."""
    global _reaping
    with _subreaper:
        if not _reaping:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
            _reaping = True


def lease_uid() -> tuple[int, int]:
    """A uid of the pool that no call on the host holds and that no task runs as (zombies included), and the
    descriptor holding its lease (an exclusive flock: the kernel drops it with the process that held it)."""
    LEASES.mkdir(mode=0o700, exist_ok=True)
    for uid in UIDS:
        fd = os.open(LEASES / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if not alive(uid):
            return uid, fd
        os.close(fd)  # what an earlier call left (a zombie the host's init has not reaped yet): not free
    raise RuntimeError(f"all of the sandbox's {POOL} uids ({UIDS.start}-{UIDS.stop - 1}) are in use on this host")


# --- the call's cgroup: its memory, processes and cores shared by every process of it ---------------------------

CGROUPS = Path("/sys/fs/cgroup")
GROUP = "gptforge-sandbox"  # the folder of the calls' cgroups, one a uid of the pool, under each hierarchy
V1 = ("memory", "pids", "cpuset", "cpu")  # the cgroup v1 controllers a call takes, where the host mounts each apart
_hierarchies: list[Path] | None = None  # where this host lets the calls have cgroups: the parents ([] for none)
_layout = threading.Lock()


def hierarchies() -> list[Path]:
    """The parent folders of the calls' cgroups: one a controller of V1 (cgroup v1), or one (cgroup v2, its
    controllers enabled below it); [] where the host lets this process make none (not root, a read-only
    /sys/fs/cgroup, a v2 root with processes of its own): then the limits are each process's alone (rlimits)."""
    global _hierarchies
    with _layout:
        if _hierarchies is None:
            _hierarchies = _make_parents()
        return _hierarchies


def _make_parents() -> list[Path]:
    try:
        if all((CGROUPS / c / "tasks").exists() for c in V1):  # v1: a hierarchy a controller
            parents = []
            for c in V1:
                parent = CGROUPS / c / GROUP
                parent.mkdir(exist_ok=True)
                if c == "cpuset":  # a v1 cpuset starts empty: its cores and memory nodes are its parent's
                    for f in ("cpuset.cpus", "cpuset.mems"):
                        (parent / f).write_text((CGROUPS / c / f).read_text())
                parents.append(parent)
            return parents
        if {"memory", "pids", "cpu", "cpuset"} <= set((CGROUPS / "cgroup.controllers").read_text().split()):
            parent = CGROUPS / GROUP
            parent.mkdir(exist_ok=True)
            for folder in (CGROUPS, parent):
                (folder / "cgroup.subtree_control").write_text("+memory +pids +cpu +cpuset")
            return [parent]
    except OSError:
        pass
    return []


def cgroups_of(uid: int, limits: Limits) -> list[Path]:
    """The call's cgroups (made, or emptied ones of an earlier call of its uid, their limits set anew): the memory
    of all its processes (`memory_mb`, no swap), their number (`processes`), this process's cores and one
    process's CPU weight, however many it forks."""
    memory, cores = str(limits.memory_mb << 20), ",".join(map(str, sorted(os.sched_getaffinity(0))))
    limit = [("memory.memsw.limit_in_bytes", "-1"),  # (v1 holds memory+swap >= memory: lift it, set both in turn)
             ("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory), ("memory.max", memory),
             ("memory.swap.max", "0"), ("pids.max", str(limits.processes)), ("cpuset.cpus", cores),
             ("cpu.shares", "1024"), ("cpu.weight", "100")]
    out = []
    try:
        for parent in hierarchies():
            group = parent / str(uid)
            group.mkdir(exist_ok=True)  # (one an earlier call of the uid left, empty: settle waited for that)
            if (group / "cpuset.mems").exists() and (parent / "cpuset.mems").exists():
                (group / "cpuset.mems").write_text((parent / "cpuset.mems").read_text())
            for name, value in limit:
                if (group / name).exists():
                    (group / name).write_text(value)
            out.append(group)
    except OSError as e:
        raise SandboxError(f"the sandbox's cgroup {group} cannot be set up: {e}") from None
    return out


def oom_killed(groups: list[Path]) -> bool:
    """Whether the kernel killed a process of the call for its memory (its cgroup's oom_kill count)."""
    for group in groups:
        for name in ("memory.oom_control", "memory.events"):
            try:
                counts = dict(line.split() for line in (group / name).read_text().splitlines())
            except (OSError, ValueError):
                continue
            if int(counts.get("oom_kill", 0)):
                return True
    return False


def release(groups: list[Path]) -> None:
    """Remove the call's cgroups once no task is in them (settle has waited for that); one that is not empty yet
    stays, and the uid's next call sets it anew."""
    for group in groups:
        try:
            group.rmdir()
        except OSError:
            pass


def _run(uid: int, argv: list[str], stdin: str, limits: Limits, groups: list[Path]) -> Result:
    def limited():  # in the child, before setpriv drops to the uid: inherited by bwrap and the program
        for group in groups:  # (still root here: the cgroups take it, and every process it starts)
            (group / "cgroup.procs").write_text(str(os.getpid()))
        memory = limits.memory_mb << 20
        for what, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, memory),
                            (resource.RLIMIT_NPROC, limits.processes), (resource.RLIMIT_NOFILE, limits.open_files),
                            (resource.RLIMIT_FSIZE, limits.disk_mb << 20), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(what, (value, value))

    rules = tempfile.TemporaryFile()  # the filter, read by bwrap from an inherited descriptor
    rules.write(seccomp_filter())
    rules.seek(0)
    try:
        process = subprocess.Popen(command(uid, limits, argv, rules.fileno()), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limited,
                                   start_new_session=True, pass_fds=(rules.fileno(),))
    finally:
        rules.close()
    process.pidfd = os.pidfd_open(process.pid)  # before anything can reap it: a kill reaches this process or none
    try:
        result = _watch(process, stdin, limits)
    finally:
        os.close(process.pidfd)
    if result.reason == "SIGKILL" and oom_killed(groups):  # the program itself killed by the kernel for memory
        result.reason = "memory"
    return result


def _watch(process: subprocess.Popen, stdin: str, limits: Limits) -> Result:
    out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
    flooded = threading.Event()

    def drain(name, pipe):
        while chunk := pipe.read1(65536) if hasattr(pipe, "read1") else pipe.read(65536):
            room = limits.output_bytes - len(out[name])
            out[name] += chunk[:max(0, room)]
            if len(chunk) > room:
                flooded.set()
                kill(process)
                return

    readers = [threading.Thread(target=drain, args=(n, getattr(process, n)), daemon=True) for n in out]
    for r in readers:
        r.start()
    try:
        process.stdin.write(stdin.encode())
        process.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    deadline, timed_out = time.monotonic() + limits.wall_s, False
    while process.poll() is None:
        if time.monotonic() > deadline:
            timed_out = True
            kill(process)
            break
        if flooded.wait(0.01):
            break
    process.wait()
    for r in readers:
        r.join(1)
    status = process.returncode
    reason = "wall time" if timed_out else "output" if flooded.is_set() else ended_by(status)
    return Result(out["stdout"].decode(errors="replace"), out["stderr"].decode(errors="replace"),
                  None if reason else status, reason, flooded.is_set())


def ended_by(status: int) -> str:
    """The signal that ended a run: a negative status (setpriv's), or bwrap's 128 + n for its child's; "" for none."""
    n = -status if status < 0 else status - 128 if status > 128 else 0
    try:
        return signal.Signals(n).name if n else ""
    except ValueError:
        return ""


def kill(process: subprocess.Popen) -> None:
    """bwrap, through the pidfd of the process this call started (never a pid that another process may have taken
    since), and with it (--die-with-parent, its PID namespace) everything in it."""
    try:
        signal.pidfd_send_signal(process.pidfd, signal.SIGKILL)
    except OSError:  # it has exited (ESRCH), or the call has ended (its pidfd closed)
        pass


def settle(uid: int, wait_s: float = 5.0) -> None:
    """Wait, reaping, until no task of the call's uid is left: the namespace's init and its program die with the
    namespace, and whatever of them this process inherited as their subreaper is reaped here. A task still there
    after `wait_s` (none should be) keeps the uid out of the pool (lease_uid skips it), never killed by uid."""
    deadline = time.monotonic() + wait_s
    while True:
        left = alive(uid)
        if not left:
            return
        for pid, running in left:
            if not running:
                try:
                    os.waitpid(pid, os.WNOHANG)  # ours to reap where we inherited it; another's parent reaps its own
                except ChildProcessError:
                    pass
        if time.monotonic() > deadline:
            return
        time.sleep(0.002)


def alive(uid: int) -> list[tuple[int, bool]]:
    """The processes of `uid`: (pid, whether it still runs, not a zombie waiting to be reaped)."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat(f"/proc/{p}").st_uid != uid:
                    continue
                with open(f"/proc/{p}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            out.append((int(p), state not in ("Z", "X")))
    return out


def python_tool(limits: Limits):
    """The built-in tool `python` (`preference.tools: [python]`): the model's code run in the sandbox, its status,
    stdout and stderr returned, cut to `limits.output_bytes` characters."""

    def python(code: str) -> str:
        """Run a Python program in a sandbox (no network, no files but its own scratch folder) and return its exit
        status, stdout and stderr.

        Args:
            code: the Python program to run
        """
        return started(run([PYTHON, "-I", "-c", LAUNCH], stdin=code, limits=limits), limits).text(limits.output_bytes)

    return python
