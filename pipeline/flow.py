"""The Prefect flow: one task per stage, each starting the stage as a child process group.

Reuse is decided here before anything starts: a stage whose fingerprint has a complete output in the
store is reused; otherwise it is run (and resumes from its own step checkpoints if it has any).
"""

from __future__ import annotations

import fcntl
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pipeline.config import PipelineConfig, dump_config, load_config, pipeline_stages
from pipeline.entry import locate
from pipeline.errors import UserError
from pipeline.launch import run_streaming, stage_command, stage_env
from pipeline.store import RunRecord, now, read_manifest

# Stages implemented so far, in pipeline order.
IMPLEMENTED = ("tokenize", "pretrain")


class StageFailed(UserError):
    """A stage process exited non-zero; its output stays incomplete and is never consumed."""


@contextmanager
def stage_lock(out_dir: Path):
    """Exclusive lock on a stage output, so two runs never write it at once (the second fails)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(out_dir.name + ".lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another run is writing {out_dir}; wait for it to finish") from None
        yield


def run_stage(cfg: PipelineConfig, stage: str, config_path: Path, record: RunRecord, log) -> dict:
    """Reuse or compute one stage; return its manifest."""
    out_dir, fingerprint, _ = locate(cfg, stage)
    started = time.perf_counter()
    manifest = read_manifest(out_dir)
    if manifest is not None:
        log(f"{stage}: reused complete output {out_dir} (fingerprint {fingerprint[:16]})")
        record.update(stage, output=str(out_dir), action="reused", status="complete",
                      started_at=now(), finished_at=now(), metrics=manifest["metrics"])
        return manifest
    action = "resumed" if (out_dir / "checkpoints").is_dir() else "computed"
    record.update(stage, output=str(out_dir), action=action, status="running", started_at=now())
    cmd = stage_command(cfg, stage, config_path)
    log(f"{stage}: {'resuming' if action == 'resumed' else 'running'} -> {out_dir}")
    with stage_lock(out_dir):
        rc = run_streaming(cmd, log, env=stage_env())
    manifest = read_manifest(out_dir)
    if rc != 0 or manifest is None:
        record.update(stage, status="failed", finished_at=now())
        raise StageFailed(f"stage {stage} failed (exit code {rc}); its output {out_dir} is left incomplete")
    record.update(stage, status="complete", finished_at=now(), metrics=manifest["metrics"],
                  seconds=round(time.perf_counter() - started, 2))
    return manifest


@task(task_run_name="{stage}", cache_policy=NO_CACHE)
def stage_task(stage: str, config_path: str) -> dict:
    cfg = load_config(config_path)
    logger = get_run_logger()
    return run_stage(cfg, stage, Path(config_path), RunRecord(cfg), logger.info)


def selected_stages(cfg: PipelineConfig, from_stage: str | None, only: str | None) -> list[str]:
    stages = [s for s in pipeline_stages(cfg) if s in IMPLEMENTED]
    for name in (from_stage, only):
        if name is not None and name not in stages:
            raise UserError(f"unknown or disabled stage {name!r}; stages of this pipeline: {', '.join(stages)}")
    if only:
        return [only]
    if from_stage:
        return stages[stages.index(from_stage):]
    return stages


@flow(name="gptforge-pipeline", log_prints=True)
def pipeline_flow(config_path: str = "configs/tiny.yaml", overrides: list[str] | None = None,
                  from_stage: str | None = None, only: str | None = None) -> dict:
    """Run the pipeline: each stage reused when complete, else computed (or resumed)."""
    cfg = load_config(config_path, overrides or [])
    record = RunRecord(cfg)
    resolved = record.dir / "config.yaml"
    resolved.write_text(dump_config(cfg))
    manifests = {}
    for stage in selected_stages(cfg, from_stage, only):
        if from_stage:
            _invalidate(cfg, stage)
        manifests[stage] = stage_task(stage, str(resolved))
    return {stage: m["metrics"] for stage, m in manifests.items()}


def _invalidate(cfg: PipelineConfig, stage: str) -> None:
    """`--from`: recompute this stage even if complete (its output is removed, checkpoints too)."""
    out_dir, _, _ = locate(cfg, stage)
    if out_dir.exists():
        shutil.rmtree(out_dir)
