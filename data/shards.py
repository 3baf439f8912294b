"""Binary token shards: documents encoded in parallel worker processes, each followed by end-of-text,
written as flat little-endian uint16 (vocabulary <= 65536) or uint32 arrays, with `index.json`.

    shards/index.json        {"dtype", "vocab_size", "eos_id", "splits": {"train": [{"file", "tokens"}], ...}}
    shards/train-00000.bin   tokens of the train split
    shards/val-00000.bin     tokens of the val split
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

_worker_tok = None
_worker_eos = 0
_worker_dtype = np.uint16


def dtype_for(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _init_worker(tokenizer_json: str, eos_id: int, dtype_name: str) -> None:
    global _worker_tok, _worker_eos, _worker_dtype
    from tokenizers import Tokenizer

    _worker_tok = Tokenizer.from_str(tokenizer_json)
    _worker_eos = eos_id
    _worker_dtype = np.dtype(dtype_name)


def _encode_batch(docs: Sequence[str]) -> np.ndarray:
    ids: list[int] = []
    for enc in _worker_tok.encode_batch_fast(list(docs), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(_worker_eos)
    return np.array(ids, dtype=_worker_dtype)


class ShardWriter:
    """Appends token arrays to numbered shard files of at most `shard_tokens` tokens."""

    def __init__(self, out_dir: Path, split: str, dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self._f = None
        self._in_shard = 0

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._f = open(self.out_dir / name, "wb")
        self.shards.append({"file": name, "tokens": 0})
        self._in_shard = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._f is None or self._in_shard >= self.shard_tokens:
                self.close()
                self._open()
            take = min(len(tokens), self.shard_tokens - self._in_shard)
            tokens[:take].tofile(self._f)
            self._in_shard += take
            self.shards[-1]["tokens"] += take
            tokens = tokens[take:]

    def close(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)


def encode_splits(tokenizer_json: str, splits: dict[str, list[str]], out_dir: Path, *, eos_id: int,
                  vocab_size: int, shard_tokens: int, num_workers: int, batch_docs: int = 2000,
                  progress: Callable[[int], None] | None = None) -> dict:
    """Encode each split's documents in `num_workers` processes into shards; write and return the index.
    `progress(n)` is called with the number of documents of each batch written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(dtype_for(vocab_size))
    index = {"dtype": dtype.name, "vocab_size": vocab_size, "eos_id": eos_id, "splits": {}}
    # The parent may have used the tokenizers thread pool (training); forked workers must not.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ctx = mp.get_context("fork")
    with ctx.Pool(num_workers, initializer=_init_worker, initargs=(tokenizer_json, eos_id, dtype.name)) as pool:
        for split, docs in splits.items():
            writer = ShardWriter(out_dir, split, dtype, shard_tokens)
            batches = (docs[i:i + batch_docs] for i in range(0, len(docs), batch_docs))
            for i, tokens in enumerate(pool.imap(_encode_batch, batches, chunksize=1)):
                writer.write(tokens)
                if progress:
                    progress(min(batch_docs, len(docs) - i * batch_docs))  # documents done
            writer.close()
            index["splits"][split] = writer.shards
    tmp = out_dir / "index.json.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out_dir / "index.json")
    return index


def read_index(shard_dir: Path) -> dict:
    return json.loads((shard_dir / "index.json").read_text())


def load_split(shard_dir: Path, split: str) -> np.ndarray:
    """All tokens of a split as one array (memory-mapped shards concatenated)."""
    index = read_index(shard_dir)
    arrays = [np.memmap(shard_dir / s["file"], dtype=index["dtype"], mode="r")
              for s in index["splits"][split] if s["tokens"]]
    return np.concatenate(arrays) if len(arrays) > 1 else np.asarray(arrays[0])


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy of the token frequency distribution, in nats per token: the loss of a model that
    ignores context. A language model must go below it to have learned anything about order."""
    counts = np.bincount(tokens.astype(np.int64))
    p = counts[counts > 0] / len(tokens)
    return float(-(p * np.log(p)).sum())
