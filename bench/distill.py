"""On-policy distillation against RL and against off-policy distillation, on the RLVR bench's task (bench/rlvr.py:
GSM8K-shaped arithmetic, SFT demonstrations of which 60% slip one too high, rewarded by `math_equal`). For each
seed, one run side by side:

- the teacher: GRPO from the SFT model (`preference.max_steps` steps, the RLVR bench's);
- on-policy distillation (the distill stage, reverse KL): the same SFT model learns toward the GRPO policy on its
  own samples, for each of `--steps` optimizer steps (by default GRPO's / 16, / 8 and / 4), 64 samples a step;
- off-policy distillation: the same SFT model fine-tuned (SFT) on the teacher's own samples of the same prompts,
  as many sequences as the distill run scored (so as many teacher-scored tokens, within the lengths' difference),
  for the same steps, at the same learning rate (`--lr`);
- a student half the teacher's size (`--small`: model.n_layer halved), pretrained and fine-tuned alone, then
  distilled from the same teacher for GRPO's / 4 steps.

Held-out `math_equal` accuracy (greedy, the evaluation's own items) of each, the steps each took, and the teacher's
gain over SFT that each recovers; `distill.png` in the root plots accuracy against optimizer steps and against
teacher-scored tokens.

    .venv/bin/python bench/distill.py [--seeds 0 1 2] [--root runs/distill] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import mean_se, run_seed  # noqa: E402
from rlvr import ROOT, write_demonstrations, write_problems  # noqa: E402


def held_out_accuracy(cfg, model_dir: Path) -> float:
    """math_equal accuracy of the model's greedy answers on the evaluation's held-out items (as eval-<stage>
    computes it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptforge.data import splits
    from gptforge.model.rewards import math_equal
    from gptforge.model.sampling.generate import generate

    items = splits.eval_set(cfg.data, "grpo").items[:cfg.eval.items]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    answers = generate(model, tokenizer, [it["prompt"] for it in items], cfg.eval.max_new_tokens, cfg.eval.batch_size)
    return sum(math_equal(None, answers, [it["answer"] for it in items])) / len(items)


def teacher_samples(cfg, teacher: Path, rows: int, path: Path, seed: int) -> tuple[Path, float]:
    """`rows` conversations to train on (and as many again for SFT's held-out split): training prompts with the
    teacher's sampled answers (temperature 1, the distill stage's sampling), and the teacher's tokens in `rows` of
    them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptforge.data import splits
    from gptforge.model.sampling.generate import sample_responses

    prompts = [it["prompt"] for it in splits.online_prompts(cfg.data).train]
    prompts = [prompts[i % len(prompts)] for i in range(2 * rows)]
    model = AutoModelForCausalLM.from_pretrained(teacher).eval()
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokens = 0
    with open(path, "w") as f:
        for i in range(0, len(prompts), 256):
            batch = prompts[i:i + 256]
            ids = sample_responses(model, tokenizer, batch, cfg.distill.max_new_tokens, seed + i)
            for prompt, answer in zip(batch, ids):
                tokens += len(answer)
                text = tokenizer.decode(answer, skip_special_tokens=True).strip()
                f.write(json.dumps({"messages": [*prompt, {"role": "assistant", "content": text}]}) + "\n")
    return path, tokens / 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--root", type=Path, default=ROOT / "runs" / "distill")
    p.add_argument("--problems", type=int, default=4000)
    p.add_argument("--demonstrations", type=int, default=20000)
    p.add_argument("--slips", type=float, default=0.6)
    p.add_argument("--steps", type=int, nargs="+", help="distill and off-policy steps (default GRPO's / 16, 8, 4)")
    p.add_argument("--lr", type=float, default=1e-4, help="the learning rate of both distillations (default 1e-4; "
                   "at 5e-4 on-policy distillation first fell below SFT, seed 0)")
    p.add_argument("--small", action="store_true", default=True)
    p.add_argument("--no-small", dest="small", action="store_false")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    from gptforge.core.config import load_config
    from gptforge.core.console import quiet

    quiet()

    root = args.root
    problems = write_problems(root / "problems.jsonl", args.problems)
    demos = write_demonstrations(root / f"demonstrations-{args.slips:g}.jsonl", args.demonstrations, args.slips)
    common = [f"data.prompts={problems}", f"data.sft={demos}", "preference.rewards=[{name: math_equal}]",
              "preference.grpo.ptx_coef=0", *args.set, "preference.algorithm=grpo"]
    grpo_steps = load_config(args.config, common).preference.max_steps
    steps = args.steps or [max(1, grpo_steps // d) for d in (16, 8, 4)]
    distill = ["distill.enabled=true", "distill.teacher=grpo", f"distill.lr={args.lr:g}", "distill.warmup_steps=0",
               "distill.global_batch_size=64", "distill.micro_batch_size=32", "distill.max_new_tokens=8"]
    table: dict[str, dict[int, float]] = {}
    tokens: dict[str, dict[int, float]] = {}
    for seed in args.seeds:
        runs = {n: run_seed(args.config, root, seed, [*common, *distill, f"distill.max_steps={n}"]) for n in steps}
        last = runs[steps[-1]]
        row = {"sft": last["eval-grpo"]["sft_accuracy/math_equal"], "grpo": last["eval-grpo"]["accuracy/math_equal"]}
        row |= {f"on-policy {n}": runs[n]["eval-distill"]["accuracy/math_equal"] for n in steps}
        cfg = load_config(args.config, [*common, *distill, f"run.seed={seed}", f"run.root={root}"])
        from gptforge.pipeline.store import locate

        sft_dir, grpo_dir = locate(cfg, "sft")[0] / "model", locate(cfg, "grpo")[0] / "model"
        for n in steps:  # off-policy: SFT from the SFT model on as many teacher samples as distill scored
            rows = n * 64
            data, written = teacher_samples(cfg, grpo_dir, rows, root / f"teacher-{seed}-{n}.jsonl", seed)
            off = run_seed(args.config, root / "off-policy", seed, [
                *common, "pretrain.enabled=false", f"model.pretrained={sft_dir}", f"data.sft={data}",
                f"sft.lr={args.lr:g}", "sft.warmup_steps=0", f"sft.max_steps={n}", "sft.global_batch_size=64",
                "sft.micro_batch_size=32", "preference.enabled=false", "reward.enabled=false"])
            off_cfg = load_config(args.config, [*common, "pretrain.enabled=false", f"model.pretrained={sft_dir}",
                                                f"data.sft={data}", f"sft.lr={args.lr:g}", "sft.warmup_steps=0",
                                                f"sft.max_steps={n}", "sft.global_batch_size=64",
                                                "sft.micro_batch_size=32", "preference.enabled=false",
                                                "reward.enabled=false", f"run.seed={seed}",
                                                f"run.root={root / 'off-policy'}"])
            assert off["sft"]["global_step"] == n
            row[f"off-policy {n}"] = held_out_accuracy(cfg, locate(off_cfg, "sft")[0] / "model")
            tokens.setdefault(f"off-policy {n}", {})[seed] = written
            tokens.setdefault(f"on-policy {n}", {})[seed] = runs[n]["distill"]["teacher_scored_tokens"]
        if args.small:
            arch = cfg.model.arch()
            small = run_seed(args.config, root / "small", seed, [
                *common, f"model.n_layer={max(1, arch.n_layer // 2)}", "distill.enabled=true",
                f"distill.teacher={grpo_dir}", f"distill.max_steps={steps[-1]}", *distill[2:],
                "preference.enabled=false"])
            row["small sft"] = small["eval-distill"]["start_accuracy/math_equal"]
            row["small distilled"] = small["eval-distill"]["accuracy/math_equal"]
        table[seed] = row
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)

    names = list(table[args.seeds[0]])
    gain = [table[s]["grpo"] - table[s]["sft"] for s in args.seeds]
    print(f"\nheld-out math_equal accuracy (greedy), seeds {args.seeds}; GRPO {grpo_steps} steps, the teacher; "
          "recovered: the share of the teacher's gain over SFT")
    print("| model | optimizer steps | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean ± se | recovered |")
    print("|" + " --- |" * (len(args.seeds) + 4))
    for name in names:
        values = [table[s][name] for s in args.seeds]
        n = grpo_steps if name == "grpo" else 0 if "sft" in name else int(name.split()[-1]) if name[-1].isdigit() \
            else steps[-1]
        recovered = statistics.mean((table[s][name] - table[s]["sft"]) / g if g else float("nan")
                                    for s, g in zip(args.seeds, gain))
        print(f"| {name} | {n} | " + " | ".join(f"{v:.3f}" for v in values) +
              f" | {mean_se(values)} | {recovered:.0%} |")
    for name, per in tokens.items():
        print(f"teacher-scored tokens, {name}: {statistics.mean(per.values()):.0f} a seed")
    plot(table, steps, grpo_steps, tokens, root / "distill.png")


def plot(table: dict, steps: list[int], grpo_steps: int, tokens: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = list(table)
    mean = {k: statistics.mean(table[s][k] for s in seeds) for k in table[seeds[0]]}
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([0, grpo_steps], [mean["sft"], mean["grpo"]], "o-", label="GRPO (the teacher)")
    for kind, color in (("on-policy", "tab:orange"), ("off-policy", "tab:green")):
        a.plot([0, *steps], [mean["sft"], *[mean[f"{kind} {n}"] for n in steps]], "o-", color=color,
               label=f"{kind} distillation")
        b.plot([0, *[statistics.mean(tokens[f"{kind} {n}"].values()) for n in steps]],
               [mean["sft"], *[mean[f"{kind} {n}"] for n in steps]], "o-", color=color, label=f"{kind} distillation")
    a.set(xlabel="optimizer steps", ylabel="held-out accuracy (math_equal)", xscale="symlog")
    b.set(xlabel="teacher-scored tokens", ylabel="held-out accuracy (math_equal)")
    for ax in (a, b):
        ax.axhline(mean["grpo"], color="grey", lw=0.5)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
