"""Two pipelines run side by side on one host, and nothing a run starts listens beyond the host: two `gptforge run`s
(each with its ephemeral Prefect server, a tokenize stage spread over a local Ray instance, a 2-process pretrain stage
and its rendezvous store) are watched while they run, and every listening socket of every process in their trees is
on loopback."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gptforge.pipeline.store import locate, read_manifest
from tests.helpers import config

pytestmark = pytest.mark.slow
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def listening(root: psutil.Process) -> set[tuple[str, str, int]]:
    """(what, address, port) of every listening TCP socket in `root`'s process tree."""
    found = set()
    for p in [root, *root.children(recursive=True)]:
        try:
            cmd = " ".join(p.cmdline())
            what = "pipeline" if p.pid == root.pid else "prefect server" if "prefect" in cmd and "server" in cmd \
                else p.name()
            found |= {(what, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.Error:  # it ended meanwhile
            pass
    return found


def test_two_pipelines_side_by_side_each_with_its_own_servers_listen_on_loopback_only(tmp_path):
    """Two `gptforge run`s at once on one host, each with its run root, its own ephemeral Prefect server (no
    PREFECT_API_URL) and its own local Ray instance (a tokenize stage over four files, four work units), every stage
    computed: each finishes with its own results, equal to the other's (the same config); their servers, Ray
    instances and rendezvous take ports of their own (a fixed 29500 made the second fail with EADDRINUSE), and every
    listening socket of every process in either tree is on loopback."""
    for k in range(4):  # four work units: the tokenize stage starts a local Ray instance
        (tmp_path / f"part{k}.txt").write_text("".join(f"document {i} of part {k}: " + "words " * (i % 40) + "\n"
                                                       for i in range(1500)))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the ephemeral Prefect server
    procs, cfgs = {}, {}
    for name in ("a", "b"):
        cfgs[name], path = config(tmp_path / name, f"data.pretrain={tmp_path}/part*.txt", "tokenizer.num_workers=2",
                                  "pretrain.max_steps=8", "sft.enabled=false", "reward.enabled=false",
                                  "preference.enabled=false")
        procs[name] = subprocess.Popen([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c", str(path)],
                                       env=env, stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                       start_new_session=True)
    roots = {n: psutil.Process(p.pid) for n, p in procs.items()}
    seen = {n: set() for n in procs}
    while any(p.poll() is None for p in procs.values()):
        for n, p in procs.items():
            if p.poll() is None:
                seen[n] |= listening(roots[n])
        time.sleep(0.3)  # (each scan walks the whole tree: more often, and it competes with the runs)
    results = {}
    for n, proc in procs.items():
        out = (tmp_path / f"{n}.log").read_text()
        assert proc.returncode == 0 and "run tiny finished" in out, out[-4000:]
        names = {what for what, _, _ in seen[n]}
        assert {"pipeline", "prefect server", "gcs_server", "raylet"} <= names, (names, out[-2000:])
        assert {ip for _, ip, _ in seen[n]} <= LOOPBACK, sorted(seen[n])
        (report,) = (tmp_path / n).rglob("report.json")
        stages = json.loads(report.read_text())["stages"]
        assert {s: i["action"] for s, i in stages.items()} == {"tokenize": "computed", "pretrain": "computed"}
        assert all(Path(i["output"]).is_relative_to(tmp_path / n) for i in stages.values())
        results[n] = read_manifest(locate(cfgs[n], "pretrain")[0])["metrics"]
    assert results["a"]["val_loss"] == results["b"]["val_loss"] and results["a"]["global_step"] == 8
    for what in ("prefect server", "gcs_server"):
        ports = [{port for w, _, port in seen[n] if w == what} for n in procs]
        assert ports[0] and ports[1] and not ports[0] & ports[1], (what, ports)
