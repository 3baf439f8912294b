"""GRPO with TRL (ZeRO-2, 2 processes), rewarded by tiny.yaml's rewards (exact match with the demo's answers and the
reward model, each logged by name), with the ptx term."""

import json

import pytest

from gptforge.model.train.metrics import check_names
from tests.helpers import HALF_REWARD, changed_from_sft, logged, logged_names, prepared, run_stage

pytestmark = pytest.mark.slow


def test_grpo(chain, tmp_path):
    """Its log interval (10) is longer than the run (2 steps): the last step is logged all the same, and the run's
    loss and rate are reported."""
    cfg, path = prepared(chain, tmp_path, "preference.algorithm=grpo", "distributed.zero_stage=2",
                         "preference.max_steps=2", "preference.grpo.scale_rewards=none", "preference.log_every=10")
    manifest, out_dir, _ = run_stage(cfg, path, "grpo")
    m = manifest["metrics"]
    assert m["global_step"] == 2
    assert changed_from_sft(chain, out_dir)
    rows = [json.loads(line) for line in (out_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [2]
    assert m["train_loss"] == pytest.approx(logged(out_dir, "loss")[-1]) and m["tokens_per_sec"] > 0
    ptx = logged(out_dir, "ptx_loss")  # tiny.yaml: preference.grpo.ptx_coef > 0, the chosen responses' loss
    assert len(ptx) == 1 and all(0 < x < 10 for x in ptx), ptx
    names = logged_names(out_dir)
    assert {"loss", "lr", "reward_mean", "kl", "kl_per_token", "response_length", "rewards/exact_match",
            "rewards/reward_model"} <= names
    check_names(dict.fromkeys(names))
    total = logged(out_dir, "reward_mean")  # TRL's total is the weighed sum of the two, as ours is
    parts = [e + 0.03 * r for e, r in zip(logged(out_dir, "rewards/exact_match"),
                                          logged(out_dir, "rewards/reward_model"))]
    assert total == pytest.approx(parts, abs=1e-4)
    # without dynamic sampling: one draw a step, whose groups are trained as drawn (rewards all equal or not)
    assert logged(out_dir, "rollout/draws") == [1.0]
    assert logged(out_dir, "rollout/zero_advantage_trained") == logged(out_dir, "rollout/zero_advantage_groups")


def test_grpo_with_cispo_sequence_level_ratios_and_the_overlong_penalty(chain, tmp_path):
    """GRPO in CISPO's loss (clipped importance weights, epsilon max 0.28) with GSPO's sequence-level ratio, and
    DAPO's soft overlong penalty over the whole budget (overlong_buffer = max_new_tokens = 8: every token of a
    response costs 1/8): it trains, and the penalty is a reward of its own in the total, each response's tokens
    (re-tokenized) over eight, negated."""
    cfg, path = prepared(chain, tmp_path, "preference.algorithm=grpo", "distributed.zero_stage=2",
                         "preference.max_steps=2", "preference.log_every=1", "preference.grpo.loss_type=cispo",
                         "preference.grpo.importance_sampling_level=sequence", "preference.grpo.epsilon_high=0.28",
                         "preference.grpo.overlong=penalty", "preference.grpo.overlong_buffer=8")
    manifest, out_dir, _ = run_stage(cfg, path, "grpo")
    assert manifest["metrics"]["global_step"] == 2 and changed_from_sft(chain, out_dir)
    penalty = logged(out_dir, "rewards/overlong")
    assert len(penalty) == 2 and all(-1 <= p < 0 for p in penalty), penalty
    total = logged(out_dir, "reward_mean")
    parts = [e + 0.03 * r + o for e, r, o in zip(logged(out_dir, "rewards/exact_match"),
                                                 logged(out_dir, "rewards/reward_model"), penalty)]
    assert total == pytest.approx(parts, abs=1e-4)


@pytest.mark.parametrize("algorithm,mode", [("grpo", "sync"), ("rloo", "async")])
def test_dynamic_sampling_replaces_the_groups_whose_rewards_are_all_equal(algorithm, mode, chain, tmp_path,
                                                                         monkeypatch):
    """A reward that is 0 for every response to half the prompts (by the parity of the prompt's CRC) and the
    response's length for the others: the first half's groups have no advantage. With dynamic sampling (up to 4
    draws a step) they are replaced by groups of new draws; without it (test_grpo's run) they are trained. RLOO's
    draws are a rollout worker's batches sampled ahead, corrected (TIS)."""
    (tmp_path / "my_rewards.py").write_text(HALF_REWARD)
    monkeypatch.chdir(tmp_path)  # the launched stage imports the reward from the user's working folder
    cfg, path = prepared(chain, tmp_path, f"preference.algorithm={algorithm}", "distributed.zero_stage=2",
                         "preference.max_steps=3", "preference.log_every=1", f"preference.{algorithm}.ptx_coef=0",
                         "preference.rewards=[{name: 'my_rewards:half'}]",
                         f"preference.{algorithm}.dynamic_sampling=true", f"preference.{algorithm}.max_draws=4",
                         f"preference.rollout.mode={mode}", "preference.rollout.correction=tis")
    manifest, out_dir, _ = run_stage(cfg, path, algorithm)
    assert manifest["metrics"]["global_step"] == 3 and changed_from_sft(chain, out_dir)
    drawn, draws = logged(out_dir, "rollout/zero_advantage_groups"), logged(out_dir, "rollout/draws")
    trained = logged(out_dir, "rollout/zero_advantage_trained")
    assert len(drawn) == len(trained) == len(draws) == 3
    # a step draws again exactly when its first draw had such a group, and trains fewer of them than it drew
    assert [d > 1 for d in draws] == [z > 0 for z in drawn], (drawn, draws)
    assert all(t <= z for t, z in zip(trained, drawn)) and sum(trained) < sum(drawn), (drawn, trained)
    if mode == "async":  # the draws sampled by the worker: the first ahead (one update behind), the next since
        staleness = logged(out_dir, "rollout/staleness")  # the mean of the step's draws
        assert staleness[0] == 0 and all(0 < s <= 1 for s in staleness[1:]) and len(logged(out_dir, "mismatch/kl")) == 3


def test_every_loss_type_ratio_level_and_clip_reaches_trls_loss(chain, tmp_path):
    """Each of preference.grpo's loss types (and GSPO's sequence-level ratio, and DAPO's upper clip) through the
    stage's own arguments (gptforge.stages.grpo.algorithm_args, trl_online.arguments) into TRL's GRPOTrainer, whose
    loss on one fixed batch is the one that type alone gives, worked out here from the same log-probabilities: a
    stage that dropped the setting would train every type as TRL's default."""
    import typing

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from gptforge.core.config.training import GRPOSection
    from gptforge.core.declarations import STAGES
    from gptforge.model.trainers import trl_online
    from gptforge.stages import grpo
    from tests.helpers import config

    model_dir = chain["sft"][1] / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    prompt = torch.randint(3, 100, (4, 3))
    completion = torch.randint(3, 100, (4, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    # behaviour log-probabilities a little off the model's: ratios exp(+-0.25) of both signs, some past 1 + 0.2
    shift = torch.tensor([0.25, -0.25, 0.1, -0.1, 0.0]).repeat(4, 1)

    def loss_of(*overrides) -> tuple[float, torch.Tensor, torch.Tensor]:
        cfg, _ = config(tmp_path / "cfg", "preference.algorithm=grpo",
                        "preference.grpo.temperature=1.0", "preference.grpo.max_new_tokens=5",
                        "preference.global_batch_size=4", "preference.micro_batch_size=4",
                        "distributed.nproc_per_node=1", *overrides)
        kwargs = trl_online.arguments(cfg, STAGES["grpo"], tmp_path, [1.0], **grpo.algorithm_args(cfg))
        kwargs.update(deepspeed=None, gradient_accumulation_steps=1)  # one process, no DeepSpeed here
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        trainer = GRPOTrainer(model=model, args=GRPOConfig(**kwargs), reward_funcs=[lambda completions, **_: [0.0]],
                              train_dataset=Dataset.from_list([{"prompt": "x"}] * 4), processing_class=tok)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        with torch.no_grad():
            logits = model(torch.cat([prompt, completion], 1)).logits[:, 2:-1]
            logp = torch.log_softmax(logits, -1).gather(-1, completion[..., None])[..., 0]
        inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
                  "completion_mask": mask, "advantages": advantages, "old_per_token_logps": logp - shift,
                  "ref_per_token_logps": logp, "num_items_in_batch": mask.sum()}  # the reference's KL term 0 here
        with torch.no_grad():
            return trainer._compute_loss(trainer.model, inputs).item(), logp, shift

    A, m = advantages[:, None], mask.float()
    types = typing.get_args(GRPOSection.model_fields["loss_type"].annotation)
    assert set(types) == {"grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo"}
    got = {t: loss_of(f"preference.grpo.loss_type={t}") for t in types}
    _, logp, shift = got["grpo"]
    ratio = shift.exp()  # pi / pi_old, token by token
    clipped = -torch.min(ratio * A, ratio.clamp(0.8, 1.2) * A)
    expected = {
        "grpo": ((clipped * m).sum(1) / m.sum(1)).mean(),  # each sequence's mean, then their mean
        "bnpo": (clipped * m).sum() / m.sum(),  # the batch's tokens
        "dr_grpo": (clipped * m).sum() / (4 * 5),  # a constant: rows x max_completion_length
        "dapo": (clipped * m).sum() / m.sum(),  # the generation batch's tokens (here the same batch)
        "cispo": (-ratio.clamp(max=5.0) * A * logp * m).sum() / m.sum(),  # the weight, bounded by 5, times log pi
        "sapo": ((-torch.sigmoid(torch.where(A > 0, 1.0, 1.05) * (ratio - 1)) * 4 / torch.where(A > 0, 1.0, 1.05)
                  * A * m).sum(1) / m.sum(1)).mean(),  # TRL's soft gate, its default temperatures
    }
    for t in types:
        assert got[t][0] == pytest.approx(expected[t].item(), rel=1e-5), t
    # GSPO: one ratio a sequence, the geometric mean of its tokens'
    gspo = loss_of("preference.grpo.loss_type=grpo", "preference.grpo.importance_sampling_level=sequence")[0]
    seq = ((shift * m).sum(1) / m.sum(1)).exp()[:, None]
    expected_gspo = -torch.min(seq * A, seq.clamp(0.8, 1.2) * A)
    assert gspo == pytest.approx(((expected_gspo * m).sum(1) / m.sum(1)).mean().item(), rel=1e-5)
    # DAPO's clip-higher: the ratio exp(0.25) = 1.28 of a positive advantage kept up to 1.28, not cut at 1.2
    high = loss_of("preference.grpo.loss_type=dapo", "preference.grpo.epsilon_high=0.28")[0]
    wide = -torch.min(ratio * A, ratio.clamp(0.8, 1.28) * A)
    assert high == pytest.approx(((wide * m).sum() / m.sum()).item(), rel=1e-5)
    assert high != pytest.approx(got["dapo"][0])
