"""Verifiable rewards: GRPO in each loss of its family, with and without dynamic sampling, and PPO, rewarded by
`math_equal` alone (no reward model, no reward stage) on a generated GSM8K-shaped file of arithmetic problems
(`question`, and a worked `answer` ending in `#### n`), against the SFT model, over several seeds, one table.
Reported for each: held-out `math_equal` accuracy (greedy) as the mean over the seeds with its standard error, its
gain over SFT with the standard error of the paired difference (the same held-out problems, the same seed), and the
share of zero-advantage groups (all rewards equal) among the groups drawn and among those trained, the means over
the run's steps (`rollout/zero_advantage_groups`, `rollout/zero_advantage_trained`).

    .venv/bin/python bench/rlvr.py [-c configs/tiny.yaml] [--seeds 0 1 2] [--root runs/rlvr] [--problems 4000]
                                   [--losses grpo dr_grpo dapo gspo cispo] [--dynamic off on] [--no-ppo]
                                   [--set k=v ...]

The losses (`preference.grpo`): grpo (each sequence's tokens averaged, rewards scaled by the group's std), dr_grpo
(Dr. GRPO: a constant length, no std scaling), dapo (the batch's tokens, clip-higher 0.28), gspo (dapo with one
ratio a sequence), cispo (clipped importance weights, epsilon max 5.0). Dynamic sampling draws up to 3 generation
batches a step.

The problems are the demo's arithmetic in GSM8K's shape (successor, larger, smaller, one- and two-digit sums), so
that the demo's pretrained model starts with the skill. SFT then learns from the user's own demonstrations of the
same tasks (`data.sft`), a share of which (`--slips`, 0.6) slip by one, always upwards: demonstrations with a
systematic flaw, which the SFT model copies (its greedy answer is mostly the slip) while its samples still give the
right answer often enough for the checker to reward; RL with verifiable rewards is made for that case. With
`--slips 0` the demonstrations are right and the checker has only the model's own errors to work on. Tokenize and
pretrain are the demo pipeline's, reused from the store where they are complete (bench/demo_seeds.py shares it
with --root).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import gain, mean_se, run_seed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS = {  # question, worked answer, final answer
    "succ": lambda a, b: (f"What number comes after {a}?", f"{a} + 1 = {a + 1}", a + 1),
    "max": lambda a, b: (f"Which is larger, {a} or {b}?", f"{max(a, b)} is more than {min(a, b)}", max(a, b)),
    "min": lambda a, b: (f"Which is smaller, {a} or {b}?", f"{min(a, b)} is less than {max(a, b)}", min(a, b)),
    "add1": lambda a, b: (f"What is {a % 10} plus {b % 10}?", f"{a % 10} + {b % 10} = {a % 10 + b % 10}",
                          a % 10 + b % 10),
    "add2": lambda a, b: (f"What is {a} plus {b}?", f"{a} + {b} = {a + b}", a + b),
}


def write_problems(path: Path, n: int, seed: int = 0) -> Path:
    """n GSM8K-shaped rows: {"question", "answer": "<worked answer>\\n#### <n>"}."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            task = rng.choice(list(PROBLEMS))
            a, b = rng.randrange(1, 100), rng.randrange(1, 100)
            question, worked, final = PROBLEMS[task](a, b)
            f.write(json.dumps({"question": question, "answer": f"{worked}.\n#### {final}", "task": task}) + "\n")
    return path


def write_demonstrations(path: Path, n: int, slips: float, seed: int = 1) -> Path:
    """n conversations of the same tasks (other operands than the problems', by the seed), the assistant answering
    with the final answer alone, as the demo's do; a share `slips` of them one too high."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            question, _, final = PROBLEMS[rng.choice(list(PROBLEMS))](rng.randrange(1, 100), rng.randrange(1, 100))
            said = final + 1 if rng.random() < slips else final
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": str(said)}]}) + "\n")
    return path


LOSSES = {  # preference.grpo settings of each loss of the family
    "grpo": ["loss_type=grpo", "scale_rewards=group"],
    "dr_grpo": ["loss_type=dr_grpo", "scale_rewards=none"],
    "dapo": ["loss_type=dapo", "epsilon_high=0.28"],
    "gspo": ["loss_type=dapo", "importance_sampling_level=sequence"],
    "cispo": ["loss_type=cispo", "epsilon_high=5.0"],
}


def zero_advantage(config: str, root: Path, seed: int, overrides: list[str]) -> tuple[float, float]:
    """The GRPO run's mean share of zero-advantage groups drawn and trained over its logged steps."""
    from gptforge.core.config import load_config
    from gptforge.pipeline.store import locate

    cfg = load_config(config, [*overrides, f"run.seed={seed}", f"run.root={root}"])
    rows = [json.loads(line) for line in (locate(cfg, "grpo")[0] / "logs" / "metrics.jsonl").read_text().splitlines()]
    drawn = [r["rollout/zero_advantage_groups"] for r in rows if "rollout/zero_advantage_groups" in r]
    trained = [r["rollout/zero_advantage_trained"] for r in rows if "rollout/zero_advantage_trained" in r]
    return sum(drawn) / len(drawn), sum(trained) / len(trained)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--root", default=str(ROOT / "runs" / "rlvr"))
    p.add_argument("--problems", type=int, default=4000)
    p.add_argument("--demonstrations", type=int, default=20000, help="SFT conversations (default 20000)")
    p.add_argument("--slips", type=float, default=0.6, help="share of demonstrations one too high (default 0.6)")
    p.add_argument("--losses", nargs="+", choices=list(LOSSES), default=list(LOSSES))
    p.add_argument("--dynamic", nargs="+", choices=["off", "on"], default=["off", "on"])
    p.add_argument("--no-ppo", action="store_true", help="GRPO's rows alone")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    from gptforge.core.console import quiet

    quiet()
    root = Path(args.root)
    problems = write_problems(root / "problems.jsonl", args.problems)
    demos = write_demonstrations(root / f"demonstrations-{args.slips:g}.jsonl", args.demonstrations, args.slips)
    common = [f"data.prompts={problems}", f"data.sft={demos}", "preference.rewards=[{name: math_equal}]",
              "preference.grpo.ptx_coef=0", "preference.ppo.ptx_coef=0", *args.set]
    variants = {f"grpo {loss}{' +ds' if ds == 'on' else ''}": [
        *[f"preference.grpo.{kv}" for kv in LOSSES[loss]], f"preference.grpo.dynamic_sampling={ds == 'on'}",
        "preference.grpo.max_draws=3", "preference.algorithm=grpo"] for loss in args.losses for ds in args.dynamic}
    if not args.no_ppo:
        variants["ppo"] = ["preference.algorithm=ppo"]
    table = {name: {} for name in variants}
    sft = []
    for seed in args.seeds:  # the runs of a seed share its pretraining and SFT (the store reuses them)
        for name, overrides in variants.items():
            algo = name.split()[0]
            run = f"seed{seed}-{name.replace(' +', '-').replace(' ', '-')}"
            runs = run_seed(args.config, root, seed, [*common, *overrides], run)
            table[name][seed] = (runs[f"eval-{algo}"]["accuracy/math_equal"],
                                 zero_advantage(args.config, root, seed, [*common, *overrides]) if algo == "grpo"
                                 else None)
            if name == next(iter(variants)):
                sft.append(runs[f"eval-{algo}"]["sft_accuracy/math_equal"])
    from gptforge.core.config import load_config

    rewarded = " + ".join(r.label() for r in load_config(args.config, common).preference.rewards)
    print(f"held-out math_equal accuracy (greedy), {len(args.seeds)} seed(s) {args.seeds}, rewarded by {rewarded}; "
          f"SFT {mean_se(sft)}")
    print("| run | held-out accuracy | gain over SFT | zero-advantage groups drawn | trained |")
    print("|---|---|---|---|---|")
    for name, rows in table.items():
        acc = [rows[s][0] for s in args.seeds]
        text, shown = gain(acc, sft)
        zero = [rows[s][1] for s in args.seeds]
        drawn, trained = (("-", "-") if zero[0] is None else
                          (mean_se([z[0] for z in zero]), mean_se([z[1] for z in zero])))
        print(f"| {name} | {mean_se(acc)} | {text}{'' if shown else ' (under 2 se)'} | {drawn} | {trained} |")


if __name__ == "__main__":
    main()
