"""Independent branches in parallel: with `preference.algorithm: [dpo, ppo]` both start as soon as SFT and the
reward model are complete, overlap in time, and give what each gives when run alone."""

import json
from pathlib import Path

import pytest

from gptforge.model.train.metrics import MEASURED
from gptforge.pipeline.flow import pipeline_flow
from tests.conftest import PPO
from tests.helpers import prepared, run_stage

pytestmark = pytest.mark.slow
SETTINGS = [s for s in PPO if not s.startswith("preference.algorithm")]  # the ppo fixture's, shared by both


def test_dpo_and_ppo_overlap_and_each_matches_its_run_alone(prefect_server, chain, ppo, tmp_path):
    cfg, _ = prepared(chain, tmp_path / "both", "preference.algorithm=[dpo,ppo]", *SETTINGS)
    pipeline_flow(config=cfg, from_stage="dpo")  # dpo, eval-dpo, ppo, eval-ppo on the chain's sft and reward
    stages = json.loads((Path(cfg.run.root) / cfg.run.name / "run.json").read_text())["stages"]
    dpo, ppo_run = stages["dpo"], stages["ppo"]
    start, end = "processes_started_at", "processes_finished_at"
    assert dpo[start] < ppo_run[end] and ppo_run[start] < dpo[end], (dpo, ppo_run)  # each began before the other ended
    alone_cfg, path = prepared(chain, tmp_path / "alone", "preference.algorithm=dpo", *SETTINGS)
    alone = {"dpo": run_stage(alone_cfg, path, "dpo")[0]["metrics"], "ppo": ppo[0]["metrics"]}  # ppo: the fixture's
    for step, metrics in alone.items():
        together = stages[step]["metrics"]
        for key, value in metrics.items():
            if key not in MEASURED and isinstance(value, (int, float)):
                assert together[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
