"""Code scored by unit tests: the model writes a one-line function, gptforge's `unit_tests` reward runs it in the
sandbox (docs/sandbox.md) against the row's tests, and RL on that reward alone fixes a slip that SFT copied, over
several seeds. Reported: the held-out share of tests passed (greedy) by the SFT model and by each policy, the mean
over the seeds with its standard error, and each policy's gain over SFT with the standard error of the paired
difference.

    .venv/bin/python bench/unit_tests.py [-c configs/tiny.yaml] [--seeds 0 1 2] [--root runs/unit_tests]
                                         [--flaws 0.6] [--documents 20000] [--lines 4000]
                                         [--problems 4000] [--demonstrations 8000] [--set k=v ...]

The task: "Write f(x) that returns 7 times x plus 38." The answer is a program, `def f(x): return 7 * x + 38`, and
the row's tests are three asserts (`f(0) == 38`, `f(1) == 45`, `f(2) == 52`). A share `--flaws` (0.6) of the
demonstrations multiply by one more (`def f(x): return 8 * x + 38`), a slip that passes one test of the three
(f(0)): the SFT model's greedy program is mostly the slip, while its samples are often right. GRPO and PPO then sample
programs rewarded by `{name: unit_tests}` alone: the share of the row's tests a program passes, run in the
sandbox, with nothing else of the row (no reference answer) read. The pretraining corpus is the demo's documents
with lines of such functions beside them (none of them with its question), so that the tokenizer has their pieces.
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


def question(a: int, b: int) -> str:
    return f"Write f(x) that returns {a} times x plus {b}."


def program(a: int, b: int) -> str:
    return f"def f(x): return {a} * x + {b}"


def tests(a: int, b: int) -> list[str]:
    return [f"assert f({x}) == {a * x + b}" for x in (0, 1, 2)]


def draw(rng: random.Random) -> tuple[int, int]:
    return rng.randrange(2, 10), rng.randrange(10, 100)


def write_demonstrations(path: Path, n: int, flaws: float, seed: int = 1) -> Path:
    """n conversations, the question and its program; a share `flaws` multiplying by one more."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = draw(rng)
            answer = program(a + 1 if rng.random() < flaws else a, b)
            f.write(json.dumps({"messages": [{"role": "user", "content": question(a, b)},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def write_problems(path: Path, n: int, seed: int = 0) -> Path:
    """n prompts with their tests ({"prompt", "tests"}), the held-out ones among them."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = draw(rng)
            f.write(json.dumps({"prompt": question(a, b), "tests": tests(a, b)}) + "\n")
    return path


def write_corpus(path: Path, documents: int, lines: int, seed: int = 2) -> Path:
    """The demo's pretraining documents and `lines` functions of the task's form (none with its question)."""
    from gptforge.data import demo

    rng = random.Random(seed)
    text = list(demo.generate(pretrain_docs=documents, sft_items=1, preference_pairs=1, eval_items=1).pretrain)
    text += [program(*draw(rng)) for _ in range(lines)]
    rng.shuffle(text)
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in text))
    return path


def overrides(root: Path, args) -> list[str]:
    """The settings of the run (its data written into `root`)."""
    root.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(root / "corpus.jsonl", args.documents, args.lines)
    prompts = write_problems(root / "problems.jsonl", args.problems)
    demos = write_demonstrations(root / f"demonstrations-{args.flaws:g}.jsonl", args.demonstrations, args.flaws)
    return [f"data.pretrain={corpus}", f"data.prompts={prompts}", f"data.sft={demos}",
            "eval.max_new_tokens=24", "preference.rewards=[{name: unit_tests}]",
            *[f"preference.{a}.max_new_tokens=24" for a in args.algorithms],
            *[f"preference.{a}.ptx_coef=0" for a in args.algorithms],
            f"preference.algorithm=[{','.join(args.algorithms)}]"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--root", default=str(ROOT / "runs" / "unit_tests"))
    p.add_argument("--documents", type=int, default=20000, help="the demo's pretraining documents")
    p.add_argument("--lines", type=int, default=4000, help="lines of functions beside them")
    p.add_argument("--problems", type=int, default=4000)
    p.add_argument("--demonstrations", type=int, default=8000)
    p.add_argument("--flaws", type=float, default=0.6, help="share of demonstrations multiplying by one more")
    p.add_argument("--algorithms", nargs="+", default=["grpo", "ppo"])
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    root = Path(args.root).resolve()
    runs = {seed: run_seed(args.config, root, seed, overrides(root, args) + args.set) for seed in args.seeds}
    first = f"eval-{args.algorithms[0]}"
    sft = [runs[s][first]["sft_accuracy/unit_tests"] for s in args.seeds]
    print(f"held-out share of unit tests passed (greedy), {len(args.seeds)} seed(s) {args.seeds}, "
          f"{args.flaws:.0%} of the demonstrations multiplying by one more, rewarded by unit_tests alone:")
    print(f"  sft:  {mean_se(sft)}")
    for algo in args.algorithms:
        passed = [runs[s][f"eval-{algo}"]["accuracy/unit_tests"] for s in args.seeds]
        text, shown = gain(passed, sft)
        print(f"  {algo}: {mean_se(passed)}  gain over SFT {text}{'' if shown else ' (under two standard errors)'}")


if __name__ == "__main__":
    main()
