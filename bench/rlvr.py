"""Verifiable rewards: GRPO and PPO rewarded by `math_equal` alone (no reward model, no reward stage) on a
generated GSM8K-shaped file of arithmetic problems (`question`, and a worked `answer` ending in `#### n`), against
the SFT model, over several seeds. Reported: held-out `math_equal` accuracy (greedy) of SFT and of each policy, as
the mean over the seeds with its standard error, and each policy's gain over SFT with the standard error of the
paired difference (the same held-out problems, the same seed).

    .venv/bin/python bench/rlvr.py [-c configs/tiny.yaml] [--seeds 0 1 2] [--root runs/rlvr] [--problems 4000]
                                   [--set k=v ...]

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--root", default=str(ROOT / "runs" / "rlvr"))
    p.add_argument("--problems", type=int, default=4000)
    p.add_argument("--demonstrations", type=int, default=20000, help="SFT conversations (default 20000)")
    p.add_argument("--slips", type=float, default=0.6, help="share of demonstrations one too high (default 0.6)")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    root = Path(args.root)
    problems = write_problems(root / "problems.jsonl", args.problems)
    demos = write_demonstrations(root / f"demonstrations-{args.slips:g}.jsonl", args.demonstrations, args.slips)
    algorithms = ["grpo", "ppo"]
    overrides = [f"data.prompts={problems}", f"data.sft={demos}", "preference.rewards=[{name: math_equal}]",
                 *[f"preference.{a}.ptx_coef=0" for a in algorithms], *args.set,
                 f"preference.algorithm=[{','.join(algorithms)}]"]
    runs = {seed: run_seed(args.config, root, seed, overrides) for seed in args.seeds}
    sft = [runs[s][f"eval-{algorithms[0]}"]["sft_accuracy/math_equal"] for s in args.seeds]
    print(f"held-out math_equal accuracy (greedy), {len(args.seeds)} seed(s) {args.seeds}, rewarded by "
          f"math_equal alone:")
    print(f"  sft:  {mean_se(sft)}")
    for algo in algorithms:
        acc = [runs[s][f"eval-{algo}"]["accuracy/math_equal"] for s in args.seeds]
        text, shown = gain(acc, sft)
        print(f"  {algo}: {mean_se(acc)}  gain over SFT {text}{'' if shown else ' (under two standard errors)'}")


if __name__ == "__main__":
    main()
