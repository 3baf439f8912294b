"""Losses as pure functions on tensors (tested against values worked out by hand)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy. logits (B, T, V), targets (B, T) already shifted; IGNORE masked."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE)
