"""Off-policy correction: the trainer's policy against the one that sampled.

The log-probabilities a rollout was sampled with (the behaviour policy, `sampled`) and the trainer's of the same
tokens before its update (`trained`) differ: by the weights' staleness in async mode, and in either mode by the
kernels (a KV cache, another engine, another precision). The policy loss then weighs each token by the ratio
r = exp(trained - sampled):

- `tis`: truncated importance sampling (Ionides 2008; veRL PR #2953, "Your efficient RL framework secretly brings
  you off-policy RL training"): min(r, tis_cap), detached;
- `icepop` (IcePop, Ring-1T, Ling team 2025): r where r is inside [low, high], 0 outside (the token leaves the
  loss): the ratio is kept inside the band, as the paper defines it and veRL's `rollout_is` (low/high bounds) and
  OpenRLHF's mask mode compute it; the paper's band, [0.5, 5], is the default;
- `none`: 1.

RLOO's loss is one a sequence: there the ratio is the sequence's, the product of its tokens' (`sequence_weights`).
Every log-ratio is clamped to +-MAX_LOG_RATIO before it is exponentiated (veRL clamps it too): a position far off
the mask, or a token the trainer finds impossible, would otherwise give inf, and 0 x inf a NaN loss.

The mismatch is measured at every step over the policy's tokens: the mean |trained - sampled|, quantiles of r, and
the KL from the sampling policy to the trainer's, estimated per token with Schulman's k3 (r - 1 - log r, which is
never negative and unbiased under the sampling policy).
"""

from __future__ import annotations

import torch


MAX_LOG_RATIO = 20.0


def ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of a log-ratio clamped to +-MAX_LOG_RATIO, detached: a weight, never a path for the gradient."""
    return torch.exp(log_ratio.detach().float().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def weigh(r: torch.Tensor, rollout) -> torch.Tensor:
    """The weight of ratios `r` under rollout.correction (tis or icepop)."""
    if rollout.correction == "tis":
        return r.clamp(max=rollout.tis_cap)
    low, high = rollout.icepop_band
    return torch.where((r >= low) & (r <= high), r, torch.zeros_like(r))


def token_weights(trained: torch.Tensor, sampled: torch.Tensor, rollout) -> torch.Tensor | None:
    """Each token's weight in the policy loss under `rollout.correction` (None: none)."""
    if rollout.correction == "none":
        return None
    return weigh(ratio(trained - sampled), rollout).to(trained.dtype)


def sequence_weights(trained: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor, rollout) -> torch.Tensor | None:
    """Each sequence's weight (B,) under `rollout.correction`: its ratio the product of its tokens' on `mask`."""
    if rollout.correction == "none":
        return None
    return weigh(ratio(((trained - sampled) * mask).sum(1)), rollout).to(trained.dtype)


def mismatch(trained: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor, rollout) -> dict[str, float]:
    """This process's mismatch metrics over the tokens of `mask`: mismatch/logp_abs_diff, mismatch/kl (per token),
    the ratio's quantiles (mismatch/ratio_p05, _p50, _p95), and the share of tokens the correction changed."""
    keep = mask.bool()
    diff = (trained - sampled)[keep].float().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if diff.numel() == 0:  # every process logs the same keys
        diff = torch.zeros(1)
    r = diff.exp()
    q = torch.quantile(r, torch.tensor([0.05, 0.5, 0.95], dtype=r.dtype))
    out = {"mismatch/logp_abs_diff": diff.abs().mean().item(), "mismatch/kl": (r - 1 - diff).mean().item(),
           "mismatch/ratio_p05": q[0].item(), "mismatch/ratio_p50": q[1].item(), "mismatch/ratio_p95": q[2].item()}
    if rollout.correction == "tis":
        out["mismatch/capped"] = (r > rollout.tis_cap).float().mean().item()
    elif rollout.correction == "icepop":
        low, high = rollout.icepop_band
        out["mismatch/masked"] = ((r < low) | (r > high)).float().mean().item()
    return out
