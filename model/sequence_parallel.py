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
"""

from __future__ import annotations

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
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation=config._attn_implementation, sequence_parallel_size=n,
        micro_batch_size=micro_batch, seq_length=seq_len, seq_length_is_variable=seq_len is None)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ulysses = ALL_ATTENTION_FUNCTIONS[config._attn_implementation]

    def heads_last(module, query, *args, **kwargs):
        # Ulysses returns (B, T/N, hidden); transformers' own kernels (B, T/N, heads, head_dim), which is what
        # GPT-2 merges (its last two dimensions). Llama-style models reshape either to (B, T/N, hidden).
        out, weights = ulysses(module, query, *args, **kwargs)
        return (out.view(*out.shape[:2], query.shape[1], -1) if out.dim() == 3 else out), weights

    ALL_ATTENTION_FUNCTIONS[config._attn_implementation] = heads_last
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return SequenceParallel(n, mpu.get_sequence_parallel_rank(), rank // n, world // n, mpu, dist.zero_stage)
