"""Sequence parallelism: DeepSpeed-Ulysses (`deepspeed.runtime.sequence_parallel.ulysses_sp`).

With `distributed.sequence_parallel: N`, consecutive groups of N ranks share each sequence: every rank holds T/N of
its tokens through the embeddings, MLPs, norms and the loss, and the attention of each layer trades that slice for
a share of the heads (an all-to-all), attends over the whole sequence, and trades back. Data parallelism runs over
the world/N groups: the ranks of a group read the same windows (`dp_rank`, `dp_world`) and each takes its slice
(`shard`). Positions are the whole sequence's, given to each slice as position ids, so RoPE and learned positions
are those of the unsharded sequence.

The loss of a rank is the mean over its slice; DeepSpeed averages gradients over all ranks, which for equal slices
is the gradient of the whole sequence's mean. Under ZeRO-1/2, DeepSpeed divides the reduced gradients by the data
parallel world (world/N) instead of the world that summed them, N times too large (ZeRO-3 divides by the
world); `backward_scale` is the factor that makes them right.

TRL's trainers that score sequences through TRL's fused LM head (DPO, GRPO, RLOO) take it through `trainer`: the
ranks of a group read the same micro-batches, and the model's fused forward shards each one, scores its slice and
joins the group's per-token log-probabilities, so that the trainer's loss code sees the whole sequences.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from gptforge.core.errors import ConfigError


@dataclass
class SequenceParallel:
    size: int
    rank: int  # within the group: which slice
    dp_rank: int
    dp_world: int
    mpu: object  # deepspeed's parallel state, given to deepspeed.initialize
    zero_stage: int
    attention: tuple = ()  # (kernel name, its own function, the Ulysses one put in its place)

    @contextlib.contextmanager
    def whole_sequences(self):
        """Each rank runs the model on whole sequences of its own (generation, reward models): the kernel's own
        attention, not Ulysses', for the time of the block."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        name, own, ulysses = self.attention
        ALL_ATTENTION_FUNCTIONS[name] = own
        try:
            yield
        finally:
            ALL_ATTENTION_FUNCTIONS[name] = ulysses

    def from_first_rank(self, value):
        """The group's first rank's `value` (any picklable object), on every rank of the group."""
        group = self.mpu.get_sequence_parallel_group()
        out = [value]
        torch.distributed.broadcast_object_list(out, src=torch.distributed.get_global_rank(group, 0), group=group)
        return out[0]

    def joined(self, x: torch.Tensor) -> torch.Tensor:
        """The group's (B, T/N, ...) slices joined along T, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.mpu.get_sequence_parallel_group())
        return torch.cat(parts, dim=1)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of (B, T, ...) along T."""
        n = x.size(1) // self.size
        return x[:, self.rank * n:(self.rank + 1) * n]

    @property
    def backward_scale(self) -> float:
        return 1.0 / self.size if self.zero_stage in (1, 2) else 1.0

    def shard_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """A right-padded batch (SFT's rows) as this rank's slice: padded to a multiple of N, the whole rows'
        position ids, no attention mask (causal attention never reaches a row's right padding, and Ulysses
        attends over the gathered sequence without one)."""
        pad = -x.size(1) % self.size
        if pad:
            x = torch.nn.functional.pad(x, (0, pad), value=0)
            y = torch.nn.functional.pad(y, (0, pad), value=-100)
        positions = torch.arange(x.size(1)).expand_as(x)
        return {"input_ids": self.shard(x), "position_ids": self.shard(positions), "use_cache": False}, self.shard(y)

    def group_mean(self, summed: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the group's token-mean loss, what this rank backpropagates) from its slice's summed loss and target
        count: the slices of a row hold different numbers of targets, so the mean is the group's sum over the
        group's count, and each rank's part of it is scaled by N to undo DeepSpeed's mean over the ranks."""
        group = self.mpu.get_sequence_parallel_group()
        totals = torch.stack([summed.detach().float(), count.float().to(summed.device)])
        torch.distributed.all_reduce(totals, group=group)
        n = totals[1].clamp(min=1)
        return totals[0] / n, summed * (self.size * self.backward_scale) / n


class _JoinSlices(torch.autograd.Function):
    """`SequenceParallel.joined`, differentiable. Every rank of the group computes the same loss from the joined
    tensor; backward hands each rank the gradient of its own slice, times `scale`."""

    @staticmethod
    def forward(ctx, x, sp, scale):
        ctx.rank, ctx.n, ctx.scale = sp.rank, x.size(1), scale
        return sp.joined(x)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n] * ctx.scale, None, None


def shard_fused_forward(model, sp: SequenceParallel, scale: float) -> None:
    """Make `model`'s fused-head forward (TRL's `add_fused_lm_head`: `model(input_ids, attention_mask, labels=...,
    fused_lm_head=True)` returns per-token log-probabilities of shape (B, T-1)) run sequence-parallel on a batch
    that every rank of the group holds:
    - each row's left padding is moved to its end (Ulysses attends causally without a mask, which right padding
      needs no more than that), and the batch right-padded to a multiple of N;
    - each rank scores its slice of the tokens against pre-shifted labels, at the whole row's positions;
    - the slices' per-token fields are joined and put back where the row's tokens were, as (B, T-1).
    Other calls (generation) go to the forward as it was."""
    from trl.trainer.utils import FusedCausalLMOutput

    fused = model.forward

    def forward(*args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head:
            return fused(*args, **({"labels": labels} if labels is not None else {}), **kwargs)
        ids = kwargs.pop("input_ids", args[0] if args else None)
        mask = kwargs.pop("attention_mask", None)
        kwargs.pop("position_ids", None)
        length = ids.size(1)
        at = torch.arange(length, device=ids.device)
        lead = (mask.cumsum(1) == 0).sum(1, keepdim=True) if mask is not None else torch.zeros_like(ids[:, :1])
        left = (at + lead) % length  # row b's token t + lead[b] comes first
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)  # position t predicts t+1
        pad = -length % sp.size
        ids = torch.nn.functional.pad(ids.gather(1, left), (0, pad), value=0)
        shifted = torch.nn.functional.pad(shifted.gather(1, left), (0, pad), value=-100)
        positions = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
        out = fused(input_ids=sp.shard(ids), position_ids=sp.shard(positions), shift_labels=sp.shard(shifted),
                    fused_lm_head=True, **kwargs)
        back = (at - lead) % length  # where each token went

        def whole(key):
            x = getattr(out, key)
            if x is None:
                return None
            x = _JoinSlices.apply(x, sp, scale) if key in ("log_probs", "entropy") else sp.joined(x)
            return x[:, :length].gather(1, back)[:, :length - 1]

        fields = {k: whole(k) for k in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1",
                                        "label_mask")}
        loss = -fields["log_probs"].sum() / fields["label_mask"].sum().clamp(min=1)
        return FusedCausalLMOutput(loss=loss, aux_loss=out.aux_loss, **fields)

    model.forward = forward


def check(config, n: int, seq_len: int, key: str) -> None:
    """What Ulysses needs of a model: heads divisible by N, a sequence divisible by N, an attention kernel that
    takes no 4D mask (not eager)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    impl = getattr(config, "_attn_implementation", "sdpa") or "sdpa"
    if impl.endswith("eager"):
        raise ConfigError(f"distributed.sequence_parallel={n} does not run on eager attention (it materialises the "
                          "whole 4D mask); set model.attention=sdpa or a FlashAttention kernel")
    if heads % n:
        raise ConfigError(f"distributed.sequence_parallel={n} does not divide the model's {heads} attention heads")
    if kv % n and n % kv:
        raise ConfigError(f"distributed.sequence_parallel={n} and the model's {kv} key/value heads: one must divide "
                          "the other")
    if seq_len % n:
        raise ConfigError(f"distributed.sequence_parallel={n} does not divide {key}={seq_len}")


def setup(model, dist, micro_batch: int, seq_len: int | None, key: str) -> SequenceParallel | None:
    """Register Ulysses attention for `model` (its own kernel inside) and the sequence-parallel groups; None when
    distributed.sequence_parallel is 1. `seq_len`: every batch's length, or None where it varies (SFT)."""
    n = dist.sequence_parallel
    if n == 1:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    config = getattr(model, "config", None)
    if config is not None and not hasattr(config, "num_key_value_heads"):  # GPT-2: no grouped heads, as many
        config.num_key_value_heads = config.num_attention_heads
    check(config, n, seq_len or n, key)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    own = ALL_ATTENTION_FUNCTIONS[config._attn_implementation]
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation=config._attn_implementation, sequence_parallel_size=n,
        micro_batch_size=micro_batch, seq_length=seq_len, seq_length_is_variable=seq_len is None)
    ulysses = ALL_ATTENTION_FUNCTIONS[config._attn_implementation]

    def heads_last(module, query, *args, **kwargs):
        # Ulysses returns (B, T/N, hidden); transformers' own kernels (B, T/N, heads, head_dim), which is what
        # GPT-2 merges (its last two dimensions). Llama-style models reshape either to (B, T/N, hidden).
        out, weights = ulysses(module, query, *args, **kwargs)
        return (out.view(*out.shape[:2], query.shape[1], -1) if out.dim() == 3 else out), weights

    ALL_ATTENTION_FUNCTIONS[config._attn_implementation] = heads_last
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return SequenceParallel(n, mpu.get_sequence_parallel_rank(), rank // n, world // n, mpu, dist.zero_stage,
                            (config._attn_implementation, own, heads_last))
