"""Across two hosts, one process each: pretrain's throughput under each way gptforge can start it, side by side in
one run, on the two hosts tests/hosts.py builds (network namespaces with their own address, hostname and sshd; the
machine's cores are shared by both, so the figures compare launchers, not networks).

    .venv/bin/python bench/two_hosts.py [--steps 150] [--repeats 2] [--set k=v ...]     (as root, with pdsh)

- torchrun over ssh (`node_launcher: ssh`), the reference;
- gptforge's own agent over ssh;
- DeepSpeed's per-node launcher, started over ssh by gptforge;
- DeepSpeed's runner over a hostfile (pdsh), which starts the same per-node launcher itself.

The hosts here resolve their own names to their addresses (the runner needs that: it gives every node the same
environment and no address of its own). Every rank writes down its environment (a sitecustomize on PYTHONPATH),
so that what differs between the launches is printed beside the figures: that is the explanation of a gap.
Tokens a second are pretrain's own (`tokens_per_sec`, over its training steps: start-up is not in it); the median
over the repeats, and each against torchrun's as a ratio.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import config, tokenize_in_process  # noqa: E402
from tests.hosts import ADDRS, NAMES, Hosts, unavailable  # noqa: E402
from tests.pipeline.test_two_hosts import RUN  # noqa: E402

SITE = """
import json, os, socket
if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
    with open(os.path.join(os.path.dirname(__file__), "seen", socket.gethostname()), "w") as f:
        json.dump(dict(os.environ), f)
"""

LAUNCHES = {
    "torchrun over ssh": ["distributed.launcher=torchrun", "distributed.node_launcher=ssh"],
    "gptforge agent over ssh": ["distributed.launcher=gptforge", "distributed.node_launcher=ssh"],
    "deepspeed per-node over ssh": ["distributed.launcher=deepspeed", "distributed.node_launcher=ssh"],
    "deepspeed runner (pdsh)": ["distributed.launcher=deepspeed", "distributed.node_launcher=local"],
}
SHOWN = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "DS_ACCELERATOR", "GLOO_SOCKET_IFNAME", "MASTER_ADDR",
         "TORCHELASTIC_USE_AGENT_STORE", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "KMP_AFFINITY", "LD_PRELOAD")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    if why := unavailable():
        sys.exit(f"error: two hosts cannot be made here: {why}")
    work = Path(tempfile.mkdtemp(prefix="two-hosts-"))
    site = work / "site"
    (site / "seen").mkdir(parents=True)
    (site / "sitecustomize.py").write_text(SITE)
    hostfile = work / "hostfile"
    hostfile.write_text(f"{NAMES[0]} slots=1\n{NAMES[1]} slots=1\n")
    common = ["distributed.zero_stage=2", "distributed.nnodes=2", "distributed.nproc_per_node=1",
              f"distributed.hostfile={hostfile}", f"distributed.master_addr={ADDRS[0]}",
              f"pretrain.max_steps={args.steps}", f"pretrain.save_every={args.steps}", "pretrain.log_every=10",
              f"pretrain.eval_every={args.steps}", "distributed.env.GPTFORGE_WARM_RANKS=0", *args.set]
    # (a rank forked by gptforge's warm agent runs no sitecustomize: each its own process here)
    hosts = Hosts(work / "hosts", loopback_names=False)
    rates: dict[str, list[float]] = {name: [] for name in LAUNCHES}
    seen: dict[str, dict] = {}  # node-b's rank's environment under each launch
    try:
        tokenized = False
        for r in range(args.repeats):
            for name, overrides in LAUNCHES.items():
                root = work / f"run-{r}-{list(LAUNCHES).index(name)}"
                cfg, path = config(root, *common, *overrides)
                if not tokenized:
                    tokenize_in_process(cfg)
                    store = root / "store"
                    tokenized = True
                else:
                    shutil.copytree(store / "tokenize", root / "store" / "tokenize")
                began = time.perf_counter()
                env = hosts.env(PYTHONPATH=str(site))
                for f in (site / "seen").iterdir():
                    f.unlink()
                proc = hosts.run(0, [sys.executable, "-c", RUN, str(path), "pretrain"], cwd=ROOT, check=False,
                                 env=env, timeout=1200)
                manifest = next((json.loads(line[9:]) for line in proc.stdout.splitlines()
                                 if line.startswith("MANIFEST ")), None)
                if proc.returncode != 0 or manifest is None:
                    sys.exit(f"error: {name} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
                rate = manifest["metrics"]["tokens_per_sec"]
                if r == 0:
                    seen[name] = json.loads((site / "seen" / NAMES[1]).read_text())
                rates[name].append(rate)
                print(f"round {r + 1} {name:28s} {rate:9,.0f} tokens/s  ({time.perf_counter() - began:.1f} s in all)",
                      flush=True)
    finally:
        hosts.close()
    ref = statistics.median(rates["torchrun over ssh"])
    print(f"\n{'launch':28s} {'tokens/s':>10s} {'vs torchrun':>12s}   (median of {args.repeats}, {args.steps} steps)")
    for name, got in rates.items():
        print(f"{name:28s} {statistics.median(got):10,.0f} {statistics.median(got) / ref:11.2f}x")
    print("\nthe ranks' environments (round 1; node-b), where they differ from torchrun's:")
    base = seen["torchrun over ssh"]
    for name, env in seen.items():
        differ = {k: env.get(k) for k in SHOWN if env.get(k) != base.get(k)}
        extra, missing = sorted(set(env) - set(base)), sorted(set(base) - set(env) - {"PET_LOCAL_ADDR"})
        print(f"  {name}: {differ or 'same'}; only here: {', '.join(extra) or 'none'}; "
              f"not here: {', '.join(missing) or 'none'}")


if __name__ == "__main__":
    main()
