"""Shared fixtures: no network, small configs in tmp_path, one Prefect test server per session."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from gptforge.core.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
SMALL = [
    "data.demo.pretrain_docs=1500", "data.demo.sft_items=200", "data.demo.preference_pairs=200",
    "data.demo.eval_items=40", "tokenizer.vocab_size=320", "tokenizer.num_workers=2",
]


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


@pytest.fixture(scope="session")
def tokenized(tmp_path_factory) -> Path:
    """The root of the session's stage store, holding the demo's tokenize output under the tests' config: the chain
    below computes in it, and a test whose tokenize has the same fingerprint copies it from there
    (tests.helpers.tokenize_from)."""
    from tests.helpers import config, tokenize_in_process

    root = tmp_path_factory.mktemp("chain")
    tokenize_in_process(config(root)[0])
    return root


@pytest.fixture(scope="session")
def pretrained(tokenized):
    """pretrain (ZeRO-2, a real 2-process run) on the session's tokenize output: (manifest, out_dir, output)."""
    from tests.helpers import config, run_stage

    cfg, path = config(tokenized, "distributed.zero_stage=2")
    return run_stage(cfg, path, "pretrain")


@pytest.fixture(scope="session")
def chain(tokenized, pretrained):
    """tokenize -> pretrain (ZeRO-2) -> sft -> reward (ZeRO-3), uninterrupted, real 2-process runs, in one root
    shared by the stage tests: {"root": Path, stage: (manifest, out_dir, output)}."""
    from tests.helpers import config, run_stage

    out = {"root": tokenized, "pretrain": pretrained}
    cfg, path = config(tokenized, "distributed.zero_stage=3")  # ZeRO is not part of the fingerprints
    out["sft"] = run_stage(cfg, path, "sft")
    out["reward"] = run_stage(cfg, path, "reward")
    return out


DPO = ["preference.algorithm=dpo", "distributed.zero_stage=2", "preference.max_steps=6", "preference.lr=5e-4",
       "preference.save_every=2", "run.tracker=mlflow"]


@pytest.fixture(scope="session")
def dpo(chain, tmp_path_factory):
    """DPO (TRL, ZeRO-2, 2 processes) on the chain's SFT policy: (manifest, out_dir, output, cfg, path)."""
    from tests.helpers import prepared, run_stage

    cfg, path = prepared(chain, tmp_path_factory.mktemp("dpo"), *DPO)
    return (*run_stage(cfg, path, "dpo"), cfg, path)


PPO = ["preference.algorithm=ppo", "distributed.zero_stage=2", "preference.max_steps=6",
       "preference.save_every=2", "preference.global_batch_size=8", "preference.micro_batch_size=2"]


@pytest.fixture(scope="session")
def ppo(chain, tmp_path_factory):
    """Our PPO (ZeRO-2, 2 processes) on the chain's SFT policy and reward model: (manifest, out_dir, output)."""
    from tests.helpers import prepared, run_stage

    cfg, path = prepared(chain, tmp_path_factory.mktemp("ppo"), *PPO)
    return run_stage(cfg, path, "ppo")
