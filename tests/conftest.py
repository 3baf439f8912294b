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
def chain(tmp_path_factory):
    """tokenize -> pretrain (ZeRO-2) -> sft -> reward (ZeRO-3), uninterrupted, real 2-process runs, in one root
    shared by the stage tests: {"root": Path, stage: (manifest, out_dir, output)}."""
    from tests.helpers import config, run_stage, tokenize_in_process

    root = tmp_path_factory.mktemp("chain")
    cfg, path = config(root, "distributed.zero_stage=2")
    tokenize_in_process(cfg)
    out = {"root": root, "pretrain": run_stage(cfg, path, "pretrain")}
    cfg, path = config(root, "distributed.zero_stage=3")  # ZeRO is not part of the fingerprints
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
