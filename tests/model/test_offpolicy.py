"""Off-policy correction on hand-built log-probabilities: TIS changes PPO's policy loss by exactly the capped
ratios, IcePop drops exactly the tokens outside its band, and the mismatch metrics are the ones their formulas
give."""

import math
from types import SimpleNamespace

import pytest
import torch

from gptforge.model.rollout.offpolicy import mismatch, token_weights
from gptforge.model.train.losses import ppo_policy_loss

# two responses of three tokens; the second's last token is padding
TRAINED = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.2, -9.0]])
SAMPLED = torch.tensor([[-1.0, -3.5, -0.4], [-1.0, -0.3, 0.0]])  # ratios e^0, e^1.5, e^-0.1 / e^-2, e^0.1
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADVANTAGES = torch.tensor([[0.5, -1.0, 2.0], [1.0, -0.5, 3.0]])


def rollout(correction: str, **kw):
    return SimpleNamespace(correction=correction, tis_cap=kw.get("cap", 2.0), icepop_band=kw.get("band", (0.5, 2.0)))


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


def test_icepop_drops_the_tokens_outside_its_band_and_none_changes_nothing():
    weights = token_weights(TRAINED, SAMPLED, rollout("icepop"))
    assert weights.tolist() == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]  # e^1.5 > 2 and e^-2 < 0.5 are out
    assert token_weights(TRAINED, SAMPLED, rollout("none")) is None


def test_the_mismatch_is_measured_over_the_policys_tokens_alone():
    m = mismatch(TRAINED, SAMPLED, MASK, rollout("tis", cap=2.0))
    diffs = [0.0, 1.5, -0.1, -2.0, 0.1]  # the padded token (-9) is left out
    assert m["mismatch/logp_abs_diff"] == pytest.approx(sum(abs(d) for d in diffs) / 5, rel=1e-6)
    assert m["mismatch/kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in diffs) / 5, rel=1e-6)
    assert m["mismatch/ratio_p50"] == pytest.approx(1.0)
    assert m["mismatch/capped"] == pytest.approx(1 / 5)  # e^1.5 alone is over 2
    assert mismatch(TRAINED, TRAINED, MASK, rollout("none"))["mismatch/kl"] == 0.0
