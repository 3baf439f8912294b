"""gptforge's node agent: each rank's environment, the first failure ending the others, a cancel reaching every
rank, and ranks that stay in the agent's process group; each both for ranks forked from the agent's import of the
module (warm ranks, a CPU node) and for ranks started as processes of their own."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from gptforge.pipeline.launch.agent import rank_env
from tests.helpers import config

RANK = textwrap.dedent("""
    import os, sys, time


    def main():
        rank = int(os.environ["RANK"])
        forked = "fake_rank" in sys.modules  # imported by the agent before it forked this rank
        with open(os.path.join(sys.argv[1], f"rank{rank}.pid"), "w") as f:
            f.write(f"{os.getpid()} {os.getpgrp()} {int(forked)}")
        if rank == int(sys.argv[2]):
            time.sleep(0.5)
            sys.exit(3)
        time.sleep(300)


    if __name__ == "__main__":
        main()
""")



def test_each_rank_gets_the_environment_a_launcher_gives():
    env = rank_env({"PATH": "/bin"}, nproc=4, nnodes=2, node_rank=1, local_rank=2, master_addr="10.0.0.1",
                   master_port=4242)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")} == {
        "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4242", "CROSS_RANK": "1", "CROSS_SIZE": "2", "LOCAL_SIZE": "4"}
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "1"
    assert rank_env({"OMP_NUM_THREADS": "8"}, 2, 1, 0, 0, "127.0.0.1", 1)["OMP_NUM_THREADS"] == "8"


WARM = {"forked": {"DS_ACCELERATOR": "cpu"}, "started": {"DS_ACCELERATOR": "cpu", "GPTFORGE_WARM_RANKS": "0"}}


def start(tmp_path, failing: int, how: str) -> subprocess.Popen:
    (tmp_path / "fake_rank.py").write_text(RANK)
    return subprocess.Popen([sys.executable, "-m", "gptforge.pipeline.launch.agent", "--nproc-per-node", "2",
                             "--master", "127.0.0.1:1", "-m", "fake_rank", str(tmp_path), str(failing)],
                            env={**os.environ, "PYTHONPATH": str(tmp_path), **WARM[how]}, start_new_session=True)


def pids(tmp_path) -> list[tuple[int, int, int]]:
    deadline = time.time() + 60
    while len(list(tmp_path.glob("rank*.pid"))) < 2:
        assert time.time() < deadline
        time.sleep(0.1)
    time.sleep(0.1)
    return [tuple(map(int, (tmp_path / f"rank{r}.pid").read_text().split())) for r in range(2)]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("how", WARM)
def test_the_first_rank_that_fails_ends_the_others_and_sets_the_exit_code(tmp_path, how):
    agent = start(tmp_path, 1, how)
    (rank0, group0, forked0), (_, group1, forked1) = pids(tmp_path)
    assert forked0 == forked1 == (how == "forked")
    assert group0 == group1 == agent.pid  # the ranks share the agent's process group: a kill of it reaches them
    assert agent.wait(30) == 3
    assert gone(rank0)


@pytest.mark.parametrize("how", WARM)
def test_a_cancelled_agent_ends_every_rank(tmp_path, how):
    agent = start(tmp_path, -1, how)
    ranks = [pid for pid, _, _ in pids(tmp_path)]
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(30) == 128 + signal.SIGTERM
    assert all(gone(pid) for pid in ranks)


WARMED = textwrap.dedent("""
    import sys
    from gptforge.pipeline.launch.agent import warm
    assert warm(sys.argv[1], ["--config", sys.argv[2], "--out", sys.argv[3]], nproc=2)
    print(*sys.modules)
""")


def test_a_warm_agent_imports_what_its_ranks_will_before_it_forks_them(tmp_path):
    """The stage's module, and what its ranks would otherwise each import as they run: the modelling code of the
    config's model family (Llama here, not GPT-2) and the stage's own (PPO's: TRL's utilities)."""
    _, path = config(tmp_path, "model.preset=llama-tiny")
    imported = set(subprocess.run([sys.executable, "-c", WARMED, "gptforge.stages.ppo", str(path), str(tmp_path)],
                                  env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True,
                                  check=True).stdout.split())
    assert {"gptforge.stages.ppo", "deepspeed", "transformers.models.llama.modeling_llama", "trl.trainer.utils", "peft",
            "torch.utils.tensorboard"} <= imported
    assert "transformers.models.gpt2.modeling_gpt2" not in imported
