"""Binary token shards: flat little-endian uint16 (vocabulary <= 65536) or uint32 arrays, each document followed
by end-of-text, written unit by unit and read memory-mapped in place.

    shards/index.json          {"format": 2, "dtype", "vocab_size", "eos_id", "max_token_id", "unigram_entropy",
                                "splits": {"train": [{"file", "tokens"}, ...], "val": [...]}}
    shards/train-00003-000.bin the first train shard file of unit 3
    shards/units/00003.json    unit 3 done: its files (a killed stage reruns the units without one)

A unit's files are written under temporary names and renamed when the unit is done, so a file named in the
index, or in a unit's record, is always whole; `TokenStream` checks each file's size against the index.
"""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path

import numpy as np

from gptforge.core.errors import DataError
from gptforge.core.files import write_json_atomic

FORMAT = 2


def dtype_for(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


class ShardWriter:
    """Appends token arrays to `<prefix>-NNN.bin` files of at most `shard_tokens` tokens, under temporary names
    until `commit()` renames them and returns [{"file", "tokens"}]."""

    def __init__(self, out_dir: Path, prefix: str, dtype, shard_tokens: int):
        self.out_dir, self.prefix, self.dtype, self.shard_tokens = Path(out_dir), prefix, np.dtype(dtype), shard_tokens
        for stale in self.out_dir.glob(f"{prefix}-*"):  # what a killed run of this unit left
            stale.unlink()
        for stale in self.out_dir.glob(f".{prefix}-*"):
            stale.unlink()
        self.shards: list[dict] = []
        self._f = None
        self._in_shard = 0

    def _open(self) -> None:
        name = f"{self.prefix}-{len(self.shards):03d}.bin"
        self._f = open(self.out_dir / f".{name}.tmp", "wb")
        self.shards.append({"file": name, "tokens": 0})
        self._in_shard = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._f is None or self._in_shard >= self.shard_tokens:
                self._close()
                self._open()
            take = min(len(tokens), self.shard_tokens - self._in_shard)
            self._f.write(tokens[:take].tobytes())  # (a full disk is an OSError with its errno: ENOSPC)
            self._in_shard += take
            self.shards[-1]["tokens"] += take
            tokens = tokens[take:]

    def _close(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None

    def commit(self) -> list[dict]:
        self._close()
        for s in self.shards:
            os.replace(self.out_dir / f".{s['file']}.tmp", self.out_dir / s["file"])
        return self.shards

    def abort(self) -> None:
        """Remove what was written (a failed unit leaves no temporary file)."""
        if self._f is not None:
            self._f.close()
            self._f = None
        for s in self.shards:
            (self.out_dir / f".{s['file']}.tmp").unlink(missing_ok=True)


def write_index(shard_dir: Path, index: dict) -> None:
    write_json_atomic(shard_dir / "index.json", {"format": FORMAT, **index})


def read_index(shard_dir: Path) -> dict:
    try:
        index = json.loads((shard_dir / "index.json").read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{shard_dir}: no readable token shard index ({e})") from None
    if index.get("format") != FORMAT:
        raise DataError(f"{shard_dir}/index.json: shard format {index.get('format')}, expected {FORMAT}; "
                        "rerun the tokenize stage")
    return index


class TokenStream:
    """A split's shards as one sequence of tokens, memory-mapped in place: `len()` and slicing (a slice may span
    shard files). Memory does not grow with the corpus."""

    def __init__(self, shard_dir: Path, split: str):
        index = read_index(shard_dir)
        self.dtype = np.dtype(index["dtype"])
        self.files, self.starts = [], [0]
        for s in index["splits"][split]:
            path = Path(shard_dir) / s["file"]
            size = path.stat().st_size if path.is_file() else -1
            if size != s["tokens"] * self.dtype.itemsize:
                raise DataError(f"{path}: {size} bytes, the index says {s['tokens']} tokens of {self.dtype.name}")
            if s["tokens"]:
                self.files.append(path)
                self.starts.append(self.starts[-1] + s["tokens"])
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def _map(self, i: int) -> np.memmap:
        if i not in self._maps:
            self._maps[i] = np.memmap(self.files[i], dtype=self.dtype, mode="r")
        return self._maps[i]

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, _ = s.indices(len(self))
        pieces = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            lo, hi = self.starts[i], self.starts[i + 1]
            take = min(stop, hi) - start
            pieces.append(self._map(i)[start - lo:start - lo + take])
            start += take
            i += 1
        if len(pieces) == 1:
            return np.asarray(pieces[0])
        return np.concatenate(pieces) if pieces else np.empty(0, self.dtype)


def entropy(counts: np.ndarray) -> float:
    """Entropy of a token frequency distribution, in nats per token: the loss of a model that ignores context.
    A language model must go below it to have learned anything about order."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
