"""Retraining when the data changes: a small flow, deployed on a schedule (`run.watch_every`), that fingerprints
every source the pipeline reads (local files through the cached digests, so an unchanged file is not reread; hub
datasets and models by their resolved revision) and emits `gptforge.data.changed` when one differs from its last
check. The pipeline deployment's trigger on that event starts a run, in which unchanged stages are reused and the
changed ones, with what follows them, recompute. A check that finds nothing new does nothing.

The fingerprints of the last check are kept in a Prefect variable (`gptforge-watch-<run name>`); the first check
records them and emits nothing.
"""

from __future__ import annotations

import re

from prefect import flow, get_run_logger
from prefect.events import DeploymentEventTrigger, emit_event

from gptforge.core.config import PipelineConfig, load_config
from gptforge.data.splits import eval_fingerprint, source_fingerprint
from gptforge.model import pretrained
from gptforge.pipeline.store import data_of, digest_cache, pipeline_steps
from gptforge.core.declarations import STAGES
from gptforge.core.registry import named_models
from gptforge.core.files import CONFIGS

EVENT = "gptforge.data.changed"
DEFAULT_CONFIG = CONFIGS / "tiny.yaml"


def resource_id(cfg: PipelineConfig) -> str:
    """The resource a pipeline's data-changed events are about (what its deployment's trigger matches)."""
    return f"gptforge.pipeline.{cfg.run.name}"


def variable_name(cfg: PipelineConfig) -> str:
    return re.sub(r"[^a-z0-9_-]", "-", f"gptforge-watch-{cfg.run.name}".lower())


def watched(cfg: PipelineConfig) -> dict[str, str]:
    """{what (a config key, or an evaluation step's data): its fingerprint} for everything the pipeline reads."""
    cache, out = digest_cache(cfg), {}
    for step in pipeline_steps(cfg):
        for name in data_of(cfg, step):
            out[f"data.{name}"] = source_fingerprint(cfg.data, name, cache)
        if STAGES[step].evaluates:
            out[f"{step} data"] = eval_fingerprint(cfg.data, step, cache)
        for key, (name, revision) in named_models(cfg, step).items():
            out[key] = pretrained.fingerprint(name, revision, cache, key)
    return out


@flow(name="gptforge-watch", log_prints=True)
def watch_flow(config: PipelineConfig = load_config(DEFAULT_CONFIG)) -> list[str]:
    """One check: emit `gptforge.data.changed` if a source changed since the last check; return what changed."""
    from prefect.variables import Variable

    logger = get_run_logger()
    now, name = watched(config), variable_name(config)
    previous = Variable.get(name, default=None)
    Variable.set(name, now, overwrite=True)
    if previous is None:
        logger.info(f"first check of run {config.run.name}: {len(now)} sources recorded")
        return []
    changed = sorted(k for k in now if previous.get(k) != now[k])
    if changed:
        emit_event(EVENT, resource={"prefect.resource.id": resource_id(config),
                                    "prefect.resource.name": config.run.name},
                   payload={"changed": changed, "fingerprints": now})
        logger.info(f"changed since the last check: {', '.join(changed)}; {EVENT} emitted")
    else:
        logger.info("nothing changed since the last check")
    return changed


def data_changed_trigger(cfg: PipelineConfig) -> DeploymentEventTrigger:
    """The pipeline deployment's trigger: a run for each `gptforge.data.changed` about this pipeline."""
    return DeploymentEventTrigger(name=f"{cfg.run.name}: data changed", expect={EVENT},
                                  match={"prefect.resource.id": resource_id(cfg)})
