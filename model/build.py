"""Building `transformers` models from presets, and parameter / FLOP accounting."""

from __future__ import annotations

import math

import torch

from gptforge.core.presets import Arch


def hf_config(arch: Arch, vocab_size: int, dropout: float = 0.0, tokens: dict | None = None):
    """A GPT2Config (learned positions, pre-LN, GELU, scaled residual init) or LlamaConfig (RoPE,
    RMSNorm, SwiGLU, GQA) for this architecture, with SDPA attention."""
    from transformers import GPT2Config, LlamaConfig

    # Special-token ids come from the tokenizer; GPT2Config's defaults (50256) may not exist in it.
    tokens = tokens or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if arch.family == "gpt2":
        cfg = GPT2Config(vocab_size=vocab_size, n_positions=arch.n_positions, n_embd=arch.n_embd,
                         n_layer=arch.n_layer, n_head=arch.n_head, n_inner=arch.intermediate_size,
                         activation_function="gelu_new", resid_pdrop=dropout, embd_pdrop=dropout,
                         attn_pdrop=dropout, scale_attn_by_inverse_layer_idx=False, use_cache=True, **tokens)
    else:
        cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=arch.n_embd, num_hidden_layers=arch.n_layer,
                          num_attention_heads=arch.n_head, num_key_value_heads=arch.n_kv_head or arch.n_head,
                          intermediate_size=arch.intermediate_size or _llama_mlp(arch.n_embd),
                          max_position_embeddings=arch.n_positions, attention_dropout=dropout,
                          tie_word_embeddings=False, use_cache=True, **tokens)
    cfg._attn_implementation = "sdpa"
    return cfg


def _llama_mlp(d: int) -> int:
    return 256 * math.ceil(int(8 * d / 3) / 256)


def build_model(arch: Arch, vocab_size: int, dropout: float = 0.0, tokens: dict | None = None):
    """A freshly initialised causal LM. GPT-2 init already scales residual projections by 1/sqrt(2*n_layer)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf_config(arch, vocab_size, dropout, tokens), attn_implementation="sdpa")


def flops_per_token(n_params: int, arch: Arch, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weight matmuls plus 12*n_layer*n_embd*seq_len for
    attention scores and weighted values (PaLM, appendix B)."""
    return 6 * n_params + 12 * arch.n_layer * arch.n_embd * seq_len


# Dense bf16 peak FLOP/s by device name fragment (vendor data sheets, no sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12,
             "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "MI300X": 1307e12}


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where it is not known (the CPU, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)
