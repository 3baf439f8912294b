"""Responses cut at their length budget (`preference.<algorithm>.overlong`, DAPO's overlong handling), for every
online stage: `mask` takes a cut response out of the loss (in TRL's GRPO and RLOO through their
`mask_truncated_completions`, in gptforge's PPO through `cut`), and `penalty` adds DAPO's soft overlong reward, 0
up to `max_new_tokens - overlong_buffer` tokens, then falling linearly to `-overlong_penalty` at `max_new_tokens`
(the rewards room adds it as the reward `overlong`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

CUT = ("truncated", "max_length")  # an episode's ends that are a cut (gptforge.model.agents.trajectory)


def cut(seqs: torch.Tensor, mask: torch.Tensor, P: int, stops: set[int], episodes=None) -> torch.Tensor:
    """(B,) True where a response was cut rather than ended: a turn whose last token is no stop token; with tools,
    an episode whose last turn was cut or that had no room left."""
    if episodes is not None:
        return torch.tensor([e.ended in CUT for e in episodes], device=mask.device)
    lengths = mask.sum(1)
    last = seqs[:, P:].gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
    ended = torch.isin(last, torch.tensor(sorted(stops), device=seqs.device))
    return (lengths > 0) & ~ended


def penalty(tokenizer, max_new_tokens: int, buffer: int, most: float) -> Callable:
    """The reward `overlong`: DAPO's soft penalty of a response by its tokens (its last turn's, re-tokenized)."""
    start = max_new_tokens - buffer

    def overlong(prompts, responses, answers, **_) -> list[float]:
        lengths = [len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in responses]
        return [-most * min(1.0, max(0, n - start) / buffer) for n in lengths]

    return overlong
