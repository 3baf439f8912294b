"""Pretrain benchmark: the pretrain stage (DeepSpeed, the configured launcher and world size) against a
plain single-process PyTorch loop training the same `transformers` model on the same shards with the
same global batch and sequence length. Both report training-step throughput (start-up, evaluation and
checkpoints excluded), side by side in one run.

    .venv/bin/python bench/pretrain.py [-c configs/tiny.yaml] [--steps 150] [--repeats 3] [--compile both|on|off]
                                       [--set k=v ...]

The stage runs twice by default, eager and with `pretrain.compile` (torch.compile through DeepSpeed's
engine.compile); the baseline is the loop a user writes, eager.

On a GPU, add `--set model.preset=gpt2-124m --set pretrain.seq_len=1024 ...` to read bf16 MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gptforge.core.config import load_config
from gptforge.data.batches import TokenWindows
from gptforge.data.shards import TokenStream
from gptforge.model.build import build_model, flops_per_token, peak_flops
from gptforge.model.train.engine import lr_schedule
from gptforge.model.train.losses import causal_lm_loss
from gptforge.model.train.metrics import WARMUP_STEPS
from gptforge.core.errors import StageFailed
from gptforge.pipeline.launch.stage import run_stage
from gptforge.pipeline.store import RunRecord, locate

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def stage(cfg, cfg_path: Path) -> dict:
    lines: list[str] = []
    try:
        for name in ("tokenize", "pretrain"):  # pretrain.compile changes no fingerprint: recompute, not reuse
            manifest = run_stage(cfg, name, cfg_path, RunRecord(cfg), lines.append, recompute=name == "pretrain")
    except StageFailed as e:
        sys.exit(f"{e}\n" + "\n".join(lines[-60:]))
    return manifest["metrics"]


def baseline(cfg) -> float:
    """A plain loop: one process, all cores, torch AdamW, the same schedule and clipping."""
    pc = cfg.pretrain
    tok_dir = locate(cfg, "tokenize")[0]
    tokens = TokenStream(tok_dir / "shards", "train")
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tok_dir / "tokenizer"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model.arch(), vocab, cfg.model.dropout).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=pc.lr, betas=(0.9, 0.95), weight_decay=pc.weight_decay)
    sched = lr_schedule(opt, pc)
    loader = TokenWindows(tokens, pc.seq_len, pc.micro_batch_size, seed=cfg.run.seed)
    accum = pc.global_batch_size // pc.micro_batch_size
    amp = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    seconds = 0.0
    for step in range(pc.max_steps):
        t0 = time.perf_counter()
        for _ in range(accum):
            x, y = loader.next()
            with amp:
                loss = causal_lm_loss(model(input_ids=x.to(device)).logits, y.to(device)) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), pc.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # synchronise
        if step >= WARMUP_STEPS:  # the stage leaves out as many
            seconds += time.perf_counter() - t0
    return (pc.max_steps - WARMUP_STEPS) * pc.global_batch_size * pc.seq_len / seconds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of stage and baseline, interleaved; the medians are compared (default 3)")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--compile", choices=["both", "on", "off"], default="both",
                   help="run the stage with pretrain.compile on, off, or both (default)")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="bench-pretrain-")
    overrides = [f"run.root={root}", f"pretrain.max_steps={args.steps}", f"pretrain.eval_every={args.steps}",
                 f"pretrain.save_every={args.steps}", *args.set]
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.compile]
    runs: dict[bool, list[dict]] = {compiled: [] for compiled in modes}
    bases: list[float] = []
    # A shared machine drifts by several percent within minutes: each round runs every mode and the baseline
    # back to back, so that drift falls on both sides of the ratio alike
    for _ in range(args.repeats):
        for compiled in modes:
            cfg = load_config(args.config, [*overrides, f"pretrain.compile={compiled}"])
            cfg_path = Path(root) / "config.yaml"
            cfg_path.write_text(json.dumps(cfg.model_dump(mode="json")))
            runs[compiled].append(stage(cfg, cfg_path))
        bases.append(baseline(cfg))
    base = statistics.median(bases)
    d, m = cfg.distributed, runs[modes[0]][0]
    print(f"model {cfg.model.name()}: {m['parameters'] / 1e6:.2f}M params, global batch "
          f"{cfg.pretrain.global_batch_size} x {cfg.pretrain.seq_len} tokens, {args.steps} steps "
          f"({WARMUP_STEPS} warm-up steps not timed), median of {args.repeats} interleaved round(s)")
    print(f"baseline (1 process, plain PyTorch, eager): {base:12,.0f} tokens/s  "
          f"(rounds: {', '.join(f'{b:,.0f}' for b in bases)})")
    for compiled, ms in runs.items():
        mode = "compiled" if compiled else "eager"
        name = f"gptforge ({d.launcher}, {d.world_size} processes, ZeRO-{d.zero_stage}, {mode})"
        rates = [r["tokens_per_sec"] for r in ms]
        rate = statistics.median(rates)
        print(f"{name}: {rate:12,.0f} tokens/s  mfu {ms[0]['mfu']}  ratio {rate / base:.2f}x (target >= 1.0x on "
              f"2 CPU cores; rounds: {', '.join(f'{r / b:.2f}x' for r, b in zip(rates, bases))})")
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if peak_flops(dev):
        n = m.get("active_parameters", m["parameters"])  # a mixture of experts computes with its active ones
        mfu = flops_per_token(n, cfg.model.arch(), cfg.pretrain.seq_len) * base / peak_flops(dev)
        print(f"baseline mfu: {mfu:.1%}")


if __name__ == "__main__":
    main()
