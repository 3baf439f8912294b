import base64
import json
import shlex
import sys
from pathlib import Path

import pytest

from gptforge.core.config import load_config
from gptforge.core.errors import ConfigError
from gptforge.pipeline.launch.nodes import SSH_OPTIONS, node_commands, node_env
from tests.conftest import TINY

BATCHES = [f"{s}.global_batch_size=256" for s in ("pretrain", "sft", "reward", "preference")]
ARGS = ["--config", "cfg.yaml", "--out", "out", "--input", "tokenize=tok"]


def cmds(*overrides, stage="pretrain", inputs=None, port=4242):
    return node_commands(load_config(TINY, [*BATCHES, *overrides]), stage, Path("cfg.yaml"), Path("out"),
                         {"tokenize": Path("tok")} if inputs is None else inputs, port, {"DS_ACCELERATOR": "cpu"})


def test_tokenize_and_evaluation_run_as_one_process():
    assert cmds(stage="tokenize", inputs={}) == [[sys.executable, "-m", "gptforge.stages.tokenize", "--config",
                                                  "cfg.yaml", "--out", "out"]]
    assert cmds(stage="eval-dpo", inputs={"dpo": Path("d")})[0][:3] == [sys.executable, "-m",
                                                                          "gptforge.stages.evaluate"]


def test_gptforges_agent_starts_each_nodes_ranks_and_meets_at_the_hosted_store():
    (c,) = cmds("distributed.nproc_per_node=4")  # the default launcher
    assert c[1:3] == ["-m", "gptforge.pipeline.launch.agent"] and "--nproc-per-node=4" in c
    assert "--master=127.0.0.1:4242" in c
    assert c[-8:] == ["-m", "gptforge.stages.pretrain", *ARGS]
    nodes = cmds("distributed.nnodes=2", "distributed.nproc_per_node=8")
    assert [[a for a in n if a.startswith(("--node-rank", "--nnodes"))] for n in nodes] == [
        ["--nnodes=2", "--node-rank=0"], ["--nnodes=2", "--node-rank=1"]]
    (dpo,) = cmds(stage="dpo", inputs={"sft": Path("s")})  # a TRL stage: accelerate's environment, no accelerate
    assert dpo[1:3] == ["-m", "gptforge.pipeline.launch.agent"]
    env = node_env(load_config(TINY, [*BATCHES, "distributed.zero_stage=3"]), "dpo")
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"


def test_deepspeed_single_node_and_hostfile():
    (c,) = cmds("distributed.launcher=deepspeed", "distributed.nproc_per_node=4")
    # one node: DeepSpeed's per-node launcher alone (its runner would import DeepSpeed once more to start it)
    assert c[1:4] == ["-u", "-m", "deepspeed.launcher.launch"] and "--master_port=4242" in c
    world = next(a for a in c if a.startswith("--world_info=")).split("=", 1)[1]
    assert json.loads(base64.urlsafe_b64decode(world)) == {"localhost": [0, 1, 2, 3]}
    assert c[-8:] == ["--module", "gptforge.stages.pretrain", *ARGS]
    (h,) = cmds("distributed.launcher=deepspeed", "distributed.hostfile=/etc/hosts.ds",
                "distributed.master_addr=10.0.0.1", "distributed.nnodes=2")
    assert h[1:3] == ["-m", "deepspeed.launcher.runner"]  # the deepspeed runner reaches the nodes itself
    assert h[h.index("--hostfile") + 1] == "/etc/hosts.ds" and h[h.index("--master_addr") + 1] == "10.0.0.1"


def test_torchrun_on_local_nodes_meets_at_the_hosted_store():
    nodes = cmds("distributed.launcher=torchrun", "distributed.nnodes=2", "distributed.nproc_per_node=8")
    assert len(nodes) == 2
    for rank, c in enumerate(nodes):
        assert c[1:3] == ["-m", "torch.distributed.run"]
        assert {"--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=8", "--rdzv_backend=c10d",
                "--rdzv_endpoint=127.0.0.1:4242", "--rdzv_conf=is_host=false"} <= set(c)
        assert c[-8:] == ["-m", "gptforge.stages.pretrain", *ARGS]


def test_ssh_and_slurm_start_an_agent_on_every_node(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# node 0 first\nnode-a slots=8\n10.0.0.2 slots=8\nnode-c slots=8\n")
    ssh = cmds("distributed.launcher=torchrun", "distributed.nnodes=2", "distributed.node_launcher=ssh",
               f"distributed.hostfile={hosts}", "distributed.master_addr=10.0.0.1")
    assert [c[:-1] for c in ssh] == [["ssh", *SSH_OPTIONS, "node-a"], ["ssh", *SSH_OPTIONS, "10.0.0.2"]]
    # under the node's side of the launch: the node's address (the hostfile's where it is one), the environment
    # down the channel (never DS_ACCELERATOR=cpu, nor a token, on a command line)
    remote = shlex.split(ssh[1][-1].split(" && ", 1)[1])
    assert remote[:7] == [sys.executable, "-m", "gptforge.pipeline.launch.on_node", "--node=1", "--master=10.0.0.1",
                          "--addrs=,10.0.0.2", "--ssh"]
    assert "--node_rank=1" in remote and "--rdzv_endpoint=10.0.0.1:4242" in remote
    assert "DS_ACCELERATOR" not in ssh[1][-1]
    (srun,) = cmds("distributed.launcher=torchrun", "distributed.nnodes=4", "distributed.node_launcher=slurm",
                   "distributed.master_addr=10.0.0.1",
                   "distributed.node_addrs=[10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4]")
    assert srun[:5] == ["srun", "--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert "--node_rank=$SLURM_NODEID" in srun[-1] and "--node=$SLURM_NODEID" in srun[-1]
    assert "--addrs=10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4" in srun[-1]
    (dpo,) = cmds("distributed.launcher=torchrun", "distributed.nnodes=4", "distributed.node_launcher=slurm",
                  "distributed.master_addr=10.0.0.1", stage="dpo", inputs={"sft": Path("s"), "reward": Path("r")})
    assert "accelerate.commands.launch" in dpo[-1] and "--machine_rank '$SLURM_NODEID'" not in dpo[-1]
    assert "--machine_rank $SLURM_NODEID" in dpo[-1] and "--num_processes 8" in dpo[-1]
    assert "--rdzv_conf __NODE_IS_HOST__" in dpo[-1]  # node 0 hosts accelerate's rendezvous, told so by on_node


def test_deepspeed_over_ssh_starts_its_per_node_launcher_on_each_node(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=1\nnode-b slots=1\n")
    nodes = cmds("distributed.launcher=deepspeed", "distributed.nnodes=2", "distributed.nproc_per_node=1",
                 "distributed.node_launcher=ssh", f"distributed.hostfile={hosts}", "distributed.master_addr=10.0.0.1")
    for rank, c in enumerate(nodes):
        remote = shlex.split(c[-1].split(" && ", 1)[1])
        agent = remote[remote.index("--") + 1:]
        assert agent[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.launch"]
        world = next(a for a in agent if a.startswith("--world_info=")).split("=", 1)[1]
        assert json.loads(base64.urlsafe_b64decode(world)) == {"node0": [0], "node1": [0]}
        assert f"--node_rank={rank}" in agent and "--master_addr=10.0.0.1" in agent
    env = node_env(load_config(TINY, [*BATCHES, "distributed.launcher=deepspeed", "distributed.nnodes=2",
                                      "distributed.node_launcher=ssh", f"distributed.hostfile={hosts}",
                                      "distributed.master_addr=10.0.0.1"]), "pretrain")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # its ranks meet at the store the run hosts


def test_the_environment_forwarded_to_every_node(monkeypatch):
    for k, v in {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_TIMEOUT": "60", "HF_HOME": "/data/hf",
                 "OMP_NUM_THREADS": "8", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": "/code", "UNRELATED": "x"}.items():
        monkeypatch.setenv(k, v)
    env = node_env(load_config(TINY, [*BATCHES, "distributed.env.NCCL_SOCKET_IFNAME=ib0", "distributed.env.N=4"]),
                   "pretrain")
    assert {k: env[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_TIMEOUT", "HF_HOME", "OMP_NUM_THREADS",
                                "OMP_WAIT_POLICY", "PYTHONPATH", "N")} == {
        "NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_TIMEOUT": "60", "HF_HOME": "/data/hf", "OMP_NUM_THREADS": "8",
        "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": "/code", "N": "4"}
    assert "UNRELATED" not in env


def test_accelerate_uses_deepspeed_with_world_size():
    nodes = cmds("distributed.launcher=torchrun", "distributed.nnodes=2", "distributed.nproc_per_node=4",
                 "distributed.zero_stage=3", stage="dpo", inputs={"sft": Path("s")})
    for rank, c in enumerate(nodes):
        assert "--use_deepspeed" in c and c[c.index("--num_processes") + 1] == "8"
        assert c[c.index("--machine_rank") + 1] == str(rank) and c[c.index("--main_process_port") + 1] == "4242"
        assert c[c.index("--zero_stage") + 1] == "3" and "--deepspeed_multinode_launcher" in c


@pytest.mark.parametrize("overrides, message", [
    (["distributed.nnodes=2", "distributed.node_rank=5", "distributed.launcher=torchrun"],
     r"distributed: node_rank=5 must be below nnodes=2"),
    (["distributed.nnodes=2", "distributed.launcher=deepspeed"],
     r"launcher=deepspeed reaches the other 1 node\(s\) through a hostfile"),
    (["distributed.nnodes=2", "distributed.launcher=torchrun", "distributed.node_launcher=ssh"],
     r"node_launcher=ssh needs distributed.hostfile"),
    (["distributed.nnodes=2", "distributed.launcher=torchrun", "distributed.node_launcher=slurm"],
     r"master_addr=127.0.0.1 is this host's loopback, which node_launcher=slurm sends the other nodes to"),
    (["distributed.nnodes=2", "distributed.node_addrs=[10.0.0.1]"],
     r"node_addrs gives 1 address\(es\) for nnodes=2"),
    (["distributed.env.NOT-A-NAME=1"], r"env: 'NOT-A-NAME' is not an environment variable's name"),
])
def test_impossible_layouts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [*BATCHES, *overrides])


def test_sigterm_kills_the_whole_stage_group(tmp_path):
    """Outside Prefect, run_streaming's own handler kills the stage and its children on SIGTERM."""
    import os
    import signal
    import subprocess
    import textwrap
    import time

    from tests.pipeline.test_deployment import stage_pids

    marker = str(tmp_path)
    child = ("import subprocess, sys, time; "
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', sys.argv[1]]); "
             "print('ready', flush=True); time.sleep(300)")
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(f"""
        import sys
        from gptforge.pipeline.launch.stage import run_streaming
        run_streaming([[sys.executable, "-c", {child!r}, {marker!r}]], lambda line: print(line, flush=True))
    """))
    log = tmp_path / "log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(parent)], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while "ready" not in log.read_text():
            assert time.time() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert len(stage_pids(marker)) == 3  # parent.py, the stage and its child
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(30) != 0
    deadline = time.time() + 15
    while stage_pids(marker):
        assert time.time() < deadline, f"still alive: {stage_pids(marker)}"
        time.sleep(0.2)


def alive(p) -> bool:
    """Whether a psutil process still runs (the same process: not a reused pid) and is no zombie."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_a_sigkilled_run_leaves_no_stage_process_and_no_server(tokenized, tmp_path):
    """SIGKILL reaches no handler of `gptforge run`; its watchdogs stop the stage's ranks and the ephemeral Prefect
    server it started."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    from gptforge.pipeline.store import locate
    from tests.helpers import config, copy_store

    cfg, path = config(tmp_path, "sft.enabled=false", "reward.enabled=false", "preference.enabled=false",
                       "pretrain.max_steps=100000", "pretrain.save_every=100000")
    copy_store(tokenized, tmp_path, "tokenize")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_URL")}
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c", str(path)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while not (locate(cfg, "pretrain")[0] / "logs").exists():  # the ranks are training
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "run.log").read_text()[-3000:]
        time.sleep(0.5)
    time.sleep(1)
    tree = psutil.Process(proc.pid).children(recursive=True)
    names = " ".join(" ".join(p.cmdline()) for p in tree if alive(p))
    assert "gptforge.stages.pretrain" in names and "uvicorn" in names  # the ranks and the ephemeral server
    assert "gptforge.pipeline.launch.fork_server" in names  # which forked the stage's agent
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 60
    while [p for p in tree if alive(p)]:
        assert time.time() < deadline, f"still alive: {[p.pid for p in tree if alive(p)]}"
        time.sleep(0.5)
    log.close()


def test_a_line_printed_after_a_progress_bar_redraw_is_logged_whatever_the_bar_rate():
    """tqdm redraws end without a newline: a warning printed right after one (rank 0's, between two redraws) shares
    the bar's line. Redraws are logged at most every `progress_every` seconds; the warning always is, on its own."""
    from gptforge.pipeline.launch.stage import run_streaming

    script = ("import sys\n"
              "for i in range(3):\n"
              "    sys.stderr.write(f'\\rsft:  {50 * i}%|##   | {i}/2 [00:00<00:00,  9.1it/s]')\n"
              "    if i == 1:\n"
              "        sys.stderr.write('warning: [sft] step 1: loss NaN/Inf on 1 of 2 rank(s); step skipped\\n')\n")
    lines, progress = [], []
    assert run_streaming([[sys.executable, "-c", script]], lines.append, on_progress=progress.append) == 0
    assert "warning: [sft] step 1: loss NaN/Inf on 1 of 2 rank(s); step skipped" in lines
    assert progress == [0.0, 100.0]  # the 50% redraw within 10 s of the first: held back
