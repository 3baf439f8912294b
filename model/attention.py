"""Attention as a model is built or loaded: the kernel (`model.attention`), RoPE scaling (`model.rope`), sliding
windows (`model.sliding_window`) and GPT-3's alternating dense and banded layers (`model.attention_pattern`,
`model.local_window`). Every stage builds and loads its models through `configure` / `load_kwargs`, so a choice
holds for presets and pretrained models alike, and for every model a later stage reloads.

What transformers has a name for is written into the model's config as transformers names it, so that
`from_pretrained` alone reproduces it: `rope_parameters`, and `sliding_window` for the families whose attention
takes one (Mistral, Mixtral, Qwen2; a Llama-style preset with a window is built as Mistral, which is Llama with a
window). The rest, a banded layer or a window on a family without one, is an attention function registered
through transformers' `AttentionInterface` (`gptforge_banded_<kernel>`), which the config names in
`attention_pattern` and `local_window`: a layer that is banded attends causally over the last `local_window`
tokens, the token itself included; dense layers are untouched. In the alternating pattern the even layers (the
first one included) are dense and the odd ones banded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from gptforge.core.attention_rules import NATIVE_WINDOW, check, kernel
from gptforge.core.errors import ConfigError

BANDED = "gptforge_banded_"


def context(config) -> int:
    return getattr(config, "n_positions", None) or config.max_position_embeddings


def configure(config, model_cfg, resolve_kernel: bool = True) -> str | None:
    """Write the model section's RoPE scaling, window and attention pattern into a transformers config (a
    preset's or a pretrained model's), in place, and return the attn_implementation to build or load it with.
    Applied again to a config that already has them (a later stage reloading a model), it changes nothing.
    `resolve_kernel=False`: the config only (no kernel is looked for: the planner, on another machine)."""
    family = config.model_type
    pattern = model_cfg.attention_pattern or getattr(config, "attention_pattern", None) or "dense"
    window = model_cfg.local_window or getattr(config, "local_window", None)
    check(family, context(config), model_cfg, pattern, window)
    if model_cfg.rope is not None:
        rope = model_cfg.rope
        current = getattr(config, "rope_parameters", None) or {}
        if current.get("rope_type") != rope.type or current.get("factor") != rope.factor:
            original = current.get("original_max_position_embeddings") or context(config)
            config.rope_parameters = {**{k: v for k, v in current.items() if k == "rope_theta"},
                                      **rope.parameters(original)}
            config.max_position_embeddings = rope.context(original)
            try:
                config.validate_rope()
            except (KeyError, ValueError) as e:
                raise ConfigError(f"model.rope: {e}") from None
    if model_cfg.sliding_window is not None:
        if family in NATIVE_WINDOW:
            config.sliding_window = model_cfg.sliding_window
            if hasattr(config, "use_sliding_window"):  # Qwen2: every layer windowed
                config.use_sliding_window, config.max_window_layers = True, 0
                config.layer_types = ["sliding_attention"] * config.num_hidden_layers
        else:  # a Llama model: every layer banded
            pattern, window = "sliding", model_cfg.sliding_window
    if pattern != "dense":
        config.attention_pattern, config.local_window = pattern, window
    if not resolve_kernel:  # the shapes alone (the planner, on a machine that is not the one that trains)
        return None
    base = kernel(model_cfg.attention)
    return register_banded(base) if pattern != "dense" else base


def load_kwargs(path: Path | str, model_cfg=None, **config_kwargs) -> dict:
    """The keyword arguments of `from_pretrained(path, ...)` that give the model the section's attention (the
    kernel, RoPE scaling, windows): its config, configured, and the attn_implementation. Without a section (a
    command given a directory alone), the model's own settings with the auto kernel."""
    from transformers import AutoConfig

    trust = bool(model_cfg and model_cfg.trust_remote_code)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust, **config_kwargs)
    if model_cfg is None:
        from gptforge.core.config import ModelSection

        model_cfg = ModelSection()
    return {"config": config, "attn_implementation": configure(config, model_cfg)}


def is_banded(module) -> int | None:
    """The band of this attention layer (None: a dense layer)."""
    config = module.config
    pattern = getattr(config, "attention_pattern", "dense")
    if pattern == "sliding" or (pattern == "alternating" and module.layer_idx % 2 == 1):
        return config.local_window
    return None


def band_mask(q_len: int, k_len: int, window: int, device) -> torch.Tensor:
    """(q_len, k_len) bool: query i (the last q_len of k_len positions) sees key j when 0 <= i - j < window."""
    q = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k = torch.arange(k_len, device=device)[None, :]
    return (k <= q) & (q - k < window)


def register_banded(base: str) -> str:
    """Register `gptforge_banded_<base>` (attention and masks) with transformers and return its name: the base
    kernel, its mask within the band on banded layers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = BANDED + base
    if name in ALL_ATTENTION_FUNCTIONS._global_mapping:
        return name

    def banded(module, query, key, value, attention_mask, **kwargs):
        if base == "eager":  # the model's own eager function (transformers has none of its own)
            fn = sys.modules[type(module).__module__].eager_attention_forward
        else:
            fn = ALL_ATTENTION_FUNCTIONS[base]
        window = is_banded(module)
        if window is None:
            return fn(module, query, key, value, attention_mask, **kwargs)
        if base.startswith("flash"):
            return fn(module, query, key, value, attention_mask, **{**kwargs, "sliding_window": window})
        q_len, k_len = query.shape[-2], key.shape[-2]
        band = band_mask(q_len, k_len, window, query.device)
        if attention_mask is None and base == "eager":  # eager adds its mask
            attention_mask = torch.zeros(band.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~band, torch.finfo(query.dtype).min)[None, None]
        elif attention_mask is None:
            attention_mask = band[None, None]
        elif attention_mask.dtype == torch.bool:
            attention_mask = attention_mask[..., :k_len] & band
        else:  # eager's additive mask
            attention_mask = attention_mask[..., :k_len].masked_fill(~band, torch.finfo(attention_mask.dtype).min)
        return fn(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, banded)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base] if base != "eager" else
                                    ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return name

