"""The memory and compute planner behind `gptforge plan`.

Model states per GPU follow the ZeRO paper (Rajbhandari et al. 2020, section 3) for mixed-precision
Adam: 2 bytes of bf16 weights, 2 of bf16 gradients and K=12 of fp32 optimizer state (master weights,
momentum, variance) per parameter, partitioned over N data-parallel GPUs by the ZeRO stage; CPU offload
moves the optimizer state (and its update) to host memory. Activations per layer follow Korthikanti et
al. 2022 (34·s·b·h + 5·a·s²·b bytes without recomputation, 2·s·b·h with full recomputation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptforge.core.presets import Arch
from gptforge.model.build import build_model, flops_per_token

GiB = 1024 ** 3
TOKENS_PER_PARAM = 20  # compute-optimal budget (Hoffmann et al. 2022)


def model_state_bytes(n_params: int, zero_stage: int, gpus: int, offload: bool) -> float:
    """Bytes of weights, gradients and optimizer state held on each GPU."""
    weights, grads, optim = 2.0 * n_params, 2.0 * n_params, 12.0 * n_params
    if offload:
        optim = 0.0
    if zero_stage >= 1:
        optim /= gpus
    if zero_stage >= 2:
        grads /= gpus
    if zero_stage >= 3:
        weights /= gpus
    return weights + grads + optim


def activation_bytes(arch: Arch, seq_len: int, micro_batch: int, checkpointing: bool) -> float:
    s, b, h, a, L = seq_len, micro_batch, arch.n_embd, arch.n_head, arch.n_layer
    per_layer = 2 * s * b * h if checkpointing else 34 * s * b * h + 5 * a * s * s * b
    return L * per_layer


@dataclass
class Plan:
    n_params: int
    flops_per_token: float
    optimal_tokens: float
    train_flops: float
    memory: dict  # {(zero_stage, offload): bytes of model states per GPU}
    activations: dict  # {checkpointing: bytes per GPU}
    days: float | None


def make_plan(arch: Arch, vocab_size: int, seq_len: int, micro_batch: int, gpus: int, tokens: float | None = None,
              peak_tflops: float = 989.0, mfu: float = 0.4) -> Plan:
    with torch.device("meta"):
        n = build_model(arch, vocab_size).num_parameters()
    fpt = flops_per_token(n, arch, seq_len)
    tokens = tokens or TOKENS_PER_PARAM * n
    memory = {(z, off): model_state_bytes(n, z, gpus, off) for z in range(4) for off in (False, True) if z or not off}
    acts = {ckpt: activation_bytes(arch, seq_len, micro_batch, ckpt) for ckpt in (False, True)}
    days = fpt * tokens / (gpus * peak_tflops * 1e12 * mfu) / 86400
    return Plan(n, fpt, TOKENS_PER_PARAM * n, fpt * tokens, memory, acts, days)


def render(p: Plan, name: str, gpus: int, gpu_mem: float | None, seq_len: int, micro_batch: int, tokens_given: bool,
           peak_tflops: float, mfu: float) -> str:
    lines = [f"model {name}: {p.n_params / 1e9:.3f}B parameters",
             f"training FLOPs per token (seq {seq_len}): {p.flops_per_token:.4g}",
             f"compute-optimal tokens (20 per parameter): {p.optimal_tokens / 1e9:.1f}B",
             f"training FLOPs for {'the given' if tokens_given else 'the compute-optimal'} tokens: {p.train_flops:.4g}",
             f"time on {gpus} GPUs at {mfu:.0%} MFU of {peak_tflops:g} TFLOP/s: {p.days:.1f} days",
             f"activations per GPU (micro-batch {micro_batch}): {p.activations[False] / GiB:.1f} GiB, "
             f"{p.activations[True] / GiB:.1f} GiB with activation checkpointing",
             f"model states per GPU on {gpus} GPUs (bf16 weights and grads, fp32 Adam):"]
    for (z, off), b in p.memory.items():
        total = b + p.activations[True]
        fits = "" if gpu_mem is None else ("  fits" if total <= gpu_mem * GiB else "  does not fit")
        lines.append(f"  ZeRO-{z}{' + CPU offload' if off else '':15s} {b / GiB:12.1f} GiB{fits}")
    return "\n".join(lines)
