"""Losses against values worked out by hand (see the comments)."""

import math

import pytest
import torch

from gptforge.data.chat import IGNORE
from gptforge.model.train.losses import (AdaptiveKLController, causal_lm_loss, gae, kl_per_token, pairwise_reward_loss,
                                         ppo_policy_loss, ppo_value_loss, token_rewards, whiten)


def test_causal_lm_loss_by_hand():
    # logits favour token 0 with log-odds ln(3) over token 1; targets 0 and 1, third ignored
    logits = torch.tensor([[[math.log(3.0), 0.0], [math.log(3.0), 0.0], [5.0, 0.0]]])
    targets = torch.tensor([[0, 1, IGNORE]])
    want = (-math.log(3 / 4) - math.log(1 / 4)) / 2
    assert causal_lm_loss(logits, targets).item() == pytest.approx(want, rel=1e-6)


def softplus(v: float) -> float:  # -log sigmoid(x) = softplus(-x)
    return math.log1p(math.exp(v))


def test_pairwise_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    assert pairwise_reward_loss(chosen, rejected).item() == pytest.approx((softplus(-2.0) + softplus(0.0)) / 2)
    # margin 1: -log sigmoid(2 - 1), -log sigmoid(0 - 1)
    with_margin = pairwise_reward_loss(chosen, rejected, margin=1.0).item()
    assert with_margin == pytest.approx((softplus(-1.0) + softplus(1.0)) / 2)
    # centering: 0.5 * mean((2+0)^2, (0+0)^2) = 1
    with_center = pairwise_reward_loss(chosen, rejected, center_coefficient=0.5).item()
    assert with_center == pytest.approx((softplus(-2.0) + softplus(0.0)) / 2 + 1.0)
    # the loss falls as the chosen reward rises above the rejected one: a sign flip fails here
    assert pairwise_reward_loss(torch.tensor([3.0]), torch.tensor([0.0])) < pairwise_reward_loss(
        torch.tensor([0.0]), torch.tensor([3.0]))


def test_gae_by_hand():
    # gamma=1, lam=0.5; deltas 0.1, 0.1, 0.3 -> A2=0.3, A1=0.1+0.5*0.3=0.25, A0=0.1+0.5*0.25=0.225
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=0.5)
    assert adv.tolist()[0] == pytest.approx([0.225, 0.25, 0.3])
    assert ret.tolist()[0] == pytest.approx([0.725, 0.85, 1.0])


def test_gae_stops_at_the_response_end():
    # the last token is padding: V after the response is 0; delta1 = 1 - 0.6 = 0.4, A0 = 0.1 + 0.5*0.4
    adv, _ = gae(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.6, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]]),
                 gamma=1.0, lam=0.5)
    assert adv.tolist()[0] == pytest.approx([0.3, 0.4, 0.0])


def test_policy_loss_clips_by_hand():
    # ratios 1.5 and 0.5 with advantages +1 and -1, clip 0.2: both clipped terms taken -> (-1.2 + 0.8) / 2
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    loss, clip_frac = ppo_policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), 0.2)
    assert loss.item() == pytest.approx(-0.2) and clip_frac.item() == 1.0
    loss, clip_frac = ppo_policy_loss(torch.log(torch.tensor([[1.1]])), torch.zeros(1, 1), torch.ones(1, 1),
                                      torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(-1.1) and clip_frac.item() == 0.0


def test_value_loss_by_hand():
    # V=1 from V_old=0.5 clipped to 0.7; return 2: max(1, 1.69) / 2
    loss = ppo_value_loss(torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]]), torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(0.845)


def test_kl_and_token_rewards_by_hand():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.5]])
    assert kl_per_token(logp, ref).tolist() == [[0.5, -0.5]]
    r = token_rewards(torch.tensor([2.0]), logp, ref, torch.ones(1, 2), kl_coef=0.1)
    assert r.tolist()[0] == pytest.approx([-0.05, 2.05])


def test_whiten_by_hand():
    out = whiten(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1.0, 1.0, 1.0, 0.0]))
    s = math.sqrt(2 / 3)
    assert out.tolist() == pytest.approx([-1 / s, 0.0, 1 / s, 0.0], rel=1e-5)


def test_adaptive_kl_controller_by_hand():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, n_steps=256)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    fixed = AdaptiveKLController(0.1, target=None, horizon=10000)
    fixed.update(100.0, 256)
    assert fixed.value == 0.1


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_generalized_jsd_is_trls_divergence_and_top_k_renormalises(beta):
    """The divergence of each beta (TRL's convention: 0 forward KL, 1 reverse KL) equals TRL's own
    ChunkedDivergenceFunction's on the same logits; by hand at the ends; over the teacher's top k, both
    distributions renormalised there."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    from gptforge.model.train.losses import generalized_jsd, on_support

    torch.manual_seed(0)
    hs, ht, ws, wt = torch.randn(6, 8), torch.randn(6, 8), torch.randn(11, 8), torch.randn(11, 8)
    s, t = torch.log_softmax(hs @ ws.T, -1), torch.log_softmax(ht @ wt.T, -1)
    theirs, _ = ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, beta)
    assert generalized_jsd(s, t, beta) == pytest.approx(theirs.tolist(), abs=1e-5)
    forward, reverse = (t.exp() * (t - s)).sum(-1), (s.exp() * (s - t)).sum(-1)
    assert generalized_jsd(s, t, 0.0) == pytest.approx(forward.tolist(), abs=1e-6)
    assert generalized_jsd(s, t, 1.0) == pytest.approx(reverse.tolist(), abs=1e-6)
    top = t.topk(3, -1)
    s3, t3 = on_support(s, top.values, top.indices)
    assert s3.exp().sum(-1) == pytest.approx([1.0] * 6) and t3.exp().sum(-1) == pytest.approx([1.0] * 6)
    assert s3 == pytest.approx(torch.log_softmax(s.gather(-1, top.indices), -1))
    assert on_support(s, t, None) == (s, t)
