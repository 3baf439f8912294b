import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.errors import ConfigError

from tests.conftest import ROOT, TINY


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_yaml_loads(path):
    cfg = load_config(path)
    assert cfg.run.name


def test_overrides_are_typed():
    cfg = load_config(TINY, ["pretrain.lr=3e-4", "model.n_layer=2", "data.on_bad_row=fail"])
    assert cfg.pretrain.lr == pytest.approx(3e-4)
    assert cfg.model.arch().n_layer == 2
    assert cfg.data.on_bad_row == "fail"


def test_unknown_key_names_the_closest_valid_key():
    with pytest.raises(ConfigError, match=r"unknown key pretrain\.lrr; did you mean pretrain\.lr\?"):
        load_config(TINY, ["pretrain.lrr=1"])
    with pytest.raises(ConfigError, match=r"unknown key tokenizr; did you mean tokenizer\?"):
        load_config(TINY, ["tokenizr.vocab_size=1"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"pretrain\.max_steps"):
        load_config(TINY, ["pretrain.max_steps=lots"])


@pytest.mark.parametrize("overrides, message", [
    (["model.n_embd=100", "model.n_head=3"], r"model: n_embd=100 is not divisible by n_head=3"),
    (["pretrain.global_batch_size=30"], r"global_batch_size=30 is not divisible"),
    (["pretrain.enabled=false"], r"sft.enabled is true but its input stage pretrain is disabled"),
    (["tokenizer.vocab_size=100"], r"vocab_size=100 is smaller than the byte alphabet"),
    (["pretrain.seq_len=4096"], r"exceeds the model context"),
    (["model.preset=gpt9"], r"unknown preset 'gpt9'"),
    (["data.preference=pairs.jsonl", "preference.algorithm=[dpo,ppo]", "preference.verifier_reward=true"],
     r"preference.verifier_reward needs data.preference: demo .* for ppo"),
    (["data.preference=pairs.jsonl", "reward.policy_samples=100"], r"reward.policy_samples needs data.preference: demo"),
    (["preference.algorithm=grpo", "preference.global_batch_size=64", "preference.ptx_batch_size=6"],
     r"preference.ptx_batch_size=6 is not divisible by global_batch_size/micro_batch_size = 4"),
])
def test_impossible_combinations(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_the_verifier_is_ignored_where_no_online_algorithm_runs():
    cfg = load_config(TINY, ["data.preference=pairs.jsonl", "preference.algorithm=dpo", "preference.verifier_reward=true",
                             "reward.policy_samples=0"])
    assert cfg.preference.verifier_reward


def test_ptx_rows_per_micro_batch():
    """The ptx rows of an update spread over processes and micro-batches; by default one per response."""
    pc = load_config(TINY, ["preference.global_batch_size=64", "preference.micro_batch_size=8"]).preference
    pc = pc.model_copy(update={"ptx_batch_size": None})
    assert pc.ptx_rows(world=2, micro_steps_per_update=4) == 8  # TRL: 64 completions a step, 8 per micro-batch
    assert pc.ptx_rows(world=2, micro_steps_per_update=1) == 8  # PPO: an update is one minibatch of 8 a process
    pc = pc.model_copy(update={"ptx_batch_size": 256})
    assert pc.ptx_rows(world=2, micro_steps_per_update=4) == 32
    assert pc.ptx_rows(world=2, micro_steps_per_update=1) == 128


def test_config_errors_exit_2_before_anything_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(TINY).read_text() + "\nfoo: 1\n")
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "-c", str(bad),
                           "--set", f"run.root={tmp_path / 'runs'}"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "unknown key foo" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()
