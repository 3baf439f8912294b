"""The Prefect flow: one task per stage, each starting the stage as a child process group.

The flow's parameter is the typed pipeline config, so the Prefect UI renders it as a form and a typo
in a form or a scheduled run's parameters fails the run before any stage starts. Reuse is decided
before a stage starts: a complete output with the stage's fingerprint (and intact files) is reused;
otherwise the stage runs, resuming from its own step checkpoints if it has any.
"""

import fcntl
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact
from prefect.artifacts import update_progress_artifact
from prefect.cache_policies import NO_CACHE

from pipeline.config import PipelineConfig, dump_config, load_config, pipeline_stages
from pipeline.entry import locate
from pipeline.errors import UserError
from pipeline.launch import run_streaming, stage_command, stage_env
from pipeline.report import write_report
from pipeline.store import RunRecord, now, read_manifest

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


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


def run_stage(cfg: PipelineConfig, stage: str, config_path: Path, record: RunRecord, log, on_progress=None) -> dict:
    """Reuse or compute one stage; return its manifest."""
    out_dir, fingerprint, _ = locate(cfg, stage)
    started = time.perf_counter()
    manifest = read_manifest(out_dir)
    if manifest is not None:
        log(f"{stage}: reused complete output {out_dir} (fingerprint {fingerprint[:16]})")
        record.update(stage, output=str(out_dir), action="reused", status="complete", started_at=now(),
                      finished_at=now(), seconds=round(time.perf_counter() - started, 2), metrics=manifest["metrics"])
        return manifest
    action = "resumed" if (out_dir / "checkpoints").is_dir() else "computed"
    record.update(stage, output=str(out_dir), action=action, status="running", started_at=now())
    log(f"{stage}: {'resuming' if action == 'resumed' else 'running'} -> {out_dir}")
    with stage_lock(out_dir):
        rc = run_streaming(stage_command(cfg, stage, config_path), log, env=stage_env(), on_progress=on_progress)
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
    progress = create_progress_artifact(progress=0.0, key=f"{stage}-progress",
                                        description=f"{stage}: share of training steps done")

    def on_progress(percent: float) -> None:
        update_progress_artifact(artifact_id=progress, progress=percent)

    manifest = run_stage(cfg, stage, Path(config_path), RunRecord(cfg), logger.info, on_progress)
    update_progress_artifact(artifact_id=progress, progress=100.0)
    out_dir = locate(cfg, stage)[0]
    create_table_artifact(key=f"{stage}-metrics", table=[{"metric": k, "value": v} for k, v in manifest["metrics"].items()],
                          description=f"{stage} final metrics; output: file://{out_dir.resolve()}")
    return manifest


def selected_stages(cfg: PipelineConfig, from_stage: str | None, only: str | None) -> list[str]:
    stages = pipeline_stages(cfg)
    for name in (from_stage, only):
        if name is not None and name not in stages:
            raise UserError(f"unknown or disabled stage {name!r}; stages of this pipeline: {', '.join(stages)}")
    if only:
        return [only]
    if from_stage:
        return stages[stages.index(from_stage):]
    return stages


@flow(name="gptforge-pipeline", log_prints=True)
def pipeline_flow(config: PipelineConfig = load_config(DEFAULT_CONFIG), from_stage: str | None = None,
                  only: str | None = None) -> dict:
    """Run the pipeline: each stage reused when complete, else computed (or resumed from its checkpoints).
    `from_stage` recomputes from that stage on; `only` runs one stage on existing inputs."""
    stages = selected_stages(config, from_stage, only)
    record = RunRecord(config)
    resolved = record.dir / "config.yaml"
    resolved.write_text(dump_config(config))
    run_task = stage_task.with_options(retries=config.run.retries, retry_delay_seconds=config.run.retry_delay)
    metrics = {}
    for stage in stages:
        if from_stage:
            _invalidate(config, stage)
        metrics[stage] = run_task(stage, str(resolved))["metrics"]
    _, markdown = write_report(record.dir)
    create_markdown_artifact(key="run-report", markdown=markdown, description=f"report of run {config.run.name}")
    return metrics


def _invalidate(cfg: PipelineConfig, stage: str) -> None:
    """`--from`: recompute this stage even if complete (its output is removed, checkpoints too)."""
    out_dir, _, _ = locate(cfg, stage)
    if out_dir.exists():
        shutil.rmtree(out_dir)
