"""Losses as pure functions on tensors (tested against values worked out by hand).

The PPO pieces (GAE, the clipped policy and value losses, whitening, the KL controller) are written here
because TRL removed its PPO trainer and with it these helpers; DPO, GRPO and RLOO use TRL's own losses.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gptforge.data.chat import IGNORE


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy. logits (B, T, V), targets (B, T) already shifted; IGNORE masked."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE)


def router_loss(output, config) -> torch.Tensor | None:
    """A mixture of experts' load-balancing loss (Fedus et al. 2021, as transformers computes it for Mixtral)
    weighed by the model's router_aux_loss_coef, to add to the training loss; None for a dense model."""
    aux = getattr(output, "aux_loss", None)
    return None if aux is None else config.router_aux_loss_coef * aux


def pairwise_reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0,
                         center_coefficient: float = 0.0) -> torch.Tensor:
    """Bradley-Terry loss -log sigmoid(r_c - r_r - margin), plus center_coefficient * mean((r_c + r_r)^2)
    to keep rewards centred on zero (Eisenstein et al. 2023). chosen, rejected: (B,) rewards."""
    loss = -F.logsigmoid(chosen - rejected - margin).mean()
    if center_coefficient:
        loss = loss + center_coefficient * ((chosen + rejected) ** 2).mean()
    return loss


# --- PPO (Schulman et al. 2017; as applied to language models by Ziegler et al. 2019) -------------


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the unmasked entries; masked entries become 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 estimate of KL(policy || reference) at each sampled token: log pi(y_t) - log pi_ref(y_t)."""
    return logp - ref_logp


def token_rewards(score: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                  kl_coef: float) -> torch.Tensor:
    """Per-token reward: -kl_coef * KL at every response token, plus the sequence score at its last token (the
    mask's last 1: a multi-turn rollout's mask has gaps, the tool turns). score (B,), logp/ref_logp/mask (B, T) ->
    (B, T)."""
    rewards = -kl_coef * kl_per_token(logp, ref_logp) * mask
    at = torch.arange(mask.size(1), device=mask.device)
    last = torch.where(mask > 0, at, -1).max(1).values  # index of each response's last token
    rewards[torch.arange(len(score)), last] += score
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over response tokens. (B, T) each; the value after the last
    token is 0. Returns advantages and returns (advantages + values), both (B, T)."""
    advantages = torch.zeros_like(rewards)
    next_adv = torch.zeros(rewards.size(0), dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros_like(next_adv)
    for t in reversed(range(rewards.size(1))):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv * m
        next_adv = torch.where(m > 0, adv, next_adv)
        next_value = torch.where(m > 0, values[:, t], next_value)
    return advantages, (advantages + values) * mask


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    clip: float, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate: mean of max(-A*r, -A*clip(r, 1-eps, 1+eps)), r = exp(logp - old_logp), each token's term
    times its off-policy weight where given (gptforge.model.sampling.offpolicy). Returns the loss and the fraction
    of tokens where the clipped term was taken. The log-ratio is clamped to +-20 first, as veRL does: a masked
    position the policy finds impossible would give exp(100) = inf in float32, and its 0 weight then a NaN."""
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip, 1 + clip)
    per_token = torch.maximum(unclipped, clipped)
    loss = masked_mean(per_token if weights is None else per_token * weights, mask)
    clip_frac = masked_mean((clipped > unclipped).float(), mask)
    return loss, clip_frac


def ppo_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                   clip: float) -> torch.Tensor:
    """Clipped value loss: 0.5 * mean of max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask)


class AdaptiveKLController:
    """KL coefficient that moves the observed KL toward a target (Ziegler et al. 2019, section 2.2):
    beta *= 1 + clip(KL/target - 1, -0.2, 0.2) * n_steps / horizon. With target None it stays fixed."""

    def __init__(self, init: float, target: float | None, horizon: int):
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, kl: float, n_steps: int) -> None:
        if self.target is None:
            return
        error = min(max(kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


# --- distillation (Agarwal et al. 2024, GKD; TRL's beta convention) --------------------------------------------


def on_support(student_logp: torch.Tensor, teacher_logp: torch.Tensor, ids: torch.Tensor | None):
    """Both log-distributions over the teacher's support: the whole vocabulary (`ids` None: (..., V) each, already
    normalised), or the k tokens `ids` (..., K) of the teacher's top k, the student's gathered there and both
    renormalised over them (what a served teacher's top-k log-probabilities allow)."""
    if ids is None:
        return student_logp, teacher_logp
    return torch.log_softmax(student_logp.gather(-1, ids), -1), torch.log_softmax(teacher_logp, -1)


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """Per position, the divergence between two log-distributions over the last dimension, in TRL's convention: beta
    0 the forward KL(teacher || student), 1 the reverse KL(student || teacher), between them the generalised JSD
    beta * KL(teacher || m) + (1 - beta) * KL(student || m), m = beta * teacher + (1 - beta) * student. (...,)."""
    s, t = student_logp.float(), teacher_logp.float()
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), 0)
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
