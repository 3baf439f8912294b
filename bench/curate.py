"""Curate benchmark: the curate stage against datatrove's own LocalPipelineExecutor running the same blocks (PII,
exact dedup, MinHash near-dedup) on the same generated JSONL corpus, each as its own process, in one run:

- documents/s and MB/s of each, and their ratio (the stage's layer: reading as tokenize reads, Ray tasks, the
  funnel, the verification of MinHash pairs against the threshold; target >= 1.0x);
- the stage's peak memory (PSS of its process tree, Ray's workers included) at the full size and at a tenth
  (target <= 1.2x: signatures and buckets stay on disk);
- near-duplicate recall and precision against the exact Jaccard similarity of the planted pairs (variants of 1%
  of the documents with about 1% of their words changed, Jaccard about 0.9, and of another 1% with about 15%
  changed, about 0.4, under the threshold; 1% exact copies besides). Targets: recall >= 0.9, precision >= 0.95.

    .venv/bin/python bench/curate.py [--gb 1.0] [--workers N] [--no-tenth]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from measure import measured  # bench/measure.py

from gptforge.core.config import dump_config, load_config
from gptforge.pipeline.store import locate, read_manifest

ROOT = Path(__file__).resolve().parents[1]
FILES = 8
THRESHOLD = 0.8
STOP = ["the", "of", "and", "to", "that", "with", "have", "be", "in", "for", "is", "on", "it", "as", "was"]
BASELINE = """
import sys, time
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.pipeline.formatters import PIIFormatter
from datatrove.pipeline.dedup import (ExactDedupFilter, ExactDedupSignature, ExactFindDedups, MinhashConfig,
                                      MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter,
                                      MinhashDedupSignature)
from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig

def text_of(doc) -> str:
    return doc.text

corpus, work, tasks, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
exact, minhash = ExactDedupConfig(content_getter=text_of), MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)
shard = "${rank}.jsonl.gz"
t0 = time.perf_counter()
for i, (pipeline, n) in enumerate([
    ([JsonlReader(corpus), PIIFormatter(), JsonlWriter(f"{work}/filtered", output_filename=shard),
      ExactDedupSignature(f"{work}/exact-sigs", exact)], tasks),
    ([ExactFindDedups(f"{work}/exact-sigs", f"{work}/exact-dups", exact)], 1),
    ([JsonlReader(f"{work}/filtered"), ExactDedupFilter(f"{work}/exact-dups", exact),
      JsonlWriter(f"{work}/deduped", output_filename=shard), MinhashDedupSignature(f"{work}/sigs", minhash)], tasks),
    ([MinhashDedupBuckets(f"{work}/sigs", f"{work}/buckets", config=minhash)], 14),
    ([MinhashDedupCluster(f"{work}/buckets", f"{work}/remove", config=minhash)], 1),
    ([JsonlReader(f"{work}/deduped"), MinhashDedupFilter(f"{work}/remove"),
      JsonlWriter(f"{work}/out", output_filename=shard)], tasks),
]):
    t1 = time.perf_counter()
    LocalPipelineExecutor(pipeline, tasks=n, workers=workers, logging_dir=f"{work}/logs/{i}").run()
    print(f"pass {i}: {time.perf_counter() - t1:.1f}s", file=sys.stderr)
print(time.perf_counter() - t0)
"""


def corpus(folder: Path, gb: float, seed: int = 0) -> tuple[list[tuple[str, str]], int]:
    """JSONL files of documents of about 1 KB of made-up words and stop words, `gb` GB in all, with planted exact
    copies and near-duplicate variants; returns the planted (original, variant) pairs and the documents written."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnoprstuvw"))
    vocab = np.array(["".join(w[:n]) for w, n in zip(rng.choice(letters, (30_000, 9)), rng.integers(3, 10, 30_000))]
                     + STOP * 400, dtype=object)
    pairs, written, files = [], 0, [folder / f"part-{k:02d}.jsonl" for k in range(FILES)]
    target = gb * 1e9 / FILES
    per_write = max(1, min(1000, int(target / 1200)))  # documents of about 1.2 KB, written a batch at a time
    for path in files:
        with open(path, "w") as f:
            while f.tell() < target:
                batch = []
                for _ in range(per_write):
                    words = vocab[rng.integers(0, len(vocab), 170)]
                    doc = " ".join(words)
                    batch.append(doc)
                    kind = rng.random()
                    if kind < 0.02:  # a variant: 1% of the words changed (Jaccard about 0.9) or 15% (about 0.4)
                        changed = words.copy()
                        at = rng.choice(len(words), max(1, int((0.01 if kind < 0.01 else 0.15) * len(words))),
                                        replace=False)
                        changed[at] = vocab[rng.integers(0, len(vocab), len(at))]
                        batch.append(" ".join(changed))
                        pairs.append((doc, batch[-1]))
                    elif kind < 0.03:
                        batch.append(doc)  # an exact copy
                f.writelines(json.dumps({"text": d}) + "\n" for d in batch)
                written += len(batch)
    return pairs, written


def jaccard(pairs: list[tuple[str, str]]) -> list[float]:
    """Exact Jaccard similarity of each pair's shingle sets, shingled as the stage's MinHash step shingles."""
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature

    sig = MinhashDedupSignature(tempfile.mkdtemp(), MinhashConfig(n_grams=5))
    out = []
    for a, b in pairs:
        x, y = set(sig.get_shingles(a).ravel().tolist()), set(sig.get_shingles(b).ravel().tolist())
        out.append(len(x & y) / len(x | y))
    return out


def stage(folder: Path, root: Path, workers: int) -> tuple[float, int, dict, Path]:
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        f"run.root={root}", f"data.pretrain={folder}/*.jsonl", f"tokenizer.num_workers={workers}",
        "curate.enabled=true", "curate.decontaminate.enabled=false", f"curate.near_dedup.threshold={THRESHOLD}",
        f"curate.tasks={FILES}"])
    root.mkdir(parents=True, exist_ok=True)
    (root / "pipeline.yaml").write_text(dump_config(cfg))
    seconds, peak, _ = measured([sys.executable, "-m", "gptforge.pipeline.cli", "stage", "curate", "-c",
                                 str(root / "pipeline.yaml")], cwd=root)
    out_dir = locate(cfg, "curate")[0]
    return seconds, peak, read_manifest(out_dir)["metrics"], out_dir


def removed_texts(folder: Path) -> set[str]:
    return {json.loads(line)["text"] for shard in folder.glob("*.jsonl.gz") for line in gzip.open(shard, "rt")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=1.0, help="corpus size in GB (the stage also runs on a tenth of it)")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--no-tenth", dest="tenth", action="store_false",
                   help="skip the run at a tenth of the corpus (and so the memory ratio): the suite's shrunk run, "
                        "whose corpus is too small for memory to tell anything")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-curate-"))
    try:
        t0 = time.perf_counter()
        pairs, n_docs = corpus(work / "corpus", args.gb)
        if args.tenth:
            corpus(work / "small", args.gb / 10, seed=1)
        size = sum(f.stat().st_size for f in (work / "corpus").iterdir())
        print(f"corpus: {FILES} JSONL files, {size / 1e9:.2f} GB, {n_docs:,} documents, {len(pairs):,} planted pairs "
              f"({time.perf_counter() - t0:.0f}s to write); {args.workers} workers")
        s_small, peak_small, _, _ = stage(work / "small", work / "run-small", args.workers) if args.tenth else \
            (None, None, None, None)
        s_ours, peak_ours, m, out_dir = stage(work / "corpus", work / "run", args.workers)
        s_base, peak_base, printed = measured([sys.executable, "-c", BASELINE, str(work / "corpus"),
                                               str(work / "baseline"), str(FILES), str(args.workers)])
        kept_base = sum(1 for shard in (work / "baseline" / "out").glob("*.gz") for _ in gzip.open(shard, "rt"))
        removed = removed_texts(out_dir / "removed" / "near_duplicate")
        similarity = jaccard(pairs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    truth = [pair for pair, j in zip(pairs, similarity) if j >= THRESHOLD]
    found = sum(1 for a, b in truth if a in removed or b in removed)
    members = {t for pair in truth for t in pair}
    recall, precision = found / max(len(truth), 1), sum(1 for t in removed if t in members) / max(len(removed), 1)
    docs, mb = m["documents_in"], m["bytes_in"] / 1e6
    print(f"gptforge  {docs:,} documents in {s_ours:7.1f}s: {docs / s_ours:,.0f} documents/s, {mb / s_ours:.2f} MB/s, "
          f"peak {peak_ours / 2**30:.2f} GiB; kept {m['documents_kept']:,} (exact {m['removed/exact_duplicate']:,}, "
          f"near {m['removed/near_duplicate']:,} removed)")
    print(f"baseline  {docs:,} documents in {s_base:7.1f}s: {docs / s_base:,.0f} documents/s, {mb / s_base:.2f} MB/s, "
          f"peak {peak_base / 2**30:.2f} GiB; kept {kept_base:,} (datatrove LocalPipelineExecutor, the same blocks)")
    if args.tenth:
        print(f"gptforge at a tenth of the corpus: {s_small:.1f}s, peak {peak_small / 2**30:.2f} GiB")
    print(f"near duplicates over Jaccard {THRESHOLD}: {len(truth):,} of {len(pairs):,} planted pairs; recall "
          f"{recall:.3f} (target >= 0.9), precision {precision:.3f} (target >= 0.95)")
    memory = f"; stage peak memory at full size / at a tenth: {peak_ours / peak_small:.2f}x (target <= 1.2x)" \
        if args.tenth else ""
    print(f"ratio gptforge/baseline documents/s: {s_base / s_ours:.2f}x (target >= 1.0x){memory}")


if __name__ == "__main__":
    main()
