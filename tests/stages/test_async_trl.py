"""Rollouts apart from training for TRL's trainers (gptforge.model.trainers.online, workers): GRPO and RLOO with a
rollout worker sampling their generation batches ahead, the sampled log-probabilities corrected and measured, a
GRPO killed and resumed exactly, and the guard of a Trainer reading a mismatch. (PPO's: test_async_rollouts.py.)"""

import pytest

from tests.helpers import kill_after_checkpoint, launch, logged, prepared, run_stage
from tests.stages.test_async_rollouts import spans, weights, with_noisy_engine

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_trls_trainers_train_on_generation_batches_sampled_ahead(algorithm, chain, tmp_path):
    """GRPO and RLOO with a rollout worker at staleness 1: each generation batch after the first was sampled with
    the weights one optimizer step old, its log-probabilities kept and the loss corrected (TIS); a run killed after
    its step-2 checkpoint (GRPO's) resumes to the uninterrupted result."""
    overrides = [f"preference.algorithm={algorithm}", "distributed.zero_stage=2", "preference.max_steps=4",
                 "preference.save_every=2", "preference.log_every=1", "preference.rollout.mode=async",
                 "preference.rollout.max_staleness=1", "preference.rollout.correction=tis"]
    cfg, path = prepared(chain, tmp_path / "run", *overrides)
    manifest, done, _ = run_stage(cfg, path, algorithm)
    assert manifest["metrics"]["global_step"] == 4
    assert logged(done, "rollout/staleness") == [0, 1, 1, 1] and logged(done, "rollout/version") == [0, 0, 1, 2]
    kl = logged(done, "mismatch/kl")  # the Trainer's first update is at learning rate 0 (its warmup's start)
    assert kl[:2] == pytest.approx([0, 0], abs=1e-6) and all(k > 1e-5 for k in kl[2:])
    generated = [s for s in spans(done) if s["what"] == "generate"]
    assert {s["who"] for s in generated} == {"worker-0"} and len(generated) == 4
    if algorithm == "rloo":
        return
    cfg, path = prepared(chain, tmp_path / "again", *overrides)
    killed = kill_after_checkpoint(cfg, path, algorithm, 2, trainer=True)
    assert (killed / "checkpoints" / "checkpoint-2" / "rollouts-rank1.pt").is_file()
    _, out_dir, out = run_stage(cfg, path, algorithm)
    assert f"[{algorithm}] resumed from {killed / 'checkpoints' / 'checkpoint-2'}" in out
    for key in ("reward_mean", "loss", "rollout/staleness", "mismatch/kl"):
        assert logged(out_dir, key) == pytest.approx(logged(done, key), abs=1e-5), key
    a, b = weights(done), weights(out_dir)
    assert all((a[k] - b[k]).abs().max() < 1e-5 for k in a)


def test_grpo_with_a_users_engine_past_max_mismatch_skips_the_steps_then_stops(chain, tmp_path, monkeypatch):
    """The guard of a TRL trainer reads the rollouts' verdict: every generation batch of the noisy engine is 0.05
    nats of KL a token off the trainer's policy, over max_mismatch, so its step is dropped, and with no checkpoint
    to roll back to the stage stops with one line."""
    cfg, path = with_noisy_engine(chain, tmp_path, monkeypatch, "preference.algorithm=grpo",
                                  "distributed.zero_stage=2", "preference.rollout.mode=async",
                                  "preference.rollout.max_staleness=0", "preference.rollout.max_mismatch=0.04",
                                  "preference.max_bad_steps=2", "preference.max_rollbacks=0")
    with launch(cfg, path, "grpo") as proc:
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    said = "the rollouts' mismatch, KL 0.04986 a token, is over preference.rollout.max_mismatch (0.04)"
    assert f"[grpo] step 1: {said}; step skipped (1 bad, 1 in a row)" in out, out[-3000:]
    assert f"error: grpo: step 2: {said}, 2 bad steps in a row (preference.max_bad_steps=2)" in out, out[-3000:]
