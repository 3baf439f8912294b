"""bench/environments.py shrunk to one seed that learns: GRPO on reasoning-gym's procedural datasets, rewarded by
the dataset's own check alone."""

import json
import re

import pytest

from tests.bench.run import bench, sets
from tests.helpers import FAST

pytestmark = pytest.mark.slow


def test_environments_bench(tmp_path):
    """One seed of one dataset within the suite: the SFT model copies the demonstrations' slip (an answer one too
    high) on most held-out items; GRPO, rewarded by reasoning-gym's own `score_answer` and nothing else, raises
    held-out accuracy (3 seeds of both datasets at the bench's settings: bench/RESULTS.md). At these settings seeds
    0-2 gave +0.33 (0.56 -> 0.89), +0.125 (0.48 -> 0.61) and +0.56 (0.27 -> 0.83) on 2026-12-07 (120 GRPO steps
    lifted seed 1 only to +0.20): the test asks +0.1, under the least of them, so that another CPU's seed 0 holds."""
    shrunk = [*FAST, "distributed.nproc_per_node=1", "pretrain.max_steps=300", "sft.max_steps=400",
              "sft.lr=2e-3", "sft.global_batch_size=32", "sft.micro_batch_size=16", "sft.save_every=200",
              "sft.eval_every=200", "preference.max_steps=60", "preference.lr=1e-4",
              "preference.global_batch_size=16", "preference.save_every=20", "eval.items=64"]
    out = bench("environments.py", "--seeds", "0", "--root", str(tmp_path), "--datasets", "chain_sum",
                "--documents", "1500", "--corpus-items", "2000", "--demonstrations", "2000", *sets(shrunk),
                one_core=True)
    sft, grpo = map(float, re.search(r"chain_sum: sft ([\d.]+) ± nan, grpo ([\d.]+) ± nan", out).groups())
    assert grpo >= sft + 0.1, out
    answers = [json.loads(line) for line in next((tmp_path / "store" / "eval-grpo").glob("*/answers.jsonl"))
               .read_text().splitlines()]
    slipped = sum(row["sft_response"].strip() == str(int(row["answer"]) + 1) for row in answers)
    assert slipped > len(answers) / 3, answers[:5]  # the SFT model copies the demonstrations' slip
