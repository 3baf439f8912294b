"""Typed pipeline config: one YAML, validated once at load, overridable with `--set section.key=value`.

Every field has a type, a default and a one-line help (the Prefect UI shows them as the parameter form).
A field that cannot change what a stage computes (how often it logs, evaluates or saves, how many
checkpoints it keeps, `compile`, parallelism) is declared with `same_result=True`: the stage store leaves
it out of fingerprints, so changing it never retrains anything (see `result_fields`).

The schema is in four modules (`base`: fields and sections; `inputs`: run, data, tokenizer; `model_layout`: model,
distributed layout, LoRA; `training`: the stages' own sections and evaluation); this one assembles them into
`PipelineConfig`, checks what crosses sections, and loads YAML with overrides. What needs more than the config (the
devices, files, models, servers) is gptforge.pipeline.preflight's; what a stage is, gptforge.core.registry's.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError, model_validator

from gptforge.core.config.base import (ALGORITHMS, ONLINE_ALGORITHMS, Algorithm, Section, Setting,  # noqa: F401
                                       result_fields, size_in_bytes)
from gptforge.core.config.inputs import (DataSection, DemoSection, EvalSourceSection,  # noqa: F401
                                         PromptSourceSection, RunSection, SourceSection, TokenizerSection)
from gptforge.core.config.model_layout import (ATTENTION, DistributedSection, LoraSection,  # noqa: F401
                                               ModelSection, RopeSection)
from gptforge.core.config.training import (CURATE_FILTERS, REWARD_BUILT_IN, CurateSection,  # noqa: F401
                                           DistillSection, DPOSection, EvalSection, GRPOSection, OnlineSection,
                                           PPOSection, PreferenceSection, PretrainSection, RewardSection, RewardSpec,
                                           RLOOSection, SFTSection, TrainSection)
from gptforge.core.declarations import (ADAPTERS, STAGES, TRAINED_SECTIONS, ULYSSES_SPLITS, adapter_of, data_parallel,
                                        reward_kind)
from gptforge.core.errors import ConfigError


class PipelineConfig(Section):
    run: RunSection = Setting(default_factory=RunSection, description="Run name, root, seed, retries, schedule.")
    data: DataSection = Setting(default_factory=DataSection, description="Where each stage's rows come from.")
    curate: CurateSection = Setting(default_factory=CurateSection, description="Deduplication, quality filters and "
                                    "decontamination of the pretraining data, before tokenize.")
    tokenizer: TokenizerSection = Setting(default_factory=TokenizerSection, description="BPE training and shards.")
    model: ModelSection = Setting(default_factory=ModelSection, description="Architecture.")
    distributed: DistributedSection = Setting(default_factory=DistributedSection,
                                              description="Launcher, processes, nodes, ZeRO.")
    pretrain: PretrainSection = Setting(default_factory=PretrainSection, description="Pretraining.")
    sft: SFTSection = Setting(default_factory=SFTSection, description="Supervised fine-tuning.")
    reward: RewardSection = Setting(default_factory=RewardSection, description="Reward model.")
    preference: PreferenceSection = Setting(default_factory=PreferenceSection, description="Alignment.")
    distill: DistillSection = Setting(default_factory=DistillSection, description="On-policy distillation of a "
                                      "student toward a teacher (off by default).")
    eval: EvalSection = Setting(default_factory=EvalSection, description="Held-out evaluation of finished outputs.")

    def trains_reward_model(self) -> bool:
        """Whether the pipeline has a reward stage: it is enabled, no ready reward model is named, and a reward model
        is among preference.rewards."""
        return self.reward.enabled and not self.preference.reward_model and self.preference.uses_reward_model()

    @model_validator(mode="after")
    def _combinations(self):
        world, sp = self.distributed.world_size, self.distributed.sequence_parallel
        for name in TRAINED_SECTIONS:
            s = getattr(self, name)
            # each stage that trains from the section divides its batch over its own data-parallel world: the world,
            # over sequence_parallel where the stage shares its sequences (the registry's data_parallel)
            stages = [d for d in STAGES.values() if d.section == name
                      and (name != "preference" or d.name in self.preference.algorithms())]
            for dp in sorted({data_parallel(self.distributed, d.name) for d in stages}):
                if s.enabled and s.global_batch_size % (s.micro_batch_size * dp):
                    raise ValueError(f"{name}.global_batch_size={s.global_batch_size} is not divisible by "
                                     f"micro_batch_size*{'world_size' if dp == world else 'data-parallel world'} = "
                                     f"{s.micro_batch_size}*{dp}")
        # What Ulysses cannot take: a length it does not divide, a mask it would drop (it attends over the whole
        # gathered sequence without one), heads it cannot share out, eager attention's whole 4D mask.
        for name, (length_key, mask_key) in ULYSSES_SPLITS.items():
            section = getattr(self, name)
            if sp == 1 or not section.enabled:
                continue
            if getattr(section, length_key) % sp:
                raise ValueError(f"distributed.sequence_parallel={sp} does not divide {name}.{length_key}="
                                 f"{getattr(section, length_key)}")
            if getattr(section, mask_key):
                raise ValueError(f"{name}.{mask_key} with distributed.sequence_parallel={sp}: Ulysses attends over the "
                                 "whole gathered sequence without a mask, so its documents would see each other; set "
                                 "one of them off")
        moe = not self.model.pretrained and self.model.arch().is_moe
        for name in TRAINED_SECTIONS:  # DeepSpeed's bf16 Muon without ZeRO: dense matrices, data parallel only
            section = getattr(self, name)
            if (getattr(section, "optimizer", "adamw") == "muon" and section.enabled
                    and self.distributed.zero_stage == 0 and self.distributed.precision != "fp32" and (moe or sp > 1)):
                raise ValueError(f"{name}.optimizer=muon with distributed.zero_stage=0 does not serve "
                                 f"{'a mixture of experts' if moe else 'sequence parallelism'} in bf16 (DeepSpeed's "
                                 "Muon without ZeRO steps dense matrices over data parallelism only): set "
                                 "distributed.zero_stage to 1, 2 or 3, or distributed.precision=fp32")
        if sp > 1 and not self.model.pretrained:
            if self.model.arch().n_head % sp:
                raise ValueError(f"distributed.sequence_parallel={sp} does not divide the model's "
                                 f"{self.model.arch().n_head} attention heads (model.n_head)")
            if self.model.attention == "eager":
                raise ValueError(f"distributed.sequence_parallel={sp} does not run on model.attention=eager (a whole "
                                 "4D mask); use sdpa or a FlashAttention kernel")
        if self.sft.enabled and not self.pretrain.enabled and not self.model.pretrained:
            raise ValueError("pretrain.enabled is false and model.pretrained is not set: sft has no model to start "
                             "from; set model.pretrained (a hub name or a local Hugging Face directory) or "
                             "pretrain.enabled=true")
        chain = [("sft", self.sft), ("reward", self.reward), ("preference", self.preference)]
        if not self.model.pretrained:
            chain.insert(0, ("pretrain", self.pretrain))
        if not self.trains_reward_model():  # a ready reward model, or none among the rewards: no reward stage
            chain.remove(("reward", self.reward))
        for (up, up_s), (down, down_s) in zip(chain, chain[1:]):
            if down_s.enabled and not up_s.enabled:
                raise ValueError(f"{down}.enabled is true but its input stage {up} is disabled ({up}.enabled=false)")
        pc = self.preference
        online = [a for a in pc.algorithms() if a in ONLINE_ALGORITHMS] if pc.enabled else []
        micro_steps = pc.global_batch_size // pc.micro_batch_size  # micro-batches of one TRL step, all processes
        for algo in online:
            oc = getattr(pc, algo)
            if oc.ptx_coef and oc.ptx_batch_size and oc.ptx_batch_size % micro_steps:
                raise ValueError(f"preference.{algo}.ptx_batch_size={oc.ptx_batch_size} is not divisible by "
                                 f"global_batch_size/micro_batch_size = {micro_steps}, the micro-batches of one "
                                 "update over all processes")
            # a data-parallel rank's rollouts a step hold whole prompt groups where it samples for a
            # sequence-parallel group (its first rank's) or replaces groups (dynamic sampling): one rule
            dp, shared = data_parallel(self.distributed, algo), sp > 1 and STAGES[algo].sequence_parallel
            if shared and oc.ptx_coef:
                raise ValueError(f"preference.{algo}.ptx_coef with distributed.sequence_parallel={sp}: the ptx rows "
                                 "are each rank's own, which a sequence-parallel group cannot share; set one of them "
                                 "off")
            whole = ("dynamic sampling replaces whole groups" if getattr(oc, "dynamic_sampling", False) else
                     f"a sequence-parallel group of {sp} samples once" if shared else None)
            rows = pc.global_batch_size // dp
            if whole and rows % oc.num_generations:
                raise ValueError(f"preference.{algo}.num_generations={oc.num_generations}: a data-parallel rank's "
                                 f"{rows} rows a step (preference.global_batch_size over the {dp} data-parallel "
                                 f"ranks) must hold whole prompt groups, as {whole}")
        led = [a for a in pc.algorithms() if STAGES[a].trainer] if pc.enabled and pc.optimizer == "muon" else []
        if led:
            raise ValueError(f"preference.optimizer=muon: {led[0]} trains through TRL's {STAGES[led[0]].trainer} "
                             "trainer, which steps its own AdamW; Muon runs in gptforge's own loops (pretrain, sft, "
                             "reward, ppo, distill): set preference.optimizer=adamw")
        checks = [(i, r.name) for i, r in enumerate(pc.rewards) if (kind := reward_kind(r)) and kind.answers]
        if online and checks and self.data.prompts.path is None and self.data.preference.path != "demo":
            i, name = checks[0]
            raise ValueError(f"preference.rewards[{i}] ({name}) compares responses with reference answers, but the "
                             f"prompts are data.preference's ({self.data.preference.path!r}), which have none: set "
                             "data.prompts to rows with answers ({prompt, answer}, or GSM8K's question/answer)")
        harnessed = (adapter := adapter_of(pc.environment)) is not None and adapter.drives
        if online and harnessed and self.data.prompts.path != pc.environment:
            raise ValueError(f"preference.environment {pc.environment} runs its own taskset's tasks: set data.prompts "
                             f"to {pc.environment} too (now {self.data.prompts.path!r})")
        for i, r in enumerate(pc.rewards):  # a reward of an adapter's items scores that adapter's prompts alone
            source = ADAPTERS.get((kind := reward_kind(r)) and kind.scores)
            if online and source and adapter_of(self.data.prompts.path) != source:
                raise ValueError(f"preference.rewards[{i}] ({r.name}) scores {source.library}'s items, but "
                                 f"data.prompts is {self.data.prompts.path!r}: set it to {source.prefix}<dataset>")
        if self.reward.enabled and self.reward.policy_samples and self.data.preference.path != "demo":
            raise ValueError(f"reward.policy_samples needs data.preference: demo (the verifier knows the demo's "
                             f"answers), not {self.data.preference.path!r}; set it to 0")
        context = self.model.arch().n_positions
        if self.model.rope is not None:
            context = self.model.rope.context(context)
        if not self.model.pretrained and self.pretrain.seq_len > context:
            raise ValueError(f"pretrain.seq_len={self.pretrain.seq_len} exceeds the model context "
                             f"n_positions={context}" + ("" if self.model.rope else "; model.rope scaling (Llama-style "
                                                         "models) extends it"))
        return self



# --- loading -------------------------------------------------------------------------------------


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        if isinstance(node.get(k), str):  # a source given by its path alone: `sft: chat.jsonl`
            node[k] = {"path": node[k]}
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {k} is not a section")
    node[keys[-1]] = value


def _unshared(node):
    """A copy in which no two places share one dict or list: a YAML alias (`rloo: *online`) becomes a copy of its
    anchor, so that overriding one place never changes another."""
    if isinstance(node, dict):
        return {k: _unshared(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unshared(v) for v in node]
    return node


def parse_override(item: str) -> tuple[str, Any]:
    """'pretrain.lr=3e-4' -> ('pretrain.lr', 0.0003); the value is read as YAML."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = PipelineConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


MOVED = {  # keys of earlier versions: where their meaning went
    "verifier_reward": "; the online stages' rewards are preference.rewards now: the demo verifier is "
                       "[{name: exact_match}] there",
    "verifier_weight": "; set the weight of {name: exact_match} in preference.rewards",
    "reward_model_weight": "; set the weight of {name: reward_model} in preference.rewards",
}


def _explain(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        key = ".".join(loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            valid = list(parent.model_fields) if parent else []
            close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
            hint = f"; did you mean {'.'.join(loc[:-1] + (close[0],))}?" if close else ""
            hint = MOVED.get(loc[-1], hint) if loc[:1] == ("preference",) else hint
            lines.append(f"unknown key {key}{hint}")
        elif e["type"] == "value_error":
            msg = str(e["msg"]).removeprefix("Value error, ")
            lines.append(f"{key}: {msg}" if loc else msg)
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    return f"invalid config {source}: " + "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] = (), data: dict | None = None) -> PipelineConfig:
    """Load a pipeline YAML (or a dict), apply `section.key=value` overrides, validate. Raises ConfigError."""
    source = str(path) if path else "(defaults)"
    tree: dict = {}
    if data is not None:
        tree = dict(data)
    elif path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    tree = _unshared(tree)
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_explain(e, source)) from None


def dump_config(cfg: PipelineConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def tokenizer_source(cfg: PipelineConfig) -> tuple[str | None, str | None]:
    """(name or directory, hub revision) of the pretrained tokenizer the tokenize stage loads: tokenizer.pretrained,
    else model.pretrained's own; (None, None): a BPE is trained."""
    if cfg.tokenizer.pretrained:
        return cfg.tokenizer.pretrained, None
    return cfg.model.pretrained, cfg.model.revision

