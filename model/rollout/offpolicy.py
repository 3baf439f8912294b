"""Off-policy correction: the trainer's policy against the one that sampled.

The log-probabilities a rollout was sampled with (the behaviour policy, `sampled`) and the trainer's of the same
tokens before its update (`trained`) differ: by the weights' staleness in async mode, and in either mode by the
kernels (a KV cache, another engine, another precision). The policy loss then weighs each token by the ratio
r = exp(trained - sampled):

- `tis`: truncated importance sampling (Ionides 2008; veRL PR #2953, "Your efficient RL framework secretly brings
  you off-policy RL training"): min(r, tis_cap), detached;
- `icepop` (IcePop, Ling team 2025): 1 where r is inside [low, high], 0 outside (the token leaves the loss);
- `none`: 1.

The mismatch is measured at every step over the policy's tokens: the mean |trained - sampled|, quantiles of r, and
the KL from the sampling policy to the trainer's, estimated per token with Schulman's k3 (r - 1 - log r, which is
never negative and unbiased under the sampling policy).
"""

from __future__ import annotations

import torch


def token_weights(trained: torch.Tensor, sampled: torch.Tensor, rollout) -> torch.Tensor | None:
    """Each token's weight in the policy loss under `rollout.correction` (None: none)."""
    if rollout.correction == "none":
        return None
    ratio = torch.exp(trained - sampled).detach()
    if rollout.correction == "tis":
        return ratio.clamp(max=rollout.tis_cap)
    low, high = rollout.icepop_band
    return ((ratio >= low) & (ratio <= high)).to(ratio.dtype)


def mismatch(trained: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor, rollout) -> dict[str, float]:
    """This process's mismatch metrics over the tokens of `mask`: mismatch/logp_abs_diff, mismatch/kl (per token),
    the ratio's quantiles (mismatch/ratio_p05, _p50, _p95), and the share of tokens the correction changed."""
    keep = mask.bool()
    diff = (trained - sampled)[keep].float()
    if diff.numel() == 0:  # every process logs the same keys
        diff = torch.zeros(1)
    ratio = diff.exp()
    q = torch.quantile(ratio, torch.tensor([0.05, 0.5, 0.95], dtype=ratio.dtype))
    out = {"mismatch/logp_abs_diff": diff.abs().mean().item(), "mismatch/kl": (ratio - 1 - diff).mean().item(),
           "mismatch/ratio_p05": q[0].item(), "mismatch/ratio_p50": q[1].item(), "mismatch/ratio_p95": q[2].item()}
    if rollout.correction == "tis":
        out["mismatch/capped"] = (ratio > rollout.tis_cap).float().mean().item()
    elif rollout.correction == "icepop":
        low, high = rollout.icepop_band
        out["mismatch/masked"] = ((ratio < low) | (ratio > high)).float().mean().item()
    return out
