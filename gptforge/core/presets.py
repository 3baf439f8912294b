"""Model presets: GPT-2 family, GPT-3 family (Brown et al. 2020, Table 2.1), Llama-style, mixture-of-experts
(Mixtral-style: Jiang et al. 2024), and the CPU-sized `tiny` ones.

A preset is an `Arch`: plain architecture fields, which `gptforge.model.build` turns into a `transformers`
config. They live in the core because the config schema validates `model.preset` against them.
"""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Arch:
    """Architecture of a decoder-only transformer."""

    family: str  # "gpt2" (learned positions, LayerNorm, GELU), "llama" (RoPE, RMSNorm, SwiGLU, GQA) or
    # "mixtral" (llama with each MLP replaced by n_experts SwiGLU experts, experts_per_token routed to each token)
    n_layer: int
    n_head: int
    n_embd: int
    n_positions: int
    vocab_size: int = 50257
    n_kv_head: int | None = None  # llama only; None means n_head (no grouping)
    intermediate_size: int | None = None  # MLP (each expert's) width; None: 4*n_embd (gpt2), ~8/3*n_embd (others)
    n_experts: int | None = None  # mixtral only
    experts_per_token: int | None = None  # mixtral only: top-k routing
    attention_pattern: str = "dense"  # or "alternating": full and locally banded causal attention, layer by layer
    local_window: int | None = None  # the banded layers' width (tokens back, the token itself included)

    @property
    def is_moe(self) -> bool:
        return self.family == "mixtral"

    def with_overrides(self, **overrides) -> "Arch":
        """This architecture with the given fields replaced (None: kept)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def _gpt3(n_layer, n_embd, n_head):
    # §2.1: "alternating dense and locally banded sparse attention patterns in the layers of the transformer,
    # similar to the Sparse Transformer". The paper gives no band width; 256 is the Sparse Transformer's scale
    # (a band of about sqrt(n) blocks) at a 2048 context.
    return Arch("gpt2", n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=2048,
                attention_pattern="alternating", local_window=256)


PRESETS: dict[str, Arch] = {
    # CPU-sized: ~0.8M parameters with a 512-token vocabulary.
    "tiny": Arch("gpt2", n_layer=4, n_head=4, n_embd=128, n_positions=128, vocab_size=512),
    "llama-tiny": Arch("llama", n_layer=4, n_head=4, n_embd=128, n_positions=128, vocab_size=512,
                       n_kv_head=2, intermediate_size=352),
    # GPT-2 (Radford et al. 2019), context 1024.
    "gpt2-124m": Arch("gpt2", n_layer=12, n_head=12, n_embd=768, n_positions=1024),
    "gpt2-350m": Arch("gpt2", n_layer=24, n_head=16, n_embd=1024, n_positions=1024),
    "gpt2-774m": Arch("gpt2", n_layer=36, n_head=20, n_embd=1280, n_positions=1024),
    "gpt2-1.5b": Arch("gpt2", n_layer=48, n_head=25, n_embd=1600, n_positions=1024),
    # GPT-3 Table 2.1, context 2048. The table's XL (24 heads of 128 for d_model 2048) and 13B
    # (d_model 5140) rows do not divide; we keep d_model and head size 128 where they can hold.
    "gpt3-small": _gpt3(12, 768, 12),
    "gpt3-medium": _gpt3(24, 1024, 16),
    "gpt3-large": _gpt3(24, 1536, 16),
    "gpt3-xl": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    "gpt3-13b": _gpt3(40, 5120, 40),
    "gpt3-175b": _gpt3(96, 12288, 96),
    # Llama-style (Touvron et al. 2023 shapes), vocab 32000, context 2048/4096.
    "llama-160m": Arch("llama", n_layer=12, n_head=12, n_embd=768, n_positions=2048, vocab_size=32000,
                       n_kv_head=4, intermediate_size=2048),
    "llama-1b": Arch("llama", n_layer=16, n_head=32, n_embd=2048, n_positions=2048, vocab_size=32000,
                     n_kv_head=8, intermediate_size=8192),
    "llama-7b": Arch("llama", n_layer=32, n_head=32, n_embd=4096, n_positions=4096, vocab_size=32000,
                     n_kv_head=32, intermediate_size=11008),
    # Mixture of experts, Mixtral-style: top-2 of 8 SwiGLU experts in every layer, GQA attention.
    "moe-tiny": Arch("mixtral", n_layer=4, n_head=4, n_embd=128, n_positions=128, vocab_size=512, n_kv_head=2,
                     intermediate_size=176, n_experts=4, experts_per_token=2),
    "moe-1b": Arch("mixtral", n_layer=12, n_head=12, n_embd=768, n_positions=2048, vocab_size=32000, n_kv_head=4,
                   intermediate_size=2048, n_experts=8, experts_per_token=2),
    "mixtral-8x7b": Arch("mixtral", n_layer=32, n_head=32, n_embd=4096, n_positions=4096, vocab_size=32000,
                         n_kv_head=8, intermediate_size=14336, n_experts=8, experts_per_token=2),
}
