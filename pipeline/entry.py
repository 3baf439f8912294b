"""What every stage module's `__main__` runs: load the config, find the stage's output and inputs in
the store, reuse a complete output, else run the stage and write its manifest last (rank 0).

    python -m stages.tokenize --config configs/tiny.yaml [--set tokenizer.vocab_size=1024]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from pipeline.config import PipelineConfig, load_config
from pipeline.errors import InputError, UserError
from pipeline.store import (MANIFEST, UPSTREAM, fingerprints, hash_outputs, now, read_manifest, stage_dir,
                            versions, write_json_atomic)

RunFn = Callable[[PipelineConfig, dict[str, Path], Path], dict]


def lineage(stage: str) -> list[str]:
    """The stage and everything upstream of it, upstream first."""
    order: list[str] = []
    for up in UPSTREAM[stage]:
        order += [s for s in lineage(up) if s not in order]
    return order + [stage]


def locate(cfg: PipelineConfig, stage: str) -> tuple[Path, str, dict[str, tuple[Path, str]]]:
    """(output dir, fingerprint, {input stage: (dir, fingerprint)}) of a stage under this config."""
    fps = fingerprints(cfg, lineage(stage))
    inputs = {up: (stage_dir(cfg, up, fps[up]), fps[up]) for up in UPSTREAM[stage]}
    return stage_dir(cfg, stage, fps[stage]), fps[stage], inputs


def execute(cfg: PipelineConfig, stage: str, run: RunFn, outputs: dict[str, str]) -> dict:
    """Run one stage in this process (one rank of it under a launcher); return its manifest."""
    out_dir, fingerprint, inputs = locate(cfg, stage)
    rank = int(os.environ.get("RANK", "0"))
    manifest = read_manifest(out_dir)
    if manifest is not None:
        print(f"[{stage}] reusing complete output {out_dir}", flush=True)
        return manifest
    for up, (up_dir, _) in inputs.items():
        if read_manifest(up_dir) is None:
            raise InputError(f"stage {stage} needs a complete {up} output at {up_dir}; "
                             f"run `gptforge run --only {up}` (or the whole pipeline) first")
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / MANIFEST).unlink(missing_ok=True)  # a stale or corrupted output is recomputed
    started = now()
    metrics = run(cfg, {up: d for up, (d, _) in inputs.items()}, out_dir)
    manifest = {
        "stage": stage, "fingerprint": fingerprint, "status": "complete",
        "config": cfg.model_dump(mode="json"),
        "inputs": {up: {"path": str(d), "fingerprint": fp} for up, (d, fp) in inputs.items()},
        "outputs": outputs, "metrics": metrics, "files": hash_outputs(out_dir, outputs),
        "started_at": started, "finished_at": now(),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")), "versions": versions(),
    }
    if rank == 0:
        write_json_atomic(out_dir / MANIFEST, manifest)
        print(f"[{stage}] complete: {out_dir}", flush=True)
    return manifest


def stage_main(stage: str, run: RunFn, outputs: dict[str, str], argv: list[str] | None = None) -> int:
    """Command-line entry of a stage module."""
    parser = argparse.ArgumentParser(prog=f"python -m stages.{stage}")
    parser.add_argument("--config", "-c", required=True, help="pipeline YAML")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    # Launchers may append --local_rank; the rank is read from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        execute(load_config(args.config, args.set), stage, run, outputs)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0
