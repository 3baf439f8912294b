"""The fork server (gptforge.pipeline.launch.fork_server): a CPU host's stage agents forked from one import, each
seen by the launcher as the process Popen would have started."""

import os
import signal
import sys
import textwrap
import time

from gptforge.pipeline.launch import fork_server
from gptforge.pipeline.launch.stage import run_streaming

# A stage's module: it notes the pid of the process that imported it; each rank prints what it sees and runs as
# its argument says.
STAGE = textwrap.dedent("""
    import os, sys, time
    IMPORTED_IN = os.getpid()
    if __name__ == "__main__":
        cmdline = open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode().strip()
        seen = ["rank", os.environ["RANK"], "pid", os.getpid(), "imported_in",
                sys.modules["forked_stage"].IMPORTED_IN, "agent", os.getppid(), "group", os.getpgid(0), "foo",
                os.environ.get("FOO"), "cmdline", cmdline]
        sys.stdout.write(" ".join(map(str, seen)) + "\\n")  # one write: the ranks print at once
        if sys.argv[1:] == ["sleep"]:
            time.sleep(300)
        if sys.argv[1:] == ["fail"] and os.environ["RANK"] == "1":
            time.sleep(1)  # (after rank 0 has printed)
        sys.exit(3 if sys.argv[1:] == ["fail"] and os.environ["RANK"] == "1" else 0)
""")


def agent(*args: str) -> list[str]:
    return [sys.executable, "-m", "gptforge.pipeline.launch.agent", "--nproc-per-node=2", "--master=127.0.0.1:1", "-m",
            "forked_stage", *args]


def seen(lines: list[str]) -> dict[int, dict[str, str]]:
    """What each rank printed, by rank."""
    ranks = {}
    for line in lines:
        if line.startswith("rank "):
            words = line.split(" ", 13)
            ranks[int(words[1])] = dict(zip(words[2::2], words[3::2]))
    return ranks


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stage_agents_fork_from_one_import_and_get_what_popen_gives(tmp_path):
    (tmp_path / "forked_stage.py").write_text(STAGE)
    env = {"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(tmp_path)}
    runs = []
    for args, extra in (((), {}), (("fail",), {}), ((), {"FOO": "x"})):
        lines = []
        runs.append((run_streaming([agent(*args)], lines.append, env={**env, **extra}), seen(lines)))
    (rc, first), (failed_rc, failed), (_, other_env) = runs
    assert rc == 0 and failed_rc == 3  # the failed rank's code, through the server
    servers = {int(r["imported_in"]) for r in (*first.values(), *failed.values())}
    assert len(servers) == 1  # both stages' ranks run on one import of the stage, made by the server
    (server,) = servers
    for ranks in (first, failed):
        assert set(ranks) == {0, 1} and len({r["agent"] for r in ranks.values()}) == 1
        (agent_pid,) = {int(r["agent"]) for r in ranks.values()}
        assert server != agent_pid and {int(r["group"]) for r in ranks.values()} == {agent_pid}  # its own group
        assert all(r["cmdline"].endswith("-m gptforge.pipeline.launch.agent --nproc-per-node=2 --master=127.0.0.1:1 -m "
                                         f"forked_stage{' fail' if ranks is failed else ''}") for r in ranks.values())
    # another environment, another server: what it imported read that environment
    assert {r["foo"] for r in other_env.values()} == {"x"} and server not in {int(r["imported_in"])
                                                                            for r in other_env.values()}
    assert {r["foo"] for r in first.values()} == {"None"}

    # killing the process group ends the agent and its ranks; the exit status comes back as Popen's would
    proc = fork_server.start(agent("sleep"), {**os.environ, **env})
    assert proc is not None
    lines = []
    while len(lines) < 2:
        lines += [line for line in proc.stdout.readline().decode().splitlines() if line.startswith("rank ")]
    pids = [int(r["pid"]) for r in seen(lines).values()]
    assert proc.poll() is None and all(alive(p) for p in pids)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    deadline = time.time() + 10
    while any(alive(p) for p in pids):
        assert time.time() < deadline, "a rank outlived its agent"
        time.sleep(0.1)


def test_what_forks():
    cpu = {"DS_ACCELERATOR": "cpu"}
    assert fork_server.forkable(agent(), cpu)
    assert fork_server.forkable([sys.executable, "-m", "gptforge.stages.evaluate", "--config", "c"], cpu)
    assert not fork_server.forkable([sys.executable, "-m", "gptforge.stages.tokenize"], cpu)  # no torch to share
    assert not fork_server.forkable(agent(), {})  # a GPU host
    assert not fork_server.forkable(agent(), {**cpu, "GPTFORGE_FORK_SERVER": "0"})
    assert not fork_server.forkable(["ssh", "node-b", *agent()], cpu)
    # a stage's own settings (the accelerate launcher's, the MLflow parent) do not ask for another server
    assert fork_server.key({**cpu, "ACCELERATE_USE_DEEPSPEED": "true"}) == fork_server.key(cpu)
    assert fork_server.key({**cpu, "HF_HOME": "/elsewhere"}) != fork_server.key(cpu)
