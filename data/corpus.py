"""The pretraining corpus, unit by unit (gptforge.data.sources.Unit), in the two passes of the tokenize stage:

- `scan_unit`: read and normalise the unit's rows, count documents, bytes, lines and bad rows, and keep its
  bottom-k sample for BPE training: the documents with the smallest seeded hash of their text, at most
  `sample_bytes` of them. Merging the units' samples the same way (`Sample`) gives a uniform sample of the
  whole corpus whatever the order or the machine the units ran on; memory never holds more than the budget.
- `encode_unit`: read and normalise again, put each document in train or val by a hash of its text (a
  duplicate never lands on both sides), encode in bounded batches through a word cache (gptforge.data.encoder)
  and write the unit's shard files (gptforge.data.shards.ShardWriter), with the train tokens' unigram counts.

Both are plain functions of their arguments, run as Ray tasks (gptforge.data.parallel).
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gptforge.data.formats import BadRow, to_text
from gptforge.data.encoder import WordCache
from gptforge.data.shards import ShardWriter
from gptforge.data.sources import Unit, count_lines, read_unit

ENCODE_BATCH = 1000  # documents encoded at a time
BAD_EXAMPLES = 5  # bad rows a unit reports by file and line (all are counted)


@dataclass(frozen=True)
class Reading:
    """How a task reads the corpus: the source section, the text field, the demo settings."""

    source: object
    text_field: str
    demo: object


def documents(unit: Unit, reading: Reading, bad: list | None = None):
    """(line, text) of the unit's usable documents; bad rows are counted into `bad` as (line, reason)."""
    for row in read_unit(unit, reading.source, reading.demo):
        reason = row.error
        if reason is None:
            try:
                yield row.line, to_text(row.value, reading.text_field)
                continue
            except BadRow as e:
                reason = str(e)
        if bad is not None:
            bad.append((row.line, reason))


def key(text: str, seed: int) -> int:
    """A seeded 64-bit hash of a document's text."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8, key=str(seed).encode()).digest(), "big")


@dataclass
class Sample:
    """The documents whose keys come first in key order, as many as `budget` bytes hold (a bottom-k sample):
    exactly the same set whatever order the documents are added in, so per-unit samples merge into the corpus's.
    A document over 1% of the budget is left out, so that one huge document cannot take the sample's place."""

    budget: int
    heap: list = field(default_factory=list)  # (-key, size, text): the largest key on top
    size: int = 0
    cutoff: int = 2 ** 64  # every document with a smaller key is in the sample; none with a larger one

    def add(self, k: int, text: str) -> None:
        n = len(text.encode())
        if k >= self.cutoff or n > self.budget // 100:
            return
        heapq.heappush(self.heap, (-k, n, text))
        self.size += n
        while self.size > self.budget:  # the largest key cannot be in the sample, nor anything after it
            neg, m, _ = heapq.heappop(self.heap)
            self.size -= m
            self.cutoff = -neg

    def texts(self) -> list[str]:
        """The sample in key order (a fixed order whatever the order of adding)."""
        return [t for _, _, t in sorted(self.heap, reverse=True)]


@dataclass
class Scan:
    documents: int = 0
    bytes: int = 0
    lines: int = 0  # rows or lines read, bad ones included (text units: the lines that start in the range)
    bad_rows: int = 0
    bad: list = field(default_factory=list)  # the first BAD_EXAMPLES (line, reason), lines counted in the unit
    sample: list = field(default_factory=list)  # (key, text)


def scan_unit(unit: Unit, reading: Reading, sample_bytes: int, seed: int, below: int = 2 ** 64) -> Scan:
    """Count the unit's documents, bytes, lines and bad rows, and keep its bottom-k sample of the documents whose
    key is below `below` (a pre-filter that keeps what a task returns near its share of the corpus's sample)."""
    out, bad, sample = Scan(), [], Sample(sample_bytes)
    for _, text in documents(unit, reading, bad):
        out.documents += 1
        out.bytes += len(text.encode())
        if sample_bytes:
            k = key(text, seed)
            if k < below:
                sample.add(k, text)
    out.bad_rows, out.bad = len(bad), bad[:BAD_EXAMPLES]
    out.lines = count_lines(unit) if unit.kind == "text" else 0
    out.sample = [(-k, t) for k, _, t in sample.heap]
    return out


@dataclass(frozen=True)
class Encoding:
    """How a task encodes: the tokenizer (its JSON), end-of-text id, shard dtype and size, the val share."""

    tokenizer_json: str
    eos_id: int
    vocab_size: int
    dtype: str
    shard_tokens: int
    val_fraction: float
    seed: int
    word_cache: bool = True


_encoders: dict = {}


def _encoder(encoding: Encoding) -> WordCache:
    """The tokenizer behind a word cache, built once a worker process (not once a task): a later task on the same
    worker finds its words already encoded."""
    from tokenizers import Tokenizer

    digest = hashlib.sha256(f"{encoding.tokenizer_json}|{encoding.word_cache}".encode()).hexdigest()
    if digest not in _encoders:
        _encoders.clear()
        tok = Tokenizer.from_str(encoding.tokenizer_json)
        tok.no_truncation()  # a pretrained tokenizer.json may carry them: a document is encoded whole, unpadded
        tok.no_padding()
        _encoders[digest] = WordCache(tok, exact_only=not encoding.word_cache)
    return _encoders[digest]


def is_val(text: str, val_fraction: float, seed: int) -> bool:
    return key(text, seed + 1) < val_fraction * 2 ** 64


def encode_unit(job: tuple[int, Unit], reading: Reading, encoding: Encoding, out_dir: Path) -> dict:
    """Encode unit `index` into its shard files under out_dir; returns the shards of each split, documents,
    the train tokens' unigram counts and the largest token id."""
    index, unit = job
    encoder = _encoder(encoding)
    writers = {s: ShardWriter(out_dir, f"{s}-{index:05d}", encoding.dtype, encoding.shard_tokens)
               for s in ("train", "val")}
    counts = np.zeros(encoding.vocab_size, dtype=np.int64)
    batches = {"train": [], "val": []}
    eos = np.array([encoding.eos_id], dtype=np.uint32)
    docs, max_id = 0, -1

    def flush(split: str) -> None:
        nonlocal max_id
        lines, texts = zip(*batches[split])
        encoded = encoder.encode(list(texts))
        encoder.check(texts[0], encoded[0], f"{unit.path} (row {lines[0]} of unit {index})")
        tokens = np.concatenate([part for ids in encoded for part in (ids, eos)])
        if split == "train":
            counts[:] += np.bincount(tokens, minlength=encoding.vocab_size)[:encoding.vocab_size]
        max_id = max(max_id, int(tokens.max()))
        writers[split].write(tokens)
        batches[split] = []

    try:
        for line, text in documents(unit, reading):
            docs += 1
            split = "val" if is_val(text, encoding.val_fraction, encoding.seed) else "train"
            batches[split].append((line, text))
            if len(batches[split]) >= ENCODE_BATCH:
                flush(split)
        for split in batches:
            if batches[split]:
                flush(split)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return {"unit": index, "documents": docs, "max_id": max_id, "counts": counts,
            "shards": {s: w.commit() for s, w in writers.items()}}
