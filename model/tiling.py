"""Memory-bounded logits and MLPs for long sequences.

The loss of a causal LM normally builds its logits whole: (B, T, V) in fp32, 16 GiB for one 32k-token sequence of
a 128k vocabulary, and as much again for their gradient. `lm_loss` instead takes the final hidden states the output
head would have read (a forward pre-hook hands the head an empty slice, so the model builds no logits) and
computes the cross-entropy a tile of tokens at a time, each tile checkpointed: forward keeps no tile's logits, and
backward recomputes one tile's at a time. The gradients are the untiled ones, accumulated by autograd as usual
(DeepSpeed's loss scaling and gradient accumulation apply unchanged: nothing runs backward outside
`engine.backward`). `tile_mlps` makes each dense MLP compute a slice of the sequence at a time
(DeepSpeed's `TiledMLP`, which recomputes the slice in backward), so its (B, T, intermediate) activations are
never whole either.

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


def lm_loss(model, inputs: dict, targets: torch.Tensor, tiles: int):
    """(loss, output) of a causal LM (or a DeepSpeed engine holding one) on `inputs` against shifted `targets`:
    through the logits when tiles is 1, else tiled (`tiled_cross_entropy`), the output then holding no logits."""
    if tiles <= 1:
        from gptforge.model.losses import causal_lm_loss

        out = model(**inputs)
        return causal_lm_loss(out.logits, targets), out
    head = getattr(model, "module", model).get_output_embeddings()
    seen = {}

    def take_hidden(module, args):
        seen["hidden"] = args[0]
        return (args[0][:, :0],)  # the head computes no logits inside the model

    handle = head.register_forward_pre_hook(take_hidden)
    try:
        out = model(**inputs)
    finally:
        handle.remove()
    return tiled_cross_entropy(head, seen["hidden"], targets, tiles), out


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
