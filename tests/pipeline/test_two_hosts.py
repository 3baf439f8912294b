"""Runs across two hosts of their own (tests/hosts.py: two network namespaces, each with its address, hostname,
hosts file and sshd), their hostnames resolving to 127.0.0.1 on themselves as on many cloud images: a stage started
on node-a reaches both over ssh (`node_launcher: ssh`), and trains only where each node is told its address; a
Slurm job across them reaches both with srun (`node_launcher: slurm`)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptforge.pipeline.store import locate, read_manifest
from tests.conftest import ROOT
from tests.helpers import config, logged, tokenize_from
from tests.hosts import ADDRS, NAMES, Hosts, Slurm, slurm_unavailable, unavailable

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"two hosts cannot be made here: {WHY}")

# The stage as `gptforge run` starts it, without Prefect's server: pipeline.launch.run_stage, on node-a.
RUN = """
import json, sys
from pathlib import Path
from gptforge.core.config import load_config
from gptforge.core.errors import StageFailed
from gptforge.pipeline.launch.stage import run_stage
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


@pytest.fixture(scope="module")
def over_ssh(hosts, tokenized, tmp_path_factory):
    """pretrain under torchrun on each host, started over ssh, uninterrupted: (exit code, output, manifest, its
    output folder, the folder where each rank wrote what reached it)."""
    root = tmp_path_factory.mktemp("over-ssh")
    site = root / "site"
    (site / "seen").mkdir(parents=True)
    (site / "sitecustomize.py").write_text(SITE)
    cfg, path = two_hosts(tokenized, root, "distributed.launcher=torchrun", "pretrain.save_every=100",
                          "distributed.env.FROM_CONFIG=yes")
    env = {"PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "NCCL_DEBUG": "WARN", "HF_GPTFORGE_MARK": "forwarded"}
    rc, out, manifest = run_on_a(hosts, path, "pretrain", env)
    return rc, out, manifest, locate(cfg, "pretrain")[0], site / "seen"


def test_pretrain_over_ssh_on_hosts_named_as_loopback_trains_as_one_host_does(hosts, pretrained, over_ssh):
    """torchrun on each host, its address its route to master_addr (the hostnames resolve to 127.0.0.1 on their
    own host: torch's guess, the agent's FQDN, sent node-b to itself). The curve of one host with 2 processes; the
    environment forwarded to both hosts' ranks, with `distributed.env`."""
    rc, out, manifest, out_dir, seen_dir = over_ssh
    assert rc == 0, out[-4000:]
    assert manifest["world_size"] == 2 and "[node 0]" in out and "[node 1]" in out
    assert logged(out_dir, "loss") == pytest.approx(logged(pretrained[1], "loss"), abs=2e-4)
    assert manifest["metrics"]["val_loss"] == pytest.approx(pretrained[0]["metrics"]["val_loss"], abs=2e-4)
    seen = {f.stem: json.loads(f.read_text()) for f in seen_dir.iterdir()}
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
    for n in (0, 1):  # DeepSpeed's launcher on each host, saying so
        assert re.search(rf"^\[node {n}\] .*\[launch\.py:\d+:main\] nnodes=2, num_local_procs=1, node_rank={n}$",
                         out, re.M), out[-3000:]
    out_dir = locate(cfg, "pretrain")[0]
    assert logged(out_dir, "loss") == pytest.approx(logged(pretrained[1], "loss"), abs=2e-4)
    assert manifest["metrics"]["val_loss"] == pytest.approx(pretrained[0]["metrics"]["val_loss"], abs=2e-4)


def test_a_node_lost_mid_stage_fails_it_naming_the_host_and_a_rerun_resumes(hosts, over_ssh, tokenized, tmp_path):
    """node-b goes down (every process on it killed, sshd too) after the step-10 checkpoint: the stage fails at
    once with one line naming node-b, nothing of it is left on node-a, and once node-b is back a rerun resumes to
    the uninterrupted result: the same two hosts' run. (One host's 2 processes get a core each, and a rank alone on
    its host gets both: the matmuls' other thread count gives a curve up to 1e-5 apart on some CPUs.)"""
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
    _, _, uninterrupted, uninterrupted_dir, _ = over_ssh
    assert manifest["metrics"]["val_loss"] == pytest.approx(uninterrupted["metrics"]["val_loss"], abs=1e-6)
    assert logged(out_dir, "loss") == pytest.approx(logged(uninterrupted_dir, "loss"), abs=1e-6)
    assert not hosts.pids(0) and not hosts.pids(1), (hosts.processes(0), hosts.processes(1))


def test_pretrain_as_a_slurm_job_across_the_two_hosts(hosts, over_ssh, tokenized, tmp_path):
    """infra/slurm/pretrain.sbatch submitted with sbatch, as a user would, to a real Slurm of the two hosts
    (slurmctld on node-a, a slurmd on each, munge between them): `gptforge run` on the allocation's first node
    starts a torchrun agent on each node with one srun (`node_launcher: slurm`). The job completes, its stage has
    a rank on each host, it trains as the same two hosts do over ssh, and nothing of it is left on either."""
    if why := slurm_unavailable():
        pytest.skip(f"no Slurm of the two hosts here: {why}")
    cfg, path = config(tmp_path, "distributed.zero_stage=2", "pretrain.save_every=100")
    tokenize_from(tokenized, cfg)
    log = tmp_path / "job.out"
    slurm = Slurm(hosts)
    try:
        job = slurm.run(["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={log}",
                         "--export=ALL,NPROC_PER_NODE=1", "infra/slurm/pretrain.sbatch", str(path)], cwd=ROOT)
        assert job.returncode == 0, job.stderr
        job_id = job.stdout.strip().split(";")[0]
        deadline = time.time() + 300
        while slurm.run(["squeue", "-h", "-j", job_id]).stdout.strip():
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        state = slurm.run(["scontrol", "show", "job", job_id]).stdout
    finally:
        slurm.close()
    assert "JobState=COMPLETED" in state, state + log.read_text()[-4000:]
    ran, _ = config(tmp_path, "distributed.zero_stage=2", "pretrain.save_every=100", "distributed.nnodes=2",
                    "distributed.node_launcher=slurm", "distributed.launcher=torchrun", "distributed.nproc_per_node=1",
                    f"distributed.master_addr={ADDRS[0]}")
    out_dir = locate(ran, "pretrain")[0]
    manifest = json.loads((out_dir / "manifest.json").read_text())
    _, _, uninterrupted, uninterrupted_dir, _ = over_ssh
    assert manifest["world_size"] == 2
    assert logged(out_dir, "loss") == pytest.approx(logged(uninterrupted_dir, "loss"), abs=1e-6)
    assert manifest["metrics"]["val_loss"] == pytest.approx(uninterrupted["metrics"]["val_loss"], abs=1e-6)
    assert not hosts.pids(0) and not hosts.pids(1), (hosts.processes(0), hosts.processes(1))


def test_sft_then_dpo_across_the_two_hosts(hosts, chain, dpo, tmp_path):
    """SFT (ZeRO-3) and a TRL stage (DPO: an accelerate launch on each host, node-a hosting its rendezvous) across
    the two hosts: the training of one host with 2 processes, each of DPO's six steps' losses that of one host."""
    from tests.conftest import DPO
    from tests.helpers import copy_store

    def rows(out_dir):
        return [json.loads(line) for line in (out_dir / "logs" / "metrics.jsonl").read_text().splitlines()]

    cfg, path = two_hosts(chain["root"], tmp_path, *DPO, "distributed.zero_stage=3", "distributed.launcher=torchrun",
                          "preference.log_every=1", "preference.save_every=10")
    copy_store(chain["root"], tmp_path, "pretrain")
    for stage in ("sft", "dpo"):
        rc, out, manifest = run_on_a(hosts, path, stage)
        assert rc == 0, out[-4000:]
        assert manifest["world_size"] == 2 and "[node 1]" in out
    sft_dir = locate(cfg, "sft")[0]
    assert logged(sft_dir, "loss") == pytest.approx(logged(chain["sft"][1], "loss"), abs=2e-4)
    ours, theirs = ([r for r in rows(d) if "loss" in r] for d in (locate(cfg, "dpo")[0], dpo[1]))
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in theirs], abs=1e-3)
    assert not hosts.pids(0) and not hosts.pids(1), (hosts.processes(0), hosts.processes(1))


def stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(grace)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def wait_on(hosts, n: int, check: str, timeout: float, what: str, proc=None, log: Path | None = None) -> None:
    """Wait until the Python snippet `check` exits 0 on host `n`."""
    deadline = time.time() + timeout
    while hosts.run(n, [sys.executable, "-c", check], check=False).returncode != 0:
        assert proc is None or proc.poll() is None, f"{what} ended:\n" + (log.read_text()[-3000:] if log else "")
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_tokenize_on_a_ray_cluster_across_the_two_hosts(hosts, tmp_path):
    """A Ray head on node-a, a Ray node on node-b (1 CPU each, their own temp folders), tokenize started on node-a
    with `tokenizer.cluster` at the head: both hosts run its tasks, and the shards are token for token those of
    the stage's own local instance."""
    from gptforge.pipeline.store import execute
    from tests.stages.test_tokenize import MIXED

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(6):
        (corpus / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": f"{w} number {i} of part {k}"}) + "\n"
                                                        for i, w in enumerate(MIXED * 60)))
    port = 6390
    temp = [Path(f"/tmp/gfray{os.getpid()}{c}") for c in "ab"]  # (Ray's socket paths must stay short)
    ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus=1", "--disable-usage-stats"]
    env = hosts.env(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")  # (between the two namespaces alone)
    logs = [open(tmp_path / f"ray-{c}.log", "w") for c in "ab"]
    head = hosts.popen(0, [*ray, "--head", "--include-dashboard=false", f"--node-ip-address={ADDRS[0]}",
                           f"--port={port}", f"--temp-dir={temp[0]}"], env=env, stdout=logs[0],
                       stderr=subprocess.STDOUT)
    nodes = [head]
    try:
        wait_on(hosts, 0, f"import socket; socket.create_connection(('{ADDRS[0]}', {port}), 1)", 120, "the Ray head",
                head, tmp_path / "ray-a.log")
        nodes.append(hosts.popen(1, [*ray, f"--address={ADDRS[0]}:{port}", f"--node-ip-address={ADDRS[1]}",
                                     f"--temp-dir={temp[1]}"], env=env, stdout=logs[1], stderr=subprocess.STDOUT))
        two = (f"import ray; ray.init(address='{ADDRS[0]}:{port}', logging_level='ERROR'); "
               "assert ray.cluster_resources().get('CPU') == 2")
        wait_on(hosts, 0, two, 120, "node-b to join", nodes[1], tmp_path / "ray-b.log")
        local, path = config(tmp_path / "local", f"data.pretrain={corpus}")
        cluster, path = config(tmp_path / "cluster", f"data.pretrain={corpus}",
                               f"tokenizer.cluster={ADDRS[0]}:{port}")
        run = ("import sys; from pathlib import Path; from gptforge.core.config import load_config; "
               "from gptforge.pipeline.store import execute; execute(load_config(Path(sys.argv[1])), 'tokenize')")
        done = hosts.run(0, [sys.executable, "-c", run, str(path)], cwd=ROOT, check=False, env=env, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        execute(local, "tokenize")
        workers = [list(t.glob("session_*/logs/python-core-worker-*.log")) for t in temp]
    finally:
        for proc in nodes:
            stop(proc, grace=3)  # (Ray takes half a minute to stop by itself)
        for t in temp:
            shutil.rmtree(t, ignore_errors=True)
    assert workers[0] and workers[1], "a host ran none of the tasks"
    dirs = [locate(c, "tokenize")[0] for c in (local, cluster)]
    files = [sorted(f.name for f in (d / "shards").glob("*.bin")) for d in dirs]
    assert files[0] == files[1] and len(files[0]) >= 6
    for name in files[0]:
        assert (dirs[0] / "shards" / name).read_bytes() == (dirs[1] / "shards" / name).read_bytes(), name
    assert len({read_manifest(d)["fingerprint"] for d in dirs}) == 1  # where it runs is not what it is
    assert len({(d / "tokenizer" / "tokenizer.json").read_bytes() for d in dirs}) == 1
    assert not hosts.pids(0) and not hosts.pids(1), (hosts.processes(0), hosts.processes(1))


def test_a_stage_on_a_prefect_worker_of_the_other_host(hosts, tokenized, tmp_path):
    """A Prefect server on node-a (its address), `gptforge deploy`, a process worker of pool `cpu` on node-b: the
    pipeline run from node-a sends its stages to the worker (tokenize reused, pretrain computed), which trains on
    node-b into the shared run.root."""
    site = tmp_path / "site"
    (site / "seen").mkdir(parents=True)
    (site / "sitecustomize.py").write_text(SITE)
    cfg, path = config(tmp_path, "sft.enabled=false", "reward.enabled=false", "preference.enabled=false",
                       "run.work_pools={pretrain: cpu}", "run.default_work_pool=cpu", "distributed.nproc_per_node=1",
                       "pretrain.max_steps=10",
                       "run.name=hosts")
    tokenize_from(tokenized, cfg)
    port = 4290
    url = f"http://{ADDRS[0]}:{port}/api"
    env = hosts.env(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_API_URL=url, PYTHONPATH=str(site),
                    PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_WORKER_QUERY_SECONDS="1",
                    GPTFORGE_WARM_RANKS="0")  # (ranks forked: no site)
    procs = []

    def start(n, name, cmd):
        procs.append(hosts.popen(n, cmd, env=env, cwd=ROOT, stdout=open(tmp_path / f"{name}.log", "w"),
                                 stderr=subprocess.STDOUT))
        return procs[-1]

    prefect = [sys.executable, "-m", "prefect"]
    gptforge = [sys.executable, "-m", "gptforge.pipeline.cli"]
    try:
        server = start(0, "server", [*prefect, "server", "start", "--host", ADDRS[0], "--port", str(port)])
        health = f"import urllib.request; urllib.request.urlopen('{url}/health', timeout=2)"
        wait_on(hosts, 0, health, 240, "the Prefect server", server, tmp_path / "server.log")
        deploy = hosts.run(0, [*gptforge, "deploy", "-c", str(path), "--name", "hosts"], env=env, cwd=ROOT,
                           check=False, timeout=300)
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
        start(1, "worker", [*prefect, "worker", "start", "--pool", "cpu", "--type", "process", "--name", "on-b"])
        run = hosts.run(0, [*gptforge, "run", "-c", str(path)], env=env, cwd=ROOT, check=False, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + (tmp_path / "worker.log").read_text()
    finally:
        for proc in reversed(procs):
            stop(proc, grace=10)
    record = json.loads((tmp_path / "hosts" / "run.json").read_text())
    assert record["stages"]["pretrain"]["status"] == "complete"
    assert (locate(cfg, "pretrain")[0] / "model" / "model.safetensors").exists()
    assert {f.stem for f in (site / "seen").iterdir()} == {NAMES[1]}  # its rank ran on node-b alone

