"""Tokenize benchmark, end to end from files on disk: the tokenize stage (reading, normalising, the BPE sample and
training, encoding, writing shards) against what a user would write instead with `datasets`:
`load_dataset("json", ...)` + `.map(tokenizer, batched=True, num_proc=cores)` + `save_to_disk`, given the
tokenizer the stage trained. Both run as their own processes on the same generated JSONL corpus; the figures are
tokens/s of each, their ratio, and each side's peak memory (proportional set size of the whole process tree,
Ray's processes and `datasets`' workers included), at the full size and, for the stage, at a tenth of it.

    .venv/bin/python bench/tokenize_bench.py [--gb 1.0] [--workers N] [--text demo|zipf]
"""

from __future__ import annotations

import sys

from measure import measured  # bench/measure.py

# This file's folder must not shadow the standard library's `tokenize`.
del sys.path[0]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


from gptforge.core.config import dump_config, load_config  # noqa: E402
from gptforge.data.demo import generate  # noqa: E402
from gptforge.pipeline.store import locate, read_manifest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FILES = 8
ZIPF_WORDS = 500_000
BASELINE = """
import sys, datasets
from transformers import AutoTokenizer
files, tok_dir, out, workers = sys.argv[1].split(","), sys.argv[2], sys.argv[3], int(sys.argv[4])
datasets.disable_progress_bars()
tok = AutoTokenizer.from_pretrained(tok_dir)
eos = tok.eos_token_id
def encode(batch):
    return {"input_ids": [ids + [eos] for ids in tok(batch["text"], add_special_tokens=False)["input_ids"]]}
import time
t0 = time.perf_counter()
ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=out + "-cache")
ds = ds.map(encode, batched=True, num_proc=workers, remove_columns=ds.column_names)
ds.save_to_disk(out, num_proc=workers)
seconds = time.perf_counter() - t0  # what follows counts the tokens, not part of the user's work
lengths = ds.map(lambda b: {"n": [len(x) for x in b["input_ids"]]}, batched=True, num_proc=workers)
print(sum(lengths["n"]), seconds)
"""


def corpus(folder: Path, gb: float) -> list[Path]:
    """JSONL files of documents of 1-3 KB made of the demo's sentences, `gb` GB in all."""
    folder.mkdir(parents=True, exist_ok=True)
    sentences = generate(seed=0, pretrain_docs=50000).pretrain
    rng = random.Random(0)
    files, target = [folder / f"part-{k:02d}.jsonl" for k in range(FILES)], gb * 1e9 / FILES
    for path in files:
        with open(path, "w") as f:
            while f.tell() < target:
                doc = " ".join(rng.choice(sentences).replace("\n", " ") for _ in range(rng.randint(40, 120)))
                f.write(json.dumps({"text": doc}) + "\n")
    return files


def zipf_corpus(folder: Path, gb: float) -> list[Path]:
    """JSONL files of documents of 1-3 KB whose words follow Zipf's law (exponent 1.1) over a vocabulary of 500,000
    made-up words with English letter frequencies, some followed by a comma or a full stop: the long tail of
    distinct words that natural text has and the demo's sentences (about a thousand distinct words) lack."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    freq = np.array([12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2, 2.0, 2.0, 1.9,
                     1.5, 1.0, 0.8, 0.15, 0.15, 0.1, 0.07])
    draws = rng.choice(letters, (ZIPF_WORDS, 11), p=freq / freq.sum())
    vocab = np.array(["".join(w[:n]) for w, n in zip(draws, rng.integers(1, 12, ZIPF_WORDS))], dtype=object)
    vocab = vocab + rng.choice(np.array(["", "", "", "", "", "", ",", "."], dtype=object), ZIPF_WORDS)
    files, target = [folder / f"part-{k:02d}.jsonl" for k in range(FILES)], gb * 1e9 / FILES
    for path in files:
        with open(path, "w") as f:
            while f.tell() < target:
                ranks = rng.zipf(1.1, 400_000)
                words = vocab[ranks[ranks <= ZIPF_WORDS] - 1]
                cuts = np.cumsum(rng.integers(200, 600, len(words) // 200))
                docs = np.split(words, cuts[cuts < len(words)])
                f.writelines(json.dumps({"text": " ".join(doc)}) + "\n" for doc in docs)
    return files


def startup(out_dir: Path) -> float:
    """The baseline's process start-up (imports), timed as the stage's is: a process that only imports."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import datasets, transformers"], check=True)
    return time.perf_counter() - t0


def stage(files: list[Path], root: Path, workers: int) -> tuple[float, int, dict, Path]:
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"run.root={root}", f"data.pretrain={files[0].parent}/*.jsonl",
                                                       f"tokenizer.num_workers={workers}"])
    path = root / "pipeline.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_config(cfg))
    seconds, peak, _ = measured([sys.executable, "-m", "gptforge.pipeline.cli", "stage", "tokenize", "-c", str(path)],
                                cwd=root)
    out_dir = locate(cfg, "tokenize")[0]
    return seconds, peak, read_manifest(out_dir)["metrics"], out_dir


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=1.0, help="corpus size in GB (the stage also runs on a tenth of it)")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--text", choices=["demo", "zipf"], default="demo",
                   help="the demo's sentences (about a thousand distinct words), or Zipf-distributed words")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    try:
        make = corpus if args.text == "demo" else zipf_corpus
        files = make(work / "corpus", args.gb)
        small = make(work / "small", args.gb / 10)
        size = sum(f.stat().st_size for f in files)
        print(f"corpus: {len(files)} JSONL files of {args.text} text, {size / 1e9:.2f} GB; {args.workers} workers")
        s_small, peak_small, m_small, _ = stage(small, work / "run-small", args.workers)
        s_ours, peak_ours, m, out_dir = stage(files, work / "run", args.workers)
        _, peak_base, printed = measured([sys.executable, "-c", BASELINE, ",".join(map(str, files)),
                                          str(out_dir / "tokenizer"), str(work / "baseline"), str(args.workers)])
        tokens_base, s_base = printed.strip().splitlines()[-1].split()
        tokens_base, s_base = int(tokens_base), float(s_base) + startup(out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ours, base = m["tokens"] / s_ours, tokens_base / s_base
    gib = 2 ** 30
    print(f"gptforge  {m['tokens']:>13,d} tokens in {s_ours:7.1f}s {ours:>11,.0f} tokens/s  peak "
          f"{peak_ours / gib:.2f} GiB ({m['bytes'] / 1e9:.2f} GB of text, {m['documents']:,} documents)")
    print(f"baseline  {tokens_base:>13,d} tokens in {s_base:7.1f}s {base:>11,.0f} tokens/s  peak "
          f"{peak_base / gib:.2f} GiB (datasets load_dataset + map + save_to_disk)")
    print(f"gptforge at a tenth of the corpus: {m_small['tokens']:,} tokens in {s_small:.1f}s, peak "
          f"{peak_small / 2**30:.2f} GiB")
    print(f"ratio gptforge/baseline tokens/s: {ours / base:.2f}x (target >= 1.5x); stage peak memory at full size / at "
          f"a tenth: {peak_ours / peak_small:.2f}x (target <= 1.2x, and under 2 GiB)")


if __name__ == "__main__":
    main()
