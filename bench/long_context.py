"""Long context on this machine: the longest sequence one training step fits under a per-rank memory cap, for
a Llama-style model of about 20M parameters (most of them its 32000-token vocabulary), in three setups side by
side:

- baseline: SDPA, logits and MLPs whole;
- tiled: tiled logits+loss and tiled MLPs (gptforge.model.train.tiling);
- tiled + sequence parallel: the same on 2 processes, Ulysses over both (gptforge.model.train.sequence_parallel).

Each trial is a fresh process (2 for sequence parallelism, gloo) that builds the model, runs one AdamW training
step at the length, and reports its peak resident memory (ru_maxrss: the whole process, Python and torch
included). A length fits when every rank's peak is under --cap-gib. Lengths double from --start. Then tokens/s
of the three at one common length (--common), where all fit.

    .venv/bin/python bench/long_context.py [--cap-gib 2.0] [--start 1024] [--max 16384] [--common 2048]

Targets (issue 24): the longest sequence at least 3x the baseline's with tiling and sequence parallelism
together; tokens/s at the common length at least 0.8x the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCH = ["model.preset=llama-tiny", "model.n_layer=4", "model.n_embd=256", "model.n_head=4", "model.n_kv_head=2",
        "model.intermediate_size=704", "model.n_positions=65536", "distributed.nproc_per_node=2"]
VOCAB = 32000


def worker(seq_len: int, setup: str, steps: int) -> None:
    import torch

    from gptforge.core.config import load_config
    from gptforge.model.train import sequence_parallel
    from gptforge.model.build import build_model
    from gptforge.model.train.distributed import setup_distributed
    from gptforge.model.train.tiling import lm_loss, logit_tiles, mlp_shards, tile_mlps

    sp_size = 2 if setup == "tiled+sp" else 1
    tiling = "false" if setup == "baseline" else "true"
    cfg = load_config(None, [*ARCH, f"distributed.tiling={tiling}", f"distributed.sequence_parallel={sp_size}",
                             "distributed.logits_tile_mb=64",
                             f"pretrain.seq_len={seq_len}", "pretrain.micro_batch_size=1",
                             "pretrain.global_batch_size=2", "sft.enabled=false", "reward.enabled=false",
                             "preference.enabled=false"])
    rank, world, device = setup_distributed()
    torch.manual_seed(0)
    model = build_model(cfg.model.arch(), VOCAB, model_cfg=cfg.model)
    dist = cfg.distributed
    sp = sequence_parallel.setup(model, dist, 1, seq_len, "pretrain.seq_len")
    local = seq_len // sp_size
    tiles = logit_tiles(dist, 1, local, VOCAB)
    tile_mlps(model, mlp_shards(dist, local, 256) if tiling == "true" else 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, VOCAB, (1, seq_len + 1))
    inputs, y = x[:, :-1], x[:, 1:]
    positions = torch.arange(seq_len)[None]
    if sp is not None:
        inputs, y, positions = sp.shard(inputs), sp.shard(y), sp.shard(positions)
    times, losses, peak = [], [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        loss, _ = lm_loss(model, {"input_ids": inputs, "position_ids": positions, "use_cache": False}, y, tiles)
        loss.backward()
        if sp is not None:  # the gradient of the whole sequence: summed over the slices
            for p in model.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= sp_size
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())  # this rank's slice's mean (sequence parallel: slices of one length)
        # the peak of one step, the first (AdamW's moments made): later steps' speed is read, not their memory
        peak = peak or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"rank": rank, "peak": peak, "step_s": min(times), "tokens": int(y.numel()), "losses": losses}),
          flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(seq_len: int, setup: str, steps: int = 1, timeout: int = 900) -> list[dict] | None:
    """Every rank's report, or None where a rank failed (out of memory, killed)."""
    n = 2 if setup == "tiled+sp" else 1
    port = free_port()
    procs = []
    for r in range(n):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu",
               "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(seq_len), setup, str(steps)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    reports = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            return None
        lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        if p.returncode or not lines:
            return None
        reports += lines
    return reports


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap-gib", type=float, default=2.0)
    ap.add_argument("--start", type=int, default=1024)
    ap.add_argument("--max", type=int, default=16384)
    ap.add_argument("--common", type=int, default=2048)
    args = ap.parse_args()
    cap = args.cap_gib * 2**30
    setups = ("baseline", "tiled", "tiled+sp")
    longest, kept = {}, {}  # kept: the trials at the common length, whose 3 steps give its speed too
    for setup in setups:
        longest[setup], length = 0, args.start
        while length <= args.max:
            reports = trial(length, setup, steps=3 if length == args.common else 1)
            if length == args.common:
                kept[setup] = reports
            peak = max(r["peak"] for r in reports) / 2**30 if reports else None
            fits = peak is not None and peak * 2**30 <= cap
            print(f"{setup:10s} seq_len {length:6d}: peak {'failed' if peak is None else f'{peak:.2f} GiB'} a rank "
                  f"-> {'fits' if fits else 'over the cap'}", flush=True)
            if not fits:
                break
            longest[setup], length = length, length * 2
    rates, losses, tokens = {}, {}, {}
    for setup in setups:
        reports = kept[setup] if setup in kept else trial(args.common, setup, steps=3)
        rates[setup] = args.common / max(r["step_s"] for r in reports) if reports else None
        if reports:  # the whole sequence's loss: the mean of the ranks' (slices of one length)
            tokens[setup] = sum(r["tokens"] for r in reports)
            losses[setup] = [sum(step) / len(reports) for step in zip(*(r["losses"] for r in reports))]
    print(f"\nlongest sequence under {args.cap_gib:g} GiB a rank (a step of 1 sequence, AdamW):")
    for setup in setups:
        print(f"  {setup:10s} {longest[setup]:6d}  ({longest[setup] / max(longest['baseline'], 1):.1f}x baseline)")
    print(f"tokens/s at {args.common} tokens (best of 3 steps; sequence parallel: one sequence on 2 ranks):")
    base = rates["baseline"]
    for setup in setups:
        rate = rates[setup]
        print(f"  {setup:10s} {'n/a' if rate is None else f'{rate:8.0f}'}"
              f"  ({'n/a' if not rate or not base else f'{rate / base:.2f}x'})")
    print(f"the same work at {args.common} tokens (tokens a step over the ranks, each step's loss):")
    for setup in setups:
        print(f"  {setup:10s} {tokens.get(setup, 0):6d} tokens  losses "
              + " ".join(f"{x:.6f}" for x in losses.get(setup, [])))
    ratio = longest["tiled+sp"] / max(longest["baseline"], 1)
    speed = (rates["tiled+sp"] or 0) / (rates["baseline"] or 1)
    print(f"targets: longest >= 3x baseline: {ratio:.1f}x {'met' if ratio >= 3 else 'NOT met'}; tokens/s >= 0.8x "
          f"baseline: {speed:.2f}x {'met' if speed >= 0.8 else 'NOT met'}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    else:
        main()
