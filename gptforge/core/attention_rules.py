"""What a model family and context can take of the model section's attention settings (RoPE scaling, windows,
the attention pattern): checked where the config is validated (presets) and where a model is configured
(gptforge.model.attention, pretrained models), each failure one ConfigError naming the key."""

from __future__ import annotations

import importlib.util

from gptforge.core.errors import ConfigError

# Families whose attention goes through transformers' AttentionInterface with a layer index: they can take a
# banded layer. Native sliding windows: the configs whose attention and masks read `sliding_window`.
BANDED_FAMILIES = ("gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3")
NATIVE_WINDOW = ("mistral", "mixtral", "qwen2", "qwen3")
FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
ROPE_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")


def check(family: str, ctx: int, model_cfg, pattern: str | None = None, window: int | None = None) -> None:
    """What a family and context can take of the model section; a ConfigError naming the key otherwise. `pattern`
    and `window`: the attention pattern and band the model will have (the preset's, or the section's)."""
    rope, sliding = model_cfg.rope, model_cfg.sliding_window
    if model_cfg.rope_theta is not None and family not in ROPE_FAMILIES:
        raise ConfigError(f"model.rope_theta: a {family} model has no rotary position embeddings (learned positions)")
    if model_cfg.pretrained and model_cfg.rope_theta is not None:
        raise ConfigError("model.rope_theta sets a preset's RoPE base; model.pretrained keeps its own")
    if rope is not None and family not in ROPE_FAMILIES:
        raise ConfigError(f"model.rope: a {family} model has no rotary position embeddings to scale (learned "
                          f"positions); RoPE scaling needs a Llama-style model ({', '.join(ROPE_FAMILIES)})")
    after = rope.context(ctx) if rope is not None else ctx
    if sliding is not None:
        if family == "gpt2":
            raise ConfigError("model.sliding_window is for Llama- and Mistral-style models; a GPT-2-style model "
                              "takes model.attention_pattern=alternating with model.local_window")
        if family not in BANDED_FAMILIES:
            raise ConfigError(f"model.sliding_window: a {family} model's attention takes no window here; "
                              f"families that do: {', '.join(BANDED_FAMILIES)}")
        if sliding > after:
            raise ConfigError(f"model.sliding_window={sliding} is larger than the context ({after} positions)")
    pattern = pattern or model_cfg.attention_pattern or "dense"
    if pattern == "alternating":
        if family not in BANDED_FAMILIES:
            raise ConfigError(f"model.attention_pattern=alternating: a {family} model's attention cannot take banded "
                              f"layers here; families that can: {', '.join(BANDED_FAMILIES)}")
        window = window or model_cfg.local_window
        if window is None:
            raise ConfigError("model.attention_pattern=alternating needs model.local_window (the banded layers' "
                              "width in tokens)")
        if window > after:
            raise ConfigError(f"model.local_window={window} is larger than the context ({after} positions)")
        if model_cfg.attention in ("flex_attention",):
            raise ConfigError("model.attention_pattern=alternating runs on sdpa, eager or flash_attention_2/3, not "
                              f"model.attention={model_cfg.attention}")


def check_context(arch, model_cfg) -> None:
    """`check` for a preset (its architecture with the section's overrides)."""
    check(arch.family, arch.n_positions, model_cfg, arch.attention_pattern, arch.local_window)


def kernel(name: str) -> str:
    """The attention kernel `model.attention` names, `auto` resolved: FlashAttention 2 on a GPU where flash-attn is
    installed, else SDPA. A FlashAttention kernel with no GPU or no package is a ConfigError naming the key. torch
    is asked for a GPU only where a FlashAttention kernel could be the answer (`gptforge run` checks the config
    before its server starts, and needs no torch for the rest)."""
    if name == "auto":
        return "flash_attention_2" if importlib.util.find_spec("flash_attn") and gpu() else "sdpa"
    if name in FLASH_PACKAGES:
        if not gpu():
            raise ConfigError(f"model.attention={name} needs a GPU, and there is none here; use sdpa (or auto)")
        if importlib.util.find_spec(FLASH_PACKAGES[name]) is None:
            raise ConfigError(f"model.attention={name} needs the {FLASH_PACKAGES[name]} package, which is not "
                              "installed: pip install 'gptforge[gpu]', or use sdpa (or auto)")
    return name


def gpu() -> bool:
    import torch

    return torch.cuda.is_available()
