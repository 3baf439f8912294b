"""The guards of a long run, on real 2-process pretraining under ZeRO-2 (gloo), with faults injected through
GPTFORGE_FAULTS (model/train/guard.py): a NaN batch and a loss spike are skipped, bad steps in a row roll back to the
newest checkpoint, a run that stays bad fails with its checkpoint kept, and a rank that hangs ends the stage
within its timeout, naming the rank."""

import re
import time

import psutil
import pytest
from safetensors.torch import load_file

from gptforge.model.train.checkpoints import newest_valid_checkpoint
from gptforge.core.errors import StageFailed
from gptforge.pipeline.launch.stage import run_stage as run_step
from gptforge.pipeline.store import RunRecord, locate, read_manifest
from tests.helpers import config, copy_store, logged, prepared, run_stage

pytestmark = pytest.mark.slow
GUARDED = ["distributed.zero_stage=2", "model.dropout=0.0", "pretrain.max_steps=10", "pretrain.save_every=1",
           "pretrain.eval_every=10", "pretrain.spike_factor=3", "pretrain.spike_window=2",
           "pretrain.max_bad_steps=2"]


def guarded(root, tokenized, faults, monkeypatch, *overrides):
    cfg, path = config(root, *GUARDED, *overrides)
    copy_store(tokenized, root, "tokenize")
    monkeypatch.setenv("GPTFORGE_FAULTS", faults)
    return cfg, path


def test_bad_steps_are_skipped_and_rolled_back_to_the_weights_of_a_run_without_them(tokenized, tmp_path,
                                                                                     monkeypatch):
    """Micro-batch 3 NaN on rank 1, 8 a spike (x10) on rank 1, 10 and 11 NaN: 3 and 8 are skipped, 10 and 11
    (max_bad_steps=2 in a row) roll back to step 7's checkpoint. The weights equal those of a run that drew
    past those four batches without ever training on them."""
    cfg, path = guarded(tmp_path / "faults", tokenized, "nan@3:1,spike@8:1,nan@10:1,nan@11:1", monkeypatch)
    manifest, out_dir, out = run_stage(cfg, path, "pretrain")
    m = manifest["metrics"]
    assert m["bad_steps"] == 4 and m["rollbacks"] == 1 and m["global_step"] == 10
    assert "step 3: loss NaN/Inf on 1 of 2 rank(s); step skipped" in out
    assert re.search(r"step 7: loss [\d.]+ over spike_factor 3 x the median", out)
    assert "rolling back to" in out and "step-00000007" in out
    steps = [r for r in logged(out_dir, "loss")]
    assert len(steps) == 10 and all(v == v for v in steps)  # ten finite logged steps

    cfg, path = guarded(tmp_path / "clean", tokenized, "drop@3,drop@8,drop@10,drop@11", monkeypatch,
                        "pretrain.save_every=100")  # (the same fingerprint: no checkpoint to roll back to needed)
    clean, clean_dir, _ = run_stage(cfg, path, "pretrain")
    assert clean["metrics"]["bad_steps"] == 0
    ours, theirs = (load_file(d / "model" / "model.safetensors") for d in (out_dir, clean_dir))
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].isfinite().all()
        assert (ours[k] - theirs[k]).abs().max() < 1e-6, k
    assert logged(out_dir, "loss") == pytest.approx(logged(clean_dir, "loss"), abs=1e-6)


def test_zero0_pretraining_skips_a_nan_batch_and_a_spike_like_a_run_without_them(tokenized, tmp_path, monkeypatch):
    """pretrain's own loop under ZeRO-0 (fp32: a plain torch optimizer, which has no overflow path of its own; the
    test above drills it under ZeRO-2): micro-batch 3 NaN on rank 1 and 5 a spike (x10) on rank 1 are skipped, and
    the weights and curve are those of a run that drew past both without training on them."""
    weights, curves = [], []
    for name, faults in (("faults", "nan@3:1,spike@5:1"), ("clean", "drop@3,drop@5")):
        cfg, path = guarded(tmp_path / name, tokenized, faults, monkeypatch, "distributed.zero_stage=0",
                            "pretrain.max_steps=6", "pretrain.eval_every=6", "pretrain.save_every=100")
        manifest, out_dir, out = run_stage(cfg, path, "pretrain")
        m = manifest["metrics"]
        assert m["global_step"] == 6 and m["rollbacks"] == 0 and m["bad_steps"] == (2 if name == "faults" else 0)
        if name == "faults":
            assert "step 3: loss NaN/Inf on 1 of 2 rank(s); step skipped" in out, out[-3000:]
            assert re.search(r"step 4: loss [\d.]+ over spike_factor 3 x the median", out), out[-3000:]  # draw 5
        weights.append(load_file(out_dir / "model" / "model.safetensors"))
        curves.append(logged(out_dir, "loss"))
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        assert weights[0][k].isfinite().all() and (weights[0][k] - weights[1][k]).abs().max() < 1e-6, k
    assert len(curves[0]) == 6 and curves[0] == pytest.approx(curves[1], abs=1e-6)


def test_a_run_that_stays_bad_fails_and_keeps_its_last_good_checkpoint(tokenized, tmp_path, monkeypatch):
    cfg, path = guarded(tmp_path, tokenized, "nan@5+:1", monkeypatch, "pretrain.max_rollbacks=1")
    lines = []
    with pytest.raises(StageFailed):
        run_step(cfg, "pretrain", path, RunRecord(cfg), lines.append)
    out = "\n".join(lines)
    errors = [line for line in lines if "error: pretrain: step" in line]
    assert errors and "2 bad steps in a row (pretrain.max_bad_steps=2) after 1 rollback(s) " \
                      "(pretrain.max_rollbacks=1)" in errors[0], out[-3000:]
    out_dir = locate(cfg, "pretrain")[0]
    assert read_manifest(out_dir) is None and not (out_dir / "model").exists()  # nothing exported
    assert newest_valid_checkpoint(out_dir / "checkpoints").name == "step-00000004"


def test_a_hung_rank_ends_the_stage_within_its_timeout_naming_the_rank(tokenized, tmp_path, monkeypatch):
    """Rank 1 sleeps inside its 4th micro-batch; distributed.timeout_minutes=0.5. The stage fails within a minute
    of the hang with one error line naming rank 1, no process of it is left, and a retry resumes."""
    cfg, path = guarded(tmp_path, tokenized, "hang@4:1", monkeypatch, "distributed.timeout_minutes=0.5")
    seen: dict[str, float] = {}

    def line(text):
        seen.setdefault(text, time.monotonic())

    before = {p.pid for p in psutil.process_iter()}
    with pytest.raises(StageFailed):
        run_step(cfg, "pretrain", path, RunRecord(cfg), line)
    ended = time.monotonic()
    hung = next(t for text, t in seen.items() if text.startswith("step      3 |"))  # rank 1 then draws the 4th
    errors = [text for text in seen if text.startswith("error: pretrain: rank 1 (host ")]
    assert errors, "\n".join(seen)[-3000:]
    assert "stopped answering" in errors[0] and "pretrain micro-batch 4" in errors[0]
    assert "distributed.timeout_minutes=0.5" in errors[0]
    assert ended - hung < 60
    left = [p for p in psutil.process_iter(["pid", "cmdline"]) if p.info["pid"] not in before
            and "gptforge.stages.pretrain" in (cmd := " ".join(p.info["cmdline"] or [])) and str(tmp_path) in cmd]
    assert not left, left

    monkeypatch.delenv("GPTFORGE_FAULTS")
    manifest, _, out = run_stage(cfg, path, "pretrain")  # the retry resumes from the newest checkpoint
    assert "[pretrain] resumed from" in out and manifest["metrics"]["global_step"] == 10


@pytest.mark.parametrize("stage, zero", [("sft", 0), ("reward", 2)])
def test_sft_and_reward_skip_a_nan_batch_and_a_spike_like_a_run_without_them(chain, stage, zero, tmp_path,
                                                                             monkeypatch):
    """The same guard in the other loops of ours (PPO: test_ppo.py; the TRL stages: test_dpo.py). SFT under ZeRO-0
    in fp32 steps a plain torch optimizer, which has no overflow path of its own: the guard's skip still leaves
    weights, moments and schedule as a run that never saw the batches."""
    steps = [f"{stage}.max_steps=6", f"{stage}.save_every=10", f"{stage}.eval_every=6", f"{stage}.spike_factor=3",
             f"{stage}.spike_window=2", f"distributed.zero_stage={zero}", "model.dropout=0.0"]
    weights = []
    for name, faults in (("faults", "nan@3:1,spike@5:1"), ("clean", "drop@3,drop@5")):
        cfg, path = prepared(chain, tmp_path / name, *steps)
        monkeypatch.setenv("GPTFORGE_FAULTS", faults)
        manifest, out_dir, out = run_stage(cfg, path, stage)
        assert manifest["metrics"]["bad_steps"] == (2 if name == "faults" else 0)
        assert name == "clean" or f"warning: [{stage}] step 3: loss NaN/Inf on 1 of 2 rank(s)" in out
        assert manifest["metrics"]["global_step"] == 6
        weights.append(load_file(out_dir / "model" / "model.safetensors"))
    for k in weights[0]:
        assert weights[0][k].isfinite().all()
        assert (weights[0][k] - weights[1][k]).abs().max() < 1e-6, k
