"""The demo's gains over several seeds: the default pipeline (or any config) run once per `run.seed`, in one
stage store (what does not depend on the seed, the tokenizer and shards, is computed once), then held-out exact
match of the base model, of SFT and of each preference algorithm, and the reward model's held-out accuracy, each
as the mean over the seeds with its standard error, and each stage's gain over the one before it with the
standard error of the paired difference (the same held-out items, the same seed).

    .venv/bin/python bench/demo_seeds.py [-c configs/tiny.yaml] [--seeds 0 1 2] [--root runs/seeds] [--set k=v ...]

The store is kept: a second call with other preference settings (`--set preference.dpo.loss_type=sigmoid`)
reuses every stage up to SFT and the reward model, and computes only what the settings change.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from gptforge.core.config import dump_config, load_config
from gptforge.core.errors import StageFailed
from gptforge.pipeline.launch.stage import run_stage
from gptforge.pipeline.store import RunRecord, pipeline_steps

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def run_seed(config: str, root: Path, seed: int, overrides: list[str], name: str | None = None) -> dict[str, dict]:
    """Every step of the pipeline at this seed (reused where complete), as the run `name` (seed<seed>):
    {step: final metrics}."""
    name = name or f"seed{seed}"
    cfg = load_config(config, [*overrides, f"run.seed={seed}", f"run.root={root}", f"run.name={name}"])
    path = root / f"{name}.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_config(cfg))
    record, metrics = RunRecord(cfg), {}
    for step in pipeline_steps(cfg):
        started = time.perf_counter()
        lines: list[str] = []
        try:
            manifest = run_stage(cfg, step, path, record, lines.append)
        except StageFailed as e:
            sys.exit(f"seed {seed}, {step}: {e}\n" + "\n".join(lines[-40:]))
        metrics[step] = manifest["metrics"]
        print(f"seed {seed} {step}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return metrics


def mean_se(values: list[float]) -> str:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return f"{statistics.mean(values):.3f} ± {se:.3f}"


def gain(after: list[float], before: list[float]) -> tuple[str, bool]:
    """The paired gain in points, mean ± standard error, and whether it is at least two standard errors."""
    diffs = [100 * (a - b) for a, b in zip(after, before)]
    mean = statistics.mean(diffs)
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    return f"{mean:+.1f} ± {se:.1f} points", mean > 0 and mean >= 2 * se


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "seeds")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    started = time.perf_counter()
    runs = {seed: run_seed(args.config, args.root, seed, args.set) for seed in args.seeds}
    algorithms = [s.removeprefix("eval-") for s in runs[args.seeds[0]] if s.startswith("eval-") and s != "eval-sft"]
    em = {"base": [runs[s]["eval-sft"]["base_exact_match"] for s in args.seeds],
          "sft": [runs[s]["eval-sft"]["exact_match"] for s in args.seeds],
          **{a: [runs[s][f"eval-{a}"]["exact_match"] for s in args.seeds] for a in algorithms}}
    accuracy = [runs[s]["reward"]["reward_accuracy"] for s in args.seeds]
    print(f"held-out exact match over seeds {args.seeds} ({args.config} {' '.join(args.set)}), "
          f"{time.perf_counter() - started:.0f} s")
    print("| model | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean ± se | gain over the previous | "
          ">= 2 se |")
    print("|" + " --- |" * (len(args.seeds) + 4))
    previous = None
    for name, values in em.items():
        before = em[previous] if previous else None
        text, ok = gain(values, before) if before else ("", None)
        cells = [f"{v:.3f}" for v in values] + [mean_se(values), text, "" if ok is None else "yes" if ok else "NO"]
        print(f"| {name} | " + " | ".join(cells) + " |")
        previous = "sft" if name in ("sft", *algorithms) else name
    print("| reward accuracy | " + " | ".join(f"{v:.3f}" for v in accuracy) + f" | {mean_se(accuracy)} | | "
          f"{'yes' if statistics.mean(accuracy) >= 0.8 else 'NO'} (>= 0.8) |")


if __name__ == "__main__":
    main()
