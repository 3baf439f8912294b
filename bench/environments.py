"""Environments from a task library: GRPO on reasoning-gym's procedural datasets (`data.prompts:
reasoning_gym:<dataset>`), rewarded by the dataset's own check alone (`{name: reasoning_gym}`), against the SFT
model, over several seeds. Reported, for each dataset: held-out accuracy (greedy; the dataset's `score_answer` of
each answer) of SFT and of GRPO, the mean over the seeds with its standard error, and GRPO's gain over SFT with the
standard error of the paired difference (the same held-out items, the same seed).

    .venv/bin/python bench/environments.py [-c configs/tiny.yaml] [--seeds 0 1 2] [--root runs/environments]
                                           [--datasets basic_arithmetic chain_sum] [--flaws 0.6] [--set k=v ...]

Two datasets whose answers are short numbers, each a sum or a difference of two numbers of one digit, in the
dataset's own phrasing: `basic_arithmetic` ("Calculate 5 - 9.") and `chain_sum` ("State the final answer to the
following arithmetic problem: 5 - 9 ="). Each has 200 distinct questions, so the training items are few (`--size`,
100) and a held-out item that is also a training item is dropped (gptforge's split does), leaving held-out items
whose questions GRPO never trained on. The pretraining corpus is the demo's documents with lines of each dataset's
items and answers beside them (items drawn from a seed range of their own), so that the tokenizer has their pieces
and the model the facts. SFT learns from the dataset's own generated solutions (other items again), a share
`--flaws` of which answer one too high, always (bench/rlvr.py's slips): the SFT model copies the slip in its greedy
answers, while its samples still answer right often enough for the check to reward. GRPO then trains on the
dataset's training items and is evaluated on its held-out items (drawn from a seed of their own). Tokenize and
pretrain are shared by the datasets (one store). (With two-digit operands the 1M-parameter model did not learn
the sums: SFT 0.10 held out, 2026-12-06.)
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
DATASETS = {"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                 "operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False},
            "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
CORPUS_SEED, DEMONSTRATION_SEED = 3 * 10**9, 4 * 10**9  # item seeds apart from training (0...) and held out (10^9...)


def items(name: str, n: int, seed: int) -> list[dict]:
    import reasoning_gym as rg

    return list(rg.create_dataset(name, size=n, seed=seed, **DATASETS[name]))


def write_corpus(path: Path, documents: int, per_dataset: int, datasets: list[str]) -> Path:
    """The demo's pretraining documents and, for each dataset, `per_dataset` lines of an item and its answer."""
    from gptforge.data import demo

    lines = list(demo.generate(pretrain_docs=documents, sft_items=1, preference_pairs=1, eval_items=1).pretrain)
    for name in datasets:
        lines += [f"{x['question']} {x['answer']}" for x in items(name, per_dataset, CORPUS_SEED)]
    random.Random(2).shuffle(lines)
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return path


def write_demonstrations(path: Path, name: str, n: int, flaws: float, seed: int = 1) -> Path:
    """n conversations of the dataset's items and their answers, a share `flaws` one too high."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for x in items(name, n, DEMONSTRATION_SEED):
            said = int(x["answer"]) + 1 if rng.random() < flaws else int(x["answer"])
            f.write(json.dumps({"messages": [{"role": "user", "content": x["question"]},
                                             {"role": "assistant", "content": str(said)}]}) + "\n")
    return path


def overrides(root: Path, name: str, args) -> list[str]:
    options = json.dumps(DATASETS[name]).replace('"', "")
    demos = write_demonstrations(root / f"{name}-demonstrations-{args.flaws:g}.jsonl", name, args.demonstrations,
                                 args.flaws)
    return [f"data.pretrain={root / 'corpus.jsonl'}", f"data.sft={demos}",
            f"data.prompts={{path: 'reasoning_gym:{name}', size: {args.size}, held_out_size: {args.held_out}, "
            f"options: {options}}}", "preference.rewards=[{name: reasoning_gym}]", "preference.grpo.ptx_coef=0",
            "preference.algorithm=grpo", *args.set]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--root", default=str(ROOT / "runs" / "environments"))
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--documents", type=int, default=20000, help="the demo's pretraining documents")
    p.add_argument("--corpus-items", type=int, default=5000, help="lines of each dataset's items in the corpus")
    p.add_argument("--demonstrations", type=int, default=8000, help="SFT conversations a dataset")
    p.add_argument("--flaws", type=float, default=0.6, help="share of demonstrations one too high")
    p.add_argument("--size", type=int, default=100, help="training items a dataset")
    p.add_argument("--held-out", type=int, default=400, help="held-out items drawn a dataset (before the training "
                   "items' questions are dropped)")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args(argv)
    from gptforge.core.console import quiet

    quiet()
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    write_corpus(root / "corpus.jsonl", args.documents, args.corpus_items, list(DATASETS))
    gains = {}
    print(f"held-out accuracy (greedy, the dataset's score_answer), {len(args.seeds)} seed(s) {args.seeds}, "
          f"{args.flaws:.0%} of the demonstrations one too high, GRPO rewarded by the dataset's check alone:")
    for name in args.datasets:
        settings = overrides(root, name, args)
        runs = {seed: run_seed(args.config, root, seed, settings) for seed in args.seeds}
        sft = [runs[s]["eval-grpo"]["sft_accuracy/reasoning_gym"] for s in args.seeds]
        acc = [runs[s]["eval-grpo"]["accuracy/reasoning_gym"] for s in args.seeds]
        text, shown = gain(acc, sft)
        gains[name] = [a - b for a, b in zip(acc, sft)]
        print(f"  {name}: sft {mean_se(sft)}, grpo {mean_se(acc)}, gain over SFT {text}"
              f"{'' if shown else ' (under two standard errors)'}")
    return gains


if __name__ == "__main__":
    main()
