"""Real 2-process preference stages on the tiny SFT policy and reward model: DPO (TRL, ZeRO-2), PPO (ours:
exact resume after SIGKILL, NaN handling), GRPO and RLOO (TRL)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.evaluate import check_same_vocabulary
from pipeline.entry import locate
from pipeline.errors import UserError
from pipeline.store import sha256_file
from model import train as T

from tests.helpers import config, copy_store, kill_after_checkpoint, launch, logged, run_stage

pytestmark = pytest.mark.slow
UPSTREAM = ("tokenize", "pretrain", "sft", "reward")
REPORT = {"exact_match", "sft_exact_match", "win_rate_vs_sft", "reward_mean", "kl"}


def changed_from_sft(chain, out_dir) -> bool:
    sft = load_file(chain["sft"][1] / "model" / "model.safetensors")
    tuned = load_file(out_dir / "model" / "model.safetensors")
    common = sft.keys() & tuned.keys()  # a gathered ZeRO-3 export may also list the tied lm_head
    assert (sft.keys() | tuned.keys()) - common <= {"lm_head.weight"}
    return any(not torch.equal(sft[k], tuned[k]) for k in common)


def prepared(chain, tmp_path, *overrides):
    cfg, path = config(tmp_path, *overrides)
    copy_store(chain["root"], tmp_path, *UPSTREAM)
    return cfg, path


def test_dpo_zero2(chain, tmp_path):
    cfg, path = prepared(chain, tmp_path, "preference.algorithm=dpo", "distributed.zero_stage=2",
                         "preference.max_steps=4", "preference.loss_type=ipo")
    manifest, out_dir, out = run_stage(cfg, path, "dpo")
    m = manifest["metrics"]
    assert REPORT <= set(m) and m["global_step"] == 4 and manifest["world_size"] == 2
    assert 0 <= m["win_rate_vs_sft"] <= 1
    assert changed_from_sft(chain, out_dir)
    assert logged(out_dir, "loss")  # Trainer logs reach logs/metrics.jsonl


PPO = ["preference.algorithm=ppo", "distributed.zero_stage=2", "preference.max_steps=6",
       "preference.save_every=2", "preference.global_batch_size=8", "preference.micro_batch_size=2"]


@pytest.fixture(scope="module")
def ppo(chain, tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    cfg, path = prepared(chain, root, *PPO)
    return run_stage(cfg, path, "ppo")


def test_ppo_trains_and_logs(chain, ppo):
    manifest, out_dir, _ = ppo
    m = manifest["metrics"]
    assert REPORT <= set(m) and m["global_step"] == 6 and m["bad_steps"] == 0
    rows = [json.loads(line) for line in (out_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward_mean", "reward_std", "kl", "policy_loss", "value_loss", "clip_frac", "entropy",
                "response_length", "gen_tokens_per_sec", "ptx_loss"):  # tiny.yaml: preference.ptx_coef > 0
        assert all(key in r for r in rows), key
    assert changed_from_sft(chain, out_dir)


def test_ppo_sigkill_then_rerun_matches_uninterrupted(chain, ppo, tmp_path):
    cfg, path = prepared(chain, tmp_path, *PPO)
    kill_after_checkpoint(cfg, path, "ppo", step=4)
    manifest, out_dir, out = run_stage(cfg, path, "ppo")
    assert "[ppo] resumed from" in out
    for key, value in manifest["metrics"].items():
        assert value == pytest.approx(ppo[0]["metrics"][key], abs=1e-6), key
    assert logged(out_dir, "reward_mean") == pytest.approx(logged(ppo[1], "reward_mean"), abs=1e-6)


def test_ppo_nan_rewards_are_skipped_then_fail_keeping_the_last_checkpoint(chain, tmp_path):
    cfg, path = prepared(chain, tmp_path, *PPO, "preference.save_every=1", "preference.max_bad_steps=2")
    reward_dir = locate(cfg, "reward")[0]
    weights = reward_dir / "model" / "model.safetensors"
    tensors = load_file(weights)
    tensors["score.weight"] = torch.full_like(tensors["score.weight"], float("nan"))
    save_file(tensors, weights, metadata={"format": "pt"})
    manifest = json.loads((reward_dir / "manifest.json").read_text())  # a complete output that scores NaN
    manifest["files"]["model/model.safetensors"] = sha256_file(weights)
    (reward_dir / "manifest.json").write_text(json.dumps(manifest))

    proc = launch(cfg, path, "ppo")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode != 0
    assert "NaN/Inf in reward or loss, step skipped (1 so far)" in out
    assert "3 steps with NaN/Inf rewards or losses (preference.max_bad_steps=2)" in out
    ckpts = locate(cfg, "ppo")[0] / "checkpoints"
    assert T.newest_valid_checkpoint(ckpts, rank=0) == ckpts / "step-00000002"
    assert not (locate(cfg, "ppo")[0] / "manifest.json").exists()


def test_ppo_rewarded_by_the_verifier_alone(chain, tmp_path):
    """With the reward model weighed 0, a PPO reward is the verifier's: 1 for the item's answer, else 0."""
    cfg, path = prepared(chain, tmp_path, *PPO, "preference.max_steps=3", "preference.save_every=10",
                         "preference.verifier_reward=true", "preference.reward_model_weight=0")
    _, out_dir, _ = run_stage(cfg, path, "ppo")
    means = [json.loads(line)["reward_mean"] for line in (out_dir / "logs" / "metrics.jsonl").read_text().splitlines()
             if "reward_mean" in line]
    assert len(means) == 3 and all(0 <= m <= 1 for m in means), means


def test_ppo_critic_starts_as_the_weighed_reward_model(chain):
    from transformers import AutoModelForSequenceClassification

    from stages.ppo import build_critic

    reward_dir = chain["reward"][1] / "model"
    critic = build_critic(reward_dir, 0.1).train()  # in train mode, as PPO reads the old values
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    x = torch.tensor([[5, 6, 7, 8, 9]])
    values = critic(input_ids=x).logits[0, :, 0]
    assert values[-1].item() == pytest.approx(0.1 * reward_model(input_ids=x).logits[0, 0].item(), abs=1e-5)
    assert torch.equal(values, critic(input_ids=x).logits[0, :, 0])  # no dropout


@pytest.mark.parametrize("algorithm, extra", [("grpo", ["preference.verifier_reward=true", "preference.scale_rewards=none"]),
                                              ("rloo", ["preference.verifier_reward=false"])])
def test_grpo_and_rloo(chain, tmp_path, algorithm, extra):
    cfg, path = prepared(chain, tmp_path, f"preference.algorithm={algorithm}", "distributed.zero_stage=2",
                         "preference.max_steps=2", "preference.num_generations=4", *extra)
    manifest, out_dir, _ = run_stage(cfg, path, algorithm)
    assert REPORT <= set(manifest["metrics"]) and manifest["metrics"]["global_step"] == 2
    assert changed_from_sft(chain, out_dir)
    ptx = logged(out_dir, "ptx_loss")  # tiny.yaml: preference.ptx_coef > 0, the chosen responses' loss
    assert len(ptx) == 2 and all(0 < x < 10 for x in ptx), ptx


def test_reward_model_with_another_vocabulary_is_an_error(chain, tmp_path):
    from transformers import AutoTokenizer

    from data.tokenizer import save_hf, train_bpe

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    save_hf(train_bpe(["completely different text"] * 20, 280, 2, specials), tmp_path, specials, 64)
    policy = AutoTokenizer.from_pretrained(chain["sft"][1] / "model")
    with pytest.raises(UserError, match="vocabularies differ"):
        check_same_vocabulary(policy, AutoTokenizer.from_pretrained(tmp_path), "reward model")
