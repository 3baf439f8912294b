"""Building `transformers` models from presets, and parameter / FLOP accounting."""

from __future__ import annotations

import math

import torch

from gptforge.core.presets import Arch


def hf_config(arch: Arch, vocab_size: int, dropout: float = 0.0, tokens: dict | None = None, model_cfg=None):
    """A GPT2Config (learned positions, pre-LN, GELU, scaled residual init), LlamaConfig (RoPE, RMSNorm, SwiGLU,
    GQA; MistralConfig, the same with a window, when the model section sets a sliding window) or MixtralConfig
    (Llama's attention, top-k routed SwiGLU experts whose router's load-balancing loss the model returns as
    `aux_loss`) for this architecture, with the model section's attention (`gptforge.model.attention`: the
    kernel, RoPE scaling, windows, the preset's attention pattern)."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, MixtralConfig

    from gptforge.core.config import ModelSection
    from gptforge.model.attention import configure

    # Special-token ids come from the tokenizer; GPT2Config's defaults (50256) may not exist in it.
    tokens = tokens or {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    kind = model_type(arch, model_cfg)
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=vocab_size, n_positions=arch.n_positions, n_embd=arch.n_embd,
                         n_layer=arch.n_layer, n_head=arch.n_head, n_inner=arch.intermediate_size,
                         activation_function="gelu_new", resid_pdrop=dropout, embd_pdrop=dropout,
                         attn_pdrop=dropout, scale_attn_by_inverse_layer_idx=False, use_cache=True, **tokens)
    else:
        common = dict(vocab_size=vocab_size, hidden_size=arch.n_embd, num_hidden_layers=arch.n_layer,
                      num_attention_heads=arch.n_head, num_key_value_heads=arch.n_kv_head or arch.n_head,
                      intermediate_size=arch.intermediate_size or _llama_mlp(arch.n_embd),
                      max_position_embeddings=arch.n_positions, attention_dropout=dropout,
                      tie_word_embeddings=False, use_cache=True, **tokens)
        if kind == "mixtral":
            cfg = MixtralConfig(**common, num_local_experts=arch.n_experts, num_experts_per_tok=arch.experts_per_token,
                                output_router_logits=True, router_aux_loss_coef=0.01)  # Mixtral's coefficient
        else:
            cfg = {"mistral": MistralConfig, "llama": LlamaConfig}[kind](**common)
        if model_cfg is not None and model_cfg.rope_theta is not None:
            cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": model_cfg.rope_theta}
    section = model_cfg or ModelSection()
    # The preset's pattern unless the section overrides it (arch already holds the overrides).
    section = section.model_copy(update={"attention_pattern": arch.attention_pattern,
                                         "local_window": arch.local_window})
    cfg._attn_implementation = configure(cfg, section)
    return cfg


def model_type(arch: Arch, model_cfg=None) -> str:
    """The transformers model type `hf_config` builds for this architecture: gpt2, mixtral (routed experts),
    mistral (a model section's sliding window) or llama."""
    if arch.family == "gpt2":
        return "gpt2"
    if arch.is_moe:
        return "mixtral"
    return "mistral" if model_cfg is not None and model_cfg.sliding_window is not None else "llama"


def arch_of(config) -> Arch:
    """The architecture fields of a transformers config (a pretrained model's), for FLOP and memory accounting."""
    family = "gpt2" if config.model_type == "gpt2" else "mixtral" if getattr(config, "num_local_experts", None) \
        else "llama"
    return Arch(family, n_layer=config.num_hidden_layers, n_head=config.num_attention_heads,
                n_embd=config.hidden_size, n_positions=context_of(config), vocab_size=config.vocab_size,
                n_kv_head=getattr(config, "num_key_value_heads", None),
                intermediate_size=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None),
                n_experts=getattr(config, "num_local_experts", None),
                experts_per_token=getattr(config, "num_experts_per_tok", None),
                **window_of(config))


def window_of(config) -> dict:
    """The attention pattern and band of a transformers config: ours (attention_pattern, local_window), or a
    native sliding window on every layer."""
    if getattr(config, "attention_pattern", None):
        return {"attention_pattern": config.attention_pattern, "local_window": config.local_window}
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return {"attention_pattern": "sliding", "local_window": config.sliding_window}
    return {}


def context_of(config) -> int:
    """A transformers config's context length (after RoPE scaling: max_position_embeddings is the scaled one)."""
    return getattr(config, "n_positions", None) or config.max_position_embeddings


def _llama_mlp(d: int) -> int:
    return 256 * math.ceil(int(8 * d / 3) / 256)


def build_model(arch: Arch, vocab_size: int, dropout: float = 0.0, tokens: dict | None = None,
                zero3: dict | None = None, model_cfg=None):
    """A freshly initialised causal LM. GPT-2 init already scales residual projections by 1/sqrt(2*n_layer).
    `zero3`: a ZeRO-3 DeepSpeed config, to build it partitioned (deepspeed.zero.Init: each module partitioned as
    soon as it is built, no rank ever holding the whole model) with the same weights as without ZeRO-3."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    config = hf_config(arch, vocab_size, dropout, tokens, model_cfg)
    if zero3 is None:
        return AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
    from unittest.mock import patch

    import deepspeed
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    def init_weights(self):  # PreTrainedModel.init_weights, gathered
        initialise_gathered(self)
        self.tie_weights(recompute_mapping=False)

    # Built as without ZeRO-3, the same random draws in the same order: each module's own initialisation in full
    # before it is partitioned, and each (sub)model's initialisation at its post_init, a module at a time, gathered.
    # (transformers' own ZeRO-3 build skips the first and initialises on rank 0 only: other draws, other weights.)
    with patch.object(PreTrainedModel, "init_weights", init_weights), prevent_arange_dtype_change(), \
            deepspeed.zero.Init(config_dict_or_path=zero3):
        return AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)


@torch.no_grad()
def initialise_gathered(model) -> None:
    """PreTrainedModel.initialize_weights over a ZeRO-3 partitioned model: the same modules in the same order
    (children first), each with its parameters gathered; every rank draws the same numbers (so that their random
    states stay equal, as without ZeRO-3) and rank 0's are kept."""
    import deepspeed
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    custom = model.is_custom_code()

    def visit(module, init):
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init)
        params = list(module.parameters(recurse=False)) + [  # _init_weights may set a direct child's parameters
            p for c in module.children() if not isinstance(c, PreTrainedModel) for p in c.parameters(recurse=False)]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=bool(params)):
            init(module, custom)

    with guard_torch_init_functions():
        visit(model, model._initialize_weights)


def parameter_counts(model) -> tuple[int, int]:
    """(total, active) parameters: active are those one token passes through, which for a mixture of experts
    counts experts_per_token of its n_experts (the router included). Counts a ZeRO-3 partitioned model whole."""
    total = experts = 0
    for name, p in model.named_parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        experts += n if ".experts." in name else 0
    config = model.config
    if not experts:
        return total, total
    return total, total - round(experts * (1 - config.num_experts_per_tok / config.num_local_experts))


def attention_span(arch: Arch, seq_len: int) -> float:
    """The keys a layer's queries attend over, averaged over the layers: seq_len for a dense layer, the window
    for a banded or sliding one (alternating: every other layer)."""
    window = min(seq_len, arch.local_window or seq_len)
    if arch.attention_pattern == "alternating":
        banded = arch.n_layer // 2
        return ((arch.n_layer - banded) * seq_len + banded * window) / arch.n_layer
    return window if arch.attention_pattern == "sliding" else seq_len


def flops_per_token(active_params: int, arch: Arch, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weight matmuls that a token passes through (N the active
    parameters: a mixture of experts computes only its routed experts) plus 12*n_layer*n_embd*span for
    attention scores and weighted values (PaLM, appendix B), span the keys attended (`attention_span`: seq_len,
    the window in banded layers)."""
    return 6 * active_params + 12 * arch.n_layer * arch.n_embd * attention_span(arch, seq_len)


# Dense bf16 peak FLOP/s by device name fragment (vendor data sheets, no sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12,
             "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12, "MI300X": 1307e12}


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where it is not known (the CPU, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)
