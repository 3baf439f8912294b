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


def setup(model, dist, micro_batch: int, seq_len: int, key: str) -> SequenceParallel | None:
    """Register Ulysses attention for `model` (its own kernel inside) and the sequence-parallel groups; None when
    distributed.sequence_parallel is 1."""
    n = dist.sequence_parallel
    if n == 1:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    config = getattr(model, "config", None)
    if config is not None and not hasattr(config, "num_key_value_heads"):  # GPT-2: no grouped heads, as many
        config.num_key_value_heads = config.num_attention_heads
    check(config, n, seq_len, key)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation=config._attn_implementation, sequence_parallel_size=n,
        micro_batch_size=micro_batch, seq_length=seq_len, seq_length_is_variable=False)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return SequenceParallel(n, mpu.get_sequence_parallel_rank(), rank // n, world // n, mpu, dist.zero_stage)
