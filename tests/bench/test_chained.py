"""The benches run on the session chain's store, shrunk: PPO, from a pretrained model, the demo's seeds and RLVR,
async rollouts."""

import json
import re
from pathlib import Path

import pytest

from tests.bench.run import CHAINED, bench, sets
from tests.helpers import UPSTREAM, copy_store

pytestmark = pytest.mark.slow


def test_ppo_bench(chain):
    out = bench("ppo.py", "-c", str(chain["root"] / "pipeline.yaml"), "--prompts", "8", "--new-tokens", "4")
    assert re.search(r"ratio cache/no cache: [\d.]+x  \(same tokens: True\)", out), out  # the same sampled tokens
    assert re.search(r"one PPO iteration .*\n  generation .*\n  scoring .*\n  training ", out), out


def actions(run_dir: Path) -> dict[str, str]:
    return {s: e["action"] for s, e in json.loads((run_dir / "run.json").read_text())["stages"].items()}


def test_from_pretrained_bench(chain, tmp_path):
    """On the session's pretrained model (its store copied: the bench's tokenize and pretrain are reused)."""
    copy_store(chain["root"], tmp_path / "demo", "tokenize", "pretrain")
    out = bench("from_pretrained.py", "--sft-steps", "3", "--root", str(tmp_path), *sets(CHAINED))
    assert re.search(r"lora SFT: +exact_match [\d.]+", out) and re.search(r"full SFT: +exact_match", out), out
    assert f"val_loss {chain['pretrain'][0]['metrics']['val_loss']}" in out  # the session's pretrained model


def test_demo_seeds_and_rlvr_benches(chain, tmp_path):
    """One store, the session chain's: bench/demo_seeds.py reuses its tokenize, pretrain, SFT and reward model and
    computes SFT's evaluation and DPO; bench/rlvr.py reuses tokenize and pretrain (its SFT learns from its own
    demonstrations)."""
    copy_store(chain["root"], tmp_path, *UPSTREAM)
    out = bench("demo_seeds.py", "--seeds", "0", "--root", str(tmp_path), *sets(CHAINED))
    assert re.search(r"\| sft \| [\d.]+ \|", out) and "| dpo |" in out and "| reward accuracy |" in out, out
    assert actions(tmp_path / "seed0") == {**dict.fromkeys(UPSTREAM, "reused"), "eval-sft": "computed",
                                           "dpo": "computed", "eval-dpo": "computed"}
    # at this size SFT answers nothing right: a format reward (an answer of digits alone) gives the groups a spread
    out = bench("rlvr.py", "--seeds", "0", "--root", str(tmp_path), "--problems", "200", "--demonstrations", "200",
                "--losses", "dapo", "--dynamic", "off", "on", *sets([*CHAINED, r"preference.format_pattern=\d+",
                "preference.rewards=[{name: math_equal}, {name: format}]"]))
    assert re.search(r"rewarded by math_equal \+ format; SFT [\d.]+ ± nan\n", out), out
    rows = {m[0]: m[1:] for m in re.findall(r"^\| (grpo dapo|grpo dapo \+ds|ppo) \| ([\d.]+) ± nan \| [+-][\d.]+ ± nan "
                                            r"points[^|]* \| ([\d.]+|-)(?: ± nan)? \| ([\d.]+|-)(?: ± nan)? \|$",
                                            out, re.M)}
    assert rows.keys() == {"grpo dapo", "grpo dapo +ds", "ppo"}, out
    # the share of zero-advantage groups trained: as drawn without dynamic sampling, fewer with it
    _, drawn, trained = rows["grpo dapo"]
    assert float(drawn) > 0 and trained == drawn, out
    _, drawn, trained = rows["grpo dapo +ds"]
    assert float(trained) < float(drawn), out


def test_async_rl_bench(chain, tmp_path):
    """bench/async_rl.py on the session chain's store: PPO sync and async (a rollout worker), 4 steps each."""
    copy_store(chain["root"], tmp_path, *UPSTREAM)
    out = bench("async_rl.py", "--seeds", "0", "--algorithms", "ppo", "--root", str(tmp_path), "--steps", "4",
                *sets(CHAINED))
    assert re.search(r"\| ppo \| sync \| [\d.]+ ± nan \| [\d.]+ ± nan \|\n\| ppo \| async \| [\d.]+ ± nan", out), out
    assert re.search(r"ppo step time sync / async: [\d.]+x", out), out
    work = dict(re.findall(r"^work: ppo (sync|async): (.*)$", out, re.M))  # a ratio of the same work
    assert work["sync"] == work["async"] == "[4] steps, [4] updates", out
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_distill_bench(chain, tmp_path):
    """bench/distill.py on the session chain's store (tokenize and pretrain reused): GRPO 4 steps as the teacher,
    on-policy and off-policy distillation at 1 and 2 steps, and a half-size student; every row of the table, the
    same teacher-scored tokens for both kinds of distillation within their responses' lengths, and the plot."""
    copy_store(chain["root"], tmp_path, *UPSTREAM)
    out = bench("distill.py", "--seeds", "0", "--root", str(tmp_path), "--problems", "200", "--demonstrations", "200",
                "--steps", "1", "2", *sets([*CHAINED, "preference.max_steps=4", "eval.items=20"]))
    rows = {}
    for row in ("sft | 0", "grpo | 4", "on-policy 1 | 1", "on-policy 2 | 2", "off-policy 1 | 1", "off-policy 2 | 2",
                "small sft | 0", "small distilled | 2"):
        found = re.search(rf"^\| {re.escape(row)} \| ([\d.]+) \| ([\d.]+) ± nan \| (-?\d+|nan)% \|$", out, re.M)
        assert found and found[1] == found[2], (row, out)  # one seed: its accuracy is the mean
        rows[row.split(" | ")[0]] = float(found[1]), found[3]
    # recovered: the share of the teacher's gain over SFT each row reaches, from the table's own accuracies (none
    # where the teacher gained nothing)
    sft, gain = rows["sft"][0], rows["grpo"][0] - rows["sft"][0]
    for name, (accuracy, recovered) in rows.items():
        assert recovered == (f"{(accuracy - sft) / gain:.0%}"[:-1] if gain else "nan"), (name, out)
    # the same teacher-scored tokens for both kinds of distillation: as many sequences (64 a step), each of the
    # distill stage's max_new_tokens (8) at most; the two models' lengths differ by a few tokens a sequence
    scored = {k: int(v) for k, v in re.findall(r"^teacher-scored tokens, (.+): (\d+) a seed$", out, re.M)}
    for n in (1, 2):
        on, off = scored[f"on-policy {n}"], scored[f"off-policy {n}"]
        assert n * 64 <= min(on, off) and max(on, off) <= n * 64 * 8 and 0.8 < on / off < 1.25, (n, scored)
    assert (tmp_path / "distill.png").stat().st_size > 0


def test_continuous_batching_bench(chain):
    """bench/continuous_batching.py on the session's SFT model, 8 prompts: both samplers' rates and their ratio,
    and each one's log-probabilities of its own samples at the trainer's (rounding), which a sampler that returned
    another distribution's would break."""
    out = bench("continuous_batching.py", "--model", str(chain["sft"][1] / "model"), "--prompts", "8",
                "--max-new-tokens", "8", "--repeats", "1")
    for name in ("static", "continuous"):
        found = re.search(rf"^{name}: \d+ response tokens/s, length [\d.]+ ± [\d.]+ \(max \d+\), \|logp - trainer's\| "
                          r"([\d.e+-]+) a token$", out, re.M)
        assert found and float(found.group(1)) < 1e-4, out
    assert re.search(r"^continuous / static: [\d.]+x", out, re.M), out
