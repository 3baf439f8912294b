"""Typed pipeline config: one YAML, validated once at load, overridable with `--set section.key=value`.

Every field has a type, a default and a help line (the Prefect UI shows them as the parameter form).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from model.presets import PRESETS
from pipeline.errors import ConfigError

STAGES = ("tokenize", "pretrain", "sft", "reward", "preference")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunSection(Section):
    name: str = Field("tiny", description="Run name: the run directory is <root>/<name>.")
    root: str = Field("runs", description="Directory holding runs and the stage store.")
    seed: int = Field(0, description="Global seed for data order, init and sampling.")
    retries: int = Field(0, ge=0, description="Prefect retries of a failed stage (a retry resumes from its checkpoint).")
    retry_delay: int = Field(10, ge=0, description="Seconds between retries.")
    schedule: str | None = Field(None, description="Cron schedule of the served deployment, e.g. '0 2 * * *'.")


class DemoSection(Section):
    seed: int = Field(0, description="Seed of the built-in demo data generator.")
    pretrain_docs: int = Field(20000, ge=1, description="Number of pretraining documents (one Q/A or sentence each).")
    sft_items: int = Field(3000, ge=1, description="Number of instruction conversations.")
    preference_pairs: int = Field(2000, ge=1, description="Number of preference pairs.")
    eval_items: int = Field(200, ge=1, description="Number of held-out verifiable items.")


class DataSection(Section):
    pretrain: str = Field("demo", description="Pretraining corpus: 'demo', a local file/folder/glob, or a hub dataset.")
    sft: str = Field("demo", description="Chat data (Alpaca, ShareGPT, OpenAI messages): 'demo', path or hub name.")
    preference: str = Field("demo", description="Preference pairs (prompt/chosen/rejected, UltraFeedback, HH): 'demo', path or hub name.")
    split: str = Field("train", description="Split to load from hub datasets.")
    text_field: str = Field("text", description="Field holding the text in JSON/Parquet pretraining rows.")
    on_bad_row: Literal["skip", "fail"] = Field("skip", description="Skip bad rows (counted) or fail the stage.")
    demo: DemoSection = Field(default_factory=DemoSection, description="Demo data sizes.")


class TokenizerSection(Section):
    pretrained: str | None = Field(None, description="Load this tokenizer (hub name or local dir) instead of training one.")
    vocab_size: int = Field(512, ge=1, description="Vocabulary size of the trained byte-level BPE, special tokens included.")
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency for a BPE merge.")
    special_tokens: list[str] = Field(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"],
                                      description="Special tokens; the first is end-of-text, the last padding.")
    val_fraction: float = Field(0.05, gt=0, lt=1, description="Fraction of documents held out as the val shard.")
    shard_tokens: int = Field(50_000_000, ge=1000, description="Maximum tokens per shard file.")
    num_workers: int = Field(0, ge=0, description="Encoding worker processes; 0 means one per CPU core.")

    @model_validator(mode="after")
    def _vocab_holds_bytes(self):
        need = 256 + len(self.special_tokens)
        if self.pretrained is None and self.vocab_size < need:
            raise ValueError(f"tokenizer.vocab_size={self.vocab_size} is smaller than the byte alphabet (256) "
                             f"plus {len(self.special_tokens)} special tokens = {need}")
        return self


class ModelSection(Section):
    preset: str = Field("tiny", description=f"Architecture preset: {', '.join(PRESETS)}.")
    n_layer: int | None = Field(None, ge=1, description="Override the preset's number of layers.")
    n_head: int | None = Field(None, ge=1, description="Override the preset's attention heads.")
    n_embd: int | None = Field(None, ge=1, description="Override the preset's hidden size.")
    n_positions: int | None = Field(None, ge=1, description="Override the preset's context length.")
    n_kv_head: int | None = Field(None, ge=1, description="Override the key/value heads (Llama family).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on embeddings, attention and residuals.")

    def arch(self):
        """The preset with this section's overrides applied (vocab size comes from the tokenizer)."""
        return PRESETS[self.preset].with_overrides(
            n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
            n_positions=self.n_positions, n_kv_head=self.n_kv_head)

    @model_validator(mode="after")
    def _shapes(self):
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        a = self.arch()
        if a.n_embd % a.n_head:
            raise ValueError(f"n_embd={a.n_embd} is not divisible by n_head={a.n_head}")
        if a.n_kv_head and a.n_head % a.n_kv_head:
            raise ValueError(f"n_head={a.n_head} is not divisible by n_kv_head={a.n_kv_head}")
        return self


class DistributedSection(Section):
    launcher: Literal["deepspeed", "torchrun", "accelerate"] = Field("deepspeed", description="Process launcher.")
    nproc_per_node: int = Field(2, ge=1, description="Processes per node (GPUs per node, or CPU processes).")
    nnodes: int = Field(1, ge=1, description="Number of nodes.")
    node_rank: int = Field(0, ge=0, description="This node's rank (multi-node without a hostfile).")
    master_addr: str = Field("127.0.0.1", description="Address of the rank-0 node.")
    master_port: int = Field(29500, ge=1, le=65535, description="Rendezvous port on the rank-0 node.")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile for multi-node runs.")
    zero_stage: int = Field(2, ge=0, le=3, description="ZeRO stage 0-3 (configs/deepspeed/zero<N>.json).")
    offload_optimizer: bool = Field(False, description="Offload optimizer state to CPU memory (ZeRO 1-3).")
    activation_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    precision: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto: bf16 on GPUs, fp32 on the CPU.")

    @model_validator(mode="after")
    def _offload_needs_zero(self):
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage 1, 2 or 3")
        return self

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class TrainSection(Section):
    enabled: bool = Field(True, description="Run this stage.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr: float = Field(1e-4, ge=0, description="Learning rate at the end of cosine decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps.")
    max_steps: int = Field(200, ge=1, description="Optimizer steps.")
    micro_batch_size: int = Field(16, ge=1, description="Sequences per process per forward pass.")
    global_batch_size: int = Field(32, ge=1, description="Sequences per optimizer step over all processes.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0, description="Gradient norm clip (0 disables).")
    log_every: int = Field(10, ge=1, description="Steps between log lines.")
    eval_every: int = Field(100, ge=1, description="Steps between evaluations.")
    save_every: int = Field(100, ge=1, description="Steps between step checkpoints.")
    keep_last: int = Field(2, ge=1, description="Step checkpoints kept.")


class PretrainSection(TrainSection):
    seq_len: int = Field(96, ge=8, description="Training sequence length in tokens.")
    eval_batches: int = Field(8, ge=1, description="Val batches per evaluation.")
    compile: bool = Field(False, description="torch.compile the model (DeepSpeed engine.compile): the first step "
                          "takes longer (tens of seconds), the rest run faster. Needs a C++ compiler on the CPU.")


class SFTSection(TrainSection):
    lr: float = Field(5e-4, gt=0, description="Peak learning rate (AdamW).")
    max_length: int = Field(96, ge=8, description="Maximum tokens per conversation.")
    assistant_only_loss: bool = Field(True, description="Loss on assistant tokens only (else the full sequence).")
    packing: bool = Field(False, description="Pack several conversations into each sequence.")
    on_too_long: Literal["skip", "truncate"] = Field("skip", description="What to do with examples over max_length.")


class RewardSection(TrainSection):
    lr: float = Field(5e-4, gt=0, description="Peak learning rate (AdamW).")
    max_length: int = Field(96, ge=8, description="Maximum tokens per prompt+response.")
    on_too_long: Literal["skip", "truncate"] = Field("skip", description="What to do with pairs over max_length.")
    margin: float = Field(0.0, ge=0, description="Margin term of the pairwise loss.")
    center_rewards_coefficient: float = Field(0.0, ge=0, description="Weight of the reward-centering term.")
    policy_samples: int = Field(0, ge=0, description="Also train on comparisons of the SFT model's own answers "
                                "(InstructGPT-style): sample one answer for this many training prompts and pair "
                                "each wrong one, as rejected, with the known answer (needs data.preference: demo, "
                                "whose verifier labels them).")
    sample_temperature: float = Field(1.0, gt=0, description="Sampling temperature of policy_samples.")


class PreferenceSection(TrainSection):
    algorithm: Literal["dpo", "ppo", "grpo", "rloo"] | list[Literal["dpo", "ppo", "grpo", "rloo"]] = Field(
        "dpo", description="Alignment algorithm(s); each runs as its own stage.")
    lr: float = Field(5e-5, gt=0, description="Peak learning rate (AdamW).")
    min_lr: float = Field(0.0, ge=0, description="Learning rate at the end of cosine decay (PPO; TRL decays to 0).")
    beta: float = Field(0.1, gt=0, description="KL strength (DPO beta, PPO initial KL coefficient).")
    loss_type: str | list[str] = Field("sigmoid", description="DPO loss type (sigmoid, ipo, hinge, robust, ...), or a "
                                       "list combined with equal weights (e.g. [sigmoid, sft] for RPO).")
    max_length: int = Field(96, ge=8, description="Maximum tokens per prompt+response.")
    max_new_tokens: int = Field(8, ge=1, description="Response length for on-policy sampling.")
    ppo_epochs: int = Field(2, ge=1, description="PPO passes over each rollout batch.")
    gamma: float = Field(1.0, ge=0, le=1, description="PPO discount factor.")
    lam: float = Field(0.95, ge=0, le=1, description="PPO GAE lambda.")
    cliprange: float = Field(0.2, gt=0, description="PPO policy ratio clip.")
    cliprange_value: float = Field(0.2, gt=0, description="PPO value clip.")
    critic_lr: float = Field(1e-4, gt=0, description="PPO critic learning rate.")
    kl_target: float | None = Field(None, gt=0, description="Adaptive KL controller target (None: fixed beta).")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive KL controller horizon, in samples.")
    num_generations: int = Field(4, ge=2, description="GRPO/RLOO completions per prompt.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="GRPO: divide each group's rewards, less their mean, by the group's std (group), the "
        "batch's (batch) or nothing (none, as Dr. GRPO).")
    verifier_reward: bool = Field(False, description="PPO/GRPO/RLOO: add a rule-based verifier of demo answers (1 when "
                                  "the response is the known answer) to the reward model's score.")
    verifier_weight: float = Field(1.0, ge=0, description="Weight of the verifier reward.")
    reward_model_weight: float = Field(1.0, ge=0, description="PPO/GRPO/RLOO: weight of the reward model's score.")
    ptx_coef: float = Field(0.0, ge=0, description="PPO/GRPO/RLOO: weight of a supervised loss on the preference "
                            "pairs' chosen responses, added to the policy loss at every update on ptx_batch_size rows "
                            "(InstructGPT's PPO-ptx, OpenRLHF's ptx_coef); 0 disables.")
    ptx_batch_size: int | None = Field(None, ge=1, description="PPO/GRPO/RLOO: rows of chosen responses in the ptx "
                                       "loss of each policy update, over all processes (PPO updates once per "
                                       "minibatch, TRL once per optimizer step); None: as many as the update's "
                                       "responses. Those rows cost a forward and backward pass, no generation.")
    max_bad_steps: int = Field(3, ge=0, description="Steps with a NaN/Inf reward or loss skipped before the stage fails.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature for rollouts.")
    top_k: int = Field(0, ge=0, description="Top-k for rollouts (0 disables).")
    top_p: float = Field(1.0, gt=0, le=1, description="Top-p for rollouts.")

    def ptx_rows(self, world: int, micro_steps_per_update: int) -> int:
        """Rows of chosen responses on each process in each micro-batch of the ptx loss, when a policy update
        takes `micro_steps_per_update` micro-batches on each process."""
        per_update = self.ptx_batch_size or self.micro_batch_size * world * micro_steps_per_update
        return per_update // (world * micro_steps_per_update)


class EvalSection(Section):
    max_new_tokens: int = Field(8, ge=1, description="Tokens generated per held-out item.")
    items: int = Field(200, ge=1, description="Held-out items evaluated.")


class PipelineConfig(Section):
    run: RunSection = Field(default_factory=RunSection)
    data: DataSection = Field(default_factory=DataSection)
    tokenizer: TokenizerSection = Field(default_factory=TokenizerSection)
    model: ModelSection = Field(default_factory=ModelSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    pretrain: PretrainSection = Field(default_factory=PretrainSection)
    sft: SFTSection = Field(default_factory=SFTSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    preference: PreferenceSection = Field(default_factory=PreferenceSection)
    eval: EvalSection = Field(default_factory=EvalSection)

    @model_validator(mode="after")
    def _combinations(self):
        world = self.distributed.world_size
        for name in ("pretrain", "sft", "reward", "preference"):
            s = getattr(self, name)
            per_step = s.micro_batch_size * world
            if s.enabled and s.global_batch_size % per_step:
                raise ValueError(f"{name}.global_batch_size={s.global_batch_size} is not divisible by "
                                 f"micro_batch_size*world_size = {s.micro_batch_size}*{world}")
        chain = [("pretrain", self.pretrain), ("sft", self.sft), ("reward", self.reward),
                 ("preference", self.preference)]
        for (up, up_s), (down, down_s) in zip(chain, chain[1:]):
            if down_s.enabled and not up_s.enabled:
                raise ValueError(f"{down}.enabled is true but its input stage {up} is disabled ({up}.enabled=false)")
        online = {"ppo", "grpo", "rloo"} & set(preference_algorithms(self))
        pc = self.preference
        micro_steps = pc.global_batch_size // pc.micro_batch_size  # micro-batches of one TRL step, all processes
        if pc.enabled and online and pc.ptx_coef and pc.ptx_batch_size and pc.ptx_batch_size % micro_steps:
            raise ValueError(f"preference.ptx_batch_size={pc.ptx_batch_size} is not divisible by global_batch_size/"
                             f"micro_batch_size = {micro_steps}, the micro-batches of one update over all processes")
        if self.preference.enabled and self.preference.verifier_reward and online and self.data.preference != "demo":
            raise ValueError(f"preference.verifier_reward needs data.preference: demo (the verifier knows the demo's "
                             f"answers), not {self.data.preference!r}; set it to false for {', '.join(sorted(online))}")
        if self.reward.enabled and self.reward.policy_samples and self.data.preference != "demo":
            raise ValueError(f"reward.policy_samples needs data.preference: demo (the verifier knows the demo's "
                             f"answers), not {self.data.preference!r}; set it to 0")
        if self.pretrain.seq_len > self.model.arch().n_positions:
            raise ValueError(f"pretrain.seq_len={self.pretrain.seq_len} exceeds the model context "
                             f"n_positions={self.model.arch().n_positions}")
        return self


# --- loading -------------------------------------------------------------------------------------


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {k} is not a section")
    node[keys[-1]] = value


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
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_explain(e, source)) from None


def dump_config(cfg: PipelineConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def preference_algorithms(cfg: PipelineConfig) -> list[str]:
    algo = cfg.preference.algorithm
    return [algo] if isinstance(algo, str) else list(algo)


def pipeline_stages(cfg: PipelineConfig) -> list[str]:
    """Stage names in order, the preference stage named after each algorithm; disabled stages left out."""
    names = ["tokenize"]
    for name in ("pretrain", "sft", "reward"):
        if getattr(cfg, name).enabled:
            names.append(name)
    if cfg.preference.enabled:
        names.extend(preference_algorithms(cfg))
    return names
