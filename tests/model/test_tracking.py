"""MLflow tracking: a stage's run nested under the pipeline's, its parameters, every step's metrics and its final
ones, read back through MLflow's client."""

import pytest

from gptforge.core.errors import UserError
from gptforge.model.train.metrics import MetricsLog
from gptforge.model.train.tracking import pipeline_run, tracking_uri
from gptforge.pipeline.store import execute


def logging_stage(losses, fail=False):
    def run(cfg, inputs, out_dir):
        log = MetricsLog(out_dir / "logs", 0)
        for step, loss in enumerate(losses, 1):
            log.log(step, loss=loss, lr=1e-3)
        log.close()
        if fail:
            raise UserError("the stage failed")
        return {"val_loss": 1.9, "global_step": len(losses)}

    return run


def runs_of(cfg):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.run.name)
    return client, {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}


def test_a_stage_run_nests_under_the_pipeline_run(small_cfg):
    cfg = small_cfg("run.tracker=mlflow", "sft.lr=0.00042")
    with pipeline_run(cfg) as parent:
        execute(cfg, "tokenize", logging_stage([3.0, 2.5, 2.0]), {})
    client, runs = runs_of(cfg)
    stage, pipeline = runs["tokenize"], runs[cfg.run.name]
    assert stage.data.tags["mlflow.parentRunId"] == parent == pipeline.info.run_id
    assert [(m.step, m.value) for m in client.get_metric_history(stage.info.run_id, "loss")] == \
        [(1, 3.0), (2, 2.5), (3, 2.0)]
    assert stage.data.metrics["val_loss"] == 1.9 and stage.data.params["sft.lr"] == "0.00042"
    assert stage.info.status == pipeline.info.status == "FINISHED"


def test_a_failed_stage_is_a_failed_run(small_cfg):
    cfg = small_cfg("run.tracker=mlflow")
    with pytest.raises(UserError), pipeline_run(cfg):
        execute(cfg, "tokenize", logging_stage([3.0], fail=True), {})
    client, runs = runs_of(cfg)
    assert runs["tokenize"].info.status == runs[cfg.run.name].info.status == "FAILED"
    assert [m.value for m in client.get_metric_history(runs["tokenize"].info.run_id, "loss")] == [3.0]
