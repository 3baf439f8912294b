import sys

from pipeline.config import load_config
from pipeline.launch import stage_command

from tests.conftest import TINY

BATCHES = [f"{s}.global_batch_size=256" for s in ("pretrain", "sft", "reward", "preference")]


def cmd(*overrides, stage="pretrain"):
    return stage_command(load_config(TINY, [*BATCHES, *overrides]), stage, "cfg.yaml")


def test_tokenize_runs_as_one_process():
    assert cmd(stage="tokenize") == [sys.executable, "-m", "stages.tokenize", "--config", "cfg.yaml"]


def test_deepspeed_single_node_and_hostfile():
    c = cmd("distributed.nproc_per_node=4")
    assert c[1:3] == ["-m", "deepspeed.launcher.runner"] and c[c.index("--num_gpus") + 1] == "4"
    assert c[-4:] == ["--module", "stages.pretrain", "--config", "cfg.yaml"]
    h = cmd("distributed.hostfile=/etc/hosts.ds", "distributed.master_addr=10.0.0.1", "distributed.nnodes=2")
    assert h[h.index("--hostfile") + 1] == "/etc/hosts.ds" and h[h.index("--master_addr") + 1] == "10.0.0.1"
    assert "--num_gpus" not in h


def test_torchrun_multi_node():
    c = cmd("distributed.launcher=torchrun", "distributed.nnodes=2", "distributed.node_rank=1",
            "distributed.master_addr=10.0.0.1", "distributed.nproc_per_node=8")
    assert c[1:3] == ["-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--nproc_per_node=8"} <= set(c)
    assert c[-4:] == ["-m", "stages.pretrain", "--config", "cfg.yaml"]


def test_accelerate_uses_deepspeed_with_world_size():
    c = cmd("distributed.launcher=accelerate", "distributed.nnodes=2", "distributed.nproc_per_node=4",
            "distributed.zero_stage=3")
    assert "--use_deepspeed" in c and c[c.index("--num_processes") + 1] == "8"
    assert c[c.index("--zero_stage") + 1] == "3" and "--deepspeed_multinode_launcher" in c
    assert c[-4:] == ["-m", "stages.pretrain", "--config", "cfg.yaml"]
