"""What the benches that run a stage as its own process measure: its wall time and the peak proportional set size of
its whole process tree (Ray's and datatrove's worker processes included)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import psutil


def tree_pss(pid: int) -> int:
    """Proportional set size of a process and all its descendants, in bytes (shared pages counted once)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in tree:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def measured(cmd: list[str], **kw) -> tuple[float, int, str]:
    """Run a command; its wall time, the peak PSS of its process tree and its stdout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    peak, out = [0], {}
    watcher = threading.Thread(target=lambda: out.update(zip(("out", "err"), proc.communicate())))
    t0 = time.perf_counter()
    watcher.start()
    while watcher.is_alive():
        peak[0] = max(peak[0], tree_pss(proc.pid))
        time.sleep(0.5)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{cmd[:4]} failed:\n{out['err'][-3000:]}")
    return seconds, peak[0], out["out"]
