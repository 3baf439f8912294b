"""Verifiable rewards end to end on the fast chain's tiny models: GRPO (TRL) and our PPO rewarded by math_equal on a
generated GSM8K-shaped file (`#### n` answers), with no reward model and so no reward stage; PPO also by the user's
own function from a module in the working folder and by a reward server on 127.0.0.1, each called from the
launched processes, logged by name, and scoring the evaluation. Whether the accuracy rises is bench/rlvr.py's to
show, over seeds, on the demo's fully trained models: these are too small to answer."""

import importlib.util
import json

import pytest

from gptforge.core.config import pipeline_stages
from gptforge.model import rewards as rewards_module
from gptforge.pipeline.store import pipeline_steps
from tests.conftest import ROOT
from tests.helpers import config, logged, prepared, run_stage
from tests.model.test_rewards import RewardServer

pytestmark = pytest.mark.slow

spec = importlib.util.spec_from_file_location("rlvr_bench", ROOT / "bench" / "rlvr.py")
rlvr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rlvr)

STEPS = ["preference.max_steps=3", "preference.save_every=100", "preference.grpo.ptx_coef=0",
         "preference.ppo.ptx_coef=0", "eval.items=16", "distributed.zero_stage=2"]


def test_grpo_and_ppo_rewarded_by_math_equal_with_the_users_function_and_a_server(chain, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(prompts, responses, answers, **row):\n"
        "    assert set(row) == {'task'}, row  # the file's other column\n"
        "    return [-float(len(r)) for r in responses]\n")
    monkeypatch.chdir(tmp_path)  # the user's working folder: the launched stages import from it
    problems = rlvr.write_problems(tmp_path / "problems.jsonl", 400)
    server = RewardServer()
    try:
        rewards = [{"name": "math_equal"}, {"name": "my_rewards:brevity", "weight": 0.0},
                   {"url": server.url, "name": "remote", "weight": 0.0}]
        cfg, path = prepared(chain, tmp_path / "runs", *STEPS, f"data.prompts={problems}",
                             "preference.algorithm=[grpo,ppo]", "preference.rewards=[{name: math_equal}]")
        assert pipeline_stages(cfg) == ["tokenize", "pretrain", "sft", "grpo", "ppo"]  # no reward stage
        assert "reward" not in pipeline_steps(cfg)
        _, grpo_dir, _ = run_stage(cfg, path, "grpo")
        assert logged(grpo_dir, "rewards/math_equal") == pytest.approx(logged(grpo_dir, "reward_mean"), abs=1e-6)
        cfg, path = prepared(chain, tmp_path / "runs", *STEPS, f"data.prompts={problems}", "eval.samples=3",
                             "preference.algorithm=[grpo,ppo]", "preference.rewards=[{name: math_equal}]")
        grpo, eval_dir, _ = run_stage(cfg, path, "eval-grpo")
        cfg, path = config(tmp_path / "runs", *STEPS, f"data.prompts={problems}", "preference.algorithm=[grpo,ppo]",
                           f"preference.rewards={json.dumps(rewards)}")
        ppo_manifest, ppo_dir, _ = run_stage(cfg, path, "ppo")
        ppo = run_stage(cfg, path, "eval-ppo")[0]["metrics"]
    finally:
        server.close()
    assert ppo_manifest["inputs"].keys() == {"sft"}
    # the held-out accuracy is math_equal on the greedy answers the evaluation wrote, against the file's #### answers
    rows = [json.loads(line) for line in (eval_dir / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and rows[0]["answer"] == rlvr_answer(problems, rows[0]["prompt"])
    right = rewards_module.math_equal(None, [r["response"] for r in rows], [r["answer"] for r in rows])
    assert grpo["metrics"]["accuracy/math_equal"] == pytest.approx(sum(right) / len(rows), abs=1e-6)
    m = grpo["metrics"]
    assert 0 <= m["sft_accuracy/math_equal"] <= 1 and "win_rate_vs_sft" in m
    # pass@3 over the 16 held-out problems, for both models (its counting: tests/model/test_rewards.py)
    assert all(abs(16 * m[k] - round(16 * m[k])) < 1e-6 for k in ("pass@3/math_equal", "sft_pass@3/math_equal"))
    # each reward logged by name from the launched processes, and scoring the evaluation too
    assert server.state["seen"] >= 2 * 3  # each of PPO's 2 processes posts its rollouts every step, then the eval
    assert server.state["bodies"][0]["answers"][0] is not None and "task" in server.state["bodies"][0]
    assert {"rewards/math_equal", "rewards/brevity", "rewards/remote"} <= set(json.loads(
        (ppo_dir / "logs" / "metrics.jsonl").read_text().splitlines()[-1]))
    assert all(b < 0 for b in logged(ppo_dir, "rewards/brevity"))  # minus the length of every response
    assert logged(ppo_dir, "reward_mean") == pytest.approx(logged(ppo_dir, "rewards/math_equal"), abs=1e-6)  # weight 0
    assert ppo["accuracy/remote"] > 0 and ppo["accuracy/brevity"] < 0


def rlvr_answer(problems, prompt) -> str:
    """The #### answer of the file's row with this prompt."""
    for line in problems.read_text().splitlines():
        row = json.loads(line)
        if row["question"] == prompt[-1]["content"]:
            return row["answer"].rsplit("#### ", 1)[1]
    raise AssertionError(prompt)
