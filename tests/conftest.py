"""Shared fixtures: no network, small configs in tmp_path, one Prefect test server per session."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that wait by sleeping, not spinning (set before torch loads libgomp; every process the tests start
# inherits it). Two xdist workers share the 2 cores: a process running 2 threads beside the other worker's ranks
# spun on the busy core at each parallel region's end. A 1-process pretrain of 60 steps beside one busy core took
# 150 s (149 s of CPU) with OpenMP's default policy, 14 s with PASSIVE (12 s alone, default).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Inductor compiles in this process rather than in a pool of compile workers it would start in each rank (the
# compiled pretraining under accelerate, cold cache: 86 s of CPU in all with the pool, 74 s without).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from gptforge.pipeline import prefect_env  # noqa: E402

prefect_env.apply()  # the Prefect settings gptforge runs with (a busy server's 503s retried), for every server and CLI

import fcntl  # noqa: E402
import pickle  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from gptforge.core.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
SMALL = [
    "data.demo.pretrain_docs=1500", "data.demo.sft_items=200", "data.demo.preference_pairs=200",
    "data.demo.eval_items=40", "tokenizer.vocab_size=320", "tokenizer.num_workers=2",
]


# The longest files, by their seconds in the suite (a full run on 2026-12-07; tests/README.md's table): `make test`
# hands them out first (--no-loadscope-reorder; pytest-xdist otherwise starts the files with the most tests first), so
# that the files of a few seconds are the ones left to even out the two workers at the end. A file missing here only
# runs later.
LONGEST_FIRST = [
    "tests/bench/test_agentic.py", "tests/pipeline/test_two_hosts.py", "tests/bench/test_training.py",
    "tests/pipeline/test_team.py", "tests/stages/test_async_rollouts.py", "tests/bench/test_chained.py",
    "tests/bench/test_unit_tests.py", "tests/bench/test_browser.py", "tests/stages/test_agents.py",
    "tests/stages/test_pretrain.py", "tests/stages/test_async_trl.py", "tests/bench/test_data.py",
    "tests/stages/test_curate.py", "tests/stages/test_pretrained.py", "tests/stages/test_long_context.py",
    "tests/bench/test_environments.py",
]


def pytest_collection_modifyitems(items):
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as collected


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skipped test fails the run, naming why it skipped: CI installs everything the suite needs, so a
    skip there is a proof that did not run. Only a test marked `gpu` may skip there (CI's machine has none)."""
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and os.environ.get("CI") == "true" and not hasattr(report, "wasxfail")
            and item.get_closest_marker("gpu") is None):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where no test may skip: {reason}"


@pytest.fixture
def small_cfg(tmp_path):
    """A fast tiny pipeline config rooted in tmp_path; extra overrides as arguments."""

    def make(*overrides):
        return load_config(TINY, [f"run.root={tmp_path / 'runs'}", *SMALL, *overrides])

    return make


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def once(tmp_path_factory, name: str, build):
    """A session fixture's value, built once for the whole run: under pytest-xdist (`make test` runs two workers)
    the first worker to ask builds it under a lock in the folder the workers share, and the other waits for it and
    loads it. Without xdist, built here."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build()
    shared = tmp_path_factory.getbasetemp().parent
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        value = shared / f"{name}.pickle"
        if value.exists():
            return pickle.loads(value.read_bytes())
        out = build()
        value.write_bytes(pickle.dumps(out))
        return out


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder for a session fixture: one for the whole run under xdist (see `once`)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.mktemp(name)
    d = tmp_path_factory.getbasetemp().parent / name
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture(scope="session")
def tokenized(tmp_path_factory) -> Path:
    """The root of the session's stage store, holding the demo's tokenize output under the tests' config: the chain
    below computes in it, and a test whose tokenize has the same fingerprint copies it from there
    (tests.helpers.tokenize_from)."""
    from tests.helpers import config, tokenize_in_process

    def build():
        root = shared_dir(tmp_path_factory, "chain")
        tokenize_in_process(config(root)[0])
        return root

    return once(tmp_path_factory, "tokenized", build)


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory, tokenized):
    """pretrain (ZeRO-2, a real 2-process run) on the session's tokenize output: (manifest, out_dir, output)."""
    from tests.helpers import config, run_stage

    cfg, path = config(tokenized, "distributed.zero_stage=2")
    return once(tmp_path_factory, "pretrained", lambda: run_stage(cfg, path, "pretrain"))


@pytest.fixture(scope="session")
def chain(tmp_path_factory, tokenized, pretrained):
    """tokenize -> pretrain (ZeRO-2) -> sft -> reward (ZeRO-3), uninterrupted, real 2-process runs, in one root
    shared by the stage tests: {"root": Path, stage: (manifest, out_dir, output)}."""
    from tests.helpers import config, run_stage

    def build():
        out = {"root": tokenized, "pretrain": pretrained}
        cfg, path = config(tokenized, "distributed.zero_stage=3")  # ZeRO is not part of the fingerprints
        out["sft"] = run_stage(cfg, path, "sft")
        out["reward"] = run_stage(cfg, path, "reward")
        return out

    return once(tmp_path_factory, "chain", build)


DPO = ["preference.algorithm=dpo", "distributed.zero_stage=2", "preference.max_steps=6", "preference.lr=5e-4",
       "preference.save_every=2", "run.tracker=mlflow"]


@pytest.fixture(scope="session")
def dpo(chain, tmp_path_factory):
    """DPO (TRL, ZeRO-2, 2 processes) on the chain's SFT policy: (manifest, out_dir, output, cfg, path)."""
    from tests.helpers import prepared, run_stage

    def build():
        cfg, path = prepared(chain, shared_dir(tmp_path_factory, "dpo"), *DPO)
        return (*run_stage(cfg, path, "dpo"), cfg, path)

    return once(tmp_path_factory, "dpo", build)


PPO = ["preference.algorithm=ppo", "distributed.zero_stage=2", "preference.max_steps=6",
       "preference.save_every=2", "preference.global_batch_size=8", "preference.micro_batch_size=2"]


@pytest.fixture(scope="session")
def ppo(chain, tmp_path_factory):
    """Our PPO (ZeRO-2, 2 processes) on the chain's SFT policy and reward model: (manifest, out_dir, output)."""
    from tests.helpers import prepared, run_stage

    def build():
        cfg, path = prepared(chain, shared_dir(tmp_path_factory, "ppo"), *PPO)
        return run_stage(cfg, path, "ppo")

    return once(tmp_path_factory, "ppo", build)
