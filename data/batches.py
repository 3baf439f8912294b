"""Distributed, resumable batching.

`DistributedOrder` visits items (token windows, conversations, pairs) epoch after epoch, each epoch in
a seeded order fixed by (seed, number of items) alone. Token windows are cut from anything with a length and
slices: a numpy array, or a split's memory-mapped shards (gptforge.data.shards.TokenStream). A micro-step
takes the next micro_batch*world items of that order and rank r takes its own disjoint slice, so what a run
sees does not depend on when it was interrupted: the state is one integer, the position.
"""

from __future__ import annotations

import numpy as np
import torch


class DistributedOrder:
    def __init__(self, n_items: int, micro_batch: int, rank: int = 0, world: int = 1, seed: int = 0):
        if n_items < micro_batch * world:
            raise ValueError(f"only {n_items} items for a micro-step of {micro_batch}x{world}")
        self.n_items, self.micro_batch, self.rank, self.world, self.seed = n_items, micro_batch, rank, world, seed
        self.position = 0  # items consumed by all ranks together
        self._epoch, self._order = -1, None

    def next_ids(self) -> np.ndarray:
        """Indices of this rank's next micro-batch."""
        ids = self.ids_at(self.position // (self.micro_batch * self.world))
        self.position += self.micro_batch * self.world
        return ids

    def ids_at(self, step: int) -> np.ndarray:
        """Indices of this rank's micro-batch at micro-step `step` (from 0), whatever was drawn before."""
        start = step * self.micro_batch * self.world + self.rank * self.micro_batch
        ids = np.empty(self.micro_batch, dtype=np.int64)
        for i in range(self.micro_batch):
            epoch, offset = divmod(start + i, self.n_items)
            if epoch != self._epoch:
                self._epoch = epoch
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n_items)
            ids[i] = self._order[offset]
        return ids

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "n_items": self.n_items}

    def load_state_dict(self, state: dict) -> None:
        if state["n_items"] != self.n_items or state["seed"] != self.seed:
            raise ValueError("loader state is from different data or seed")
        self.position = state["position"]


class TokenWindows(DistributedOrder):
    """Windows of seq_len+1 tokens cut from the token stream, as (inputs, targets) micro-batches."""

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch: int, rank: int = 0, world: int = 1,
                 seed: int = 0):
        self.tokens, self.seq_len = tokens, seq_len
        super().__init__((len(tokens) - 1) // seq_len, micro_batch, rank, world, seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: inputs and next-token targets, both (B, T) int64."""
        return _windows(self.tokens, self.seq_len, self.next_ids())


def _windows(tokens: np.ndarray, seq_len: int, ids) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in ids])
    rows = torch.from_numpy(rows.astype(np.int64))
    return rows[:, :-1], rows[:, 1:]  # (B, T), (B, T)


def eval_batches(tokens: np.ndarray, seq_len: int, micro_batch: int, n_batches: int, rank: int, world: int):
    """Fixed val micro-batches for this rank: the first n_batches*micro_batch*world windows, in order."""
    n_windows = (len(tokens) - 1) // seq_len
    total = min(n_batches * micro_batch * world, n_windows - n_windows % (micro_batch * world))
    if total == 0:
        raise ValueError(f"the val split holds {n_windows} windows of {seq_len + 1} tokens, "
                         f"fewer than one micro-step of {micro_batch}x{world}")
    for start in range(rank * micro_batch, total, micro_batch * world):
        yield _windows(tokens, seq_len, range(start, start + micro_batch))


def document_positions(x: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids of (B, T) windows that restart at 0 after each end-of-text token: the token after an eos
    starts a document, the eos itself ends the one before."""
    idx = torch.arange(x.size(1), device=x.device).expand_as(x)
    starts = torch.zeros_like(x, dtype=torch.bool)
    starts[:, 1:] = x[:, :-1] == eos_id
    start_of = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_of
