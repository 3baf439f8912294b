"""What the pipeline asks of a config about its stages, from their declarations (gptforge.core.declarations, where
each stage is declared once): which run in a pipeline, the data-parallel world of one, and the models it reads by
name rather than from an upstream stage's output."""

from __future__ import annotations

from gptforge.core.config import PipelineConfig, tokenizer_source
from gptforge.core.declarations import NAMEABLE, STAGE_OR_MODEL, STAGES, data_parallel  # noqa: F401


def pipeline_stages(cfg: PipelineConfig) -> list[str]:
    """Stage names in order, the preference stage named after each algorithm; disabled stages left out (tokenize
    too when the pipeline starts from model.pretrained without pretraining it, and reward when
    preference.reward_model names a ready one or preference.rewards has no reward model)."""
    names = ["tokenize"] if cfg.pretrain.enabled or not cfg.model.pretrained else []
    if names and cfg.curate.enabled:
        names.insert(0, "curate")
    for name in ("pretrain", "sft"):
        if getattr(cfg, name).enabled:
            names.append(name)
    if cfg.trains_reward_model():
        names.append("reward")
    if cfg.preference.enabled:
        names.extend(cfg.preference.algorithms())
    names.extend(s.name for s in STAGES.values() if s.switch is not None and s.switch(cfg))
    return names


def setting(cfg: PipelineConfig, key: str):
    """The value of a dotted config key (`distill.teacher`)."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def named_stage(cfg: PipelineConfig, key: str) -> str | None:
    """The stage of the run that the setting `key` (one of a declaration's `named`) names, else None (a model)."""
    value = setting(cfg, key)
    return value if value in NAMEABLE else None


def named_models(cfg: PipelineConfig, step: str) -> dict[str, tuple[str, str | None]]:
    """The models a step reads by name rather than from an upstream stage's output (those of its declaration's
    `named` that the config sets): {config key: (hub name or directory, revision)}."""
    named, pc, out = STAGES[step].named, cfg.preference, {}
    if "tokenizer" in named and (source := tokenizer_source(cfg))[0]:
        out["tokenizer.pretrained" if cfg.tokenizer.pretrained else "model.pretrained"] = source
    if cfg.model.pretrained and ("model" in named or ("base" in named and not cfg.pretrain.enabled)):
        out["model.pretrained"] = (cfg.model.pretrained, cfg.model.revision)
    if "reward.pretrained" in named and cfg.reward.pretrained:
        out["reward.pretrained"] = (cfg.reward.pretrained, None)
    if "preference.reward_model" in named and pc.reward_model and pc.uses_reward_model():
        out["preference.reward_model"] = (pc.reward_model, None)
    if "preference.reference" in named and pc.reference:
        out["preference.reference"] = (pc.reference, None)
    if "preference.ppo.critic" in named and pc.ppo.critic:
        out["preference.ppo.critic"] = (pc.ppo.critic, None)
    for key in (k for k in named if k in STAGE_OR_MODEL):  # a stage of the run is an input, not a named model
        if (value := setting(cfg, key)) and named_stage(cfg, key) is None:
            out[key] = (value, None)
    return out
