"""`gptforge deploy`: the team layout on the Prefect server at PREFECT_API_URL.

- the work pools the config names (`run.work_pools`, `run.default_work_pool`), of type process unless they exist;
- `gptforge-stage/<pool>` for each of them: the flow that runs one step there (gptforge.pipeline.team.pools);
- `gptforge-pipeline/<name>` on `run.default_work_pool`, with `run.schedule` and a trigger on
  `gptforge.data.changed` about this pipeline;
- `gptforge-watch/<name>`, every `run.watch_every` seconds (gptforge.pipeline.team.watch);
- the slot limit `run.slots` (`--slots N`);
- the automation that marks a flow run Crashed once its heartbeats stop (open-source Prefect has no zombie detection
  of its own: Prefect's documented recipe), so a run whose process vanished is never left Running.

Deployments name their flows by module path (`gptforge.pipeline.flow.stage_flow`): a worker runs the installed
gptforge, so every worker host needs the same gptforge installed and `run.root` on a filesystem they all share.
"""

from __future__ import annotations

from datetime import timedelta

from gptforge.core.config import PipelineConfig
from gptforge.core.errors import ConfigError
from gptforge.pipeline import prefect_env
from gptforge.pipeline.preflight import preflight

CRASH_AUTOMATION = "gptforge: crash flow runs whose heartbeats stopped"
JOB_ENV = prefect_env.SETTINGS  # what deployed flow runs are started with


def pools_of(cfg: PipelineConfig) -> list[str]:
    return sorted(set(cfg.run.work_pools.values()) | ({cfg.run.default_work_pool} - {None}))


def ensure_pools(client, names: list[str], log) -> None:
    from prefect.client.schemas.actions import WorkPoolCreate

    existing = {p.name for p in client.read_work_pools()}
    for name in names:
        if name not in existing:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            log(f"work pool {name!r} created (type process): start its worker with "
                f"`prefect worker start --pool {name}`")


def ensure_slots(client, name: str, slots: int, log) -> None:
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    try:
        client.read_global_concurrency_limit_by_name(name)
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=slots))
    except ObjectNotFound:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
    log(f"slot limit {name!r}: {slots} slots")


def crash_automation():
    """Prefect's recipe: a flow run that sent a heartbeat and then, for three heartbeat periods, neither another
    nor a final state, is marked Crashed."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return AutomationCore(
        name=CRASH_AUTOMATION,
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
            within=timedelta(seconds=3 * prefect_env.HEARTBEAT_SECONDS)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message="marked Crashed: its heartbeats stopped (its process is gone)")])


def ensure_crash_automation(client, log) -> None:
    if not client.read_automations_by_name(CRASH_AUTOMATION):
        client.create_automation(crash_automation())
        log(f"automation {CRASH_AUTOMATION!r} created")


def deploy(cfg: PipelineConfig, name: str, slots: int | None, log=print) -> None:
    from prefect.client.orchestration import get_client
    from prefect.deployments.runner import EntrypointType

    from gptforge.pipeline.flow import pipeline_flow, stage_flow
    from gptforge.pipeline.team.pools import api_url
    from gptforge.pipeline.team.watch import data_changed_trigger, watch_flow

    if api_url() is None:
        raise ConfigError("gptforge deploy needs PREFECT_API_URL: the Prefect server to deploy to")
    preflight(cfg, log=log, team=False)  # what its runs will need, before anything is deployed (it makes the pools)
    if cfg.run.default_work_pool is None:
        raise ConfigError("gptforge deploy needs run.default_work_pool: the pool the pipeline and watch flows run "
                          "on (and every stage run.work_pools does not map)")
    with get_client(sync_client=True) as client:
        ensure_pools(client, pools_of(cfg), log)
        if slots is not None:
            ensure_slots(client, cfg.run.slots, slots, log)
        ensure_crash_automation(client, log)
    params = {"config": cfg.model_dump(mode="json")}
    common = {"entrypoint_type": EntrypointType.MODULE_PATH, "job_variables": {"env": JOB_ENV}}
    for pool in pools_of(cfg):
        stage_flow.to_deployment(name=pool, description=f"one gptforge stage on work pool {pool}",
                                 **common).apply(work_pool_name=pool)
        log(f"deployment gptforge-stage/{pool} on work pool {pool!r}")
    pipeline_flow.to_deployment(
        name=name, parameters=params, cron=cfg.run.schedule, triggers=[data_changed_trigger(cfg)],
        description="gptforge pipeline: tokenize -> pretrain -> sft -> reward -> preference", **common,
    ).apply(work_pool_name=cfg.run.default_work_pool)
    log(f"deployment gptforge-pipeline/{name} on work pool {cfg.run.default_work_pool!r}"
        + (f", schedule {cfg.run.schedule!r}" if cfg.run.schedule else "") + ", started when its data changes")
    watch_flow.to_deployment(name=name, parameters=params, interval=cfg.run.watch_every,
                             description="checks the pipeline's data sources; emits gptforge.data.changed",
                             **common).apply(work_pool_name=cfg.run.default_work_pool)
    log(f"deployment gptforge-watch/{name}: a check every {cfg.run.watch_every} s")
