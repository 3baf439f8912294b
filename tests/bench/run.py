"""Running a bench as a user starts it, shrunk, from the suite (tests/bench/)."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SMALL
from tests.helpers import FAST

# The session chain's settings (its stages reused from its store), one process and a few steps for what a bench adds.
CHAINED = [*SMALL, *FAST, "distributed.nproc_per_node=1", "preference.algorithm=dpo", "preference.max_steps=3",
           "preference.save_every=100"]
BROWSER = Path("/usr/bin/chromedriver").exists() and shutil.which("chromium") is not None


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def bench(script: str, *args: str, timeout: int = 900, one_core: bool = False) -> str:
    """The bench's output; `one_core`: pinned to one core, for a single-process run beside the suite's other worker
    (its rank would otherwise take a thread on each core and wait on the busy one: bench/agentic.py's shrunk run
    took 530 s in the suite on 2026-12-04, against 136 s alone on both cores and 180 s alone on one)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "SE_AVOID_STATS": "true"}
    env.pop("PREFECT_API_URL", None)
    core = {max(os.sched_getaffinity(0))}
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, core)) if one_core else None)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # SIGINT: the bench's own `finally` stops the servers and workers it started
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"{script} ran past {timeout} s:\n{(stdout + stderr)[-4000:]}")
    assert proc.returncode == 0, (stdout + stderr)[-4000:]
    return stdout
