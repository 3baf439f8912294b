"""Tokenize stage: train (or load) a byte-level BPE tokenizer and encode the pretraining corpus into
binary token shards with a train/val split.

    gptforge stage tokenize -c configs/tiny.yaml
    python -m gptforge.stages.tokenize --config configs/tiny.yaml --out DIR

Outputs: `tokenizer/` (Hugging Face files with the chat template) and `shards/` (see data.shards).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from gptforge.core.config import PipelineConfig
from gptforge.core.errors import DataError
from gptforge.data import loaders
from gptforge.data.shards import encode_splits
from gptforge.data.tokenizer import load_pretrained, save_hf, train_bpe
from gptforge.stages.cli import main

OUTPUTS = {"tokenizer": "tokenizer", "shards": "shards"}


def split_docs(docs: list[str], val_fraction: float) -> dict[str, list[str]]:
    """Deterministic document-level split: a document goes to val by a hash of its position."""
    every = max(2, round(1 / val_fraction))
    val = docs[::every]
    train = [d for i, d in enumerate(docs) if i % every]
    return {"train": train, "val": val}


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    tc = cfg.tokenizer
    corpus = loaders.pretrain_texts(cfg.data)
    docs = corpus.items
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    print(f"[tokenize] {len(docs)} documents, {n_bytes / 1e6:.1f} MB, {corpus.bad_rows} bad rows skipped", flush=True)

    tok_dir = out_dir / "tokenizer"
    if tc.pretrained:
        tok, eos_id = load_pretrained(tc.pretrained, tok_dir)
    else:
        t0 = time.perf_counter()
        tok = train_bpe(docs, tc.vocab_size, tc.min_frequency, tc.special_tokens)
        save_hf(tok, tok_dir, tc.special_tokens)
        eos_id = tok.token_to_id(tc.special_tokens[0])
        print(f"[tokenize] trained BPE, vocab {tok.get_vocab_size()} in {time.perf_counter() - t0:.1f}s", flush=True)
    vocab_size = tok.get_vocab_size()

    splits = split_docs(docs, tc.val_fraction)
    if not splits["train"] or not splits["val"]:
        raise DataError(f"corpus of {len(docs)} documents is too small for a train/val split "
                        f"(tokenizer.val_fraction={tc.val_fraction})")
    workers = tc.num_workers or os.cpu_count() or 1
    t0 = time.perf_counter()
    with tqdm(total=len(docs), unit="doc", desc="tokenize", file=sys.stderr, mininterval=2.0) as bar:
        index = encode_splits(tok.to_str(), splits, out_dir / "shards", eos_id=eos_id, vocab_size=vocab_size,
                              shard_tokens=tc.shard_tokens, num_workers=workers, progress=bar.update)
    seconds = time.perf_counter() - t0
    tokens = {split: sum(s["tokens"] for s in shards) for split, shards in index["splits"].items()}
    total = sum(tokens.values())
    return {
        "vocab_size": vocab_size, "tokens": total, "bytes": n_bytes,
        "tokens_per_sec": round(total / seconds, 1), "bad_rows": corpus.bad_rows,
        "documents": len(docs), "train_tokens": tokens["train"], "val_tokens": tokens["val"],
        "tokenizer_sha256": hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest(),
    }


if __name__ == "__main__":
    sys.exit(main("tokenize", run))
