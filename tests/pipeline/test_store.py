import json
import os
import signal
import subprocess
import sys

import pytest

from gptforge.core.errors import InputError
from gptforge.model.train.metrics import MEASURED
from gptforge.pipeline.store import execute, fingerprints, locate, read_manifest


def changed(before: dict, after: dict) -> list[str]:
    return [s for s in before if before[s] != after[s]]


def test_same_config_same_fingerprint(small_cfg):
    assert fingerprints(small_cfg()) == fingerprints(small_cfg())


def test_change_propagates_downstream_only(small_cfg):
    base = fingerprints(small_cfg())
    assert list(base) == ["tokenize", "pretrain", "sft", "eval-sft", "reward", "dpo", "eval-dpo"]
    assert changed(base, fingerprints(small_cfg("sft.lr=1e-4"))) == ["sft", "eval-sft", "reward", "dpo", "eval-dpo"]
    tok = fingerprints(small_cfg("tokenizer.vocab_size=300"))
    assert all(base[s] != tok[s] for s in base)


def test_a_pretrained_model_is_fingerprinted_by_its_commit(small_cfg, tmp_path, monkeypatch):
    """From a hub model without pretraining: no tokenize or pretrain step; a new upload (main moves to another
    commit) changes sft and what follows, an unchanged one nothing; LoRA settings change the stage they are in."""
    from tests import hub_models

    cache = tmp_path / "hub"
    hub_models.use_cache(monkeypatch, cache)
    src = hub_models.save_model("qwen2", tmp_path / "qwen2")
    hub_models.hub_cache(cache, "org/qwen2-tiny", src)
    cfg = ("model.pretrained=org/qwen2-tiny", "pretrain.enabled=false")
    base = fingerprints(small_cfg(*cfg))
    assert list(base) == ["sft", "eval-sft", "reward", "dpo", "eval-dpo"]
    assert changed(base, fingerprints(small_cfg(*cfg))) == []
    hub_models.hub_cache(cache, "org/qwen2-tiny", src, commit="b" * 40)
    assert changed(base, fingerprints(small_cfg(*cfg))) == list(base)
    hub_models.hub_cache(cache, "org/qwen2-tiny", src)  # main back on the first commit
    assert changed(base, fingerprints(small_cfg(*cfg, "reward.lora.r=8"))) == ["reward", "eval-dpo"]
    assert changed(base, fingerprints(small_cfg(*cfg, "model.revision=" + "b" * 40))) == list(base)
    pretraining = fingerprints(small_cfg("model.pretrained=org/qwen2-tiny"))  # continued pretraining: its tokenizer
    assert list(pretraining)[:2] == ["tokenize", "pretrain"] and pretraining["tokenize"] != \
        fingerprints(small_cfg())["tokenize"]


@pytest.mark.parametrize("override", ["pretrain.log_every=50", "pretrain.eval_every=7", "pretrain.save_every=3",
                                      "pretrain.keep_last=5", "pretrain.compile=true", "sft.log_every=1",
                                      "preference.save_every=2", "tokenizer.num_workers=1", "distributed.zero_stage=3",
                                      "preference.algorithm=[dpo,ppo]"])
def test_settings_that_cannot_change_a_result_reuse_every_stage(small_cfg, override):
    base = fingerprints(small_cfg())
    assert changed(base, fingerprints(small_cfg(override))) == []


def test_each_algorithm_hashes_the_shared_fields_and_its_own():
    from gptforge.core.config import load_config
    from tests.conftest import TINY

    every = ["preference.algorithm=[dpo,ppo,grpo,rloo]"]
    base = fingerprints(load_config(TINY, every))
    assert changed(base, fingerprints(load_config(TINY, [*every, "preference.ppo.ppo_epochs=4"]))) == [
        "ppo", "eval-ppo"]
    assert changed(base, fingerprints(load_config(TINY, [*every, "preference.grpo.ptx_coef=0.5"]))) == [
        "grpo", "eval-grpo"]
    assert changed(base, fingerprints(load_config(TINY, [*every, "preference.beta=0.2"]))) == [
        "dpo", "eval-dpo", "ppo", "eval-ppo", "grpo", "eval-grpo", "rloo", "eval-rloo"]
    assert changed(base, fingerprints(load_config(TINY, [*every, "reward.lr=1e-4"]))) == [  # DPO uses no reward model
        "reward", "eval-dpo", "ppo", "eval-ppo", "grpo", "eval-grpo", "rloo", "eval-rloo"]
    # the sandbox's limits change what the python tool returns: every stage that rolls out with it, distill too
    # (and DPO, which hashes the whole preference section)
    distill = [*every, "distill.enabled=true", "distill.teacher=grpo", "preference.tools=[python]"]
    base = fingerprints(load_config(TINY, distill))
    assert changed(base, fingerprints(load_config(TINY, [*distill, "preference.sandbox.memory_mb=256"]))) == [
        "dpo", "eval-dpo", "ppo", "eval-ppo", "grpo", "eval-grpo", "rloo", "eval-rloo", "distill", "eval-distill"]


def test_evaluation_settings_rerun_evaluation_only(small_cfg):
    base = fingerprints(small_cfg())
    assert changed(base, fingerprints(small_cfg("eval.items=10"))) == ["eval-sft", "eval-dpo"]
    assert changed(base, fingerprints(small_cfg("eval.max_new_tokens=4"))) == ["eval-sft", "eval-dpo"]


def test_changed_data_file_changes_its_stage_and_downstream(small_cfg, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one line\nanother line\n")
    before = fingerprints(small_cfg(f"data.pretrain={corpus}"))
    assert fingerprints(small_cfg(f"data.pretrain={corpus}")) == before  # (its digest now cached)
    corpus.write_text("one line\nanother lime\n")  # one byte changed, the size kept
    after = fingerprints(small_cfg(f"data.pretrain={corpus}"))
    assert all(before[s] != after[s] for s in before)
    # SFT data changes: tokenize and pretrain keep their outputs
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"instruction": "hi", "output": "hello"}\n')
    base = fingerprints(small_cfg())
    assert changed(base, fingerprints(small_cfg(f"data.sft={chat}"))) == [
        "sft", "eval-sft", "reward", "dpo", "eval-dpo"]


KILLED_STAGE = """
import os, signal, sys
from gptforge.core.config import load_config
from gptforge.pipeline.store import execute

def run(cfg, inputs, out_dir):
    (out_dir / "shards").mkdir()
    (out_dir / "shards" / "index.json").write_text("{}")
    os.kill(os.getpid(), signal.SIGKILL)  # dies before the manifest is written

execute(load_config(sys.argv[1], sys.argv[2:]), "tokenize", run, {"shards": "shards"})
"""


def test_stage_killed_before_manifest_is_never_consumed(small_cfg, tmp_path):
    cfg = small_cfg()
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(json.dumps(cfg.model_dump(mode="json")))
    proc = subprocess.run([sys.executable, "-c", KILLED_STAGE, str(cfg_path)], cwd=tmp_path)
    assert proc.returncode == -signal.SIGKILL
    out_dir, _, _ = locate(cfg, "tokenize")
    assert (out_dir / "shards" / "index.json").exists()
    assert read_manifest(out_dir) is None
    with pytest.raises(InputError, match="needs a complete tokenize output"):
        execute(cfg, "pretrain", lambda *a: pytest.fail("must not run"), {})


def test_corrupted_output_is_not_complete(small_cfg):
    cfg = small_cfg()

    def run(cfg, inputs, out_dir):
        (out_dir / "model").mkdir()
        (out_dir / "model" / "weights.bin").write_bytes(b"abc")
        return {"loss": 1.0}

    manifest = execute(cfg, "tokenize", run, {"model": "model"})
    out_dir = locate(cfg, "tokenize")[0]
    assert set(manifest) >= {"stage", "fingerprint", "status", "config", "inputs", "outputs", "metrics", "files",
                             "started_at", "finished_at", "world_size", "versions"}
    metrics = read_manifest(out_dir)["metrics"]
    assert metrics["peak_host_memory_gib"] > 0  # measured for every stage
    assert {k: v for k, v in metrics.items() if k not in MEASURED} == {"loss": 1.0}
    # a second execute reuses instead of running
    assert execute(cfg, "tokenize", lambda *a: pytest.fail("must reuse"), {"model": "model"})["status"] == "complete"
    (out_dir / "model" / "weights.bin").write_bytes(b"abd")
    assert read_manifest(out_dir) is None
    os.remove(out_dir / "model" / "weights.bin")
    assert read_manifest(out_dir) is None


def test_demo_parts_fingerprint_separately(small_cfg):
    base = fingerprints(small_cfg())
    pairs = fingerprints(small_cfg("data.demo.preference_pairs=123"))
    assert changed(base, pairs) == ["reward", "dpo", "eval-dpo"]
    corpus = fingerprints(small_cfg("data.demo.pretrain_docs=1234"))
    assert all(base[s] != corpus[s] for s in base)
    held_out = fingerprints(small_cfg("data.demo.eval_items=30"))  # validation rows and the evaluated items
    assert changed(base, held_out) == ["sft", "eval-sft", "reward", "dpo", "eval-dpo"]
