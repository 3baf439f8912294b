"""The evaluation step over finished outputs: after SFT (the SFT model and its base on the held-out items) and
after a preference stage (the report against the SFT model); changing what is evaluated reruns only this."""

import json
import subprocess
import sys

import pytest

from gptforge.data.splits import VAL_EVERY
from gptforge.model.eval.generation import win_rate
from gptforge.model.rewards import verify
from gptforge.pipeline.store import locate
from tests.conftest import DPO, ROOT
from tests.data.test_eval_set import user_files
from tests.helpers import UPSTREAM, config, copy_store, prepared, run_stage

pytestmark = pytest.mark.slow
REPORT = {"exact_match", "sft_exact_match", "win_rate_vs_sft", "reward_mean", "kl", "eval_items"}


def answers(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "answers.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def eval_sft(chain, tmp_path_factory):
    cfg, path = prepared(chain, tmp_path_factory.mktemp("eval"), "eval.harness_tasks=[gptforge_demo]")
    return (*run_stage(cfg, path, "eval-sft"), cfg, path)


def test_sft_evaluation(eval_sft):
    manifest, out_dir, _, cfg, _ = eval_sft
    m = manifest["metrics"]
    rows = answers(out_dir)
    assert m["eval_items"] == len(rows) == cfg.eval.items
    # both figures recomputed from each item's two answers
    assert m["exact_match"] == pytest.approx(sum(verify([r["response"]], [r["answer"]])[0] for r in rows) / len(rows))
    assert m["base_exact_match"] == pytest.approx(
        sum(verify([r["base_response"]], [r["answer"]])[0] for r in rows) / len(rows))
    assert manifest["inputs"].keys() == {"sft", "pretrain"}
    # lm-evaluation-harness on the demo's held-out items as a local task: the stage's own answers and exact match
    samples = [json.loads(line) for line in (out_dir / "harness/samples/gptforge_demo.jsonl").read_text().splitlines()]
    assert [s["filtered_resps"][0] for s in sorted(samples, key=lambda s: s["doc_id"])] == [r["response"] for r in rows]
    assert m["harness/gptforge_demo/exact_match/strip"] == pytest.approx(m["exact_match"])
    assert {"harness/results.json", "harness/gptforge_demo.yaml"} <= manifest["files"].keys()


def evaluate(path, out_dir, inputs: dict, *overrides) -> tuple[dict, list[dict]]:
    """The evaluation step by hand, one process (python -m gptforge.stages.evaluate): (metrics, answers)."""
    cmd = [sys.executable, "-m", "gptforge.stages.evaluate", "--config", str(path), "--out", str(out_dir)]
    cmd += [f"--input={k}={v}" for k, v in inputs.items()] + [f"--set={o}" for o in overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out_dir / "result.json").read_text())["metrics"], answers(out_dir)


def test_evaluation_on_the_users_chat_data(chain, tmp_path):
    """With data.sft a user's file: its held-out conversations, scored against their own answers; with prompts
    that have no answers (data.eval), the report says what it cannot compute instead of printing zeros."""
    files = user_files(tmp_path, n=200)
    _, path = config(tmp_path, f"data.sft={files['sft']}", "reward.policy_samples=0")
    models = {"sft": chain["sft"][1], "pretrain": chain["pretrain"][1]}
    m, rows = evaluate(path, tmp_path / "held-out", models)
    held_out = [json.loads(line) for line in open(files["sft"])][::VAL_EVERY]
    assert [r["answer"] for r in rows] == [r["output"] for r in held_out] and m["eval_items"] == len(held_out)
    assert m["exact_match"] == pytest.approx(sum(r["response"] == r["answer"] for r in rows) / len(rows))
    assert {"base_exact_match", "rouge_l", "base_rouge_l"} <= m.keys() and "unscored" not in m
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["instruction"]}) + "\n" for r in held_out))
    m, rows = evaluate(path, tmp_path / "prompts", models, f"data.eval={prompts}")
    assert m["unscored"] == f"no reference answers in data.eval={prompts}" and len(rows) == len(held_out)
    assert not {"exact_match", "rouge_l", "base_exact_match"} & m.keys()


def test_preference_evaluation_on_the_users_pairs(chain, dpo, tmp_path):
    """With data.preference a user's file: the held-out pairs' prompts, judged by the reward model; no exact
    match, which only the demo's verifiable items have."""
    files = user_files(tmp_path, n=200)
    _, path = config(tmp_path, f"data.preference={files['preference']}", "reward.policy_samples=0")
    models = {"dpo": dpo[1], "sft": chain["sft"][1], "reward": chain["reward"][1]}
    m, rows = evaluate(path, tmp_path / "held-out", models)
    prompts = {json.loads(line)["prompt"] for line in list(open(files["preference"]))[::VAL_EVERY]}
    assert {r["prompt"][0]["content"] for r in rows} == prompts and m["eval_items"] == len(prompts)
    assert {"win_rate_vs_sft", "reward_mean", "sft_reward_mean", "kl"} <= m.keys()
    assert not {"exact_match", "sft_exact_match"} & m.keys()
    # the judge's figures recomputed from each item's two answers and their scores
    assert m["win_rate_vs_sft"] == pytest.approx(win_rate(*zip(*[(r["response"], r["sft_response"], r["score"],
                                                                  r["sft_score"]) for r in rows])))
    assert m["reward_mean"] == pytest.approx(sum(r["score"] for r in rows) / len(rows))
    assert m["sft_reward_mean"] == pytest.approx(sum(r["sft_score"] for r in rows) / len(rows))


def test_changing_what_is_evaluated_reruns_the_evaluation_only(chain, eval_sft, tmp_path):
    cfg, path = prepared(chain, tmp_path, "eval.items=12")
    assert locate(cfg, "sft")[0].name == locate(eval_sft[3], "sft")[0].name  # the same SFT output
    assert locate(cfg, "eval-sft")[0].name != eval_sft[1].name
    manifest, out_dir, _ = run_stage(cfg, path, "eval-sft")
    assert manifest["metrics"]["eval_items"] == 12
    assert answers(out_dir) == answers(eval_sft[1])[:12]  # the same model, the first 12 of the same items


@pytest.fixture(scope="module")
def eval_dpo(dpo):
    _, _, _, cfg, path = dpo
    return run_stage(cfg, path, "eval-dpo")


def test_preference_evaluation(eval_dpo, eval_sft):
    manifest, out_dir, _ = eval_dpo
    m = manifest["metrics"]
    assert REPORT <= set(m) and manifest["inputs"].keys() == {"dpo", "sft", "reward"}
    assert m["sft_exact_match"] == eval_sft[0]["metrics"]["exact_match"]  # the same SFT model on the same items
    hits = sum(r["response"] == r["answer"] for r in answers(out_dir))
    assert m["exact_match"] == pytest.approx(hits / m["eval_items"])


def test_evaluation_on_every_process_matches_one_process(dpo, eval_dpo, tmp_path):
    """eval.processes=all under ZeRO-3: the models partitioned over 2 processes, each generating and scoring its
    share of the fixed batches in step with the other; the report and the answers are those of one process."""
    dpo_root = dpo[1].parents[2]  # <root>/store/dpo/<fingerprint>
    cfg, path = config(tmp_path, *DPO, "eval.processes=all", "distributed.zero_stage=3")
    copy_store(dpo_root, tmp_path, *UPSTREAM, "dpo")
    manifest, out_dir, output = run_stage(cfg, path, "eval-dpo")
    assert "[memory] rank 1:" in output  # two processes ran it
    one, every = eval_dpo[0]["metrics"], manifest["metrics"]
    assert answers(out_dir) == answers(eval_dpo[1])
    assert {k: every[k] for k in ("exact_match", "sft_exact_match", "win_rate_vs_sft", "eval_items")} == \
        {k: one[k] for k in ("exact_match", "sft_exact_match", "win_rate_vs_sft", "eval_items")}
    assert every["reward_mean"] == pytest.approx(one["reward_mean"], abs=1e-4)
    assert every["kl"] == pytest.approx(one["kl"], abs=1e-3)
