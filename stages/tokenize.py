"""Tokenize stage: train (or load) a byte-level BPE tokenizer and encode the pretraining corpus into binary
token shards with a train/val split, streaming: nothing holds the corpus in memory.

    gptforge stage tokenize -c configs/tiny.yaml
    python -m gptforge.stages.tokenize --config configs/tiny.yaml --out DIR

The corpus is cut into units (a file, a byte range of a large text file, row ranges of columnar data; see
gptforge.data.sources), processed as Ray tasks on a local instance or on `tokenizer.cluster`
(gptforge.data.parallel) in two passes: a scan (documents, bad rows named by file and line, a bounded seeded
sample for BPE training: gptforge.data.corpus), then the encoding, unit by unit into shard files. A killed
stage resumes: the tokenizer and every finished unit are kept (`units/`), the rest rerun from scratch.

Outputs: `tokenizer/` (Hugging Face files with the chat template) and `shards/` (see gptforge.data.shards).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gptforge.core.config import PipelineConfig, tokenizer_source
from gptforge.core.errors import DataError
from gptforge.core.files import write_json_atomic
from gptforge.data.corpus import Encoding, Reading, Sample, Scan, encode_unit, scan_unit
from gptforge.data.parallel import engine
from gptforge.data.shards import dtype_for, entropy, write_index
from gptforge.data.sources import Unit, unit_bytes, units
from gptforge.data.tokenizer import load_pretrained, save_hf, train_bpe
from gptforge.model.pretrained import TOKENIZER_FILES, model_dir
from gptforge.stages.entry import exit_process, main

WARNINGS = 5  # bad rows named in the log (all are counted)
# The seed of the tokenizer's sample and of the train/val split. Not run.seed: tokenize is unseeded (its declaration),
# so one output serves every run.seed of a store (bench/demo_seeds.py); with run.seed the split was whichever seed
# tokenized first, and the same config's val_loss differed by 0.08 between two stores (bench/optimizers.py).
SEED = 0


def scan(cfg: PipelineConfig, plan: list[Unit], reading: Reading, run_units,
         done_dir: Path) -> tuple[list[Scan], Sample]:
    """The scan pass over every unit (kept in done_dir, so that a resumed stage skips it), and the corpus's BPE
    sample merged from the units' (empty when the tokenizer is pretrained or already trained).

    So that no task returns much more than its share of the sample, units keep only the documents whose key is
    below a fraction q of the key range, twice the sample's share of the corpus's known bytes; the merged sample
    is exact when it ends below q (it almost always does), and is scanned again with q doubled when not."""
    tc = cfg.tokenizer
    trained = (done_dir.parent / "tokenizer" / "tokenizer.json").is_file() or tokenizer_source(cfg)[0]
    budget = 0 if trained else tc.train_sample_bytes
    sizes = [unit_bytes(u) for u in plan]
    q = 1.0 if None in sizes or not budget else min(1.0, 2 * budget / max(sum(sizes), 1))
    while True:
        sample, scans = Sample(budget), [None] * len(plan)
        if trained:
            for i in range(len(plan)):
                record = done_dir / f"scan-{i:05d}.json"
                if record.is_file():
                    scans[i] = Scan(**json.loads(record.read_text()))
        todo = [i for i, s in enumerate(scans) if s is None]
        below = int(q * 2 ** 64) if q < 1 else 2 ** 64
        with tqdm(total=len(plan), initial=len(plan) - len(todo), unit="unit", desc="tokenize: scan",
                  file=sys.stderr, mininterval=2.0) as bar:
            for j, result in run_units(scan_unit, [plan[i] for i in todo], reading, budget, SEED, below):
                for k, text in result.sample:
                    sample.add(k, text)
                result.sample = []
                scans[todo[j]] = result
                write_json_atomic(done_dir / f"scan-{todo[j]:05d}.json", asdict(result))
                bar.update(1)
        if q == 1.0 or sample.cutoff <= below:
            return scans, sample
        q = min(1.0, 2 * q)


def report_bad_rows(cfg: PipelineConfig, plan: list[Unit], scans: list[Scan]) -> int:
    """Name the first bad rows by file and line (lines counted from each file's start), or fail on the first
    with data.on_bad_row=fail; return how many there were."""
    before: dict[str, int] = {}  # lines of each file in the units before
    named = 0
    for unit, s in zip(plan, scans):
        offset = before.get(unit.path, 0) if unit.kind == "text" else 0
        for line, reason in s.bad:
            where = f"{unit.path}:{line + offset}"
            if cfg.data.on_bad_row == "fail":
                raise DataError(f"{where}: bad text row: {reason} (data.on_bad_row=fail)")
            if named < WARNINGS:
                print(f"warning: {where}: skipped bad text row: {reason}", file=sys.stderr, flush=True)
                named += 1
        before[unit.path] = offset + s.lines
    bad = sum(s.bad_rows for s in scans)
    if bad > WARNINGS:
        print(f"warning: skipped {bad} bad text rows in all", file=sys.stderr, flush=True)
    return bad


def tokenizer(cfg: PipelineConfig, sample: Sample, tok_dir: Path):
    """Train the BPE on the sample (kept in tok_dir: a resumed stage loads it), or load the pretrained one."""
    tc = cfg.tokenizer
    name, revision = tokenizer_source(cfg)  # tokenizer.pretrained, else model.pretrained's own
    if name:
        key = "tokenizer.pretrained" if tc.pretrained else "model.pretrained"
        return load_pretrained(str(model_dir(name, revision, key, TOKENIZER_FILES)), tok_dir)  # not its weights
    if not (tok_dir / "tokenizer.json").is_file():
        t0 = time.perf_counter()
        texts = sample.texts()
        tok = train_bpe(texts, tc.vocab_size, tc.min_frequency, tc.special_tokens)
        tmp = tok_dir.with_name(".tokenizer.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf(tok, tmp, tc.special_tokens)
        os.replace(tmp, tok_dir)  # whole or absent
        print(f"[tokenize] trained BPE on a sample of {len(texts)} documents ({sample.size:,} bytes), vocab "
              f"{tok.get_vocab_size()} in {time.perf_counter() - t0:.1f}s", flush=True)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    return tok, tok.token_to_id(tc.special_tokens[0])


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    tc = cfg.tokenizer
    shard_dir, tok_dir = out_dir / "shards", out_dir / "tokenizer"
    done_dir = shard_dir / "units"
    done_dir.mkdir(parents=True, exist_ok=True)
    (shard_dir / "index.json").unlink(missing_ok=True)  # written last
    reading = Reading(cfg.data.pretrain, cfg.data.text_field, cfg.data.demo)
    plan = units(cfg.data.pretrain, demo_docs=cfg.data.demo.pretrain_docs)
    workers = tc.num_workers or os.cpu_count() or 1
    try:
        with engine(tc.cluster, workers, len(plan)) as run_units:
            scans, sample = scan(cfg, plan, reading, run_units, done_dir)
            bad_rows = report_bad_rows(cfg, plan, scans)
            documents, n_bytes = sum(s.documents for s in scans), sum(s.bytes for s in scans)
            if not documents:
                raise DataError(f"no usable text rows in {cfg.data.pretrain.path} ({bad_rows} bad rows skipped)")
            print(f"[tokenize] {documents} documents, {n_bytes:,} bytes in {len(plan)} units, {bad_rows} bad rows "
                  f"skipped", flush=True)
            tok, eos_id = tokenizer(cfg, sample, tok_dir)
            vocab_size = tok.get_vocab_size()
            encoding = Encoding(tok.to_str(), eos_id, vocab_size, np.dtype(dtype_for(vocab_size)).name, tc.shard_tokens,
                                tc.val_fraction, SEED, tc.word_cache)
            results, fresh, seconds = encode(plan, reading, encoding, run_units, shard_dir)
    except BaseException:  # a task stopped mid-unit (another failed, or we were cancelled) left its temporary files
        for tmp in shard_dir.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        raise

    ordered = [results[i] for i in range(len(plan))]
    splits = {s: [f for r in ordered for f in r["shards"][s]] for s in ("train", "val")}
    tokens = {s: sum(f["tokens"] for f in files) for s, files in splits.items()}
    if not tokens["train"] or not tokens["val"]:
        raise DataError(f"the corpus ({documents} documents) leaves the {'val' if tokens['train'] else 'train'} split "
                        f"empty at tokenizer.val_fraction={tc.val_fraction}; give more data or change it")
    counts = sum(np.load(done_dir / f"{i:05d}.npy") for i in range(len(plan)))
    index = {"dtype": encoding.dtype, "vocab_size": vocab_size, "eos_id": eos_id,
             "max_token_id": max(r["max_id"] for r in ordered), "unigram_entropy": entropy(counts), "splits": splits}
    write_index(shard_dir, index)
    return {
        "vocab_size": vocab_size, "tokens": tokens["train"] + tokens["val"], "bytes": n_bytes,
        "tokens_per_sec": round(fresh / seconds, 1) if fresh else None,
        "bad_rows": bad_rows, "documents": documents, "train_tokens": tokens["train"], "val_tokens": tokens["val"],
        "unigram_entropy": round(index["unigram_entropy"], 6),
        "tokenizer_sha256": hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest(),
    }


def encode(plan: list[Unit], reading: Reading, encoding: Encoding, run_units,
           shard_dir: Path) -> tuple[dict[int, dict], int, float]:
    """The encode pass over the units a killed run did not finish: every unit's record, and the tokens this run
    encoded and its seconds."""
    done_dir = shard_dir / "units"
    results, t0 = encoded(plan, done_dir), time.perf_counter()
    todo = [i for i in range(len(plan)) if i not in results]
    with tqdm(total=len(plan), initial=len(results), unit="unit", desc="tokenize: encode", file=sys.stderr,
              mininterval=2.0) as bar:
        for _, result in run_units(encode_unit, [(i, plan[i]) for i in todo], reading, encoding, shard_dir):
            np.save(done_dir / f"{result['unit']:05d}.npy", result.pop("counts"))
            write_json_atomic(done_dir / f"{result['unit']:05d}.json", result)
            results[result["unit"]] = result
            bar.update(1)
    fresh = sum(f["tokens"] for i in todo for files in results[i]["shards"].values() for f in files)
    return results, fresh, time.perf_counter() - t0


def encoded(plan: list[Unit], done_dir: Path) -> dict[int, dict]:
    """The units a killed run finished: their record and counts, and every file they name, whole."""
    out = {}
    for i in range(len(plan)):
        record, counts = done_dir / f"{i:05d}.json", done_dir / f"{i:05d}.npy"
        if record.is_file() and counts.is_file():
            result = json.loads(record.read_text())
            files = [f for split in result["shards"].values() for f in split]
            if all((done_dir.parent / f["file"]).is_file() for f in files):
                out[i] = result
    return out


if __name__ == "__main__":
    exit_process(main("tokenize", run))
