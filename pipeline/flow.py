"""The Prefect flows: the pipeline, one task per step, each started once its inputs are complete; and the stage
flow (`gptforge-stage`) that runs one step on a work pool's worker (gptforge.pipeline.team.pools).

The flow's parameter is the typed pipeline config, so the Prefect UI renders it as a form and a typo
in a form or a scheduled run's parameters fails the run before any stage starts. Reuse is decided
before a stage starts: a complete output with the stage's fingerprint (and intact files) is reused;
otherwise the stage runs, resuming from its own step checkpoints if it has any.
"""

import base64
import os
import socket
import tempfile
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.futures import as_completed
from prefect.states import Cancelled
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.artifacts import (create_link_artifact, create_markdown_artifact, create_progress_artifact,
                               create_table_artifact, update_progress_artifact)
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment, flow_run, task_run

from gptforge.core.config import PipelineConfig, dump_config, load_config
from gptforge.core.declarations import STAGES
from gptforge.core.errors import UserError
from gptforge.core.files import write_text_atomic
from gptforge.pipeline.team.approval import approve
from gptforge.pipeline.launch.stage import kill_running, run_stage
from gptforge.model.train.tracking import pipeline_run
from gptforge.pipeline.preflight import preflight
from gptforge.pipeline.report import FUNNEL, artifact_markdown, draw_funnel, funnel_markdown, write_report
from gptforge.pipeline.store import RunRecord, locate, pipeline_steps, read_manifest, upstream
from gptforge.pipeline.team.pools import STAGE_FLOW, Rejected, cancel_children, pool_of, run_on_pool
from gptforge.core.files import CONFIGS

DEFAULT_CONFIG = CONFIGS / "tiny.yaml"


@task(task_run_name="{stage}", cache_policy=NO_CACHE)
def stage_task(stage: str, config_path: str, recompute: bool = False) -> dict:
    """One step of the pipeline: on its work pool (run.work_pools), or in this process."""
    cfg = load_config(config_path)
    logger = get_run_logger()
    # --from recomputes on the first attempt; a retry resumes from what that attempt checkpointed
    recompute = recompute and task_run.run_count <= 1
    if pool_of(cfg, stage):
        return run_on_pool(cfg, stage, recompute, logger.info)
    return run_here(cfg, stage, Path(config_path), logger.info, recompute)


def run_here(cfg: PipelineConfig, stage: str, config_path: Path, log, recompute: bool) -> dict:
    """Run (or reuse) a step in this process's flow or task run, with its progress, metrics and output shown as
    Prefect artifacts."""
    progress = create_progress_artifact(progress=0.0, key=f"{stage}-progress",
                                        description=f"{stage}: share of training steps done")

    def on_progress(percent: float) -> None:
        update_progress_artifact(artifact_id=progress, progress=percent)

    manifest = run_stage(cfg, stage, config_path, RunRecord(cfg), log, on_progress, recompute)
    update_progress_artifact(artifact_id=progress, progress=100.0)
    out_dir = locate(cfg, stage)[0]
    create_table_artifact(key=f"{stage}-metrics",
                          table=[{"metric": k, "value": v} for k, v in manifest["metrics"].items()],
                          description=f"{stage} final metrics; output: {out_dir.resolve().as_uri()}")
    create_link_artifact(key=f"{stage}-output", link=out_dir.resolve().as_uri(), link_text=str(out_dir.resolve()),
                         description=f"{stage}: its output (a Hugging Face checkpoint in model/ if it trains one)")
    if "funnel" in STAGES[stage].outputs:  # the funnel, its plot inline (the UI cannot reach the run's files)
        with tempfile.TemporaryDirectory() as tmp:
            draw_funnel(manifest["metrics"], Path(tmp) / f"{FUNNEL}.png")
            png = base64.b64encode((Path(tmp) / f"{FUNNEL}.png").read_bytes()).decode()
        create_markdown_artifact(key=FUNNEL, markdown=funnel_markdown(
            out_dir, lambda name: f"data:image/png;base64,{png}"), description=f"{stage}: what each step removed")
    return manifest


@flow(name=STAGE_FLOW, log_prints=True)
def stage_flow(config: PipelineConfig, step: str, recompute: bool = False, workdir: str | None = None) -> dict:
    """One step of a pipeline, on a work pool's worker (started by the pipeline flow through `gptforge-stage/<pool>`):
    reused, resumed or computed through the stage store, which every worker shares. `workdir`, the pipeline's
    folder, is where relative paths in the config are read from, where this worker has it."""
    if workdir and Path(workdir).is_dir():
        os.chdir(workdir)
    if not Path(config.run.root).is_dir():
        raise UserError(f"run.root {config.run.root} is not on this worker ({socket.gethostname()}): put it on a "
                        "filesystem every worker and the pipeline mount at the same path")
    record = RunRecord(config)
    path = record.dir / "stages" / f"{step}.yaml"
    path.parent.mkdir(exist_ok=True)
    write_text_atomic(path, dump_config(config))
    return run_here(config, step, path, get_run_logger().info, recompute)["metrics"]


def selected_stages(cfg: PipelineConfig, from_stage: str | None, only: str | None) -> list[str]:
    """The steps a run computes: all of them, those from `from_stage` on, or `only` one stage (with its
    evaluation step, unless `only` names the evaluation step itself)."""
    steps = pipeline_steps(cfg)
    for name in (from_stage, only):
        if name is not None and name not in steps:
            raise UserError(f"unknown or disabled stage {name!r}; stages of this pipeline: {', '.join(steps)}")
    if only:
        return [s for s in steps if s == only or s == f"eval-{only}"]
    if from_stage:
        return steps[steps.index(from_stage):]
    return steps


@flow(name="gptforge-pipeline", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=16))
def pipeline_flow(config: PipelineConfig = load_config(DEFAULT_CONFIG), from_stage: str | None = None,
                  only: str | None = None):
    """Run the pipeline: each stage reused when complete, else computed (or resumed from its checkpoints), as
    soon as its inputs are complete. `from_stage` recomputes from that stage on; `only` runs one stage on existing
    inputs."""
    stages = selected_stages(config, from_stage, only)
    preflight(config, stages)  # a run started from the UI or a schedule: every bad input before any stage
    config = named_for_this_run(config)
    record = RunRecord(config)
    resolved = record.dir / "config.yaml"
    resolved.write_text(dump_config(config))
    with pipeline_run(config):  # MLflow (run.tracker): the stages' runs nest under this one
        metrics, rejected = run_steps(config, stages, str(resolved), from_stage is not None, record)
    if rejected:
        record.update(outcome=f"cancelled: {rejected}")
    write_report(record.dir)
    create_markdown_artifact(key="run-report", markdown=artifact_markdown(record.dir),
                             description=f"report of run {config.run.name}")
    if rejected:
        return Cancelled(message=str(rejected))
    return metrics


def run_steps(config: PipelineConfig, stages: list[str], config_path: str, recompute: bool,
              record: RunRecord) -> tuple[dict, Rejected | None]:
    """Start each step once the steps it reads are complete (independent branches, such as the preference
    algorithms and the evaluation steps, run at once), pausing first at approval gates. A failure stops only what
    depends on it; the other branches finish, and then the first failure is raised. Returns (metrics by step, the
    rejection that cancelled a branch, if any). If this flow is cancelled or interrupted, its stages are too."""
    run_task = stage_task.with_options(retries=config.run.retries, retry_delay_seconds=config.run.retry_delay)
    logger = get_run_logger()
    pending, running = list(stages), {}
    metrics, failed, rejected = {}, {}, None
    try:
        while pending or running:
            for step in list(pending):
                needs = [u for u in upstream(config, step) if u in stages]
                if any(u in failed for u in needs):
                    pending.remove(step)
                    failed[step] = None  # not run: an input failed or was rejected
                elif all(u in metrics for u in needs):
                    pending.remove(step)
                    if step in config.run.approve_before and read_manifest(locate(config, step)[0]) is None:
                        try:
                            approve(config.run.approve_timeout, step, record, logger.info)
                        except Rejected as e:
                            rejected, failed[step] = e, None
                            continue
                    running[step] = run_task.submit(step, config_path, recompute=recompute)
            if not running:
                continue
            done = next(as_completed(list(running.values())))
            step = next(s for s, f in running.items() if f is done)
            del running[step]
            try:
                metrics[step] = done.result()["metrics"]
            except Exception as e:  # noqa: BLE001 - raised below, once the other branches are done
                failed[step] = e
                logger.error(f"{step} failed: {e}; the stages that need it will not run")
    except BaseException:  # cancelled (SIGTERM), interrupted: no stage outlives the run that started it
        cancel_children(f"pipeline run {config.run.name} was cancelled")
        kill_running()
        for future in running.values():  # each records itself cancelled; what it raised is not this run's end
            try:
                future.wait(timeout=30)
            except BaseException:  # noqa: BLE001
                pass
        raise
    errors = [e for e in failed.values() if e is not None]
    if errors:
        raise errors[0]
    return metrics, rejected


def named_for_this_run(config: PipelineConfig) -> PipelineConfig:
    """A deployment's runs (from the UI, from the schedule) each get a run directory of their own: the run name
    plus the flow run's start time and the start of its id. A `gptforge run` keeps the name it was given."""
    if deployment.id is None:
        return config
    stamp = f"{flow_run.scheduled_start_time:%Y%m%d-%H%M%S}-{flow_run.id[:6]}"
    return config.model_copy(update={"run": config.run.model_copy(update={"name": f"{config.run.name}-{stamp}"})})
