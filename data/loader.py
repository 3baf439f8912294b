"""A distributed, resumable loader over token shards.

The token stream is cut into windows of seq_len+1 tokens. Each epoch visits every window once in a
seeded order; the global order is fixed by (seed, number of windows) alone. A global batch is the
next `global_batch` windows of that order and rank r takes its own disjoint slice of every micro-step,
so the data a run sees does not depend on when it was interrupted: the state is one integer.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenWindows:
    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch: int, rank: int = 0, world: int = 1,
                 seed: int = 0):
        self.tokens, self.seq_len, self.micro_batch = tokens, seq_len, micro_batch
        self.rank, self.world, self.seed = rank, world, seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < micro_batch * world:
            raise ValueError(f"only {self.n_windows} windows of {seq_len + 1} tokens for a micro-step of "
                             f"{micro_batch}x{world} sequences")
        self.position = 0  # windows consumed by all ranks together
        self._epoch, self._order = -1, None

    def _window_ids(self, start: int, count: int) -> np.ndarray:
        ids = np.empty(count, dtype=np.int64)
        for i in range(count):
            epoch, offset = divmod(start + i, self.n_windows)
            if epoch != self._epoch:
                self._epoch = epoch
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            ids[i] = self._order[offset]
        return ids

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro-batch: inputs and next-token targets, both (B, T) int64."""
        start = self.position + self.rank * self.micro_batch
        ids = self._window_ids(start, self.micro_batch)
        self.position += self.micro_batch * self.world
        rows = np.stack([self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1] for i in ids])
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1], rows[:, 1:]  # (B, T), (B, T)

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "n_windows": self.n_windows}

    def load_state_dict(self, state: dict) -> None:
        if state["n_windows"] != self.n_windows or state["seed"] != self.seed:
            raise ValueError("loader state is from different shards or seed")
        self.position = state["position"]


def eval_batches(tokens: np.ndarray, seq_len: int, micro_batch: int, n_batches: int, rank: int, world: int):
    """Fixed val micro-batches for this rank: the first n_batches*micro_batch*world windows, in order."""
    n_windows = (len(tokens) - 1) // seq_len
    total = min(n_batches * micro_batch * world, n_windows - n_windows % (micro_batch * world))
    if total == 0:
        raise ValueError(f"the val split holds {n_windows} windows of {seq_len + 1} tokens, "
                         f"fewer than one micro-step of {micro_batch}x{world}")
    for start in range(rank * micro_batch, total, micro_batch * world):
        rows = np.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(start, start + micro_batch)])
        rows = torch.from_numpy(rows.astype(np.int64))
        yield rows[:, :-1], rows[:, 1:]
