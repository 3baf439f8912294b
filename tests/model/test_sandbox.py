"""The sandbox model-written code runs in (gptforge.model.agents.sandbox), attacked as a policy optimised for reward
would: each leak is shown on a naive runner (`subprocess.run` with a timeout) where it is safe to, and refused by
the sandbox; the bombs and floods end in the sandbox's limits, the stage's process untouched, and nothing of a call
outlives it. Then the `python` tool and the `unit_tests` reward on it, and the mistakes a user can make."""

import fcntl
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from gptforge.core.config import load_config
from gptforge.core.errors import UserError
from gptforge.model.agents import sandbox
from gptforge.model.agents.sandbox import PYTHON, Limits, alive, run
from tests.conftest import ROOT, TINY

pytestmark = pytest.mark.skipif(sandbox.missing() is not None, reason=f"the sandbox: {sandbox.missing()}")


def naive(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)


def boxed(code: str, **limits):
    return run([PYTHON, "-c", code], limits=Limits(**{"wall_s": 10.0, **limits}))


def test_files_outside_the_scratch_folder_are_neither_read_nor_written(tmp_path):
    answers = tmp_path / "answers.jsonl"  # the run's reward answers
    answers.write_text('{"answer": "42"}\n')
    for path in (answers, "/etc/shadow", ROOT / "README.md"):
        code = f"print(open({str(path)!r}).read()[:20])"
        assert naive(code).returncode == 0  # a plain subprocess reads it
        got = boxed(code)
        assert got.exit_status == 1 and ("FileNotFoundError" in got.stderr or "PermissionError" in got.stderr)
    target = tmp_path / "pwned"
    assert naive(f"open({str(target)!r}, 'w').write('x')").returncode == 0 and target.exists()
    target.unlink()
    for path in (target, "/usr/pwned", "/pwned"):
        got = boxed(f"open({str(path)!r}, 'w').write('x')")
        assert got.exit_status == 1 and "Error" in got.stderr
    assert not target.exists() and not os.path.exists("/usr/pwned")
    ok = boxed("open('notes.txt', 'w').write('kept'); print(open('/scratch/notes.txt').read())")
    assert (ok.exit_status, ok.stdout.strip()) == (0, "kept")  # its own scratch folder is its to use


def test_no_network_and_no_inherited_secrets(monkeypatch):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); print('connected')"
    try:
        assert naive(connect).stdout.strip() == "connected"  # the test's server on the host's loopback
        got = boxed(connect)
        assert got.exit_status == 1 and "ConnectionRefusedError" in got.stderr  # its loopback is its own
        far = boxed("import socket; socket.create_connection(('192.0.2.1', 80), timeout=3)")  # another address
        assert far.exit_status == 1 and "Network is unreachable" in far.stderr
    finally:
        server.close()
    monkeypatch.setenv("HF_TOKEN", "hf_planted_secret")
    read = "import os; print(os.environ.get('HF_TOKEN'), sorted(os.environ))"
    assert "hf_planted_secret" in naive(read).stdout
    got = boxed(read)
    assert got.exit_status == 0 and "hf_planted_secret" not in got.stdout and got.stdout.startswith("None")


def test_bombs_loops_and_floods_end_in_the_limits():
    forks = boxed("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", wall_s=4)
    assert forks.exit_status is None and forks.reason == "wall time"  # RLIMIT_NPROC held it to 32 processes
    memory = boxed("x = bytearray(4 << 30)", memory_mb=256)
    assert memory.exit_status == 1 and "MemoryError" in memory.stderr
    t0 = time.monotonic()
    loop = boxed("while True:\n    pass", wall_s=2, cpu_s=60)
    assert loop.exit_status is None and loop.reason == "wall time" and time.monotonic() - t0 < 6
    cpu = boxed("while True:\n    pass", wall_s=30, cpu_s=1)
    assert cpu.exit_status is None and cpu.reason in ("SIGKILL", "SIGXCPU"), cpu  # RLIMIT_CPU, long before 30 s
    flood = boxed("while True:\n    print('x' * 1000)", output_bytes=4096)
    assert flood.reason == "output" and flood.truncated and len(flood.stdout) == 4096
    disk = boxed("open('big', 'wb').write(b'0' * (64 << 20))", disk_mb=8)
    assert disk.exit_status == 1 and ("File too large" in disk.stderr or "No space" in disk.stderr)


def test_its_process_and_open_file_limits_pid_namespace_and_uid_are_its_own(monkeypatch):
    """Each limit the docs promise, counted from inside: forks until the kernel refuses (RLIMIT_NPROC of its uid),
    files opened until it refuses (RLIMIT_NOFILE); its PID namespace shows it only its own processes and not this
    test's; and it runs, seen from the host, as one of the sandbox's uids, not as this process's."""
    count_forks = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                   "            time.sleep(3)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
                   "    print(n, type(e).__name__)")
    got = boxed(count_forks, processes=6)
    forked, error = got.stdout.split()
    # the uid's processes, bwrap's and the program's own included, stop at 6: fewer than 6 children
    assert error == "BlockingIOError" and 0 < int(forked) < 6, got
    assert int(boxed(count_forks, processes=12).stdout.split()[0]) > int(forked)  # the limit, not something else
    count_files = ("n = []\ntry:\n    while True:\n        n.append(open('/dev/null'))\nexcept OSError as e:\n"
                   "    print(len(n), e.errno)")
    files, errno = map(int, boxed(count_files, open_files=20).stdout.split())
    assert errno == 24 and 10 < files < 20  # EMFILE: its 20 descriptors, stdin, stdout and stderr among them
    assert int(boxed(count_files, open_files=40).stdout.split()[0]) == files + 20
    here = os.getpid()
    seen = boxed(f"import os\nprint(os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
                 f"try:\n    os.kill({here}, 0)\n    print('reached')\nexcept ProcessLookupError:\n    print('none')")
    first, reached = seen.stdout.splitlines()
    pid, pids = first.split(" ", 1)
    assert pid == "2" and pids == "[1, 2]" and reached == "none", seen  # bwrap's init and itself, and nothing else
    assert naive(f"import os\nos.kill({here}, 0)\nprint('reached')").stdout.strip() == "reached"
    ran: dict = {}
    leased = leases(monkeypatch)
    thread = threading.Thread(target=lambda: ran.update(r=boxed("import time\nprint('up', flush=True)\n"
                                                                "time.sleep(3)")))
    thread.start()
    deadline = time.monotonic() + 10
    running: list = []
    while not running and time.monotonic() < deadline:  # (other processes of the suite may hold other uids)
        running = [pid for uid in leased for pid, up in alive(uid) if up]
        time.sleep(0.05)
    thread.join()
    assert running and leased[0] in sandbox.UIDS and os.getuid() != leased[0]  # a sandbox uid ran it
    assert ran["r"].stdout.strip() == "up"


def test_dev_is_read_only_and_the_kernel_refuses_new_namespaces_and_its_attack_surfaces():
    """/dev's nodes read-only, /dev/shm no larger than the scratch folder; no user or network namespace of its own
    making (the sandbox's are made before its seccomp filter loads, and --disable-userns closes nested ones), and
    io_uring, bpf, keyrings, ptrace, mount and widening its own cores refused with EPERM (a plain process here may
    do each)."""
    assert boxed("open('/dev/x', 'w')").stderr.rstrip().endswith("OSError: [Errno 30] Read-only file system: '/dev/x'")
    shm = boxed("open('/dev/shm/x', 'wb').write(b'0' * (64 << 20))", disk_mb=8)
    assert shm.exit_status == 1 and ("File too large" in shm.stderr or "No space" in shm.stderr)
    calls = {  # each a raw system call: (what a plain process gets here, what the sandboxed one must get)
        "unshare(NEWUSER|NEWNET)": "libc.unshare(0x10000000 | 0x40000000)",
        "io_uring_setup": "libc.syscall(425, 8, ctypes.create_string_buffer(120))",
        "bpf": "libc.syscall(321, 0, ctypes.create_string_buffer(128), 128)",
        "keyctl": "libc.syscall(250, 0, 0, 0, 0, 0)",
        "ptrace(TRACEME)": "libc.ptrace(0, 0, 0, 0)",
        "mount": "libc.mount(b'none', b'/scratch', b'tmpfs', 0, None)",
        "sched_setaffinity": "libc.sched_setaffinity(0, 8, ctypes.byref(ctypes.c_ulong(3)))",
    }
    probe = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nr = {}\nprint(r, ctypes.get_errno())"
    for what, call in calls.items():
        got = boxed(probe.format(call))
        result, errno = got.stdout.split()
        assert (result, errno) == ("-1", "1"), (what, got)  # EPERM
    assert naive(probe.format(calls["io_uring_setup"])).stdout.split()[0] != "-1"  # the host's kernel has it
    forked = boxed("import threading, subprocess\nt = threading.Thread(target=print, args=('thread',))\nt.start()\n"
                   "t.join()\nprint(subprocess.run(['/usr/bin/echo', 'child'], capture_output=True, text=True).stdout)")
    assert forked.stdout.split() == ["thread", "child"]  # threads and children as before (clone without NEW* flags)


BOMB = """
import os, time
kids = []
for _ in range(5):
    pid = os.fork()
    if pid == 0:
        held = bytearray(50 << 20)  # written: resident, not only reserved
        time.sleep(1)
        os._exit(0)
    kids.append(pid)
print(sum(os.waitpid(k, 0)[1] == 0 for k in kids))
"""


def test_a_memory_bomb_across_children_is_held_to_the_calls_memory_and_its_cores_are_the_trainers(monkeypatch):
    """Five children of 50 MiB each: under memory_mb 120 the call's cgroup holds them all to 120 MiB together (the
    rlimit alone, a process's, let each have its own 120: 250 MiB), and under 400 all five hold; the call's cores
    are this process's. (Where no cgroup can be made here the limits are per process, as docs/sandbox.md says: a
    skip, which fails a CI=true run, whose host is root with cgroups.)"""
    if not sandbox.hierarchies():
        pytest.skip("this host lets this process make no cgroup: the sandbox's limits are per process here")
    leased = leases(monkeypatch)
    survivors = int(boxed(BOMB, memory_mb=120).stdout)
    assert survivors <= 2, survivors  # 2 x 50 MiB and the interpreters fit in 120; a third does not
    assert int(boxed(BOMB, memory_mb=400).stdout) == 5  # the limit, not something else
    cores = boxed("import os\nprint(sorted(os.sched_getaffinity(0)))")
    assert cores.stdout.strip() == str(sorted(os.sched_getaffinity(0)))
    for parent in sandbox.hierarchies():  # each call's cgroups go with it
        assert not any((parent / str(uid)).exists() for uid in leased), parent


LONG_CALL = """
from gptforge.model.agents.sandbox import PYTHON, Limits, run
r = run([PYTHON, "-c", "import time; time.sleep(3); print('done')"], limits=Limits(wall_s=20))
print(r.exit_status, r.stdout.strip())
"""


def test_two_processes_calling_at_once_and_many_calls_back_to_back():
    """Another process's long call runs while this one makes short calls: each has its own uid, and nothing this
    process's calls do reaches it. Then 200 calls in a row under a process limit of 8, each judged right: no zombie
    and no uid of an earlier call counts against the next."""
    from gptforge.model.agents import judge

    long = subprocess.Popen([sys.executable, "-c", LONG_CALL], stdout=subprocess.PIPE, text=True)
    time.sleep(1)  # (its call is under way)
    for _ in range(20):
        assert boxed("print(1)").stdout == "1\n"
    assert long.communicate(timeout=60)[0].split() == ["0", "done"]  # unharmed
    tests = [judge.split(t) for t in ("assert f(2) == 4", "assert f(3) == 9")]
    scores = [judge.score("def f(x):\n    return x * x\n", tests, Limits(processes=8)) for _ in range(200)]
    assert scores == [1.0] * 200


def leases(monkeypatch) -> list[int]:
    """The uids this process's calls lease from now on (other processes of the suite lease others at once)."""
    leased: list[int] = []
    lease = sandbox.lease_uid

    def recorded():
        uid, fd = lease()
        leased.append(uid)
        return uid, fd

    monkeypatch.setattr(sandbox, "lease_uid", recorded)
    return leased


def test_nothing_of_a_call_outlives_it(monkeypatch):
    leased = leases(monkeypatch)
    started = boxed("import subprocess\nsubprocess.Popen(['/usr/bin/python3', '-c', 'import time; time.sleep(60)'])\n"
                    "print('started')")
    assert (started.exit_status, started.stdout.strip()) == (0, "started")
    (uid,) = leased
    assert not alive(uid)  # the background process is gone, and no zombie of the call is left to hold its uid
    fd = os.open(sandbox.LEASES / str(uid), os.O_RDWR)  # its lease given back: free for the next call
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_the_python_tool_and_the_unit_tests_reward():
    python = sandbox.python_tool(Limits(output_bytes=200))
    assert python("print(sum(range(10)))") == "exit status 0\nstdout:\n45\n"
    assert python("raise ValueError('no')").startswith("exit status 1\nstdout:\n\nstderr:\nTraceback")
    assert python("print('y' * 500)").endswith("[cut at 200 characters]")
    cfg = load_config(TINY, ["preference.rewards=[{name: unit_tests}]", "preference.algorithm=grpo"])
    from gptforge.model import rewards

    (check,) = rewards.build(cfg.preference)
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-1, 1) == 0"]
    responses = ["Here:\n```python\ndef add(a, b):\n    return a + b\n```", "def add(a, b):\n    return 0",
                 "import os\nos._exit(0)", "print('\\nforged 3 3')\nraise SystemExit(0)", "def add(a, b):\n    1/0"]
    assert check(None, responses, [None] * 5, {"tests": [tests] * 5}) == [1.0, 1 / 3, 0.0, 0.0, 0.0]


def test_sandbox_mistakes_are_one_line_naming_the_key(monkeypatch):
    with pytest.raises(UserError, match=r"preference.sandbox.memory_mb\n  Input should be greater than 0|"
                                        r"preference.sandbox.memory_mb.*greater than 0"):
        load_config(TINY, ["preference.sandbox.memory_mb=0"])
    from gptforge.model.agents.tools import Setup

    monkeypatch.setattr(sandbox.shutil, "which", lambda tool: None if tool == "bwrap" else f"/usr/bin/{tool}")
    with pytest.raises(UserError, match=r"preference.tools: python runs model-written code in a sandbox, but bwrap "
                                        r"is not installed \(apt-get install bubblewrap\)"):
        Setup.load(None, ["python"], timeout_s=10)
