"""RLOO with TRL (ZeRO-2, 2 processes), rewarded by the reward model alone, with the ptx term."""

import pytest

from gptforge.model.train.metrics import check_names
from tests.helpers import changed_from_sft, logged, logged_names, prepared, run_stage

pytestmark = pytest.mark.slow


def test_rloo(chain, tmp_path):
    cfg, path = prepared(chain, tmp_path, "preference.algorithm=rloo", "distributed.zero_stage=2",
                         "preference.max_steps=2",
                         "preference.rewards=[{name: reward_model}]")
    manifest, out_dir, _ = run_stage(cfg, path, "rloo")
    assert manifest["metrics"]["global_step"] == 2
    assert changed_from_sft(chain, out_dir)
    ptx = logged(out_dir, "ptx_loss")  # tiny.yaml: preference.rloo.ptx_coef > 0, the chosen responses' loss
    assert len(ptx) == 2 and all(0 < x < 10 for x in ptx), ptx
    names = logged_names(out_dir)
    assert {"loss", "lr", "reward_mean", "kl", "kl_per_token", "response_length", "rewards/reward_model"} <= names
    check_names(dict.fromkeys(names))
    assert "rewards/exact_match" not in names
    assert logged(out_dir, "reward_mean") == pytest.approx(logged(out_dir, "rewards/reward_model"), abs=1e-4)
