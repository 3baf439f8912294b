"""infra/slurm/pretrain.sbatch on a real Slurm of two hosts: Debian's slurm-wlm, slurmctld on node-a and a slurmd on
each of the two hosts tests/hosts.py builds (network namespaces with their own address, hostname and sshd), munge
between them. The job is submitted with sbatch as a user would; `gptforge run` on the allocation's first node
starts a torchrun agent on each node through srun (`node_launcher: slurm`). Printed: the job's state and time, its
tokens a second, and its loss curve against the same pretraining on one host with 2 processes, run here first.

    apt-get install --no-install-recommends slurmctld slurmd slurm-client munge    # as root (.ci/run does)
    .venv/bin/python bench/slurm_two_hosts.py [--steps 30]

(Its shrunk run in the suite: tests/pipeline/test_two_hosts.py::test_pretrain_as_a_slurm_job_across_the_two_hosts,
the job's curve against the same two hosts over ssh.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gptforge.pipeline.store import locate  # noqa: E402
from tests.helpers import config, logged, run_stage, tokenize_in_process  # noqa: E402
from tests.hosts import ADDRS, Hosts, Slurm, slurm_unavailable  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    if why := slurm_unavailable():
        sys.exit(f"error: no Slurm of two hosts here: {why}")
    work = Path(tempfile.mkdtemp(prefix="slurm-two-hosts-"))
    common = ["distributed.zero_stage=2", f"pretrain.max_steps={args.steps}", f"pretrain.save_every={args.steps}"]
    one, one_path = config(work / "one-host", *common)
    tokenize_in_process(one)
    one_manifest, one_dir, _ = run_stage(one, one_path, "pretrain")
    cfg, path = config(work / "slurm", *common)
    tokenize_in_process(cfg)
    hosts = Hosts(work / "hosts")
    log = work / "job.out"
    try:
        began = time.time()
        slurm = Slurm(hosts)
        up = time.time() - began
        try:
            job = slurm.run(["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={log}",
                             "--export=ALL,NPROC_PER_NODE=1", "infra/slurm/pretrain.sbatch", str(path)], cwd=ROOT)
            if job.returncode != 0:
                sys.exit(f"error: sbatch: {job.stderr.strip()}")
            job_id = job.stdout.strip().split(";")[0]
            submitted = time.time()
            while slurm.run(["squeue", "-h", "-j", job_id]).stdout.strip():
                if time.time() - submitted > 900:
                    sys.exit(f"error: job {job_id} still running after 15 minutes:\n{log.read_text()[-3000:]}")
                time.sleep(1)
            took = time.time() - submitted
            state = slurm.run(["scontrol", "show", "job", job_id]).stdout
        finally:
            slurm.close()
        left = hosts.processes(0) + hosts.processes(1)
    finally:
        hosts.close()
    out = log.read_text()
    if "JobState=COMPLETED" not in state:
        sys.exit(f"error: job {job_id} did not complete:\n{state}\n{out[-4000:]}")
    ran, _ = config(work / "slurm", *common, "distributed.node_launcher=slurm", "distributed.launcher=torchrun",
                    "distributed.nnodes=2", "distributed.nproc_per_node=1", f"distributed.master_addr={ADDRS[0]}")
    out_dir = locate(ran, "pretrain")[0]
    manifest = json.loads((out_dir / "manifest.json").read_text())
    curves = logged(out_dir, "loss"), logged(one_dir, "loss")
    gap = max(abs(a - b) for a, b in zip(*curves))
    print(f"Slurm of two hosts up in {up:.1f} s; job {job_id} COMPLETED in {took:.1f} s (sbatch to the end, "
          f"`gptforge run` and its Prefect server included)")
    print(f"world size {manifest['world_size']}; {manifest['metrics']['tokens_per_sec']:,.0f} tokens/s against "
          f"{one_manifest['metrics']['tokens_per_sec']:,.0f} on one host with 2 processes")
    print(f"loss curve over {len(curves[0])} steps: largest difference from one host's {gap:.2e}; val_loss "
          f"{manifest['metrics']['val_loss']:.6f} against {one_manifest['metrics']['val_loss']:.6f}")
    print(f"processes left on the hosts: {left or 'none'}")


if __name__ == "__main__":
    main()
