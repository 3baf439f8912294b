"""The evaluation step over finished outputs: after SFT (the SFT model and its base on the held-out items) and
after a preference stage (the report against the SFT model); changing what is evaluated reruns only this."""

import json

import pytest

from gptforge.pipeline.store import locate
from tests.conftest import DPO
from tests.helpers import UPSTREAM, config, copy_store, prepared, run_stage

pytestmark = pytest.mark.slow
REPORT = {"exact_match", "sft_exact_match", "win_rate_vs_sft", "reward_mean", "kl", "eval_items"}


def answers(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "answers.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def eval_sft(chain, tmp_path_factory):
    cfg, path = prepared(chain, tmp_path_factory.mktemp("eval"))
    return (*run_stage(cfg, path, "eval-sft"), cfg, path)


def test_sft_evaluation(eval_sft):
    manifest, out_dir, _, cfg, _ = eval_sft
    m = manifest["metrics"]
    rows = answers(out_dir)
    assert m["eval_items"] == len(rows) == cfg.eval.items
    assert m["exact_match"] == pytest.approx(sum(r["response"] == r["answer"] for r in rows) / len(rows))
    assert 0 <= m["base_exact_match"] <= 1 and manifest["inputs"].keys() == {"sft", "pretrain"}


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
