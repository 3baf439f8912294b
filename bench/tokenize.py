"""Tokenize benchmark: the tokenize stage's encoder against what a user would otherwise write,
side by side on the same generated corpus and the same trained fast tokenizer.

    .venv/bin/python bench/tokenize.py [--mb 50] [--workers N]

ours:     data.shards.encode_splits (worker processes, flat uint16 shards, index.json)
baseline: datasets.Dataset.from_dict + .map(tokenizer, batched=True, num_proc=N) + save_to_disk
Both are timed end to end from the list of documents in memory to files on disk.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file's folder must not shadow the standard library's `tokenize`.
del sys.path[0]

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gptforge.data.demo import generate  # noqa: E402
from gptforge.data.shards import encode_splits  # noqa: E402
from gptforge.data.tokenizer import train_bpe  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def corpus(mb: float) -> list[str]:
    docs = generate(seed=0, pretrain_docs=10000).pretrain
    per_doc = sum(len(d.encode()) for d in docs) / len(docs)
    return generate(seed=0, pretrain_docs=int(mb * 1e6 / per_doc)).pretrain


def ours(tok, docs, workers, out: Path) -> int:
    index = encode_splits(tok.to_str(), {"train": docs}, out, eos_id=tok.token_to_id(SPECIALS[0]),
                          vocab_size=tok.get_vocab_size(), shard_tokens=100_000_000, num_workers=workers)
    return sum(s["tokens"] for s in index["splits"]["train"])


def baseline(tok, docs, workers, out: Path) -> int:
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0])
    eos = hf.eos_token_id

    def encode(batch):
        return {"input_ids": [ids + [eos] for ids in hf(batch["text"])["input_ids"]]}

    ds = datasets.Dataset.from_dict({"text": docs})
    ds = ds.map(encode, batched=True, num_proc=workers, remove_columns=["text"])
    ds.save_to_disk(str(out))
    return sum(len(x) for x in ds["input_ids"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=50.0, help="corpus size in MB")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    args = p.parse_args()
    docs = corpus(args.mb)
    n_bytes = sum(len(d.encode()) for d in docs)
    tok = train_bpe(docs[:50000], 512, 2, SPECIALS)
    print(f"corpus: {len(docs)} docs, {n_bytes / 1e6:.1f} MB; workers: {args.workers}")
    work = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    results = {}
    try:
        for name, fn in (("baseline", baseline), ("gptforge", ours)):
            t0 = time.perf_counter()
            tokens = fn(tok, docs, args.workers, work / name)
            seconds = time.perf_counter() - t0
            results[name] = tokens / seconds
            print(f"{name:9s} {tokens:>12,d} tokens in {seconds:6.2f}s  {tokens / seconds:>12,.0f} tokens/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"ratio gptforge/baseline: {results['gptforge'] / results['baseline']:.2f}x (target >= 1.5x)")


if __name__ == "__main__":
    main()
