"""gptforge on a team's Prefect server: a real server on 127.0.0.1 (its own PREFECT_HOME), the layout `gptforge
deploy` creates on it (two process work pools, the stage deployments, a slot limit, the crashed-run automation) and
a worker for each pool, all started here. Stages run as child flow runs on the pools the config names and outlive
the pipeline's flow process; cancelling the pipeline cancels them; slots keep two pipelines' training apart; an
approval gate waits for a person; a changed data file starts a run of the served deployment; bad team settings are
one error line."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from gptforge.pipeline.store import locate
from tests.conftest import ROOT
from tests.helpers import config, copy_store, free_port

pytestmark = pytest.mark.slow
PIPE = ["sft.enabled=false", "reward.enabled=false", "preference.enabled=false"]
POOLS = ["run.work_pools={tokenize: cpu, pretrain: gpu}", "run.default_work_pool=cpu"]
PREFECT = [sys.executable, "-m", "prefect"]
GPTFORGE = [sys.executable, "-m", "gptforge.pipeline.cli"]


def wait_for(predicate, timeout: float, what: str, poll: float = 0.5):
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


class Team:
    """The server and its workers; `api()` is a client of this server (whatever other server the session's
    tests use)."""

    def __init__(self, root: Path):
        self.root, self.procs = root, []
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/api"
        # os.environ holds gptforge's Prefect settings (tests/conftest.py: prefect_env.apply)
        self.env = {**os.environ, "PREFECT_HOME": str(root / "prefect-home"), "PREFECT_API_URL": self.url,
                    "PREFECT_WORKER_QUERY_SECONDS": "1"}
        self.start("server", PREFECT + ["server", "start", "--host", "127.0.0.1", "--port", str(port)])
        wait_for(self.healthy, 240, "the Prefect server")

    def start(self, name: str, cmd: list[str], **kw) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "a")  # a pipe nobody reads would fill up and block it
        proc = subprocess.Popen(cmd, env=kw.pop("env", self.env), stdout=log, stderr=subprocess.STDOUT,
                                cwd=kw.pop("cwd", ROOT), start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def healthy(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    @contextmanager
    def api(self):
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.url}), get_client(sync_client=True) as client:
            yield client

    def gptforge(self, *args, check=True, **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run(GPTFORGE + list(args), env=kw.pop("env", self.env), capture_output=True, text=True,
                              cwd=ROOT, timeout=kw.pop("timeout", 600), **kw)
        assert not check or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    def log(self, name: str, tail: int | None = 4000) -> str:
        return (self.root / f"{name}.log").read_text()[-tail if tail else 0:]

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + 10  # one grace period for all (the module's teardown took 31 s: 10 s for each in turn)
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    """Server, `gptforge deploy --slots 2` of a config that maps tokenize to `cpu` and pretrain to `gpu`, and a
    process worker for each pool."""
    root = tmp_path_factory.mktemp("team")
    t = Team(root)
    try:
        _, path = config(root / "deploy", *PIPE, *POOLS)
        out = t.gptforge("deploy", "-c", str(path), "--name", "team-test", "--slots", "2")
        assert "work pool 'gpu' created" in out.stdout and "automation" in out.stdout
        for pool in ("cpu", "gpu"):
            t.start(f"worker-{pool}", PREFECT + ["worker", "start", "--pool", pool, "--type", "process"])
        with t.api() as client:
            wait_for(lambda: all(client.read_workers_for_work_pool(p) for p in ("cpu", "gpu")), 120, "the workers")
        yield t
    finally:
        t.close()


def flow_runs(client, flow: str, **filters) -> list:
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow])), **filters)


def stage_runs(client, run_name: str) -> dict[str, list]:
    """{step: [its gptforge-stage flow runs]} of the pipeline run named `run_name` (or, run from a deployment, that
    name and its stamp)."""
    out: dict[str, list] = {}
    for run in flow_runs(client, "gptforge-stage"):
        if any(t == f"gptforge-run:{run_name}" or t.startswith(f"gptforge-run:{run_name}-") for t in run.tags):
            step = next(t.split(":", 1)[1] for t in run.tags if t.startswith("gptforge-step:"))
            out.setdefault(step, []).append(run)
    return out


def pipeline_run_of(client, run_name: str):
    runs = [r for r in flow_runs(client, "gptforge-pipeline")
            if r.parameters.get("config", {}).get("run", {}).get("name", "").startswith(run_name)]
    return runs[0] if runs else None


def record(cfg) -> dict:
    return json.loads((Path(cfg.run.root) / cfg.run.name / "run.json").read_text())


def test_stages_run_on_their_pools_and_outlive_the_pipeline(team, tokenized, tmp_path):
    """pretrain on `gpu`, as a child flow run of the pipeline's (tokenize reused; computed on `cpu`: the approval
    test). SIGKILL the pipeline's flow process while pretrain trains: pretrain trains on, a rerun joins it rather
    than starting a second copy or failing on its lock, and the killed run is marked Crashed by the automation once
    its heartbeats stop. pretrain's processes are stopped (SIGSTOP) from the kill until the rerun has joined, so
    that it is still training then however long the rerun takes to start, and continued (SIGCONT) after."""
    from tests.pipeline.test_deployment import stage_pids

    cfg, path = config(tmp_path, *PIPE, *POOLS, "pretrain.max_steps=40", "pretrain.save_every=10", "run.name=pools")
    copy_store(tokenized, tmp_path, "tokenize")
    first = team.start("pools-first", GPTFORGE + ["run", "-c", str(path)])
    ckpt = locate(cfg, "pretrain")[0] / "checkpoints" / "step-00000010" / "complete.json"
    wait_for(lambda: ckpt.exists() or first.poll() is not None, 400, "pretrain's first checkpoint")
    assert first.poll() is None, team.log("pools-first")
    held = stage_pids(str(tmp_path), "gptforge.stages.pretrain")
    assert len(held) >= 3, held  # the agent and its 2 ranks
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        os.killpg(first.pid, signal.SIGKILL)  # the pipeline's flow process and everything it started itself
        first.wait()
        with team.api() as client:
            (pretrain,) = stage_runs(client, "pools")["pretrain"]
            assert client.read_flow_run(pretrain.id).state.is_running()  # on the gpu worker, not the killed group
            killed = pipeline_run_of(client, "pools")
            again = team.start("pools-again", GPTFORGE + ["run", "-c", str(path)])
            wait_for(lambda: "joining flow run" in team.log("pools-again") or again.poll() is not None, 300,
                     "the rerun to join pretrain's flow run")
            assert "joining flow run" in team.log("pools-again"), team.log("pools-again")
    finally:
        resume(held)
    assert again.wait(600) == 0, team.log("pools-again")
    with team.api() as client:
        runs = stage_runs(client, "pools")
        assert runs.keys() == {"pretrain"} and len(runs["pretrain"]) == 1  # nothing ran twice (tokenize: reused)
        pools = {step: client.read_flow_run(r[0].id) for step, r in runs.items()}
        assert {s: r.work_pool_name for s, r in pools.items()} == {"pretrain": "gpu"}
        assert all(r.state.is_completed() and r.parent_task_run_id is not None for r in pools.values())
    stages = record(cfg)["stages"]
    assert stages["pretrain"]["status"] == "complete" and stages["pretrain"]["metrics"]["global_step"] == 40
    team.killed_pipeline = killed.id  # checked Crashed at the end of this module (three heartbeats later)


def test_cancelling_the_pipeline_cancels_its_stage_runs(team, tokenized, tmp_path):
    """A run of the deployed pipeline on the cpu worker: cancelled while pretrain trains on the gpu worker, its
    stage run is cancelled too and pretrain's processes are gone within seconds."""
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    from tests.pipeline.test_deployment import stage_pids

    copy_store(tokenized, tmp_path, "tokenize")
    cfg, _ = config(tmp_path, *PIPE, *POOLS, "pretrain.max_steps=100000", "pretrain.save_every=100000",
                    "run.name=cancelled")
    with team.api() as client:
        run = run_deployment("gptforge-pipeline/team-test", parameters={"config": cfg.model_dump(mode="json")},
                             timeout=0)
        marker = str(tmp_path)
        wait_for(lambda: stage_pids(marker, "gptforge.stages.pretrain"), 400, "pretrain's ranks")
        time.sleep(3)
        client.set_flow_run_state(run.id, Cancelling(), force=True)
        t0 = time.time()
        wait_for(lambda: not stage_pids(marker), 60, "pretrain's processes to end")
        print(f"stage processes gone {time.time() - t0:.1f} s after the cancel")
        wait_for(lambda: client.read_flow_run(run.id).state.is_final(), 120, "the pipeline run to end")
        assert client.read_flow_run(run.id).state.is_cancelled()
        (pretrain,) = stage_runs(client, "cancelled")["pretrain"]
        wait_for(lambda: client.read_flow_run(pretrain.id).state.is_final(), 60, "the stage run to end")
        assert client.read_flow_run(pretrain.id).state.is_cancelled()


def overlap(a: dict, b: dict) -> bool:
    """Whether two stages' processes ran at the same time (recorded while they held their slots)."""
    start, end = "processes_started_at", "processes_finished_at"
    return a[start] < b[end] and b[start] < a[end]


def test_two_pipelines_share_two_slots_without_overlapping(team, tokenized, tmp_path):
    """Two pipelines of one config in two roots against the server, one in its own process, one with its stages on
    the pools, their tokenize reused. Each pretraining takes both slots (2 processes), so one waits, showing
    `Waiting for slots` as the state of its flow run, and neither fails. The first pretraining's processes are
    stopped (SIGSTOP) once they hold the slots, until the other is seen waiting (or for 2 minutes at most), and then
    continued: short runs of 20 steps still meet."""
    from tests.pipeline.test_deployment import stage_pids

    runs = {"slots-a": [], "slots-b": POOLS}
    cfgs, procs = {}, {}
    for name, extra in runs.items():
        cfg, path = config(tmp_path / name, *PIPE, *extra, f"run.name={name}", "pretrain.max_steps=20",
                           "pretrain.save_every=1000")
        copy_store(tokenized, tmp_path / name, "tokenize")
        cfgs[name], procs[name] = cfg, team.start(name, GPTFORGE + ["run", "-c", str(path)])
    seen, held, stopped = set(), [], [0.0]
    with team.api() as client:
        def watch():
            if not stopped[0] and len(pids := stage_pids(str(tmp_path), "gptforge.stages.pretrain")) >= 3:
                held.extend(pids)  # the first pretraining's agent and 2 ranks, holding both slots
                for pid in held:
                    os.kill(pid, signal.SIGSTOP)
                stopped[0] = time.time()
            for name in runs:
                pipeline = pipeline_run_of(client, name)
                flows = [pipeline] + [r for v in stage_runs(client, name).values() for r in v] if pipeline else []
                seen.update(name for r in flows if r.state_name == "Waiting for slots")
            if held and (seen or time.time() - stopped[0] > 120):
                resume(held)
            return all(p.poll() is not None for p in procs.values())

        try:
            wait_for(watch, 600, "the two pipelines", poll=0.3)
        finally:
            resume(held)
    assert [p.returncode for p in procs.values()] == [0, 0], "".join(team.log(n) for n in runs)
    a, b = (record(c)["stages"]["pretrain"] for c in cfgs.values())
    assert a["status"] == b["status"] == "complete" and not overlap(a, b), (a, b)
    assert seen, "neither was seen waiting for slots"
    assert "waiting for 2 of the 2 slots" in "".join(team.log(n, tail=None) for n in (*runs, "worker-gpu"))


def resume(pids: list[int]) -> None:
    """SIGCONT every process of `pids` still there, and forget them."""
    while pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids.pop(), signal.SIGCONT)


def approve(client, run_id, run_input: dict) -> None:
    """Answer a paused run's approval as a person does from the UI: again while the run is still paused. A busy SQLite
    server can drop the transition (its state validation met a locked database in a CI run of 2026-12-06, and the
    approved run stayed paused for good)."""
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.responses import SetStateStatus

    deadline = time.time() + 120
    while client.read_flow_run(run_id).state_type == StateType.PAUSED:
        assert time.time() < deadline, "the run stayed paused"
        if client.resume_flow_run(run_id, run_input=run_input).status != SetStateStatus.ACCEPT:
            time.sleep(1)


def test_approval_gate_approved_then_rejected(team, tmp_path):
    """`run.approve_before: [pretrain]`, the stages on the pools: tokenize computes on `cpu` as a child flow run of
    the pipeline's, then the flow pauses, holding no slot; approved through the API it goes on without recomputing
    tokenize; rejected, the run ends Cancelled with the note
    in run.json and report. (The two runs have the same fingerprints in two roots: each computes its own root's
    outputs, neither joins the other's stage runs.)"""
    from prefect.client.schemas.objects import StateType

    cfgs, procs = {}, {}
    for name in ("approved", "rejected"):
        cfg, path = config(tmp_path / name, *PIPE, *POOLS, f"run.name={name}", "run.approve_before=[pretrain]",
                           "pretrain.max_steps=6")
        cfgs[name] = cfg
        procs[name] = team.start(name, GPTFORGE + ["run", "-c", str(path)])
    with team.api() as client:
        paused = {n: wait_for(lambda n=n: (r := pipeline_run_of(client, n)) and r.state_type == StateType.PAUSED and r,
                              300, f"{n} to pause") for n in cfgs}
        assert client.read_global_concurrency_limit_by_name("gptforge-gpus").active_slots == 0
        assert record(cfgs["approved"])["stages"]["pretrain"]["status"] == "awaiting approval"
        approve(client, paused["approved"].id, {"approve": True, "note": "tokens look right"})
        approve(client, paused["rejected"].id, {"approve": False, "note": "wrong tokenizer"})
        for proc in procs.values():
            proc.wait(400)
        states = {n: client.read_flow_run(r.id).state for n, r in paused.items()}
        (tokenize,) = stage_runs(client, "approved")["tokenize"]
        tokenize = client.read_flow_run(tokenize.id)
        assert tokenize.work_pool_name == "cpu" and tokenize.state.is_completed() and tokenize.parent_task_run_id
    assert procs["approved"].returncode == 0 and states["approved"].is_completed(), team.log("approved")
    ok = record(cfgs["approved"])["stages"]
    assert ok["tokenize"]["action"] == "computed" and ok["pretrain"]["status"] == "complete"
    assert ok["pretrain"]["output"] == str(locate(cfgs["approved"], "pretrain")[0])
    assert record(cfgs["rejected"])["stages"]["tokenize"]["output"] == str(locate(cfgs["rejected"], "tokenize")[0])
    assert ok["pretrain"]["approval"]["approve"] is True and ok["pretrain"]["approval"]["note"] == "tokens look right"
    assert procs["rejected"].returncode != 0 and states["rejected"].is_cancelled(), team.log("rejected")
    assert "error: run rejected cancelled: pretrain was rejected at its approval gate: wrong tokenizer" in \
        team.log("rejected")
    no = record(cfgs["rejected"])
    assert no["stages"]["pretrain"]["approval"] == {**no["stages"]["pretrain"]["approval"], "approve": False,
                                                    "note": "wrong tokenizer"}
    assert "processes_started_at" not in no["stages"]["pretrain"]  # it never started
    report = (Path(cfgs["rejected"].run.root) / "rejected" / "report.md").read_text()
    assert "rejected" in report and "wrong tokenizer" in report


def chats(n: int, offset: int = 0) -> str:
    rows = [{"messages": [{"role": "user", "content": f"what is {i} plus one?"},
                          {"role": "assistant", "content": f"{i + 1}"}]} for i in range(offset, offset + n)]
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_changed_sft_file_starts_one_run_that_recomputes_from_sft(team, chain, tmp_path):
    """The served deployment and its watch flow: after the first check, changing the local SFT file makes the next
    check emit gptforge.data.changed, and the deployment's trigger starts one run, in which tokenize and pretrain are
    reused and sft and its evaluation compute. A check with nothing changed starts no run."""
    data = tmp_path / "chats.jsonl"
    data.write_text(chats(64))
    cfg, path = config(tmp_path, "reward.enabled=false", "preference.enabled=false", f"data.sft={data}",
                       "run.name=watched", "run.watch_every=86400", "sft.max_steps=4")
    copy_store(chain["root"], tmp_path, "tokenize", "pretrain")
    team.start("serve", GPTFORGE + ["serve", "-c", str(path), "--name", "watch-test"],  # its runner polls each second
               env={**team.env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"})
    with team.api() as client:
        wait_for(lambda: any(d.name == "watch-test" for d in client.read_deployments()), 120, "the served deployment")
        (deployment,) = [d for d in client.read_deployments() if d.name == "watch-test" and d.flow_id == next(
            f.id for f in client.read_flows() if f.name == "gptforge-pipeline")]

        def pipeline_runs():
            from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

            only = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
            return client.read_flow_runs(deployment_filter=only)

        def check() -> str:
            return team.gptforge("watch", "-c", str(path)).stdout.strip().splitlines()[-1]

        check()  # the first check records the sources
        assert check() == "nothing changed" and pipeline_runs() == []
        data.write_text(chats(64, offset=100))
        assert check().startswith("changed: data.sft")  # (and the evaluation items SFT holds out of it)
        (run,) = wait_for(pipeline_runs, 120, "the triggered run")
        wait_for(lambda: client.read_flow_run(run.id).state.is_final(), 600, "the triggered run to end")
        assert client.read_flow_run(run.id).state.is_completed(), team.log("serve")
        assert check() == "nothing changed"
        time.sleep(3)  # (the runner polls every second: a run started by the check would be there by now)
        assert len(pipeline_runs()) == 1  # nothing new, no run
    (run_dir,) = Path(cfg.run.root).glob("watched-*")
    actions = {s: i["action"] for s, i in json.loads((run_dir / "run.json").read_text())["stages"].items()}
    assert actions == {"tokenize": "reused", "pretrain": "reused", "sft": "computed", "eval-sft": "computed"}


@pytest.mark.parametrize("overrides, error", [
    (["run.work_pools={pretrain: gpus}", "run.default_work_pool=cpu"],
     "run.work_pools: no work pool 'gpus' on"),
    (["distributed.nproc_per_node=4", "pretrain.micro_batch_size=4",
      *[f"{s}.micro_batch_size=2" for s in ("sft", "reward", "preference")]],
     "run.slots: the limit 'gptforge-gpus' has 2 slots, but stage pretrain needs 4"),
])
def test_bad_team_settings_are_one_line_before_anything_runs(team, tmp_path, overrides, error):
    cfg, path = config(tmp_path, *PIPE, *overrides)
    out = team.gptforge("run", "-c", str(path), check=False, timeout=120)
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1].startswith(f"error: {error}"), out.stderr
    assert not (Path(cfg.run.root) / "store").exists()


def test_zz_the_killed_pipeline_run_is_marked_crashed(team):
    """(Last in this module: by now the killed run's heartbeats have been missing for long enough.)"""
    if not hasattr(team, "killed_pipeline"):
        pytest.skip("needs test_stages_run_on_their_pools_and_outlive_the_pipeline first")
    with team.api() as client:
        state = wait_for(lambda: (s := client.read_flow_run(team.killed_pipeline).state).is_final() and s, 240,
                         "the automation to mark the killed run Crashed", poll=2)
    assert state.is_crashed(), state
