"""Our PPO on 2 processes (ZeRO-2) on the tiny SFT policy and reward model: it trains and logs, resumes exactly
from its step checkpoints, skips NaN rewards and then fails keeping the last checkpoint. (PPO rewarded by a check
alone, with no reward model: test_rlvr.py.)"""

import json

import pytest
import torch

from gptforge.model.train.checkpoints import newest_valid_checkpoint
from gptforge.model.train.metrics import check_names
from gptforge.pipeline.store import locate
from gptforge.model.train.metrics import MEASURED
from tests.conftest import PPO
from tests.helpers import changed_from_sft, kill_after_checkpoint, launch, logged, logged_names, prepared, run_stage

pytestmark = pytest.mark.slow


def test_ppo_trains_and_logs(chain, ppo):
    manifest, out_dir, _ = ppo
    m = manifest["metrics"]
    assert m["global_step"] == 6 and m["bad_steps"] == 0
    rows = [json.loads(line) for line in (out_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward_mean", "reward_std", "kl", "kl_per_token", "policy_loss", "value_loss", "clip_frac", "entropy",
                "response_length", "gen_tokens_per_sec", "ptx_loss", "lr", "grad_norm"):  # tiny.yaml: ptx_coef > 0
        assert all(key in r for r in rows), key
    check_names(dict.fromkeys(logged_names(out_dir)))  # rewards/<label> among them
    assert {"rewards/exact_match", "rewards/reward_model"} <= logged_names(out_dir)  # tiny.yaml's rewards
    # exact match is 1 for the item's answer, else 0: a step's mean over its 8 responses is a multiple of 1/8
    assert all(abs(8 * m - round(8 * m)) < 1e-6 for m in logged(out_dir, "rewards/exact_match"))
    assert changed_from_sft(chain, out_dir)


def test_ppo_sigkilled_after_its_step_4_checkpoint_reruns_to_the_uninterrupted_run(chain, ppo, tmp_path):
    """The session's PPO, SIGKILLed (its whole process group) once its step-4 checkpoint is complete: the rerun
    resumes there and ends on the uninterrupted run's metrics and rewards."""
    cfg, path = prepared(chain, tmp_path, *PPO)
    assert locate(cfg, "ppo")[0].name == ppo[1].name  # the session's run, fingerprint for fingerprint
    killed = kill_after_checkpoint(cfg, path, "ppo", 4)
    assert sorted(p.name for p in (killed / "checkpoints").glob("step-*"))[:2] == ["step-00000002", "step-00000004"]
    manifest, out_dir, out = run_stage(cfg, path, "ppo")
    assert f"[ppo] resumed from {killed / 'checkpoints' / 'step-00000004'}" in out
    for key, value in manifest["metrics"].items():
        if key not in MEASURED:
            assert value == pytest.approx(ppo[0]["metrics"][key], abs=1e-6), key
    assert logged(out_dir, "reward_mean") == pytest.approx(logged(ppo[1], "reward_mean"), abs=1e-6)


def test_ppo_nan_rewards_are_skipped_rolled_back_then_fail_keeping_the_last_checkpoint(chain, tmp_path, monkeypatch):
    """From its 3rd prompt batch on, the rewards are NaN (a drill, model/train/guard.py): steps 1-2 train and are
    checkpointed; the next two batches are skipped, the stage rolls back to step 2, the two after fail it."""
    cfg, path = prepared(chain, tmp_path, *PPO, "preference.save_every=1", "preference.max_bad_steps=2",
                         "preference.max_rollbacks=1")
    monkeypatch.setenv("GPTFORGE_FAULTS", "nan@3+")
    with launch(cfg, path, "ppo") as proc:
        out, _ = proc.communicate(timeout=900)
    assert proc.returncode != 0
    assert "[ppo] step 3: reward, advantage or loss NaN/Inf; step skipped (1 bad, 1 in a row)" in out
    assert "rolling back to" in out
    assert "error: ppo: step 3: reward, advantage or loss NaN/Inf, 2 bad steps in a row (preference.max_bad_steps=2) " \
           "after 1 rollback(s) (preference.max_rollbacks=1)" in out
    out_dir = locate(cfg, "ppo")[0]
    assert newest_valid_checkpoint(out_dir / "checkpoints") == out_dir / "checkpoints" / "step-00000002"
    assert not (out_dir / "manifest.json").exists() and not (out_dir / "result.json").exists()


def test_ppo_critic_starts_as_the_weighed_reward_model(chain):
    from transformers import AutoModelForSequenceClassification

    from gptforge.stages.ppo import build_critic

    reward_dir = chain["reward"][1] / "model"
    critic = build_critic(reward_dir, 0.1).train()  # in train mode, as PPO reads the old values
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    x = torch.tensor([[5, 6, 7, 8, 9]])
    values = critic(input_ids=x).logits[0, :, 0]
    assert values[-1].item() == pytest.approx(0.1 * reward_model(input_ids=x).logits[0, 0].item(), abs=1e-5)
    assert torch.equal(values, critic(input_ids=x).logits[0, :, 0])  # no dropout


def test_ppo_with_overlong_mask_leaves_responses_cut_at_their_budget_out_of_the_loss(chain, tmp_path):
    """max_new_tokens=1: every response is cut before its end (the SFT model does not answer with its stop token
    alone), so `overlong: mask` leaves every token out of the loss (and the KL penalty, and the value loss): with no
    ptx term and no weight decay the actor ends where SFT did, while the same run without the mask moves it."""
    common = [*PPO, "preference.max_steps=2", "preference.ppo.max_new_tokens=1", "preference.ppo.ptx_coef=0",
              "preference.weight_decay=0"]
    cfg, path = prepared(chain, tmp_path / "masked", *common, "preference.ppo.overlong=mask")
    manifest, out_dir, _ = run_stage(cfg, path, "ppo")
    assert logged(out_dir, "rollout/truncated") == [1.0, 1.0]
    assert not changed_from_sft(chain, out_dir)
    cfg, path = prepared(chain, tmp_path / "kept", *common)
    manifest, out_dir, _ = run_stage(cfg, path, "ppo")
    assert logged(out_dir, "rollout/truncated") == [1.0, 1.0] and changed_from_sft(chain, out_dir)
