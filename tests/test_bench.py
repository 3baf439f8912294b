"""Every script in bench/ runs, shrunk, so that none rots unseen: each is started as a user starts it, on a tiny
model and a few steps, and must exit 0 and print the figure it exists for. The figures themselves (ratios against
targets) are read from full runs, never asserted here. bench/gpu.sh, and bench/pretrain.py within it:
tests/test_infra.py."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SMALL
from tests.helpers import FAST, UPSTREAM, copy_store

pytestmark = pytest.mark.slow
# The session chain's settings (its stages reused from its store), one process and a few steps for what a bench adds.
CHAINED = [*SMALL, *FAST, "distributed.nproc_per_node=1", "preference.algorithm=dpo", "preference.max_steps=3",
           "preference.save_every=100", "preference.eval_every=3"]
BROWSER = Path("/usr/bin/chromedriver").exists() and shutil.which("chromium") is not None


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def bench(script: str, *args: str, timeout: int = 900) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "SE_AVOID_STATS": "true"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # SIGINT: the bench's own `finally` stops the servers and workers it started
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"{script} ran past {timeout} s:\n{(stdout + stderr)[-4000:]}")
    assert proc.returncode == 0, (stdout + stderr)[-4000:]
    return stdout


def test_tokenize_bench(tmp_path):
    out = bench("tokenize_bench.py", "--gb", "0.003", "--workers", "2")
    assert re.search(r"ratio gptforge/baseline tokens/s: [\d.]+x \(target >= 1.5x\)", out), out


def test_ppo_bench(chain):
    out = bench("ppo.py", "-c", str(chain["root"] / "pipeline.yaml"), "--prompts", "8", "--new-tokens", "4")
    assert re.search(r"ratio cache/no cache: [\d.]+x", out), out
    assert re.search(r"one PPO iteration .*\n  generation .*\n  scoring .*\n  training ", out), out


def test_long_context_bench():
    out = bench("long_context.py", "--cap-gib", "8", "--start", "256", "--max", "256", "--common", "256")
    assert re.search(r"targets: longest >= 3x baseline: [\d.]+x", out), out


def test_lora_bench():
    out = bench("lora.py", "--smoke")
    assert re.search(r"memory: LoRA / full = [\d.]+x", out) and "speed: gptforge LoRA / TRL SFTTrainer" in out, out


def actions(run_dir: Path) -> dict[str, str]:
    return {s: e["action"] for s, e in json.loads((run_dir / "run.json").read_text())["stages"].items()}


def test_from_pretrained_bench(chain, tmp_path):
    """On the session's pretrained model (its store copied: the bench's tokenize and pretrain are reused)."""
    copy_store(chain["root"], tmp_path / "demo", "tokenize", "pretrain")
    out = bench("from_pretrained.py", "--sft-steps", "3", "--root", str(tmp_path), *sets(CHAINED))
    assert re.search(r"lora SFT: +exact_match [\d.]+", out) and re.search(r"full SFT: +exact_match", out), out
    assert f"val_loss {chain['pretrain'][0]['metrics']['val_loss']}" in out  # the session's pretrained model


def test_demo_seeds_and_rlvr_benches(chain, tmp_path):
    """One store, the session chain's: bench/demo_seeds.py reuses its tokenize, pretrain, SFT and reward model and
    computes SFT's evaluation and DPO; bench/rlvr.py reuses tokenize and pretrain (its SFT learns from its own
    demonstrations)."""
    copy_store(chain["root"], tmp_path, *UPSTREAM)
    out = bench("demo_seeds.py", "--seeds", "0", "--root", str(tmp_path), *sets(CHAINED))
    assert re.search(r"\| sft \| [\d.]+ \|", out) and "| dpo |" in out and "| reward accuracy |" in out, out
    assert actions(tmp_path / "seed0") == {**dict.fromkeys(UPSTREAM, "reused"), "eval-sft": "computed",
                                           "dpo": "computed", "eval-dpo": "computed"}
    out = bench("rlvr.py", "--seeds", "0", "--root", str(tmp_path), "--problems", "200",
                "--demonstrations", "200", *sets(CHAINED))
    assert re.search(r"  sft: +[\d.]+ ± nan\n  grpo: +[\d.]+ ± nan  gain over SFT [+-][\d.]+ ± nan points", out), out
    assert re.search(r"  ppo: +[\d.]+ ± nan  gain over SFT", out), out


@pytest.mark.skipif(not BROWSER, reason="needs chromium and chromium-driver (apt) and selenium (.[browser])")
@pytest.mark.parametrize("script", ["report_browser.py", "team_ui.py"])
def test_browser_benches(script, tmp_path):
    pytest.importorskip("selenium")
    bench(script, "--out", str(tmp_path))
    assert any(tmp_path.glob("*.png"))
