"""Context extension: a Llama 3-style model pretrained at 64 tokens (RoPE base 500000), its context taken to 256 by
continued pretraining with YaRN (`model.rope: {type: yarn, factor: 4}`) against the same model with its context
merely raised (max_position_embeddings 256, no scaling), over several seeds. Reported: the val loss at 256 tokens of
each after the same continued pretraining, and YaRN's margin, the mean over the seeds with its standard error.

    .venv/bin/python bench/yarn.py [-c configs/tiny.yaml] [--seeds 0 1 2] [--root runs/yarn] [--short-steps 400]
                                   [--long-steps 2] [--rope '{type: yarn, ...}'] [--set k=v ...]

Why RoPE base 500000 and 64 tokens: the slow rotary dimensions of such a base never turn past what 64 positions
show them, which plain extrapolation to 256 then gets wrong and YaRN interpolates. (With 60 steps and base 10000,
extrapolation held up as well as YaRN: 1.748 against 1.755.) Why YaRN's ramp at beta_fast 4 (rotations within the
original context; its default 32 is for originals of thousands of tokens): over 64 tokens, 32 rotations would leave
only dimensions of a wavelength under 2 tokens alone and interpolate the ones that carry local order; at 4 those of
a wavelength under 16 keep their angles. Why 2 steps at 256: the raised model's error past 64 is what YaRN spares
it, and continued pretraining mends it (2026-12-06, 5 seeds, 2-layer model: margin 0.051 ± 0.010 after 2 steps,
0.006 ± 0.003 after 12; YaRN's default ramp: 0.039 ± 0.015 and 0.008 ± 0.004, a seed below zero in both). Tokenize
is the demo's, reused from the store where it is complete; the long runs, every seed's in one root, read its
tokenizer (every base model's own) and share one tokenize.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import mean_se  # noqa: E402

from gptforge.core.config import dump_config, load_config  # noqa: E402
from gptforge.core.errors import StageFailed  # noqa: E402
from gptforge.pipeline.launch.stage import run_stage  # noqa: E402
from gptforge.pipeline.store import RunRecord  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
SHORT = ["model.preset=llama-tiny", "model.n_positions=64", "model.rope_theta=500000", "pretrain.seq_len=64",
         "pretrain.save_every=100000", "pretrain.log_every=50", "pretrain.lr=3e-3", "pretrain.warmup_steps=10",
         "distributed.nproc_per_node=1", "pretrain.global_batch_size=16", "pretrain.micro_batch_size=16"]
LONG = ["pretrain.seq_len=256", "pretrain.warmup_steps=0", "pretrain.micro_batch_size=4", "pretrain.save_every=100000",
        "pretrain.global_batch_size=4", "pretrain.eval_batches=4", "pretrain.log_every=1", "pretrain.lr=5e-4",
        "pretrain.min_lr=5e-4", "distributed.nproc_per_node=1"]


def stages(config: str, root: Path, names: list[str], overrides: list[str]) -> tuple[dict, Path]:
    """Run (or reuse) `names` in `root`: (the last one's manifest, its output folder)."""
    from gptforge.pipeline.store import locate

    cfg = load_config(config, [f"run.root={root}", *overrides])
    root.mkdir(parents=True, exist_ok=True)
    path = root / "pipeline.yaml"
    path.write_text(dump_config(cfg))
    lines: list[str] = []
    try:
        for name in names:
            manifest = run_stage(cfg, name, path, RunRecord(cfg), lines.append)
    except StageFailed as e:
        sys.exit(f"{root}: {e}\n" + "\n".join(lines[-40:]))
    return manifest, locate(cfg, names[-1])[0]


def run_seed(args, seed: int) -> dict[str, float]:
    """{yarn, raised: val loss at 256 tokens} of one seed."""
    root = Path(args.root)
    manifest, short = stages(args.config, root, ["tokenize", "pretrain"],
                             [*args.set, *SHORT, f"pretrain.max_steps={args.short_steps}",
                              f"pretrain.eval_every={args.short_steps}", f"run.seed={seed}"])
    base = short / "model"
    # the demo's tokenizer (tokenize is unseeded: every seed's base has it), so that every seed's long runs, in one
    # root, share one tokenize of the data with it
    tokenizer = Path(manifest["inputs"]["tokenize"]["path"]) / "tokenizer"
    raised = root / f"seed{seed}-raised-model"  # no scaling: the context raised by hand
    if not raised.exists():
        shutil.copytree(base, raised)
        conf = json.loads((raised / "config.json").read_text())
        (raised / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 256}))
    out = {}
    for name, model, extra in (("yarn", base, [f"model.rope={args.rope}"]), ("raised", raised, [])):
        manifest, out_dir = stages(args.config, root / "long", ["tokenize", "pretrain"],
                                   [*args.set, f"model.pretrained={model}", f"tokenizer.pretrained={tokenizer}", *LONG,
                                    f"pretrain.max_steps={args.long_steps}", f"pretrain.eval_every={args.long_steps}",
                                    f"run.seed={seed}", *extra])
        out[name] = manifest["metrics"]["val_loss"]
        print(f"seed {seed} {name}: val_loss {out[name]:.4f} at 256 tokens; model {out_dir / 'model'}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--root", default=str(ROOT / "runs" / "yarn"))
    p.add_argument("--short-steps", type=int, default=400, help="pretraining at 64 tokens (default 400)")
    p.add_argument("--long-steps", type=int, default=2, help="continued pretraining at 256 tokens (default 2)")
    p.add_argument("--rope", default="{type: yarn, factor: 4, beta_fast: 4, beta_slow: 1}",
                   help="model.rope of the YaRN run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of both phases (the data, the model's size); the bench's own pretrain and context "
                        "settings win over it")
    args = p.parse_args()
    runs = {seed: run_seed(args, seed) for seed in args.seeds}
    yarn, raised = ([runs[s][k] for s in args.seeds] for k in ("yarn", "raised"))
    margins = [r - y for y, r in zip(yarn, raised)]
    print(f"val loss at 256 tokens after {args.long_steps} steps of a model pretrained {args.short_steps} steps at "
          f"64, {len(args.seeds)} seed(s) {args.seeds}:")
    print(f"  yarn:   {mean_se(yarn)}")
    print(f"  raised: {mean_se(raised)}")
    print(f"  YaRN's margin (raised - yarn): {mean_se(margins)}")


if __name__ == "__main__":
    main()
