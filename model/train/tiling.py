"""Memory-bounded logits and MLPs for long sequences.

The loss of a causal LM normally builds its logits whole: (B, T, V) in fp32, 16 GiB for one 32k-token sequence of
a 128k vocabulary, and as much again for their gradient. `lm_loss` instead takes the final hidden states the output
head would have read (a forward pre-hook hands the head an empty slice, so the model builds no logits) and
computes the cross-entropy a tile of tokens at a time. Where the head's weight is whole (ZeRO 0-2), one fused pass
(`FusedLinearCrossEntropy`) takes each tile's gradients as it goes and keeps only them; under ZeRO-3, whose head is
gathered only inside its own calls, each tile is checkpointed and recomputed in backward. Either way the gradients
are the untiled ones and reach the parameters through autograd (DeepSpeed's loss scaling and gradient accumulation
apply unchanged: nothing is accumulated outside `engine.backward`).

`tile_mlps` makes each dense MLP compute a slice of the sequence at a time (DeepSpeed's `TiledMLP`, which
recomputes the slice in backward), so its (B, T, intermediate) activations are never whole either.

`distributed.tiling` chooses: auto tiles the logits above `distributed.logits_tile_mb` and the MLPs from 4096
tokens a sequence; true always; false never.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gptforge.data.chat import IGNORE

MLP_FROM_TOKENS = 4096  # auto: sequences this long get tiled MLPs


def logit_tiles(dist, batch: int, seq_len: int, vocab: int) -> int:
    """How many tiles the loss of a (batch, seq_len) micro-batch is cut into: 1 (untiled) unless its fp32 logits
    exceed distributed.logits_tile_mb (auto), or always (true), at least 2 then."""
    if dist.tiling is False:
        return 1
    tiles = math.ceil(batch * seq_len * vocab * 4 / (dist.logits_tile_mb * 2**20))
    if dist.tiling is True:
        return max(2, tiles)
    return tiles if tiles > 1 else 1


def mlp_shards(dist, seq_len: int, hidden: int) -> int:
    """Slices of the sequence each MLP computes at a time: DeepSpeed's ceil(T / hidden), or 1 (untiled)."""
    if dist.tiling is False or (dist.tiling == "auto" and seq_len < MLP_FROM_TOKENS):
        return 1
    return max(2, math.ceil(seq_len / hidden))


def _tile_loss(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE, reduction="sum")


def tiled_cross_entropy(head, hidden: torch.Tensor, targets: torch.Tensor, tiles: int) -> torch.Tensor:
    """Mean next-token cross-entropy of head(hidden) against targets (IGNORE masked), `tiles` tiles of tokens at a
    time, each checkpointed: no more than one tile's logits ever exist."""
    h, t = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    total = sum(checkpoint(_tile_loss, head, hc, tc, use_reentrant=False)
                for hc, tc in zip(h.chunk(tiles), t.chunk(tiles)))
    return total / (t != IGNORE).sum().clamp(min=1)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """sum_t CE(hidden_t @ weight^T + bias, target_t) / n, computed a tile of tokens at a time with each tile's
    gradients taken in forward (softmax minus the one-hot target, through the head by hand): one pass of the head,
    no logits kept, as Liger's fused linear cross-entropy does. The gradients are stored and scaled by the
    incoming gradient in backward, so DeepSpeed's loss scaling and gradient accumulation apply as to any loss."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, tiles: int, n):
        h, t = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
        need = ctx.needs_input_grad
        grad_h = torch.zeros_like(h) if need[0] else None
        grad_w = torch.zeros_like(weight) if need[1] else None
        grad_b = torch.zeros_like(bias) if bias is not None and need[2] else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        step = -(-h.size(0) // tiles)
        for i in range(0, h.size(0), step):
            hc, tc = h[i:i + step], t[i:i + step]
            logits = F.linear(hc, weight, bias).float()
            keep = tc != IGNORE
            safe = tc.masked_fill(~keep, 0)
            lse = logits.logsumexp(-1)
            total += ((lse - logits.gather(1, safe[:, None])[:, 0]) * keep).sum()
            if grad_h is None and grad_w is None:
                continue
            d = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            d[torch.arange(len(tc), device=d.device), safe] -= 1.0
            d *= keep[:, None]
            if grad_h is not None:
                grad_h[i:i + step] = (d.to(weight.dtype) @ weight).to(h.dtype)
            if grad_w is not None:
                grad_w.addmm_(d.t().to(weight.dtype), hc.to(weight.dtype))
            if grad_b is not None:
                grad_b += d.sum(0).to(bias.dtype)
        ctx.save_for_backward(*(g / n if g is not None else torch.empty(0) for g in (grad_h, grad_w, grad_b)))
        ctx.shape = hidden.shape
        ctx.has = (grad_h is not None, grad_w is not None, grad_b is not None)
        return total / n

    @staticmethod
    def backward(ctx, g):
        gh, gw, gb = ctx.saved_tensors
        has_h, has_w, has_b = ctx.has
        return (gh.view(ctx.shape) * g if has_h else None, gw * g if has_w else None, gb * g if has_b else None,
                None, None, None)


def final_hidden(model, inputs: dict):
    """(output head, the final hidden states it reads (B, T, D), output) of a forward on `inputs` in which the head
    computes no logits: a forward pre-hook hands it an empty slice of the hidden states and keeps them."""
    head = getattr(model, "module", model).get_output_embeddings()
    seen = {}

    def take_hidden(module, args):
        seen["hidden"] = args[0]
        return (args[0][:, :0],)

    handle = head.register_forward_pre_hook(take_hidden)
    try:
        out = model(**inputs)
    finally:
        handle.remove()
    return head, seen["hidden"], out


def lm_loss(model, inputs: dict, targets: torch.Tensor, tiles: int, reduction: str = "mean"):
    """(loss, output) of a causal LM (or a DeepSpeed engine holding one) on `inputs` against shifted `targets`:
    through the logits when tiles is 1, else tiled, the output then holding no logits. `reduction`: the mean over
    the targets that count, or their sum (0 where none does). A loss builds no KV cache."""
    inputs = {"use_cache": False, **inputs}
    if tiles <= 1:
        out = model(**inputs)
        logits = out.logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                               reduction=reduction), out
    head, hidden, out = final_hidden(model, inputs)
    n = (targets != IGNORE).sum().clamp(min=1) if reduction == "mean" else torch.ones((), device=targets.device)
    if isinstance(head, torch.nn.Linear) and not hasattr(head.weight, "ds_id"):  # a whole head: one fused pass
        return FusedLinearCrossEntropy.apply(hidden, head.weight, head.bias, targets, tiles, n), out
    # ZeRO-3 gathers the head's partitioned weight only inside its own calls: checkpointed tiles, recomputed
    return tiled_cross_entropy(head, hidden, targets, tiles) * ((targets != IGNORE).sum().clamp(min=1) / n), out


def _tile_logprobs(head, hidden: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    logits = head(hidden).float()
    return selective_log_softmax(logits, index), entropy_from_logits(logits)


def token_logprobs(model, inputs: dict, start: int, index: torch.Tensor, tiles: int):
    """(log-probabilities of `index` (B, R), the entropy there (B, R), output) from the positions start..-1 of a
    causal LM's forward on `inputs` (the logits that predict each of R tokens after `start`): the logits whole when
    tiles is 1, else a checkpointed tile of rows at a time from the final hidden states (the output then holding
    no logits). Scoring builds no KV cache."""
    inputs = {"use_cache": False, **inputs}
    if tiles <= 1:
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        out = model(**inputs)
        logits = out.logits[:, start:-1].float()
        return selective_log_softmax(logits, index), entropy_from_logits(logits), out
    head, hidden, out = final_hidden(model, inputs)
    hidden = hidden[:, start:-1]
    parts = [checkpoint(_tile_logprobs, head, h, i, use_reentrant=False)
             for h, i in zip(hidden.chunk(tiles, dim=1), index.chunk(tiles, dim=1))]
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1), out


def tile_mlps(model, shards: int) -> int:
    """Make every dense MLP of `model` (GPT-2's, Llama's and its kin's; not a mixture of experts' routed blocks)
    compute `shards` slices of the sequence at a time (DeepSpeed's TiledMLP). Returns how many were tiled."""
    if shards <= 1:
        return 0
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp(self, x):  # the class's own forward, on a contiguous slice (GPT-2's Conv1D views its input)
        return type(self).forward(self, x.contiguous())

    def forward(self, x):
        if x.dim() < 2 or x.shape[-2] < shards:
            return type(self).forward(self, x)
        return TiledMLP.apply(mlp, self, x, shards, list(self.parameters()))

    n = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("MLP") and "Sparse" not in name and "Moe" not in name:
            module.forward = types.MethodType(forward, module)
            n += 1
    return n
