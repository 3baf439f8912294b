"""The pipeline as its users drive it from Prefect: a served deployment (`gptforge serve`) on a Prefect
test server, runs started with custom parameters, a config typo, cancellation, reuse, resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptforge.pipeline.store import locate
from tests.helpers import config, copy_store

pytestmark = pytest.mark.slow
DEPLOYMENT = "gptforge-pipeline/gptforge-test"
PIPE = ["sft.enabled=false", "reward.enabled=false", "preference.enabled=false"]


def stage_pids(marker: str, *also: str) -> list[int]:
    """Processes whose command line mentions `marker` (the test's run root) and each of `also`."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
                if all(m in cmd for m in (marker, *also)) and int(d.name) != os.getpid():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


@pytest.fixture(scope="module")
def served(prefect_server, tmp_path_factory):
    """`gptforge serve` in a subprocess, pointed at the test server."""
    from prefect.settings import PREFECT_API_URL

    root = tmp_path_factory.mktemp("served")
    cfg, path = config(root, *PIPE)
    # the runner looks for scheduled runs every second (its default: 10 s, which each run here would wait for)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    log = open(root / "serve.log", "w")  # a pipe nobody reads would fill up and block the server
    cmd = [sys.executable, "-m", "gptforge.pipeline.cli", "serve", "-c", str(path), "--name", "gptforge-test"]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    from prefect.client.orchestration import get_client

    deadline = time.time() + 120
    with get_client(sync_client=True) as client:
        while True:
            try:
                client.read_deployment_by_name(DEPLOYMENT)
                break
            except Exception:  # not registered yet
                assert proc.poll() is None and time.time() < deadline, (root / "serve.log").read_text()[-3000:]
                time.sleep(1)
    yield cfg
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)
    log.close()


def start(cfg, **kw):
    from prefect.deployments import run_deployment

    return run_deployment(DEPLOYMENT, parameters={"config": json.loads(json.dumps(cfg.model_dump(mode="json"))), **kw},
                          timeout=0)


def wait(flow_run, timeout=300):
    from prefect.client.orchestration import get_client

    deadline = time.time() + timeout
    with get_client(sync_client=True) as client:
        while True:
            state = client.read_flow_run(flow_run.id).state
            if state.is_final():
                return state
            assert time.time() < deadline, f"flow run still {state.name}"
            time.sleep(1)


def run_dir(cfg, flow_run) -> Path:
    """A deployment's run writes <root>/<run.name>-<start time>-<flow run id[:6]>/."""
    (found,) = Path(cfg.run.root).glob(f"{cfg.run.name}-*-{str(flow_run.id)[:6]}")
    return found


def run_json(cfg, flow_run) -> dict:
    return json.loads((run_dir(cfg, flow_run) / "run.json").read_text())


def test_run_with_custom_parameters_then_reuse(served, tmp_path):
    cfg, _ = config(tmp_path, *PIPE, "pretrain.max_steps=6", "run.name=custom")
    first = start(cfg)
    assert wait(first).is_completed()
    record = run_json(cfg, first)
    assert {s: i["action"] for s, i in record["stages"].items()} == {"tokenize": "computed", "pretrain": "computed"}
    assert record["stages"]["pretrain"]["metrics"]["global_step"] == 6  # the custom parameter took effect
    assert (run_dir(cfg, first) / "report.md").is_file()
    t0 = time.time()
    second = start(cfg)
    assert wait(second).is_completed()
    assert {i["action"] for i in run_json(cfg, second)["stages"].values()} == {"reused"}
    print(f"rerun with nothing changed: {time.time() - t0:.1f}s")
    # each run has its own directory, and `gptforge status` lists both
    status = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "status", "--root", cfg.run.root],
                            capture_output=True, text=True)
    assert status.returncode == 0 and run_dir(cfg, first).name in status.stdout and \
        run_dir(cfg, second).name in status.stdout and "2 complete" in status.stdout


def test_config_typo_is_refused_before_any_run(served, tmp_path):
    """The deployment enforces the config's schema (every section forbids unknown keys): the server refuses a run
    whose parameters hold a misspelt key, naming it, and nothing runs."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import PrefectHTTPStatusError

    cfg, _ = config(tmp_path, *PIPE)
    params = json.loads(json.dumps(cfg.model_dump(mode="json")))
    params["pretrain"]["lrr"] = 1.0
    with get_client(sync_client=True) as client:
        before = len(client.read_flow_runs())
    with pytest.raises(PrefectHTTPStatusError) as refused:
        run_deployment(DEPLOYMENT, parameters={"config": params}, timeout=0)
    assert refused.value.response.status_code == 409 and "'lrr' was unexpected" in str(refused.value)
    with get_client(sync_client=True) as client:
        assert len(client.read_flow_runs()) == before
    assert not (Path(cfg.run.root) / "store").exists()


def test_cancel_kills_every_stage_process(served, tokenized, tmp_path):
    """The stage runs in a task thread of the served flow's process (on a worker: test_team.py's cancel test), and
    the flow's cancellation kills its process group."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    cfg, _ = config(tmp_path, *PIPE, "pretrain.max_steps=100000", "pretrain.save_every=100000")
    copy_store(tokenized, tmp_path, "tokenize")
    run = start(cfg)
    marker = str(tmp_path)
    deadline = time.time() + 300
    while not any("gptforge.stages.pretrain" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                  for p in stage_pids(marker) if Path(f"/proc/{p}").exists()):
        assert time.time() < deadline, "pretrain never started"
        time.sleep(0.5)
    while not (locate(cfg, "pretrain")[0] / "logs").is_dir():  # the ranks are in training
        assert time.time() < deadline, "pretrain never trained"
        time.sleep(0.5)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling(), force=True)
    deadline = time.time() + 60
    while stage_pids(marker):
        assert time.time() < deadline, f"stage processes still alive: {stage_pids(marker)}"
        time.sleep(0.5)
    state = wait(run, 120)
    assert state.is_cancelled(), state
    assert run_json(cfg, run)["stages"]["pretrain"]["status"] == "cancelled"


def test_killed_stage_is_resumed_by_the_retry(served, tokenized, tmp_path):
    cfg, _ = config(tmp_path, *PIPE, "pretrain.max_steps=60", "pretrain.save_every=10", "run.retries=1",
                    "run.retry_delay=0")
    copy_store(tokenized, tmp_path, "tokenize")
    run = start(cfg)
    ckpt = locate(cfg, "pretrain")[0] / "checkpoints" / "step-00000010" / "complete.json"
    deadline = time.time() + 300
    while not ckpt.exists():
        assert time.time() < deadline
        time.sleep(0.1)
    for pid in stage_pids("gptforge.stages.pretrain"):
        if str(tmp_path) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert wait(run).is_completed()
    record = run_json(cfg, run)["stages"]["pretrain"]
    assert record["action"] == "resumed" and record["metrics"]["global_step"] == 60
