"""Runs across two hosts of their own (tests/hosts.py: two network namespaces, each with its address, hostname,
hosts file and sshd), their hostnames resolving to 127.0.0.1 on themselves as on many cloud images: a stage started
on node-a reaches both over ssh (`node_launcher: ssh`), and trains only where each node is told its address."""

import json
import sys
import time
from pathlib import Path

import pytest

from gptforge.pipeline.store import locate
from tests.conftest import ROOT
from tests.helpers import config, logged, tokenize_from
from tests.hosts import ADDRS, NAMES, Hosts, unavailable

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"two hosts cannot be made here: {WHY}")

# The stage as `gptforge run` starts it, without Prefect's server: pipeline.launch.run_stage, on node-a.
RUN = """
import json, sys
from pathlib import Path
from gptforge.core.config import load_config
from gptforge.core.errors import StageFailed
from gptforge.pipeline.launch import run_stage
from gptforge.pipeline.store import RunRecord
cfg = load_config(Path(sys.argv[1]))
try:
    manifest = run_stage(cfg, sys.argv[2], Path(sys.argv[1]), RunRecord(cfg), lambda line: print(line, flush=True))
except StageFailed as e:
    print(f"error: {e}", flush=True)
    sys.exit(1)
print("MANIFEST " + json.dumps(manifest))
"""

# Run on every rank, wherever it starts (PYTHONPATH, forwarded): what reached it.
SITE = """
import json, os, socket
if "RANK" in os.environ:
    keys = ("OMP_NUM_THREADS", "NCCL_DEBUG", "HF_GPTFORGE_MARK", "PET_LOCAL_ADDR", "GLOO_SOCKET_IFNAME", "FROM_CONFIG")
    with open(os.path.join(os.path.dirname(__file__), "seen", socket.gethostname() + ".json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
"""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = Hosts(tmp_path_factory.mktemp("hosts"))
    yield h
    h.close()


def two_hosts(tokenized, root: Path, *overrides):
    """A config rooted at `root` whose stages run on node-a and node-b, one process each, named in a hostfile."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "hostfile").write_text(f"{NAMES[0]} slots=1\n{NAMES[1]} slots=1\n")
    cfg, path = config(root, "distributed.zero_stage=2", "distributed.nnodes=2", "distributed.nproc_per_node=1",
                       "distributed.node_launcher=ssh", f"distributed.hostfile={root / 'hostfile'}",
                       f"distributed.master_addr={ADDRS[0]}", *overrides)
    tokenize_from(tokenized, cfg)
    return cfg, path


def run_on_a(hosts, path: Path, stage: str, env: dict | None = None, timeout: float = 300):
    """Run `stage` from node-a; (exit code, output, manifest or None)."""
    proc = hosts.run(0, [sys.executable, "-c", RUN, str(path), stage], cwd=ROOT, check=False, timeout=timeout,
                     env=hosts.env(**(env or {})))
    out = proc.stdout + proc.stderr
    manifest = next((json.loads(line[9:]) for line in proc.stdout.splitlines() if line.startswith("MANIFEST ")), None)
    return proc.returncode, out, manifest


def test_pretrain_over_ssh_on_hosts_named_as_loopback_trains_as_one_host_does(hosts, pretrained, tokenized, tmp_path):
    """torchrun on each host, its address its route to master_addr (the hostnames resolve to 127.0.0.1 on their
    own host: torch's guess, the agent's FQDN, sent node-b to itself). The curve of one host with 2 processes; the
    environment forwarded to both hosts' ranks, with `distributed.env`."""
    site = tmp_path / "site"
    (site / "seen").mkdir(parents=True)
    (site / "sitecustomize.py").write_text(SITE)
    cfg, path = two_hosts(tokenized, tmp_path, "distributed.launcher=torchrun", "pretrain.save_every=100",
                          "distributed.env.FROM_CONFIG=yes")
    env = {"PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "NCCL_DEBUG": "WARN", "HF_GPTFORGE_MARK": "forwarded"}
    rc, out, manifest = run_on_a(hosts, path, "pretrain", env)
    assert rc == 0, out[-4000:]
    assert manifest["world_size"] == 2 and "[node 0]" in out and "[node 1]" in out
    out_dir = locate(cfg, "pretrain")[0]
    assert logged(out_dir, "loss") == pytest.approx(logged(pretrained[1], "loss"), abs=2e-4)
    assert manifest["metrics"]["val_loss"] == pytest.approx(pretrained[0]["metrics"]["val_loss"], abs=2e-4)
    seen = {f.stem: json.loads(f.read_text()) for f in (site / "seen").iterdir()}
    assert set(seen) == set(NAMES)  # a rank on each host
    for name, addr in zip(NAMES, ADDRS):
        assert seen[name]["PET_LOCAL_ADDR"] == addr and seen[name]["GLOO_SOCKET_IFNAME"] not in (None, "lo")
        assert {k: seen[name][k] for k in ("NCCL_DEBUG", "HF_GPTFORGE_MARK", "FROM_CONFIG")} == {
            "NCCL_DEBUG": "WARN", "HF_GPTFORGE_MARK": "forwarded", "FROM_CONFIG": "true"}
    assert not hosts.pids(0) and not hosts.pids(1), (hosts.processes(0), hosts.processes(1))


def test_deepspeed_per_node_launchers_over_ssh_train_as_one_host_does(hosts, pretrained, tokenized, tmp_path):
    """DeepSpeed's launcher on each host, started by gptforge over ssh (no pdsh), its ranks meeting at the store
    the run hosts on master_addr."""
    cfg, path = two_hosts(tokenized, tmp_path, "distributed.launcher=deepspeed", "pretrain.save_every=100",
                          f"distributed.node_addrs=[{ADDRS[0]},{ADDRS[1]}]")
    rc, out, manifest = run_on_a(hosts, path, "pretrain")
    assert rc == 0, out[-4000:]
    assert manifest["world_size"] == 2 and "[node 1]" in out
    out_dir = locate(cfg, "pretrain")[0]
    assert logged(out_dir, "loss") == pytest.approx(logged(pretrained[1], "loss"), abs=2e-4)
    assert manifest["metrics"]["val_loss"] == pytest.approx(pretrained[0]["metrics"]["val_loss"], abs=2e-4)


def test_a_node_lost_mid_stage_fails_it_naming_the_host_and_a_rerun_resumes(hosts, pretrained, tokenized, tmp_path):
    """node-b goes down (every process on it killed, sshd too) after the step-10 checkpoint: the stage fails at
    once with one line naming node-b, nothing of it is left on node-a, and once node-b is back a rerun resumes to
    the uninterrupted result."""
    cfg, path = two_hosts(tokenized, tmp_path)  # gptforge's own agent on each host
    out_dir = locate(cfg, "pretrain")[0]
    proc = hosts.popen(0, [sys.executable, "-c", RUN, str(path), "pretrain"], cwd=ROOT, stdout=open(
        tmp_path / "killed.log", "w"), stderr=open(tmp_path / "killed.err", "w"))
    deadline = time.time() + 300
    while not (out_dir / "checkpoints" / "step-00000010" / "complete.json").exists():
        assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    hosts.crash(1)
    crashed = time.time()
    try:
        proc.wait(120)
    finally:
        hosts.boot(1)
    waited = time.time() - crashed
    out = (tmp_path / "killed.log").read_text()
    errors = [line.split("error: ", 1)[1] for line in out.splitlines() if "error: " in line]
    assert proc.returncode == 1 and errors, out[-3000:]
    assert errors[-1].startswith(f"stage pretrain failed: node 1 ({NAMES[1]}) was lost"), errors
    assert waited < 30, waited
    deadline = time.time() + 15  # (node-a's side ends once its channel closes: SIGTERM, then SIGKILL)
    while hosts.pids(0) and time.time() < deadline:
        time.sleep(0.2)
    assert not hosts.pids(0), hosts.processes(0)
    rc, out, manifest = run_on_a(hosts, path, "pretrain")
    assert rc == 0, out[-4000:]
    assert "[pretrain] resumed from" in out
    assert manifest["metrics"]["val_loss"] == pytest.approx(pretrained[0]["metrics"]["val_loss"], abs=1e-5)
    assert logged(out_dir, "loss") == pytest.approx(logged(pretrained[1], "loss"), abs=1e-5)
    assert not hosts.pids(0) and not hosts.pids(1), (hosts.processes(0), hosts.processes(1))


def test_sft_then_dpo_across_the_two_hosts(hosts, chain, dpo, tmp_path):
    """SFT (ZeRO-3) and a TRL stage (DPO: an accelerate launch on each host, node-a hosting its rendezvous) across
    the two hosts: the training of one host with 2 processes."""
    from tests.conftest import DPO
    from tests.helpers import copy_store

    def rows(out_dir):
        return [json.loads(line) for line in (out_dir / "logs" / "metrics.jsonl").read_text().splitlines()]

    cfg, path = two_hosts(chain["root"], tmp_path, *DPO, "distributed.zero_stage=3", "distributed.launcher=torchrun",
                          "preference.log_every=10", "preference.save_every=10")
    copy_store(chain["root"], tmp_path, "pretrain")
    for stage in ("sft", "dpo"):
        rc, out, manifest = run_on_a(hosts, path, stage)
        assert rc == 0, out[-4000:]
        assert manifest["world_size"] == 2 and "[node 1]" in out
    sft_dir = locate(cfg, "sft")[0]
    assert logged(sft_dir, "loss") == pytest.approx(logged(chain["sft"][1], "loss"), abs=2e-4)
    logged_dpo = [r for r in rows(locate(cfg, "dpo")[0]) if "loss" in r]
    each_step = [r["loss"] for r in rows(dpo[1]) if "loss" in r]
    assert logged_dpo[-1]["loss"] == pytest.approx(sum(each_step) / len(each_step), abs=1e-3)
    assert not hosts.pids(0) and not hosts.pids(1), (hosts.processes(0), hosts.processes(1))
