"""Off-policy correction on hand-built log-probabilities: TIS changes PPO's policy loss by exactly the capped
ratios, IcePop keeps the ratio inside its band and drops exactly the tokens outside it, both as the paper and the
peers (veRL, OpenRLHF) compute them on the same numbers; RLOO's weight is the sequence's; a masked position's huge
log-ratio makes no NaN; and the mismatch metrics are the ones their formulas give."""

import math
from types import SimpleNamespace

import pytest
import torch

from gptforge.model.sampling.offpolicy import mismatch, sequence_weights, token_weights
from gptforge.model.train.losses import ppo_policy_loss

# two responses of three tokens; the second's last token is padding
TRAINED = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.2, -9.0]])
SAMPLED = torch.tensor([[-1.0, -3.5, -0.4], [-1.0, -0.3, 0.0]])  # ratios e^0, e^1.5, e^-0.1 / e^-2, e^0.1
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADVANTAGES = torch.tensor([[0.5, -1.0, 2.0], [1.0, -0.5, 3.0]])


def rollout(correction: str, **kw):
    return SimpleNamespace(correction=correction, tis_cap=kw.get("cap", 2.0), icepop_band=kw.get("band", (0.5, 2.0)))


def peers_loss(logp, old_logp, sampled_logp, advantages, mask, correction, cap=2.0, band=(0.5, 2.0), clip=0.2):
    """The PPO token loss with the rollout correction as veRL 0.9.1 (`rollout_is` token level: the weight
    pi_old / pi_rollout, truncated at the upper threshold (TIS), or, IcePop's low/high mode, kept where inside the
    bounds and 0 outside) and OpenRLHF 0.11.2 (`vllm_is_correction_type` tis / icepop, the mask mode) write it,
    transcribed here from their formulas: -min(r A, clip(r) A) * w, its mean over the mask."""
    r = torch.exp(logp - old_logp)
    w = torch.exp(old_logp - sampled_logp)
    w = w.clamp(max=cap) if correction == "tis" else w * ((w >= band[0]) & (w <= band[1]))
    per_token = -torch.min(r * advantages, r.clamp(1 - clip, 1 + clip) * advantages) * w.detach()
    return (per_token * mask).sum() / mask.sum()


def test_tis_weighs_each_tokens_loss_by_its_ratio_capped():
    logp = TRAINED + torch.tensor([[0.1, -0.1, 0.05], [0.0, 0.2, 0.0]])  # the policy after an update
    plain, _ = ppo_policy_loss(logp, TRAINED, ADVANTAGES, MASK, 0.2)
    weights = token_weights(TRAINED, SAMPLED, rollout("tis"))
    ratios = [[1.0, math.exp(1.5), math.exp(-0.1)], [math.exp(-2.0), math.exp(0.1), math.exp(-9.0)]]
    assert weights.flatten().tolist() == pytest.approx([min(r, 2.0) for row in ratios for r in row], rel=1e-6)
    corrected, _ = ppo_policy_loss(logp, TRAINED, ADVANTAGES, MASK, 0.2, weights)
    r = torch.exp(logp - TRAINED)
    per_token = torch.maximum(-ADVANTAGES * r, -ADVANTAGES * r.clamp(0.8, 1.2))
    assert corrected.item() == pytest.approx(((per_token * weights * MASK).sum() / MASK.sum()).item(), rel=1e-6)
    assert plain.item() == pytest.approx(((per_token * MASK).sum() / MASK.sum()).item(), rel=1e-6)
    assert corrected.item() != pytest.approx(plain.item(), rel=1e-3)  # the correction changed it
    assert not weights.requires_grad


def test_icepop_keeps_the_ratio_inside_its_band_drops_the_tokens_outside_and_none_changes_nothing():
    weights = token_weights(TRAINED, SAMPLED, rollout("icepop"))
    inside = [[1.0, 0.0, math.exp(-0.1)], [0.0, math.exp(0.1), 0.0]]  # e^1.5 > 2 and e^-2 < 0.5 are out
    assert weights.tolist() == [pytest.approx(row, rel=1e-6) for row in inside]
    assert token_weights(TRAINED, SAMPLED, rollout("none")) is None
    assert not weights.requires_grad


@pytest.mark.parametrize("correction", ["tis", "icepop"])
def test_the_weights_and_losses_are_the_papers_and_the_peers_on_fixed_numbers(correction):
    """The reproducer: one token, A = 1, pi_train = 0.6, pi_sampled = 0.4 (r = 1.5), cap 2 and band [0.5, 2]: the
    peers' loss -1.5 and gradient -1.5 (a weight of 1 inside the band gave -1.0 and -1.0); then the batch above."""
    logp = torch.tensor([[math.log(0.6)]], requires_grad=True)
    old, sampled, a, m = logp.detach().clone(), torch.tensor([[math.log(0.4)]]), torch.ones(1, 1), torch.ones(1, 1)
    loss, _ = ppo_policy_loss(logp, old, a, m, 0.2, token_weights(old, sampled, rollout(correction)))
    loss.backward()
    assert loss.item() == pytest.approx(-1.5, rel=1e-6) and logp.grad.item() == pytest.approx(-1.5, rel=1e-6)
    theirs = peers_loss(logp.detach(), old, sampled, a, m, correction)
    assert loss.item() == pytest.approx(theirs.item(), rel=1e-6)
    # a batch: the policy after an update, ratios on both sides of the band and of the clip
    new = (TRAINED + torch.tensor([[0.1, -0.1, 0.05], [0.0, 0.2, 0.0]])).requires_grad_()
    ours, _ = ppo_policy_loss(new, TRAINED, ADVANTAGES, MASK, 0.2, token_weights(TRAINED, SAMPLED, rollout(correction)))
    theirs = peers_loss(new, TRAINED, SAMPLED, ADVANTAGES, MASK, correction)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    g_ours, = torch.autograd.grad(ours, new)
    g_theirs, = torch.autograd.grad(theirs, new)
    assert torch.allclose(g_ours, g_theirs, atol=1e-7)


def test_rloos_weight_is_the_sequences_ratio_and_no_masked_position_makes_a_nan():
    """RLOO weighs a sequence by the product of its tokens' ratios on its mask: truncated (tis), or kept inside the
    band and 0 outside (icepop). A masked position whose log-ratio is 100 (a padding token the trainer finds
    impossible) stays out: in float32 exp(100) is inf, and 0 x inf would make the loss NaN."""
    logs = [(1.5 - 0.1), (-2.0 + 0.1)]  # each sequence's log-ratio over its mask
    tis = sequence_weights(TRAINED, SAMPLED, MASK, rollout("tis"))
    assert tis.tolist() == pytest.approx([min(math.exp(x), 2.0) for x in logs], rel=1e-6)
    ice = sequence_weights(TRAINED, SAMPLED, MASK, rollout("icepop", band=(0.1, 5.0)))
    assert ice.tolist() == pytest.approx([math.exp(logs[0]), math.exp(logs[1])], rel=1e-6)
    assert sequence_weights(TRAINED, SAMPLED, MASK, rollout("icepop")).tolist() == [0.0, 0.0]  # e^1.4, e^-1.9 out
    far = SAMPLED.clone()
    far[1, 2] = -109.0  # the padded position: trained -9 against -109, a log-ratio of 100
    for correction in ("tis", "icepop"):
        weights = token_weights(TRAINED, far, rollout(correction))
        assert torch.isfinite(weights).all()
        logp = TRAINED.clone().requires_grad_()
        loss, _ = ppo_policy_loss(logp, TRAINED, ADVANTAGES, MASK, 0.2, weights)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        assert torch.isfinite(sequence_weights(TRAINED, far, torch.ones_like(MASK), rollout(correction))).all()
    stale = TRAINED.clone()
    stale[1, 2] = -109.0  # the policy's ratio at the padded position: exp(100)
    loss, _ = ppo_policy_loss(TRAINED, stale, ADVANTAGES, MASK, 0.2)
    assert torch.isfinite(loss)


def test_the_mismatch_is_measured_over_the_policys_tokens_alone():
    m = mismatch(TRAINED, SAMPLED, MASK, rollout("tis", cap=2.0))
    diffs = [0.0, 1.5, -0.1, -2.0, 0.1]  # the padded token (-9) is left out
    assert m["mismatch/logp_abs_diff"] == pytest.approx(sum(abs(d) for d in diffs) / 5, rel=1e-6)
    assert m["mismatch/kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in diffs) / 5, rel=1e-6)
    assert m["mismatch/ratio_p50"] == pytest.approx(1.0)
    assert m["mismatch/capped"] == pytest.approx(1 / 5)  # e^1.5 alone is over 2
    assert mismatch(TRAINED, TRAINED, MASK, rollout("none"))["mismatch/kl"] == 0.0
