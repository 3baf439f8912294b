"""Curate stage: the pretraining corpus deduplicated, filtered and decontaminated before tokenize, with datatrove's
blocks run by datatrove's Ray executor, on a local Ray instance on 127.0.0.1 or on `tokenizer.cluster`.

    gptforge stage curate -c configs/curated.yaml      (finds its output in the stage store)
    python -m gptforge.stages.curate --config CONFIG --out DIR

Its passes, each a datatrove pipeline over `curate.tasks` tasks (a task a share of the source's units):
1. filter: read the source as tokenize reads it (gptforge.data.curation.UnitReader), then the language filter
   (`curate.languages`), the quality filters (`curate.filters`: Gopher quality and repetition, C4, FineWeb),
   email and IP addresses replaced (`curate.pii`), documents holding an evaluation item removed (n-grams against
   gptforge.data.decontamination's index); each task's survivors written, and their exact-dedup signatures;
2. exact duplicates found (one task), then removed as each task's survivors are read back, and MinHash
   signatures of the rest written (`curate.near_dedup`);
3. MinHash candidate pairs, a task a band; verified against the threshold (gptforge.data.curation.VerifiedPairs);
   clustered (one task);
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
from pathlib import Path

from gptforge.core.config import PipelineConfig
from gptforge.core.errors import UserError
from gptforge.core.files import write_json_atomic
from gptforge.data.corpus import Reading
from gptforge.data.curation import (SHARD, Decontaminate, FullSignatures, LinguaFilter, LocalFastTextLID,
                                    RankShardReader, Tally, UnitReader, VerifiedPairs, quality_filter, text_of)
from gptforge.data.decontamination import build_index, evaluation_items
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
    from datatrove.pipeline.dedup import (ExactDedupFilter, ExactDedupSignature, ExactFindDedups, MinhashConfig,
                                          MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter)
    from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig
    from datatrove.pipeline.formatters import PIIFormatter
    from datatrove.pipeline.writers import JsonlWriter

    cc, work = cfg.curate, out_dir / "work"
    plan = units(cfg.data.pretrain, demo_docs=cfg.data.demo.pretrain_docs)
    tasks = cc.tasks or min(len(plan), MAX_TASKS)
    workers = cfg.tokenizer.num_workers or os.cpu_count() or 1

    def shards(folder: Path):  # a task's documents, one file a task
        return JsonlWriter(str(folder), output_filename=SHARD.replace("{rank:05d}", "${rank}"))

    def removed(reason: str):
        return shards(out_dir / "removed" / reason)

    # What the pipeline evaluates on, indexed once (a resumed stage reuses the index it wrote)
    record = {}
    if cc.decontaminate.enabled:
        index = work / "decontamination"
        done = out_dir / "decontamination.json"
        if not done.is_file():
            items = {**evaluation_items(cfg), **task_documents(cfg.eval)}
            write_json_atomic(done, build_index(items, index, cc.decontaminate.ngram, cc.decontaminate.min_words))
        record = json.loads(done.read_text())
        print(f"[curate] decontaminating against {sum(r['indexed'] for r in record.values())} items of "
              f"{len(record)} sources: {', '.join(record)}", flush=True)

    # (pass name, its blocks, its tasks; the reason each filter's drops count under)
    passes: list[tuple[str, list, int, dict[int, str]]] = []
    exact = ExactDedupConfig(content_getter=text_of) if cc.exact_dedup else None
    minhash = MinhashConfig(n_grams=cc.near_dedup.ngram, num_buckets=cc.near_dedup.bands,
                            hashes_per_bucket=cc.near_dedup.rows) if cc.near_dedup.enabled else None
    reading = Reading(cfg.data.pretrain, cfg.data.text_field, cfg.data.demo)
    blocks, reasons = [UnitReader(plan, reading, cfg.data.on_bad_row), Tally("in")], {}
    if cc.languages:
        reasons[len(blocks)] = "language"
        blocks.append(language_filter(cc, removed("language")))
    for name, args in cc.filters.items():
        reasons[len(blocks)] = name
        blocks.append(quality_filter(name, args, removed(name)))
    if cc.pii:
        blocks.append(PIIFormatter())
    if cc.decontaminate.enabled:
        reasons[len(blocks)] = "contaminated"
        blocks.append(Decontaminate(work / "decontamination", removed("contaminated")))
    last = "filtered"
    if exact or minhash:
        blocks.append(shards(work / "filtered"))
        if exact:
            blocks.append(ExactDedupSignature(str(work / "exact" / "signatures"), exact))
    else:
        blocks += [Tally("kept"), shards(out_dir / "documents")]
    passes.append(("filter", blocks, tasks, reasons))
    if exact:
        passes.append(("exact-find", [ExactFindDedups(str(work / "exact" / "signatures"),
                                                      str(work / "exact" / "duplicates"), exact)], 1, {}))
        blocks = [RankShardReader(str(work / "filtered")),
                  ExactDedupFilter(str(work / "exact" / "duplicates"), exact, removed("exact_duplicate"))]
        blocks += [shards(work / "deduped")] if minhash else [Tally("kept"), shards(out_dir / "documents")]
        last = "deduped"
        passes.append(("exact-filter", blocks, tasks, {1: "exact_duplicate"}))
    if minhash:
        sigs, hashes = work / "minhash" / "signatures", cc.near_dedup.bands * cc.near_dedup.rows
        passes[-1][1].append(FullSignatures(sigs, minhash, work / "minhash" / "full"))  # as the survivors are written
        passes += [
            ("minhash-buckets", [MinhashDedupBuckets(str(sigs), str(work / "minhash" / "buckets"), config=minhash)],
             cc.near_dedup.bands, {}),
            ("minhash-verify", [VerifiedPairs(work / "minhash" / "full", work / "minhash" / "buckets",
                                              work / "minhash" / "verified", hashes, cc.near_dedup.threshold)],
             cc.near_dedup.bands, {}),
            ("minhash-cluster", [MinhashDedupCluster(str(work / "minhash" / "verified"),
                                                     str(work / "minhash" / "remove"), config=minhash)], 1, {}),
            ("minhash-filter", [RankShardReader(str(work / last)),
                                MinhashDedupFilter(str(work / "minhash" / "remove"), removed("near_duplicate")),
                                Tally("kept"), shards(out_dir / "documents")], tasks, {1: "near_duplicate"}),
        ]

    with ray_instance(cfg.tokenizer.cluster, workers):
        for name, blocks, n, _ in passes:
            run_pass(RayPipelineExecutor(blocks, tasks=n, logging_dir=str(work / "logs" / name)), name)
    return funnel(passes, work / "logs", out_dir, cc.examples)


def run_task(executor, rank: int) -> None:
    """One datatrove task: the executor's own run of a rank (its log, stats and completion file), in a Ray worker."""
    executor._run_for_rank(rank, local_rank=1)  # local_rank 1: the task's log to its file, errors alone to stderr


def run_pass(executor, name: str) -> None:
    """Every unfinished task of a pass as a Ray task (a CPU each), then their stats merged into `stats.json`, as
    datatrove's RayPipelineExecutor does. Its `run` would run each task in a process pool that its Ray actor forks;
    forked from a process that holds Ray's threads, such a pool sometimes never ended here with every task done.
    A task that fails ends the stage with its own error line; a rerun runs only the unfinished tasks."""
    import ray
    from datatrove.utils.stats import PipelineStats

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
                    cause = e.cause if isinstance(e.cause, UserError) else None
                    raise cause or UserError(f"curate: pass {name}, task {rank} failed: {last_error(e)}; its log: "
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
    print(f"[curate] {name}: {executor.world_size} task(s) done" + (f", {executor.world_size - len(ranks)} of them "
          "by an earlier run" if len(ranks) < executor.world_size else ""), flush=True)


def last_error(error: Exception) -> str:
    """The last line of a failed task's exception."""
    lines = [ln for ln in str(error).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(error).__name__


def funnel(passes, logs: Path, out_dir: Path, examples: int) -> dict:
    """The stage's metrics from each pass's merged stats: documents and bytes in and kept, the documents each
    reason removed, the bad rows; and `funnel.json` with a few removed documents for each reason."""
    metrics: dict = {}
    counts = {}
    for name, blocks, _, reasons in passes:
        steps = json.loads((logs / name / "stats.json").read_text())
        for i, step in enumerate(steps):
            for label in ("in", "kept"):
                if isinstance(blocks[i], Tally) and blocks[i].label == label:
                    metrics[f"documents_{label}"] = stat(step, f"{label}_documents")
                    metrics[f"bytes_{label}"] = stat(step, f"{label}_bytes")
            if isinstance(blocks[i], UnitReader):
                metrics["bad_rows"] = stat(step, "bad_rows")
            if i in reasons:
                counts[reasons[i]] = counts.get(reasons[i], 0) + stat(step, "dropped")
    metrics.update({f"removed/{reason}": n for reason, n in counts.items()})
    shown = {reason: removed_examples(out_dir / "removed" / reason, examples) for reason in counts}
    write_json_atomic(out_dir / "funnel.json", {"metrics": metrics, "examples": shown})
    print(f"[curate] kept {metrics['documents_kept']} of {metrics['documents_in']} documents "
          f"({metrics['bytes_kept']:,} of {metrics['bytes_in']:,} bytes); removed "
          + ", ".join(f"{r} {n}" for r, n in counts.items()), flush=True)
    return metrics


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
