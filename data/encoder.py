"""Encoding a corpus with a word cache in front of the Hugging Face tokenizer, token for token what
`Tokenizer.encode_batch_fast` gives, several times faster on text whose words repeat.

Most of the Rust tokenizer's time on natural text goes to its pre-tokenization (the regex and the
normalized-string bookkeeping of every piece), not to BPE: it runs about 1M tokens/s a core whether or not the
words are new. Text repeats its words, so `WordCache` cuts documents into chunks at places where the
pre-tokenizer is known to start a piece, encodes each distinct chunk once, and assembles documents from the
encoded chunks (tiktoken and the BPE model's own cache do the same below the pre-tokenizer).

Where a cut is safe. The cut goes before a space followed by a printable ASCII character, position i. Each
alternative of the pre-tokenization pattern (Llama 3's and ours, `gptforge.data.tokenizer.SPLIT`, and GPT-2's)
holds a space only as its first character, or inside a run of whitespace; a whitespace run that reached i would
have to continue into text[i + 1], which is not whitespace, or end at i, where `\\s+(?!\\S)` would have ended it
one character earlier. So a piece starts at i whatever comes before or after it, and a chunk encodes alone as it
does in its document: the pieces of the text are the pieces of its chunks.

It is used only where that argument holds: no normalizer, one of those pre-tokenizers (byte-level, no prefix
space), a plain BPE model; documents that hold an added (special) token are encoded whole by the tokenizer, and no
added token may contain whitespace. Anything else encodes every document with the tokenizer (`exact` says which).
Memory is bounded: chunks over CHUNK_CHARS are not kept, and the cache holds two generations of at most
`capacity` chunks (the newer one, and the older one it promotes from).
"""

from __future__ import annotations

import json
import re

import numpy as np

CUT = re.compile(r"(?= [!-~])")  # before a space followed by a printable ASCII character
CHUNK_CHARS = 64  # longer chunks (text without spaces) are encoded but not kept
CAPACITY = 1 << 18  # chunks in a generation of the cache

# The pre-tokenizers the cut is proven for, as they appear in tokenizer.json (trim_offsets left out: it changes
# offsets, not ids).
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = (
    {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
    {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},  # GPT-2's pattern
)


def _strip_offsets(node):
    if isinstance(node, dict):
        return {k: _strip_offsets(v) for k, v in node.items() if k != "trim_offsets"}
    if isinstance(node, list):
        return [_strip_offsets(v) for v in node]
    return node


def exact(tok) -> str | None:
    """None when the word cache gives exactly the tokenizer's ids, or why not."""
    spec = json.loads(tok.to_str())
    model = spec["model"]
    if spec.get("normalizer") is not None:
        return "the tokenizer has a normalizer"
    if _strip_offsets(spec.get("pre_tokenizer")) not in PRE_TOKENIZERS:
        return "its pre-tokenizer is not byte-level BPE with the GPT-2 or Llama 3 pattern"
    if model["type"] != "BPE" or model.get("dropout") or model.get("byte_fallback") or model.get("ignore_merges") \
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "its model is not plain BPE"
    if any(re.search(r"\s", t["content"]) for t in spec.get("added_tokens", [])):
        return "an added token holds whitespace"
    return None


def byte_lengths(tok) -> np.ndarray:
    """The length in bytes of every token of a byte-level vocabulary (added tokens: their UTF-8 length)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    width = {c: 1 for c in bytes_to_unicode().values()}
    lengths = np.zeros(tok.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        lengths[i] = len(token.encode()) if token in added else sum(width.get(c, 0) for c in token)
    return lengths


class WordCache:
    """`encode(texts)`: the token ids of each text (uint32 arrays), as `tok.encode_batch_fast(texts,
    add_special_tokens=False)` gives them."""

    def __init__(self, tok, capacity: int = CAPACITY, exact_only: bool = False):
        self.tok, self.capacity = tok, capacity
        self.why_not = "tokenizer.word_cache=false" if exact_only else exact(tok)
        added = sorted((t.content for t in tok.get_added_tokens_decoder().values()), key=len, reverse=True)
        self.added = re.compile("|".join(map(re.escape, added))) if added else None
        self.lengths = byte_lengths(tok) if self.why_not is None else None
        self.new: dict[str, bytes] = {}
        self.old: dict[str, bytes] = {}

    def check(self, text: str, ids: np.ndarray, where: str) -> None:
        """Compare a document's cached encoding with the tokenizer's (the stage checks one a batch)."""
        if self.why_not is None and not np.array_equal(ids, self.plain([text])[0]):
            raise RuntimeError(f"{where}: the word cache's token ids differ from the tokenizer's; please report "
                               "this document, and set tokenizer.word_cache=false to encode without the cache")

    def plain(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32) for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        if self.why_not is not None:
            return self.plain(texts)
        chunked = [None if self.added and self.added.search(t) else CUT.split(t) for t in texts]
        whole = iter(self.plain([t for t, chunks in zip(texts, chunked) if chunks is None]))
        new, old = self.new, self.old
        batch = self._learn({c for chunks in chunked if chunks for c in chunks if c not in new and c not in old})
        out = []
        for chunks in chunked:
            if chunks is None:
                out.append(next(whole))
                continue
            parts = []
            for c in chunks:
                ids = new.get(c)
                if ids is None:
                    ids = batch.get(c)  # learned in this batch (kept below)
                if ids is None:  # in the older generation, or dropped when the cache turned over during this batch
                    ids = old.get(c)
                    if ids is None:
                        ids = self.plain([c])[0].tobytes()
                    self._keep(c, ids)  # in use again: into the newer generation
                    new, old = self.new, self.old
                parts.append(ids)
            out.append(np.frombuffer(b"".join(parts), dtype=np.uint32))
        for c, ids in batch.items():
            self._keep(c, ids)
        return out

    def _keep(self, chunk: str, ids: bytes) -> None:
        if len(chunk) > CHUNK_CHARS:
            return
        if len(self.new) >= self.capacity:
            self.old, self.new = self.new, {}
        self.new[chunk] = ids

    def _learn(self, chunks: set[str]) -> dict[str, bytes]:
        """The ids of chunks in neither generation: those that start a piece encoded together, as one text
        (each chunk's tokens found by the tokens' byte lengths), the others (a document's first chunk) one by
        one."""
        joinable, alone = [], []
        for c in chunks:
            (joinable if CUT.match(c) else alone).append(c)
        out = {}
        if joinable:
            ids = self.plain(["".join(joinable)])[0]
            ends = np.cumsum(self.lengths[ids])
            cuts = np.searchsorted(ends, np.cumsum([len(c.encode()) for c in joinable]), side="right")
            for c, part in zip(joinable, np.split(ids, cuts[:-1])):
                out[c] = part.tobytes()
        for c, ids in zip(alone, self.plain(alone)):
            out[c] = ids.tobytes()
        return out
