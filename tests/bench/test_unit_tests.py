"""bench/unit_tests.py shrunk to one seed that learns: code scored by unit tests run in the sandbox."""

import json
import re

import pytest

from tests.bench.run import bench, sets
from tests.helpers import FAST

pytestmark = pytest.mark.slow


def test_unit_tests_bench(tmp_path):
    """One seed within the suite (about 3 minutes of a core): the SFT model writes the demonstrations' program with
    their slip (a multiplier one too high, which passes one test of three); GRPO, rewarded by the share of the
    row's unit tests its program passes in the sandbox and nothing else, raises that share on held-out problems
    (3 seeds and the bench's settings: bench/RESULTS.md). At these settings seeds 0-2 gave 0.31 -> 0.65 (+0.34),
    0.20 -> 0.22 (+0.02: its SFT model copied the constant too rarely) and 0.33 -> 0.50 (+0.17) on 2026-12-07: no
    margin holds for every seed, so the test asserts the direction, as the bench's 3 seeds show it."""
    shrunk = [*FAST, "distributed.nproc_per_node=1", "pretrain.max_steps=100", "sft.max_steps=400", "sft.lr=2e-3",
              "sft.global_batch_size=32", "sft.micro_batch_size=16", "sft.save_every=200", "sft.eval_every=200",
              "preference.max_steps=40", "preference.lr=1e-4", "preference.global_batch_size=16",
              "preference.save_every=20", "eval.items=64"]
    out = bench("unit_tests.py", "--seeds", "0", "--root", str(tmp_path), "--documents", "1500", "--lines", "400",
                "--problems", "1000", "--demonstrations", "2000", "--algorithms", "grpo", *sets(shrunk),
                one_core=True)
    passed = {a: float(re.search(rf"  {a}: +([\d.]+) ± nan", out).group(1)) for a in ("sft", "grpo")}
    assert passed["grpo"] > passed["sft"], out  # the direction
    answers = [json.loads(line) for line in next((tmp_path / "store" / "eval-grpo").glob("*/answers.jsonl"))
               .read_text().splitlines()]
    slipped = 0
    for row in answers:
        a, b = map(int, re.search(r"returns (\d+) times x plus (\d+)", row["prompt"][0]["content"]).groups())
        slipped += row["sft_response"].strip() == f"def f(x): return {a + 1} * x + {b}"
        if row["response"].strip() == f"def f(x): return {a} * x + {b}":
            assert row["score"] == 1.0, row  # the right program passes all three tests in the sandbox
    assert slipped > len(answers) / 2, answers[:5]  # the SFT model copies the demonstrations' slip
