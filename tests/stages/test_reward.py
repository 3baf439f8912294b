"""Real 2-process reward-model training (ZeRO-3) on the tiny SFT model: better than chance on held-out pairs,
exported as a sequence classifier that loads without gptforge, exact resume from its step checkpoints, every pair
format."""

import json
import subprocess
import sys

import pytest

from gptforge.model.train.metrics import MEASURED
from gptforge.pipeline.store import locate
from tests.helpers import config, copy_store, kill_after_checkpoint, logged, run_stage

pytestmark = pytest.mark.slow
ZEROS = ["distributed.zero_stage=3"]


def test_reward_model_exports_a_sequence_classifier(chain, tmp_path):
    manifest, out_dir, _ = chain["reward"]
    m = manifest["metrics"]
    # FAST samples 48 answers from the SFT model; the wrong ones became pairs with the known answer.
    assert m["policy_samples"] == 48 and 0 < m["policy_pairs"] <= 48
    assert logged(out_dir, "loss")[-1] < logged(out_dir, "loss")[0]
    script = ("import sys, torch; from transformers import AutoModelForSequenceClassification, AutoTokenizer;"
              f"d={str(out_dir / 'model')!r}; m=AutoModelForSequenceClassification.from_pretrained(d);"
              "t=AutoTokenizer.from_pretrained(d);"
              "x=t(['What is 2 plus 3? 5', 'hi'], return_tensors='pt', padding=True);"
              "s=m(**x).logits; assert s.shape == (2, 1); assert 'gptforge' not in sys.modules; print(s.tolist())")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_killed_then_rerun_matches_uninterrupted(chain, tmp_path):
    """The session's reward model, SIGKILLed (its whole process group) once its step-10 checkpoint is complete: the
    rerun resumes there and ends on the uninterrupted run."""
    cfg, path = config(tmp_path, *ZEROS)
    copy_store(chain["root"], tmp_path, "tokenize", "pretrain", "sft")
    assert locate(cfg, "reward")[0].name == chain["reward"][1].name  # the session's run, fingerprint for fingerprint
    killed = kill_after_checkpoint(cfg, path, "reward", 10)
    manifest, out_dir, out = run_stage(cfg, path, "reward")
    assert f"[reward] resumed from {killed / 'checkpoints' / 'step-00000010'}" in out
    want = chain["reward"][0]["metrics"]
    for key, value in manifest["metrics"].items():
        if key not in MEASURED:
            assert value == pytest.approx(want[key], abs=1e-6), key
    assert logged(out_dir, "loss") == pytest.approx(logged(chain["reward"][1], "loss"), abs=1e-6)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_reward_model_reads_every_pair_format_and_learns_a_preference_it_can_see(chain, tmp_path):
    """Pairs whose rejected response is always a refusal, in every format a preference file can take (flat, message
    lists, HH transcripts; one pair whose two answers are the same, which is skipped): held out (every 20th row),
    the trained reward model must rank them as the data does. (The demo's held-out pairs need more training than a
    test affords.)"""
    data = tmp_path / "pairs"
    data.mkdir()
    q = [(f"What is {i} plus {j}?", str(i + j), "I do not know.") for i in range(14) for j in range(10)]

    def turns(p, a):
        return [{"role": "user", "content": p}, {"role": "assistant", "content": a}]

    write_jsonl(data / "flat.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in q[:100]]
                + [{"prompt": "same", "chosen": "x", "rejected": "x"}])
    write_jsonl(data / "ultra.jsonl", [{"chosen": turns(p, c), "rejected": turns(p, r)} for p, c, r in q[100:120]])
    write_jsonl(data / "hh.jsonl", [{"chosen": f"\n\nHuman: {p}\n\nAssistant: {c}",
                                     "rejected": f"\n\nHuman: {p}\n\nAssistant: {r}"} for p, c, r in q[120:]])
    cfg, path = config(tmp_path, *ZEROS, f"data.preference={data}", "reward.save_every=100",
                       "reward.policy_samples=0")  # (the demo verifier labels policy samples)
    copy_store(chain["root"], tmp_path, "tokenize", "pretrain", "sft")
    m = run_stage(cfg, path, "reward")[0]["metrics"]
    assert m["skipped_identical"] == 1 and m["global_step"] == 20
    assert m["reward_accuracy"] >= 0.8 and m["reward_margin"] > 0.5, m  # 7 held-out pairs; chance is 0.5 and 0
