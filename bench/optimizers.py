"""Muon against AdamW on a pretraining run: each at its best learning rate of a small sweep, then over several
seeds, the optimizer steps and the wall time Muon takes to reach AdamW's final validation loss. Side by side in
one run; the ratios printed, no timed assertion.

    .venv/bin/python bench/optimizers.py [-c configs/tiny.yaml] [--seeds 0 1 2] [--steps 200]
                                         [--adamw-lrs 1e-3 2e-3 4e-3] [--muon-lrs 0.01 0.02 0.04]
                                         [--root runs/optimizers] [--set k=v ...]

Both train the same model on the same shards with the same batches, warmup and cosine schedule; AdamW's runs sweep
`pretrain.lr`, Muon's sweep `pretrain.muon_lr` (its hidden matrices; the embeddings and head stay on AdamW at the
config's `pretrain.lr`). The sweep is at the first seed, each optimizer's best rate (the lowest final validation
loss) then runs at every seed. Reported, at each seed and as the mean with its standard error:
- AdamW's final validation loss, and the first evaluation step at which Muon's is at or below it (evaluations
  every `pretrain.eval_every` steps), over AdamW's steps: the step ratio (target: at most 0.75);
- the same in wall time, from each run's training throughput (Muon's orthogonalisation costs time, more so on a
  CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from gptforge.core.config import dump_config, load_config
from gptforge.core.errors import StageFailed
from gptforge.pipeline.launch.stage import run_stage
from gptforge.pipeline.store import RunRecord, locate

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def pretrain(config: str, root: Path, name: str, overrides: list[str]) -> tuple[dict, list[tuple[int, float]]]:
    """The pretrain stage (tokenize reused from the root's store): its metrics and its (step, val_loss) curve."""
    cfg = load_config(config, [*overrides, f"run.root={root}", f"run.name={name}"])
    path = root / f"{name}.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_config(cfg))
    lines: list[str] = []
    try:
        for step in ("tokenize", "pretrain"):
            manifest = run_stage(cfg, step, path, RunRecord(cfg), lines.append)
    except StageFailed as e:
        sys.exit(f"{name}: {e}\n" + "\n".join(lines[-40:]))
    out_dir = locate(cfg, "pretrain")[0]
    rows = [json.loads(line) for line in (out_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    print(f"  {name}: val_loss {manifest['metrics']['val_loss']:.4f}, "
          f"{manifest['metrics']['tokens_per_sec']:.0f} tokens/s", file=sys.stderr, flush=True)
    return manifest["metrics"], curve


def reached(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, loss in curve if loss <= target), None)


def mean_se(values: list[float]) -> str:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return f"{statistics.mean(values):.3f} ± {se:.3f}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3])
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    p.add_argument("--root", type=Path, default=ROOT / "runs" / "optimizers")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    root = args.root.resolve()
    common = [f"pretrain.max_steps={args.steps}", "pretrain.eval_every=10", "pretrain.eval_batches=4",
              f"pretrain.save_every={args.steps}", "sft.enabled=false", "reward.enabled=false",
              "preference.enabled=false", *args.set]
    first = args.seeds[0]
    print(f"sweep at seed {first}, {args.steps} steps:", file=sys.stderr)
    sweep = {("adamw", lr): pretrain(args.config, root, f"adamw-{lr:g}-s{first}",
                                     [*common, f"run.seed={first}", f"pretrain.lr={lr}"])
             for lr in args.adamw_lrs}
    sweep |= {("muon", lr): pretrain(args.config, root, f"muon-{lr:g}-s{first}",
                                     [*common, f"run.seed={first}", "pretrain.optimizer=muon",
                                      f"pretrain.muon_lr={lr}"]) for lr in args.muon_lrs}
    best = {o: min((k for k in sweep if k[0] == o), key=lambda k: sweep[k][0]["val_loss"])[1]
            for o in ("adamw", "muon")}
    rates = {"adamw": lambda lr: [f"pretrain.lr={lr}"],
             "muon": lambda lr: ["pretrain.optimizer=muon", f"pretrain.muon_lr={lr}"]}
    runs = {}
    for seed in args.seeds:
        for o in ("adamw", "muon"):
            runs[o, seed] = sweep[o, best[o]] if seed == first else pretrain(
                args.config, root, f"{o}-{best[o]:g}-s{seed}", [*common, f"run.seed={seed}", *rates[o](best[o])])
    print(f"Muon against AdamW, pretraining {args.steps} steps ({args.config} {' '.join(args.set)}); the sweep at "
          f"seed {first}:")
    for (o, lr), (m, _) in sweep.items():
        print(f"  {o} lr {lr:g}: final val_loss {m['val_loss']:.4f}{'  (best)' if best[o] == lr else ''}")
    print("| seed | AdamW final val_loss | Muon final val_loss | Muon's steps to AdamW's final | step ratio | "
          "wall-time ratio |")
    print("|---|---|---|---|---|---|")
    steps, walls = [], []
    for seed in args.seeds:
        (adam, _), (muon, curve) = runs["adamw", seed], runs["muon", seed]
        at = reached(curve, adam["val_loss"])
        ratio = (at or float("inf")) / args.steps
        wall = ratio * adam["tokens_per_sec"] / muon["tokens_per_sec"]  # the same tokens a step
        steps.append(ratio)
        walls.append(wall)
        print(f"| {seed} | {adam['val_loss']:.4f} | {muon['val_loss']:.4f} | {at if at else 'not reached'} | "
              f"{ratio:.2f}x | {wall:.2f}x |")
    print(f"Muon reaches AdamW's final validation loss in {mean_se(steps)} of its steps (target: at most 0.75) and "
          f"{mean_se(walls)} of its wall time, at AdamW lr {best['adamw']:g} and Muon lr {best['muon']:g}")


if __name__ == "__main__":
    main()
