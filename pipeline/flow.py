"""The Prefect flow: one task per stage, each starting the stage as a child process group.

The flow's parameter is the typed pipeline config, so the Prefect UI renders it as a form and a typo
in a form or a scheduled run's parameters fails the run before any stage starts. Reuse is decided
before a stage starts: a complete output with the stage's fingerprint (and intact files) is reused;
otherwise the stage runs, resuming from its own step checkpoints if it has any.
"""

from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import (create_link_artifact, create_markdown_artifact, create_progress_artifact,
                               create_table_artifact, update_progress_artifact)
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment, flow_run, task_run

from gptforge.core.config import PipelineConfig, dump_config, load_config
from gptforge.core.errors import UserError
from gptforge.pipeline.launch import run_stage
from gptforge.model.harness import check_tasks
from gptforge.model.pretrained import check_models
from gptforge.model.tracking import pipeline_run
from gptforge.pipeline.report import artifact_markdown, write_report
from gptforge.pipeline.store import RunRecord, locate, pipeline_steps

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


@task(task_run_name="{stage}", cache_policy=NO_CACHE)
def stage_task(stage: str, config_path: str, recompute: bool = False) -> dict:
    cfg = load_config(config_path)
    logger = get_run_logger()
    progress = create_progress_artifact(progress=0.0, key=f"{stage}-progress",
                                        description=f"{stage}: share of training steps done")

    def on_progress(percent: float) -> None:
        update_progress_artifact(artifact_id=progress, progress=percent)

    # --from recomputes on the first attempt; a retry resumes from what that attempt checkpointed
    recompute = recompute and task_run.run_count <= 1
    manifest = run_stage(cfg, stage, Path(config_path), RunRecord(cfg), logger.info, on_progress, recompute)
    update_progress_artifact(artifact_id=progress, progress=100.0)
    out_dir = locate(cfg, stage)[0]
    create_table_artifact(key=f"{stage}-metrics",
                          table=[{"metric": k, "value": v} for k, v in manifest["metrics"].items()],
                          description=f"{stage} final metrics; output: {out_dir.resolve().as_uri()}")
    create_link_artifact(key=f"{stage}-output", link=out_dir.resolve().as_uri(), link_text=str(out_dir.resolve()),
                         description=f"{stage}: its output (a Hugging Face checkpoint in model/ if it trains one)")
    return manifest


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


@flow(name="gptforge-pipeline", log_prints=True)
def pipeline_flow(config: PipelineConfig = load_config(DEFAULT_CONFIG), from_stage: str | None = None,
                  only: str | None = None) -> dict:
    """Run the pipeline: each stage reused when complete, else computed (or resumed from its checkpoints).
    `from_stage` recomputes from that stage on; `only` runs one stage on existing inputs."""
    stages = selected_stages(config, from_stage, only)
    if config.eval.harness_tasks:  # a misspelt task fails now, not after the training before its evaluation
        check_tasks(config.eval)
    check_models(config)  # a model that cannot load, or adapters that match nothing, fail before any stage
    config = named_for_this_run(config)
    record = RunRecord(config)
    resolved = record.dir / "config.yaml"
    resolved.write_text(dump_config(config))
    run_task = stage_task.with_options(retries=config.run.retries, retry_delay_seconds=config.run.retry_delay)
    metrics = {}
    with pipeline_run(config):  # MLflow (run.tracker): the stages' runs nest under this one
        for stage in stages:
            metrics[stage] = run_task(stage, str(resolved), recompute=from_stage is not None)["metrics"]
    write_report(record.dir)
    create_markdown_artifact(key="run-report", markdown=artifact_markdown(record.dir),
                             description=f"report of run {config.run.name}")
    return metrics


def named_for_this_run(config: PipelineConfig) -> PipelineConfig:
    """A deployment's runs (from the UI, from the schedule) each get a run directory of their own: the run name
    plus the flow run's start time and the start of its id. A `gptforge run` keeps the name it was given."""
    if deployment.id is None:
        return config
    stamp = f"{flow_run.scheduled_start_time:%Y%m%d-%H%M%S}-{flow_run.id[:6]}"
    return config.model_copy(update={"run": config.run.model_copy(update={"name": f"{config.run.name}-{stamp}"})})
