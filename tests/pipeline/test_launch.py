import sys
from pathlib import Path

import pytest

from gptforge.core.config import load_config
from gptforge.pipeline.launch import stage_command
from tests.conftest import TINY

BATCHES = [f"{s}.global_batch_size=256" for s in ("pretrain", "sft", "reward", "preference")]
ARGS = ["--config", "cfg.yaml", "--out", "out", "--input", "tokenize=tok"]


def cmd(*overrides, stage="pretrain", inputs=None):
    return stage_command(load_config(TINY, [*BATCHES, *overrides]), stage, Path("cfg.yaml"), Path("out"),
                         {"tokenize": Path("tok")} if inputs is None else inputs)


def test_tokenize_and_evaluation_run_as_one_process():
    assert cmd(stage="tokenize", inputs={}) == [sys.executable, "-m", "gptforge.stages.tokenize", "--config",
                                                "cfg.yaml", "--out", "out"]
    assert cmd(stage="eval-dpo", inputs={"dpo": Path("d")})[:3] == [sys.executable, "-m", "gptforge.stages.evaluate"]


def test_deepspeed_single_node_and_hostfile():
    c = cmd("distributed.nproc_per_node=4")
    assert c[1:3] == ["-m", "deepspeed.launcher.runner"] and c[c.index("--num_gpus") + 1] == "4"
    assert c[-8:] == ["--module", "gptforge.stages.pretrain", *ARGS]
    h = cmd("distributed.hostfile=/etc/hosts.ds", "distributed.master_addr=10.0.0.1", "distributed.nnodes=2")
    assert h[h.index("--hostfile") + 1] == "/etc/hosts.ds" and h[h.index("--master_addr") + 1] == "10.0.0.1"
    assert "--num_gpus" not in h


def test_torchrun_multi_node():
    c = cmd("distributed.launcher=torchrun", "distributed.nnodes=2", "distributed.node_rank=1",
            "distributed.master_addr=10.0.0.1", "distributed.nproc_per_node=8")
    assert c[1:3] == ["-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--nproc_per_node=8"} <= set(c)
    assert c[-8:] == ["-m", "gptforge.stages.pretrain", *ARGS]


def test_accelerate_uses_deepspeed_with_world_size():
    c = cmd("distributed.launcher=accelerate", "distributed.nnodes=2", "distributed.nproc_per_node=4",
            "distributed.zero_stage=3")
    assert "--use_deepspeed" in c and c[c.index("--num_processes") + 1] == "8"
    assert c[c.index("--zero_stage") + 1] == "3" and "--deepspeed_multinode_launcher" in c
    assert c[-8:] == ["-m", "gptforge.stages.pretrain", *ARGS]


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
        from gptforge.pipeline.launch import run_streaming
        run_streaming([sys.executable, "-c", {child!r}, {marker!r}], lambda line: print(line, flush=True))
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


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_sigkilled_run_leaves_no_stage_process_and_no_server(tmp_path):
    """SIGKILL reaches no handler of `gptforge run`; its watchdogs stop the stage's ranks and the ephemeral Prefect
    server it started."""
    import os
    import signal
    import subprocess
    import time

    from gptforge.pipeline.store import locate
    from tests.helpers import config

    cfg, path = config(tmp_path, "sft.enabled=false", "reward.enabled=false", "preference.enabled=false",
                       "pretrain.max_steps=100000", "pretrain.save_every=100000")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_URL")}
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c", str(path)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while not (locate(cfg, "pretrain")[0] / "logs").exists():  # the ranks are training
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "run.log").read_text()[-3000:]
        time.sleep(0.5)
    time.sleep(3)
    tree = descendants(proc.pid)
    names = " ".join(Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace") for p in tree if alive(p))
    assert "gptforge.stages.pretrain" in names and "uvicorn" in names  # the ranks and the ephemeral server
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 60
    while [p for p in tree if alive(p)]:
        assert time.time() < deadline, f"still alive: {[p for p in tree if alive(p)]}"
        time.sleep(0.5)
    log.close()
