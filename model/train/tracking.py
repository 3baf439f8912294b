"""Experiment tracking in MLflow (`run.tracker: mlflow`): an MLflow run for each pipeline run and, nested under it,
one for each stage, holding the stage's parameters (its config, flattened: `sft.lr`), every metric it logs at each
step (ours and TRL's, in our names, as MetricsLog writes them) and its final metrics. The experiment is named after
the run (`run.name`); only rank 0 of a stage logs.

`run.tracking_uri` names the tracking server or store; by default a SQLite file beside the stage store,
`<run.root>/mlflow.db` (`mlflow ui --backend-store-uri sqlite:///runs/mlflow.db` shows it). A stage started by a
pipeline finds its parent run in the environment (`GPTFORGE_MLFLOW_PARENT_RUN`); one started by hand is a run of
its own. A resumed stage logs on into the run it started (its id is kept in `logs/mlflow_run.json`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from gptforge.core.errors import UserError

PARENT_ENV = "GPTFORGE_MLFLOW_PARENT_RUN"
RUN_FILE = "mlflow_run.json"  # in the stage's logs/


def tracking_uri(cfg) -> str:
    return cfg.run.tracking_uri or f"sqlite:///{(Path(cfg.run.root) / 'mlflow.db').resolve()}"


def _client(cfg):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(cfg))


def _experiment(client, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # noqa: BLE001 - another process created it meanwhile
        return client.get_experiment_by_name(name).experiment_id


def _unreachable(cfg, e: Exception) -> UserError:
    return UserError(f"run.tracking_uri={tracking_uri(cfg)!r}: MLflow could not be reached ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}); fix the URI or set run.tracker=none")


def flatten(data: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:500]
    return out


@contextmanager
def pipeline_run(cfg):
    """The pipeline's MLflow run for the block (None when tracking is off); the stages started in the block nest
    theirs under it."""
    if cfg.run.tracker != "mlflow":
        yield None
        return
    try:
        client = _client(cfg)
        run = client.create_run(_experiment(client, cfg.run.name), run_name=cfg.run.name,
                                tags={"gptforge.kind": "pipeline"})
    except Exception as e:  # noqa: BLE001
        raise _unreachable(cfg, e) from None
    before, os.environ[PARENT_ENV] = os.environ.get(PARENT_ENV), run.info.run_id
    status = "FAILED"
    try:
        yield run.info.run_id
        status = "FINISHED"
    finally:
        if before is None:
            os.environ.pop(PARENT_ENV, None)
        else:
            os.environ[PARENT_ENV] = before
        client.set_terminated(run.info.run_id, status)


class StageRun:
    """A stage's MLflow run (rank 0): created, or reopened by a resumed stage; `log` a step's metrics; `finish`."""

    def __init__(self, cfg, stage: str, out_dir: Path):
        from mlflow.entities import Param

        self.client = _client(cfg)
        record = out_dir / "logs" / RUN_FILE
        try:
            if record.is_file() and self._reopened(json.loads(record.read_text())["run_id"]):
                return
            parent = os.environ.get(PARENT_ENV)
            run = self.client.create_run(_experiment(self.client, cfg.run.name), run_name=stage,
                                         tags={"gptforge.kind": "stage", "gptforge.output": str(out_dir.resolve()),
                                               **({"mlflow.parentRunId": parent} if parent else {})})
            self.run_id = run.info.run_id
            params = [Param(k, v) for k, v in flatten(cfg.model_dump(mode="json")).items()]
            for i in range(0, len(params), 100):  # MLflow takes 100 parameters a batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        except Exception as e:  # noqa: BLE001
            raise _unreachable(cfg, e) from None
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"run_id": self.run_id}))

    failed = False  # set once logging fails: the rest of the stage logs to its files only

    def _reopened(self, run_id: str) -> bool:
        """Log on into the run a killed attempt of this stage started, if this store holds it."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(run_id, status="RUNNING")
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":  # an output copied from another store
                return False
            raise
        self.run_id = run_id
        return True

    def log(self, step: int | None, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if self.failed or not batch:
            return
        try:
            self.client.log_batch(self.run_id, metrics=batch)
        except Exception as e:  # noqa: BLE001 - training goes on; the JSONL and TensorBoard logs still hold it all
            self.failed = True
            print(f"warning: MLflow logging stopped ({type(e).__name__}: {e})", file=sys.stderr, flush=True)

    def finish(self, metrics: dict | None) -> None:
        if metrics is not None:
            self.log(metrics.get("global_step"), metrics)
        self.client.set_terminated(self.run_id, "FINISHED" if metrics is not None else "FAILED")


_active: StageRun | None = None


@contextmanager
def stage_run(cfg, stage: str, out_dir: Path, rank: int):
    """Track the stage run in the block (rank 0, `run.tracker: mlflow`); yields a callable taking its final
    metrics."""
    global _active
    if rank != 0 or cfg.run.tracker != "mlflow":
        yield lambda metrics: None
        return
    _active = StageRun(cfg, stage, out_dir)
    final: list[dict] = []
    try:
        yield final.append
    finally:
        _active.finish(final[0] if final else None)
        _active = None


def log_step(step: int, metrics: dict) -> None:
    """A step's metrics to the active stage run, if any (MetricsLog calls it)."""
    if _active is not None:
        _active.log(step, metrics)
