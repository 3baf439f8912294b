"""Orchestration at team scale: stages on Prefect work pools, GPU slots shared by every run of a server, and the
checks a run makes before anything starts.

With `run.work_pools`, a stage runs as a flow run of the `gptforge-stage` deployment of its pool
(`gptforge-stage/<pool>`, created by `gptforge deploy`), started by the pipeline flow with `run_deployment` as its
subflow. It runs on that pool's worker, in a process of its own: the pipeline's flow process can die and the stage
trains on. A pipeline that asks for a stage output already being computed (the output's tag, its fingerprint in
this stage store, on a flow run that has not finished) joins that flow run rather than starting a second one; the
idempotency key (that tag and the number of earlier, finished attempts) makes two pipelines asking at the same
moment create one.

Slots: a stage holds `distributed.nnodes x nproc_per_node` slots of the global concurrency limit `run.slots` while
its processes run (a single-process evaluation one; tokenizing none), through Prefect's leases, which the server
takes back when the holder stops renewing them (a killed process). A stage that must wait says so in its flow run's
state name (`Waiting for slots`) and its log. With no server (the ephemeral one of a plain `gptforge run`), or no
such limit on it, stages take no slots.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path

from gptforge.core.config import PipelineConfig
from gptforge.core.declarations import STAGES
from gptforge.core.errors import ConfigError, StageFailed, UserError

STAGE_FLOW = "gptforge-stage"
WAITING = "Waiting for slots"
LEASE_SECONDS = 60  # a killed holder's slots return within this (and the server's repossessor loop)
_started: set = set()  # flow run ids of the stage runs this process started (cancelled with it)
_joined: set = set()  # and of those it joined, started by a pipeline run that may since have died
_lock = threading.Lock()


def api_url() -> str | None:
    """The Prefect server this process talks to, or None for the ephemeral one."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def uses_pools(cfg: PipelineConfig) -> bool:
    return bool(cfg.run.work_pools)


def pool_of(cfg: PipelineConfig, step: str) -> str | None:
    """The work pool a step runs on, or None: in the flow's own process."""
    if not uses_pools(cfg):
        return None
    return cfg.run.work_pools.get(step, cfg.run.default_work_pool)


def slots_needed(cfg: PipelineConfig, step: str) -> int:
    from gptforge.pipeline.launch.nodes import single_process

    if not STAGES[step].gpus:  # tokenize: its own Ray workers on the CPU
        return 0
    return 1 if single_process(cfg, step) else cfg.distributed.world_size


def closest(name: str, names: list[str]) -> str:
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.0)
    return f"; did you mean {match[0]!r}?" if match else ""


def check_team(cfg: PipelineConfig, steps: list[str]) -> None:
    """Everything about pools, gates and slots that can be wrong, as one error line before any stage starts."""
    for key, named in (("run.work_pools", list(cfg.run.work_pools)), ("run.approve_before", cfg.run.approve_before)):
        for step in named:
            if step not in steps:
                raise ConfigError(f"{key} names {step!r}, which is not a stage of this pipeline{closest(step, steps)} "
                                  f"(its stages: {', '.join(steps)})")
    if not (uses_pools(cfg) or cfg.run.approve_before or api_url()):
        return
    if api_url() is None:
        what = "run.work_pools" if uses_pools(cfg) else "run.approve_before"
        raise ConfigError(f"{what} needs a Prefect server: set PREFECT_API_URL (with the ephemeral server of a "
                          "plain `gptforge run`, no worker could run a stage and nobody could approve one)")
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        if uses_pools(cfg):
            missing = {pool_of(cfg, s) for s in steps} - {None}
            missing -= {p.name for p in client.read_work_pools()}
            if None in {pool_of(cfg, s) for s in steps}:
                raise ConfigError("run.work_pools leaves stages without a pool: name one in run.default_work_pool")
            if missing:
                raise ConfigError(f"run.work_pools: no work pool {sorted(missing)[0]!r} on {api_url()}; create it "
                                  "with `gptforge deploy` (or `prefect work-pool create NAME --type process`)")
        try:
            limit = client.read_global_concurrency_limit_by_name(cfg.run.slots)
        except ObjectNotFound:
            return
        widest = max(steps, key=lambda s: slots_needed(cfg, s))
        if slots_needed(cfg, widest) > limit.limit:
            raise ConfigError(f"run.slots: the limit {cfg.run.slots!r} has {limit.limit} slots, but stage {widest} "
                              f"needs {slots_needed(cfg, widest)} (distributed.nnodes x nproc_per_node); raise it "
                              "with `gptforge deploy --slots N` or run fewer processes")


def set_state_name(name: str) -> None:
    """Name the current flow run's Running state (what the UI shows), best effort."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.states import Running

    if flow_run.id is None:
        return
    try:
        with get_client(sync_client=True) as client:
            if client.read_flow_run(flow_run.id).state.is_running():  # never over a pause or an ending
                client.set_flow_run_state(flow_run.id, Running(name=name))
    except Exception:  # noqa: BLE001 - a label in the UI must never fail a stage
        pass


@contextmanager
def gpu_slots(cfg: PipelineConfig, step: str, log: Callable[[str], None]):
    """Hold the step's slots of `run.slots` while the block runs (see the module's docstring)."""
    need = slots_needed(cfg, step)
    if need == 0 or api_url() is None:
        yield
        return
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(cfg.run.slots)
    except ObjectNotFound:
        yield
        return
    hold = {"names": cfg.run.slots, "occupy": need, "strict": True, "lease_duration": LEASE_SECONDS,
            "raise_on_lease_renewal_failure": False}
    with ExitStack() as stack:
        try:
            stack.enter_context(concurrency(timeout_seconds=1, **hold))
        except TimeoutError:
            log(f"{step}: waiting for {need} of the {limit.limit} slots of {cfg.run.slots!r}")
            set_state_name(WAITING)
            stack.enter_context(concurrency(**hold))
            set_state_name("Running")
        log(f"{step}: holding {need} slot(s) of {cfg.run.slots!r}")
        yield


# --- stages on work pools ---------------------------------------------------------------------------------------

def output_tag(out_dir: Path) -> str:
    """What marks the flow runs that compute one stage output: its fingerprint in one stage store (one run.root)."""
    return f"gptforge-output:{hashlib.sha256(str(out_dir.resolve()).encode()).hexdigest()[:16]}"


def stage_runs(client, tag: str, final: bool) -> list:
    """Flow runs of the stage flow carrying `tag`, finished ones (final=True) or the others."""
    from prefect.client.schemas.filters import (FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterState,
                                                FlowRunFilterStateType, FlowRunFilterTags)
    from prefect.client.schemas.objects import TERMINAL_STATES, StateType

    types = list(TERMINAL_STATES) if final else [t for t in StateType if t not in TERMINAL_STATES]
    return client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=[STAGE_FLOW])),
        flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag]),
                                      state=FlowRunFilterState(type=FlowRunFilterStateType(any_=types))))


def wait_final(client, flow_run_id, poll: float = 2.0):
    while True:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        time.sleep(poll)


def run_on_pool(cfg: PipelineConfig, step: str, recompute: bool, log: Callable[[str], None]) -> dict:
    """Run a step as a flow run of `gptforge-stage/<pool>` (or join the one already computing its output), wait
    for it, and return the output's manifest (on the stage store every worker shares)."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from gptforge.pipeline.store import RunRecord, locate, now, read_manifest

    out_dir, fingerprint, _ = locate(cfg, step)
    pool, tag = pool_of(cfg, step), output_tag(out_dir)
    if not recompute and (manifest := read_manifest(out_dir)) is not None:  # nothing for a worker to do
        log(f"{step}: reused complete output {out_dir} (fingerprint {fingerprint[:16]})")
        RunRecord(cfg).update(step, output=str(out_dir), action="reused", status="complete", started_at=now(),
                              finished_at=now(), seconds=0.0, metrics=manifest["metrics"])
        return manifest
    with get_client(sync_client=True) as client:
        active = stage_runs(client, tag, final=False)
        if active:
            run, mine = active[0], _joined
            log(f"{step}: joining flow run {run.name} ({run.id}), already computing {out_dir}")
        else:
            attempts = len(stage_runs(client, tag, final=True))
            root = str(Path(cfg.run.root).resolve())  # the stage store, at the same path on every worker
            shared = cfg.model_copy(update={"run": cfg.run.model_copy(update={"root": root})})
            run, mine = run_deployment(
                f"{STAGE_FLOW}/{pool}", timeout=0, flow_run_name=f"{step} · {cfg.run.name}",
                parameters={"config": shared.model_dump(mode="json"), "step": step, "recompute": recompute,
                            "workdir": os.getcwd()},
                tags=[tag, f"gptforge-step:{step}", f"gptforge-run:{cfg.run.name}"],
                idempotency_key=f"{tag}:{attempts}:{int(recompute)}"), _started
            log(f"{step}: flow run {run.name} ({run.id}) on work pool {pool!r}")
        with _lock:
            mine.add(run.id)
        try:
            run = wait_final(client, run.id)
        finally:
            with _lock:
                mine.discard(run.id)
    if not run.state.is_completed():
        raise StageFailed(f"stage {step} {run.state.name.lower()} on work pool {pool!r}: "
                          f"{run.state.message or 'see its flow run ' + run.name}")
    manifest = read_manifest(out_dir, verify=False)
    if manifest is None:
        raise StageFailed(f"stage {step} completed on work pool {pool!r}, but {out_dir} holds no complete output "
                          "here: run.root must be a filesystem every worker and the pipeline share")
    return manifest


def cancel_children(message: str) -> None:
    """Cancel the stage flow runs this process started, and those it joined whose own pipeline run has ended (the
    pipeline was cancelled or interrupted). A stage joined from a pipeline still running is left to it."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    with _lock:
        started, joined = list(_started), list(_joined)
        _started.clear()
        _joined.clear()
    if not started and not joined:
        return
    with get_client(sync_client=True) as client:
        for flow_run_id in started + [i for i in joined if orphaned(client, i)]:
            try:
                client.set_flow_run_state(flow_run_id, Cancelling(message=message), force=True)
            except Exception:  # noqa: BLE001 - cancel the others
                pass


def orphaned(client, flow_run_id) -> bool:
    """Whether a stage flow run's parent pipeline run has ended (or it has none)."""
    run = client.read_flow_run(flow_run_id)
    if run.parent_task_run_id is None:
        return True
    try:
        parent = client.read_flow_run(client.read_task_run(run.parent_task_run_id).flow_run_id)
    except Exception:  # noqa: BLE001 - no parent to be found
        return True
    return parent.state is None or parent.state.is_final()


class Rejected(UserError):
    """A person rejected a stage at its approval gate."""
