"""Nothing a run starts listens beyond the host: `gptforge run` (its ephemeral Prefect server, a tokenize stage
spread over a local Ray instance, a 2-process pretrain stage and its rendezvous store) is watched while it runs,
and every listening socket of every process in its tree is on loopback."""

import os
import subprocess
import sys
import time

import psutil
import pytest

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


def test_every_socket_a_run_listens_on_is_on_loopback(tmp_path):
    for k in range(4):  # four work units: the tokenize stage starts a local Ray instance
        (tmp_path / f"part{k}.txt").write_text("".join(f"document {i} of part {k}: " + "words " * (i % 40) + "\n"
                                                       for i in range(1500)))
    _, path = config(tmp_path / "run", f"data.pretrain={tmp_path}/part*.txt", "tokenizer.num_workers=2",
                     "pretrain.max_steps=8", "sft.enabled=false", "reward.enabled=false", "preference.enabled=false")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the ephemeral Prefect server
    proc = subprocess.Popen([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c", str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    root, seen = psutil.Process(proc.pid), set()
    while proc.poll() is None:
        seen |= listening(root)
        time.sleep(0.3)  # (each scan walks the whole tree: more often, and it competes with the run)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-4000:]
    names = {what for what, _, _ in seen}
    assert {"pipeline", "prefect server", "gcs_server", "raylet"} <= names, (names, out[-2000:])
    assert {ip for _, ip, _ in seen} <= LOOPBACK, sorted(seen)
