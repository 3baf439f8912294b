"""Curate stage: the pretraining corpus deduplicated, filtered and decontaminated before tokenize, with datatrove's
blocks run by datatrove's Ray executor, on a local Ray instance on 127.0.0.1 or on `tokenizer.cluster`.

    gptforge stage curate -c configs/curated.yaml      (finds its output in the stage store)
    python -m gptforge.stages.curate --config CONFIG --out DIR

Its passes, each a datatrove pipeline over `curate.tasks` tasks (a task a share of the source's units):
1. filter: read the source as tokenize reads it (gptforge.data.curation.blocks.UnitReader), then the language filter
   (`curate.languages`), the quality filters (`curate.filters`: Gopher quality and repetition, C4, FineWeb),
   email and IP addresses replaced (`curate.pii`), documents holding an evaluation item removed (n-grams against
   gptforge.data.curation.decontamination's index); each task's survivors written, and their exact-dedup signatures;
2. exact duplicates found (one task), then removed as each task's survivors are read back, and MinHash
   signatures of the rest written (`curate.near_dedup`);
3. MinHash candidate pairs, a task a band; verified against the threshold
   (gptforge.data.curation.blocks.VerifiedPairs); clustered (one task);
4. each task's documents read back, near duplicates removed, written as `documents/<task>.jsonl.gz`.
Signatures, buckets and documents stay on disk between passes (memory flat in the corpus size), and datatrove
keeps each task's completion, so a killed stage resumes with its finished tasks kept.

Outputs: `documents/` (the shards tokenize streams: {"text", "id", "metadata"} rows), `removed/<reason>/` (every
removed document, by reason), `decontamination.json` (what was checked). Metrics: the funnel (`documents_in`,
`documents_kept`, `bytes_in`, `bytes_kept`, `removed/<reason>`) and `bad_rows`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from gptforge.core.config import PipelineConfig
from gptforge.core.errors import UserError
from gptforge.core.files import write_json_atomic
from gptforge.data import splits
from gptforge.data.corpus import Reading
from gptforge.data.curation.blocks import (SHARD, WORK_SHARD, Decontaminate, FullSignatures, LinguaFilter,
                                           LocalFastTextLID, RankShardReader, RowsReader, Tally, UnitReader,
                                           VerifiedPairs, quality_filter, text_of)
from gptforge.data.curation.decontamination import build_index, evaluation_items
from gptforge.data.parallel import ray_instance
from gptforge.data.sources import units
from gptforge.model.eval.harness import task_documents
from gptforge.stages.entry import exit_process, main

MAX_TASKS = 256  # datatrove tasks a pass, where curate.tasks is 0 (one a unit of the source)


def language_filter(cc, exclusion_writer):
    """lingua (offline), or datatrove's fastText filter over a local model file (curate.language_model)."""
    if cc.language_model == "lingua":
        return LinguaFilter(cc.languages, cc.language_threshold, exclusion_writer)
    from datatrove.pipeline.filters import LanguageFilter

    lid = LanguageFilter(languages=cc.languages, language_threshold=cc.language_threshold,
                         exclusion_writer=exclusion_writer)
    lid.model = LocalFastTextLID(cc.language_model, cc.languages)  # never downloaded
    return lid


def stat(step: dict, key: str) -> int:
    """A count of a step's merged datatrove stats (0 where it never counted it)."""
    value = step["stats"].get(key, 0)
    return int(value["total"] if isinstance(value, dict) else value)


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    from datatrove.executor.ray import RayPipelineExecutor

    cc, work = cfg.curate, out_dir / "work"
    workers = cfg.tokenizer.num_workers or os.cpu_count() or 1
    index = work / "decontamination"

    # What the pipeline evaluates on, indexed once (a resumed stage reuses the index it wrote)
    if cc.decontaminate.enabled:
        done = out_dir / "decontamination.json"
        if not done.is_file():
            items = {**evaluation_items(cfg), **task_documents(cfg.eval)}
            write_json_atomic(done, build_index(items, index, cc.decontaminate.ngram, cc.decontaminate.min_words))
        record = json.loads(done.read_text())
        print(f"[curate] decontaminating against {sum(r['indexed'] for r in record.values())} items of "
              f"{len(record)} sources: {', '.join(record)}", flush=True)

    # Each source's passes: data.pretrain's documents through every block, into documents/; the training rows of
    # data.sft and data.preference (their held-out rows settled first, and left as they are) through PII,
    # decontamination and dedup, into <source>/train.jsonl beside <source>/held_out.jsonl
    jobs, rows = [], {}
    if "pretrain" in cc.sources:
        plan = units(cfg.data.pretrain, demo_docs=cfg.data.demo.pretrain_docs)
        reader = UnitReader(plan, Reading(cfg.data.pretrain, cfg.data.text_field, cfg.data.demo), cfg.data.on_bad_row)
        jobs.append(("pretrain", passes(cfg, reader, cc.tasks or min(len(plan), MAX_TASKS), work, out_dir, index)))
    for which in (s for s in cc.sources if s != "pretrain"):
        rows[which] = splits.conversations(cfg.data) if which == "sft" else splits.preference_pairs(cfg.data)
        reader = RowsReader(rows[which].train, rows[which].bad_rows)
        jobs.append((which, passes(cfg, reader, cc.tasks or workers, work / which, out_dir / which, index)))

    with ray_instance(cfg.tokenizer.cluster, workers):
        for which, source_passes in jobs:
            for name, blocks, n, _ in source_passes:
                label = name if which == "pretrain" else f"{which} {name}"
                logs = work / "logs" / label.replace(" ", "-")
                run_pass(RayPipelineExecutor(blocks, tasks=n, logging_dir=str(logs)), label)
    metrics, shown = {}, {}
    for which, source_passes in jobs:
        prefix = "" if which == "pretrain" else f"{which}/"
        folder = out_dir if which == "pretrain" else out_dir / which
        m = funnel(source_passes, work / "logs", "" if which == "pretrain" else f"{which}-")
        metrics.update({prefix + k: v for k, v in m.items()})
        shown[which] = {reason.removeprefix("removed/"): removed_examples(folder / reason, cc.examples)
                        for reason in m if reason.startswith("removed/")}
        if which in rows:
            write_rows(folder, rows[which], cc.pii)
        print(f"[curate] {which}: kept {m['documents_kept']} of {m['documents_in']} "
              f"{'documents' if which == 'pretrain' else 'training rows'} ({m['bytes_kept']:,} of "
              f"{m['bytes_in']:,} bytes); removed " + ", ".join(f"{k.removeprefix('removed/')} {n}"
                                                                 for k, n in m.items() if k.startswith("removed/")),
              flush=True)
    write_json_atomic(out_dir / "funnel.json", {"metrics": metrics, "examples": shown})
    return metrics


def passes(cfg: PipelineConfig, reader, tasks: int, work: Path, out: Path, index: Path) -> list[tuple[str, list, int,
                                                                                                   dict]]:
    """The passes that curate one source: (name, its blocks, its tasks, {block index: the reason it removes for}).
    The language and quality filters apply to data.pretrain's documents (UnitReader) alone. Kept documents go to
    `out/documents/`, removed ones to `out/removed/<reason>/`."""
    from datatrove.pipeline.dedup import (ExactDedupFilter, ExactDedupSignature, ExactFindDedups, MinhashConfig,
                                          MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter)
    from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig
    from datatrove.pipeline.formatters import PIIFormatter
    from datatrove.pipeline.writers import JsonlWriter

    cc, documents = cfg.curate, isinstance(reader, UnitReader)

    def shards(folder: Path, between_passes: bool = False):  # a task's documents, one file a task
        name = WORK_SHARD if between_passes else SHARD
        return JsonlWriter(str(folder), output_filename=name.replace("{rank:05d}", "${rank}"),
                           compression=None if between_passes else "gzip")

    def removed(reason: str):
        return shards(out / "removed" / reason)

    out_list: list[tuple[str, list, int, dict[int, str]]] = []
    exact = ExactDedupConfig(content_getter=text_of) if cc.exact_dedup else None
    minhash = MinhashConfig(n_grams=cc.near_dedup.ngram, num_buckets=cc.near_dedup.bands,
                            hashes_per_bucket=cc.near_dedup.rows) if cc.near_dedup.enabled else None
    blocks, reasons = [reader, Tally("in")], {}
    if cc.languages and documents:
        reasons[len(blocks)] = "language"
        blocks.append(language_filter(cc, removed("language")))
    for name, args in cc.filters.items() if documents else ():
        reasons[len(blocks)] = name
        blocks.append(quality_filter(name, args, removed(name)))
    if cc.pii:
        blocks.append(PIIFormatter())
    if cc.decontaminate.enabled:
        reasons[len(blocks)] = "contaminated"
        blocks.append(Decontaminate(index, removed("contaminated")))
    last = "filtered"
    if exact or minhash:
        blocks.append(shards(work / "filtered", between_passes=True))
        if exact:
            blocks.append(ExactDedupSignature(str(work / "exact" / "signatures"), exact))
    else:
        blocks += [Tally("kept"), shards(out / "documents")]
    out_list.append(("filter", blocks, tasks, reasons))
    if exact:
        out_list.append(("exact-find", [ExactFindDedups(str(work / "exact" / "signatures"),
                                                        str(work / "exact" / "duplicates"), exact)], 1, {}))
        blocks = [RankShardReader(str(work / "filtered")),
                  ExactDedupFilter(str(work / "exact" / "duplicates"), exact, removed("exact_duplicate"))]
        blocks += ([shards(work / "deduped", between_passes=True)] if minhash
                   else [Tally("kept"), shards(out / "documents")])
        last = "deduped"
        out_list.append(("exact-filter", blocks, tasks, {1: "exact_duplicate"}))
    if minhash:
        sigs, hashes = work / "minhash" / "signatures", cc.near_dedup.bands * cc.near_dedup.rows
        out_list[-1][1].append(FullSignatures(sigs, minhash, work / "minhash" / "full"))  # as survivors are written
        out_list += [
            ("minhash-buckets", [MinhashDedupBuckets(str(sigs), str(work / "minhash" / "buckets"), config=minhash)],
             cc.near_dedup.bands, {}),
            ("minhash-verify", [VerifiedPairs(work / "minhash" / "full", work / "minhash" / "buckets",
                                              work / "minhash" / "verified", hashes, cc.near_dedup.threshold)],
             cc.near_dedup.bands, {}),
            ("minhash-cluster", [MinhashDedupCluster(str(work / "minhash" / "verified"),
                                                     str(work / "minhash" / "remove"), config=minhash)], 1, {}),
            ("minhash-filter", [RankShardReader(str(work / last)),
                                MinhashDedupFilter(str(work / "minhash" / "remove"), removed("near_duplicate")),
                                Tally("kept"), shards(out / "documents")], tasks, {1: "near_duplicate"}),
        ]
    return out_list


def write_rows(folder: Path, split, pii: bool) -> None:
    """A curated source's rows: `train.jsonl`, the training rows curate kept, in their order (emails and IP
    addresses replaced where curate.pii), and `held_out.jsonl`, the rows the source held out, as they were."""
    import gzip

    from datatrove.pipeline.formatters import PIIFormatter

    ids = sorted(int(json.loads(line)["id"]) for shard in (folder / "documents").glob("*.jsonl.gz")
                 for line in gzip.open(shard, "rt"))
    fmt = PIIFormatter().format if pii else None
    for name, rows in (("train.jsonl", [formatted(split.train[i], fmt) for i in ids]), ("held_out.jsonl", split.val)):
        tmp = folder / f"{name}.part"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        tmp.replace(folder / name)


def formatted(value, fmt):
    """A normalised row with `fmt` applied to each of its texts (message contents, responses), roles left."""
    if fmt is None:
        return value
    if isinstance(value, str):
        return fmt(value)
    if isinstance(value, list):
        return [formatted(v, fmt) for v in value]
    if isinstance(value, dict):
        return {k: v if k == "role" else formatted(v, fmt) for k, v in value.items()}
    return value


def run_task(executor, rank: int) -> None:
    """One datatrove task: datatrove's run of a rank (its log, stats and completion file), in a Ray worker. The base
    executor's: the Ray executor's logs each task to `<tmp>/ray_logs/logs/task_<rank>.log` first, one path for
    every pipeline on the machine, so that two stages' tasks of the same rank wrote into one file and one of them
    failed copying it back (a UnicodeDecodeError mid-character)."""
    from datatrove.executor.base import PipelineExecutor

    PipelineExecutor._run_for_rank(executor, rank, local_rank=1)  # local_rank 1: errors alone to stderr


def run_pass(executor, name: str) -> None:
    """Every unfinished task of a pass as a Ray task (a CPU each), then their stats merged into `stats.json`, as
    datatrove's RayPipelineExecutor does. Its `run` would run each task in a process pool that its Ray actor forks;
    forked from a process that holds Ray's threads, such a pool sometimes never ended here with every task done.
    A task that fails ends the stage with its own error line; a rerun runs only the unfinished tasks."""
    import ray
    from datatrove.utils.stats import PipelineStats

    t0 = time.perf_counter()
    ranks = executor.get_incomplete_ranks(range(executor.world_size))
    if ranks:
        executor.save_executor_as_json()
        task = ray.remote(num_cpus=1, max_retries=0)(run_task)
        shared = ray.put(executor)
        pending = {task.remote(shared, rank): rank for rank in ranks}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                rank = pending.pop(done[0])
                try:
                    ray.get(done[0])
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, UserError):
                        raise e.cause from None
                    print(str(e), file=sys.stderr, flush=True)  # the task's traceback, above the error line
                    raise UserError(f"curate: pass {name}, task {rank} failed: {last_error(e)}; its log: "
                                   f"{executor.logging_dir.path}/logs/task_{rank:05d}.log") from None
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
    total = PipelineStats()
    for rank in range(executor.world_size):
        with executor.logging_dir.open(f"stats/{rank:05d}.json", "r") as f:
            total += PipelineStats.from_json(json.load(f))
    with executor.logging_dir.open("stats.json", "wt") as f:
        total.save_to_disk(f)
    print(f"[curate] {name}: {executor.world_size} task(s) done in {time.perf_counter() - t0:.1f}s"
          + (f", {executor.world_size - len(ranks)} of them by an earlier run" if len(ranks) < executor.world_size
             else ""), flush=True)


def last_error(error: Exception) -> str:
    """The last line of a failed task's exception."""
    lines = [ln for ln in str(error).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(error).__name__


def funnel(passes, logs: Path, prefix: str) -> dict:
    """A source's funnel from each pass's merged stats (`logs/<prefix><pass>/stats.json`): documents and bytes in
    and kept, the documents each reason removed (`removed/<reason>`), the bad rows."""
    metrics: dict = {}
    counts = {}
    for name, blocks, _, reasons in passes:
        steps = json.loads((logs / f"{prefix}{name}" / "stats.json").read_text())
        for i, step in enumerate(steps):
            for label in ("in", "kept"):
                if isinstance(blocks[i], Tally) and blocks[i].label == label:
                    metrics[f"documents_{label}"] = stat(step, f"{label}_documents")
                    metrics[f"bytes_{label}"] = stat(step, f"{label}_bytes")
            if isinstance(blocks[i], (UnitReader, RowsReader)):
                metrics["bad_rows"] = stat(step, "bad_rows")
            if i in reasons:
                counts[reasons[i]] = counts.get(reasons[i], 0) + stat(step, "dropped")
    return {**metrics, **{f"removed/{reason}": n for reason, n in counts.items()}}


def removed_examples(folder: Path, n: int) -> list[dict]:
    """The first `n` documents removed for one reason: their id, the start of their text, and why where known."""
    import gzip

    out = []
    for shard in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(shard, "rt") as f:
            for line in f:
                if len(out) >= n:
                    return out
                row = json.loads(line)
                meta = row.get("metadata", {})
                why = {k: meta[k] for k in ("contaminated_ngram", "contaminated_task", "language", "filter_reason")
                       if k in meta}
                out.append({"id": row.get("id"), "text": row["text"][:300], **why})
    return out


if __name__ == "__main__":
    exit_process(main("curate", run))
