import subprocess
import sys

import pytest

from gptforge.core.presets import PRESETS
from gptforge.model.plan import make_plan, model_state_bytes
from tests.conftest import ROOT


def test_gpt3_175b_against_the_paper():
    arch = PRESETS["gpt3-175b"]
    p = make_plan(arch, arch.vocab_size, seq_len=2048, micro_batch=1, gpus=1024, tokens=300e9)
    assert p.n_params == pytest.approx(175e9, rel=0.01)
    # The paper's 3.14e23 training FLOPs is 6*N*D for 300B tokens; the attention term adds ~3%.
    assert p.train_flops == pytest.approx(3.14e23, rel=0.05)
    assert p.flops_per_token == pytest.approx(6 * p.n_params + 12 * 96 * 12288 * 2048)
    assert p.optimal_tokens == pytest.approx(20 * p.n_params)
    # ZeRO-0 holds 16 bytes per parameter on every GPU (2.8 TB); ZeRO-3 divides all of it by N.
    assert p.memory[(0, False)] == pytest.approx(16 * p.n_params)
    assert p.memory[(3, False)] == pytest.approx(16 * p.n_params / 1024)


def test_zero_stages_by_hand():
    n, gpus = 1_000_000, 4
    assert model_state_bytes(n, 1, gpus, False) == 2 * n + 2 * n + 12 * n / 4
    assert model_state_bytes(n, 2, gpus, False) == 2 * n + 2 * n / 4 + 12 * n / 4
    assert model_state_bytes(n, 2, gpus, True) == 2 * n + 2 * n / 4


def test_plan_command():
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "plan", "--set", "model.preset=gpt3-175b",
                           "--set", "pretrain.seq_len=2048", "--set", "pretrain.micro_batch_size=1",
                           "--set", "pretrain.global_batch_size=2", "--gpus", "1024", "--gpu-mem", "80",
                           "--tokens", "300e9"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "174.6" in proc.stdout and "ZeRO-3" in proc.stdout and "days" in proc.stdout
    assert "does not fit" in proc.stdout.splitlines()[7]  # ZeRO-0 on 80 GiB
