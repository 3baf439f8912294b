"""Pretrain benchmark: the pretrain stage (DeepSpeed, the configured launcher and world size) against a
plain single-process PyTorch loop training the same `transformers` model on the same shards with the
same global batch and sequence length. Both report training-step throughput (start-up, evaluation and
checkpoints excluded), side by side in one run.

    .venv/bin/python bench/pretrain.py [-c configs/tiny.yaml] [--steps 150] [--compile both|on|off] [--set key=value ...]

The stage runs twice by default, eager and with `pretrain.compile` (torch.compile through DeepSpeed's
engine.compile); the baseline is the loop a user writes, eager.

On a GPU, add `--set model.preset=gpt2-124m --set pretrain.seq_len=1024 ...` to read bf16 MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from data.loader import TokenWindows  # noqa: E402
from data.shards import load_split  # noqa: E402
from model.build import build_model, flops_per_token, peak_flops  # noqa: E402
from model.losses import causal_lm_loss  # noqa: E402
from model.train import warmup_cosine  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.entry import locate  # noqa: E402
from pipeline.launch import stage_command, stage_env  # noqa: E402
from pipeline.store import read_manifest  # noqa: E402
from stages.pretrain import WARMUP_STEPS  # noqa: E402


def stage(cfg, cfg_path: Path) -> dict:
    for name in ("tokenize", "pretrain"):
        proc = subprocess.run(stage_command(cfg, name, cfg_path), cwd=ROOT, env={**os.environ, **stage_env()},
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return read_manifest(locate(cfg, "pretrain")[0])["metrics"]


def baseline(cfg) -> float:
    """A plain loop: one process, all cores, torch AdamW, the same schedule and clipping."""
    pc = cfg.pretrain
    tok_dir = locate(cfg, "tokenize")[0]
    tokens = load_split(tok_dir / "shards", "train")
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tok_dir / "tokenizer"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model.arch(), vocab, cfg.model.dropout).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=pc.lr, betas=(0.9, 0.95), weight_decay=pc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(pc))
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
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--compile", choices=["both", "on", "off"], default="both",
                   help="run the stage with pretrain.compile on, off, or both (default)")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="bench-pretrain-")
    overrides = [f"run.root={root}", f"pretrain.max_steps={args.steps}", f"pretrain.eval_every={args.steps}",
                 f"pretrain.save_every={args.steps}", *args.set]
    runs = {}
    for compiled in {"both": [False, True], "on": [True], "off": [False]}[args.compile]:
        cfg = load_config(args.config, [*overrides, f"pretrain.compile={compiled}"])
        cfg_path = Path(root) / "config.yaml"
        cfg_path.write_text(json.dumps(cfg.model_dump(mode="json")))
        runs[compiled] = stage(cfg, cfg_path)
    base = baseline(cfg)
    d, m = cfg.distributed, next(iter(runs.values()))
    print(f"model {cfg.model.preset}: {m['parameters'] / 1e6:.2f}M params, global batch {cfg.pretrain.global_batch_size}"
          f" x {cfg.pretrain.seq_len} tokens, {args.steps} steps ({WARMUP_STEPS} warm-up steps not timed)")
    print(f"baseline (1 process, plain PyTorch, eager): {base:12,.0f} tokens/s")
    for compiled, m in runs.items():
        name = f"gptforge ({d.launcher}, {d.world_size} processes, ZeRO-{d.zero_stage}, {'compiled' if compiled else 'eager'})"
        print(f"{name}: {m['tokens_per_sec']:12,.0f} tokens/s  mfu {m['mfu']}  "
              f"ratio {m['tokens_per_sec'] / base:.2f}x (target >= 1.0x on 2 CPU cores)")
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if peak_flops(dev):
        n = m["parameters"]
        print(f"baseline mfu: {flops_per_token(n, cfg.model.arch(), cfg.pretrain.seq_len) * base / peak_flops(dev):.1%}")


if __name__ == "__main__":
    main()
