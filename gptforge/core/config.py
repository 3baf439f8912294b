"""Typed pipeline config: one YAML, validated once at load, overridable with `--set section.key=value`.

Every field has a type, a default and a one-line help (the Prefect UI shows them as the parameter form).
A field that cannot change what a stage computes (how often it logs, evaluates or saves, how many
checkpoints it keeps, `compile`, parallelism) is declared with `same_result=True`: the stage store leaves
it out of fingerprints, so changing it never retrains anything (see `result_fields`).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gptforge.core.errors import ConfigError
from gptforge.core.presets import PRESETS

ALGORITHMS = ("dpo", "ppo", "grpo", "rloo")
ONLINE_ALGORITHMS = ("ppo", "grpo", "rloo")  # rewarded by preference.rewards
SEQUENCE_PARALLEL_STAGES = ("pretrain", "sft", "dpo", "grpo", "rloo")  # distributed.sequence_parallel serves these
Algorithm = Literal["dpo", "ppo", "grpo", "rloo"]


def Setting(default: Any = ..., *, same_result: bool = False, **kw) -> Any:
    """A config field; `same_result=True` marks one that cannot change a stage's output."""
    return Field(default, json_schema_extra={"same_result": True} if same_result else None, **kw)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def result_fields(section: Section, leave_out: tuple[str, ...] = ()) -> dict:
    """The fields of a section that can change a result (what a fingerprint hashes), nested sections included."""
    out = {}
    for name, field in type(section).model_fields.items():
        if name in leave_out or (field.json_schema_extra or {}).get("same_result"):
            continue
        value = getattr(section, name)
        out[name] = result_fields(value) if isinstance(value, Section) else section.model_dump(
            mode="json", include={name})[name]
    return out


class RunSection(Section):
    name: str = Setting("tiny", description="Run name: the run directory is <root>/<name>.")
    root: str = Setting("runs", description="Directory holding runs and the stage store.")
    seed: int = Setting(0, description="Global seed for data order, init and sampling.")
    retries: int = Setting(0, ge=0, description="Prefect retries of a failed stage (a retry resumes from its "
                           "checkpoint).")
    retry_delay: int = Setting(10, ge=0, description="Seconds between retries.")
    schedule: str | None = Setting(None, description="Cron schedule of the served deployment, e.g. '0 2 * * *'.")
    work_pools: dict[str, str] = Setting({}, same_result=True, description="Stage (or evaluation step) -> Prefect "
                                         "work pool it runs on, e.g. {tokenize: cpu, pretrain: gpu}; empty: every "
                                         "stage runs in the flow's own process.")
    default_work_pool: str | None = Setting(None, same_result=True, description="Work pool of the stages not in "
                                            "run.work_pools (and of the pipeline and watch deployments).")
    slots: str = Setting("gptforge-gpus", same_result=True, description="Prefect global concurrency limit a stage "
                         "takes its world size of slots from while it runs (created by `gptforge deploy --slots N`).")
    approve_before: list[str] = Setting([], same_result=True, description="Stages the flow pauses before, for a "
                                        "person's approval in the Prefect UI.")
    approve_timeout: int = Setting(86400, ge=60, same_result=True, description="Seconds an approval may wait "
                                   "before the run fails.")
    watch_every: int = Setting(600, ge=10, same_result=True, description="Seconds between the deployed watch "
                               "flow's checks of the data sources and named models.")
    tracker: Literal["none", "mlflow"] = Setting("none", same_result=True, description="Experiment tracker: mlflow "
                                                 "logs each stage's parameters and metrics, nested under the run's.")
    tracking_uri: str | None = Setting(None, same_result=True, description="MLflow tracking server or store; None: "
                                       "sqlite:///<run.root>/mlflow.db.")


class DemoSection(Section):
    seed: int = Setting(0, description="Seed of the built-in demo data generator.")
    pretrain_docs: int = Setting(20000, ge=1, description="Number of pretraining documents (one Q/A or sentence each).")
    sft_items: int = Setting(3000, ge=1, description="Number of instruction conversations.")
    sft_flaws: float = Setting(0.0, ge=0, lt=1, description="Share of the conversations whose answer is a plausible "
                               "wrong one, as human demonstrations have (the preference pairs always rank the right "
                               "answer first).")
    preference_pairs: int = Setting(2000, ge=1, description="Number of preference pairs.")
    eval_items: int = Setting(200, ge=1, description="Number of held-out verifiable items.")


class SourceSection(Section):
    """Where one kind of rows comes from. A plain string in the YAML (`sft: chat.jsonl`) is its `path`."""

    path: str = Setting("demo", description="'demo', a local file, folder or glob (.txt .jsonl .json .parquet .arrow, "
                        ".gz/.zst), a save_to_disk folder, or a hub dataset name.")
    split: str = Setting("train", description="Split of a hub dataset or of a saved DatasetDict.")
    subset: str | None = Setting(None, description="Subset (configuration) of a hub dataset.")
    revision: str | None = Setting(None, description="Hub dataset revision (branch, tag or commit); None: the newest "
                                   "commit of main, resolved at every run.")
    streaming: bool = Setting(False, same_result=True, description="Stream a hub dataset instead of downloading it "
                              "first.")

    @model_validator(mode="before")
    @classmethod
    def _from_path(cls, data):
        return {"path": data} if isinstance(data, str) else data


class EvalSourceSection(SourceSection):
    """Where the evaluation steps' prompts come from; a plain string in the YAML is its `path`."""

    path: str | None = Setting(None, description="None: the rows held out of data.sft / data.preference; else a "
                               "source of prompts with optional answers ({prompt, answer}) or conversations.")


class PromptSourceSection(SourceSection):
    """Where the online stages' prompts come from; a plain string in the YAML is its `path`."""

    path: str | None = Setting(None, description="None: the preference pairs' prompts; else {prompt, answer} rows, "
                               "conversations ending in the reference, or GSM8K question/answer rows (#### 42).")


class DataSection(Section):
    pretrain: SourceSection = Setting(default_factory=SourceSection, description="Pretraining corpus.")
    sft: SourceSection = Setting(default_factory=SourceSection, description="Chat data (Alpaca, ShareGPT, OpenAI "
                                 "messages).")
    preference: SourceSection = Setting(default_factory=SourceSection, description="Preference pairs (prompt/chosen/"
                                        "rejected, UltraFeedback, HH).")
    text_field: str = Setting("text", description="Field holding the text in JSON/Parquet/Arrow pretraining rows.")
    on_bad_row: Literal["skip", "fail"] = Setting("skip", description="Skip bad rows (counted) or fail the stage.")
    eval: EvalSourceSection = Setting(default_factory=EvalSourceSection, description="Held-out prompts for the "
                                      "evaluation steps (default: rows held out of the stages' own data).")
    prompts: PromptSourceSection = Setting(default_factory=PromptSourceSection, description="Prompts with optional "
                                           "reference answers for the online stages (ppo, grpo, rloo) and their "
                                           "evaluation (default: the preference pairs' prompts).")
    demo: DemoSection = Setting(default_factory=DemoSection, description="Demo data sizes.")


class TokenizerSection(Section):
    pretrained: str | None = Setting(None, description="Load this tokenizer (hub name or local dir) instead of "
                                     "training one.")
    vocab_size: int = Setting(512, ge=1, description="Vocabulary size of the trained byte-level BPE, special tokens "
                              "included.")
    min_frequency: int = Setting(2, ge=1, description="Minimum pair frequency for a BPE merge.")
    special_tokens: list[str] = Setting(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"],
                                        description="Special tokens: end-of-text, start and end of a chat turn, "
                                        "padding (the last; end-of-text when there are three).")
    val_fraction: float = Setting(0.05, gt=0, lt=1, description="Fraction of documents held out as the val shard.")
    train_sample_bytes: int = Setting(100_000_000, ge=1, description="BPE trains on a seeded sample of at most this "
                                      "many bytes of documents, drawn across the whole corpus.")
    shard_tokens: int = Setting(50_000_000, ge=1000, description="Maximum tokens per shard file.")
    word_cache: bool = Setting(True, same_result=True, description="Encode each distinct word once, the same ids "
                               "as the tokenizer alone (gptforge.data.encoder); false: encode every document whole.")
    num_workers: int = Setting(0, ge=0, same_result=True, description="Worker processes of the local Ray instance; 0 "
                               "means one per CPU core.")
    cluster: str | None = Setting(None, same_result=True, description="Ray cluster doing the tokenize stage's "
                                  "parallel work ('auto' or host:port); None: a local instance the stage starts.")

    @model_validator(mode="after")
    def _vocab_holds_bytes(self):
        need = 256 + len(self.special_tokens)
        if self.pretrained is None and self.vocab_size < need:
            raise ValueError(f"tokenizer.vocab_size={self.vocab_size} is smaller than the byte alphabet (256) "
                             f"plus {len(self.special_tokens)} special tokens = {need}")
        if self.pretrained is None and len(self.special_tokens) < 3:
            raise ValueError("tokenizer.special_tokens needs at least end-of-text, turn start and turn end")
        return self


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30, "TIB": 2**40}


def size_in_bytes(size: str | int) -> int:
    """'5GB' -> 5_000_000_000 (also KB, MB, TB and the binary KiB ... TiB; a bare number is bytes)."""
    text = str(size).strip().upper()
    number = text.rstrip("KMGTIB ")
    unit = text[len(number):].strip()
    try:
        value = float(number) * UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"{size!r} is not a size (bytes, or a number with KB, MB, GB, TB, KiB, MiB, GiB, "
                         "TiB)") from None
    if value < 1:
        raise ValueError(f"{size!r} is not a positive size")
    return int(value)


ATTENTION = ("auto", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "eager")
# The fields each RoPE scaling type needs (transformers' own validation of rope_parameters), beyond `type`.
ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                 "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
                 "longrope": ("factor", "original_max_position_embeddings", "short_factor", "long_factor")}


class RopeSection(Section):
    """RoPE scaling, written into the model's config as transformers names it (`rope_parameters`)."""

    type: Literal["linear", "dynamic", "yarn", "llama3", "longrope"] = Setting(
        description="Scaling: linear (position interpolation), dynamic (NTK), yarn, llama3, longrope.")
    factor: float | None = Setting(None, ge=1, description="Context extension factor: the scaled context is "
                                   "original_max_position_embeddings * factor.")
    original_max_position_embeddings: int | None = Setting(None, ge=1, description="The context the model was "
                                                           "trained at (default: its current context).")
    attention_factor: float | None = Setting(None, gt=0, description="yarn/longrope: attention temperature.")
    beta_fast: float | None = Setting(None, description="yarn: fast boundary of the ramp (default 32).")
    beta_slow: float | None = Setting(None, description="yarn: slow boundary of the ramp (default 1).")
    low_freq_factor: float | None = Setting(None, description="llama3: low-frequency factor (1 in Llama 3.1).")
    high_freq_factor: float | None = Setting(None, description="llama3: high-frequency factor (4 in Llama 3.1).")
    short_factor: list[float] | None = Setting(None, description="longrope: per-dimension factors below the "
                                               "original context (head_dim/2 numbers).")
    long_factor: list[float] | None = Setting(None, description="longrope: per-dimension factors beyond it.")

    @model_validator(mode="after")
    def _complete(self):
        missing = [k for k in ROPE_REQUIRED[self.type] if getattr(self, k) is None]
        if missing:
            raise ValueError(f"RoPE type {self.type} needs {', '.join(missing)}")
        return self

    def parameters(self, context: int) -> dict:
        """rope_parameters fields (transformers 5), for a model whose current context is `context`."""
        out = {k: v for k, v in self.model_dump(exclude={"type"}).items() if v is not None}
        out.setdefault("original_max_position_embeddings", context)
        return {"rope_type": self.type, **out}

    def context(self, context: int) -> int:
        """The context after scaling."""
        return round((self.original_max_position_embeddings or context) * self.factor)


class ModelSection(Section):
    pretrained: str | None = Setting(None, description="Start from this Hugging Face model (a hub name or a local "
                                     "directory) instead of a preset: architecture, weights and tokenizer are its own.")
    revision: str | None = Setting(None, description="Hub revision (branch, tag or commit) of model.pretrained; None: "
                                   "main, resolved to its commit at every run (a new upload retrains).")
    trust_remote_code: bool = Setting(False, description="Allow a model.pretrained that needs its own modelling code "
                                      "(runs code from the model's repository).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Setting(
        "auto", description="dtype model.pretrained loads in; auto: the training precision (bf16 on GPUs, fp32 on the "
        "CPU).")
    preset: str = Setting("tiny", description="Architecture preset (gptforge/core/presets.py): tiny, gpt2-124m..1.5b, "
                          "gpt3-small..175b, llama-tiny..7b; mixture of experts: moe-tiny, moe-1b, mixtral-8x7b.")
    n_layer: int | None = Setting(None, ge=1, description="Override the preset's number of layers.")
    n_head: int | None = Setting(None, ge=1, description="Override the preset's attention heads.")
    n_embd: int | None = Setting(None, ge=1, description="Override the preset's hidden size.")
    n_positions: int | None = Setting(None, ge=1, description="Override the preset's context length.")
    n_kv_head: int | None = Setting(None, ge=1, description="Override the key/value heads (Llama, MoE).")
    intermediate_size: int | None = Setting(None, ge=1, description="Override the MLP width (each expert's in an "
                                            "MoE).")
    n_experts: int | None = Setting(None, ge=1, description="Override the number of experts (MoE presets).")
    experts_per_token: int | None = Setting(None, ge=1, description="Override the experts routed to each token "
                                            "(top-k; MoE presets).")
    dropout: float = Setting(0.0, ge=0, lt=1, description="Dropout on embeddings, attention and residuals.")
    attention: Literal[ATTENTION] = Setting(
        "auto", description="Attention kernel: sdpa, flash_attention_2/3, flex_attention, eager; auto: "
        "flash_attention_2 on a GPU with flash-attn installed, else sdpa.")
    rope_theta: float | None = Setting(None, gt=0, description="RoPE base of a Llama-style preset (None: 10000; "
                                       "Llama 3 uses 500000).")
    rope: RopeSection | None = Setting(None, description="RoPE scaling {type, factor, ...} (Llama-style models): the "
                                       "context becomes original_max_position_embeddings * factor.")
    sliding_window: int | None = Setting(None, ge=1, description="Every layer attends over the last sliding_window "
                                         "tokens only (Llama- and Mistral-style models).")
    attention_pattern: Literal["dense", "alternating"] | None = Setting(
        None, description="dense: full causal attention in every layer; alternating: full and banded (the last "
        "local_window tokens) layers in turn (GPT-3); None: the preset's.")
    local_window: int | None = Setting(None, ge=1, description="Width of the banded layers of attention_pattern "
                                       "alternating (None: the preset's).")
    max_shard_size: str = Setting("5GB", same_result=True, description="Largest safetensors file of an exported "
                                  "model (bytes, or with a unit: 500MB, 5GB, 2GiB); larger models are sharded with "
                                  "an index file.")

    OVERRIDES: ClassVar[tuple[str, ...]] = ("n_layer", "n_head", "n_embd", "n_positions", "n_kv_head",
                                            "intermediate_size", "n_experts", "experts_per_token",
                                            "attention_pattern", "local_window")

    def arch(self):
        """The preset with this section's overrides applied (vocab size comes from the tokenizer)."""
        return PRESETS[self.preset].with_overrides(**{k: getattr(self, k) for k in self.OVERRIDES})

    @property
    def shard_bytes(self) -> int:
        return size_in_bytes(self.max_shard_size)

    def name(self) -> str:
        """The pretrained model's name, or the preset's with the overrides when there are any: `gpt3-175b
        (n_layer=48)`."""
        if self.pretrained:
            return self.pretrained + (f"@{self.revision}" if self.revision else "")
        changed = [f"{k}={getattr(self, k)}" for k in self.OVERRIDES if getattr(self, k) is not None]
        return f"{self.preset} ({', '.join(changed)})" if changed else self.preset

    @model_validator(mode="after")
    def _shapes(self):
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        a = self.arch()
        if a.n_embd % a.n_head:
            raise ValueError(f"n_embd={a.n_embd} is not divisible by n_head={a.n_head}")
        if a.n_kv_head and a.n_head % a.n_kv_head:
            raise ValueError(f"n_head={a.n_head} is not divisible by n_kv_head={a.n_kv_head}")
        if not a.is_moe and (self.n_experts or self.experts_per_token):
            raise ValueError(f"model.n_experts and model.experts_per_token need a mixture-of-experts preset "
                             f"(moe-tiny, moe-1b, mixtral-8x7b); {self.preset} is dense")
        try:
            size_in_bytes(self.max_shard_size)
        except ValueError as e:
            raise ValueError(f"model.max_shard_size: {e}") from None
        if not self.pretrained:
            from gptforge.core.attention_rules import check_context

            check_context(a, self)
        if a.is_moe and a.experts_per_token > a.n_experts:
            raise ValueError(f"model.experts_per_token={a.experts_per_token} is more than the model's "
                             f"n_experts={a.n_experts}: each token is routed to experts_per_token of n_experts")
        return self


class DistributedSection(Section):
    launcher: Literal["gptforge", "deepspeed", "torchrun", "accelerate"] = Setting(
        "gptforge", description="The agent each node runs: gptforge's own (ranks start at once, in its process group), "
        "deepspeed, torchrun or accelerate (TRL stages: accelerate under those).")
    node_launcher: Literal["local", "ssh", "slurm"] = Setting(
        "local", same_result=True, description="How a run starts the agents: local (all on this host), ssh (one per "
        "hostfile host), slurm (srun in the allocation).")
    nproc_per_node: int = Setting(2, ge=1, description="Processes per node (GPUs per node, or CPU processes).")
    nnodes: int = Setting(1, ge=1, description="Number of nodes.")
    node_rank: int = Setting(0, ge=0, same_result=True, description="This node's rank, for a stage started by hand "
                             "on each node (gptforge stage); a run assigns them itself.")
    master_addr: str = Setting("127.0.0.1", same_result=True, description="Address of the rendezvous: this host's "
                               "address the other nodes reach (127.0.0.1 on one host).")
    master_port: int | None = Setting(None, ge=1, le=65535, same_result=True, description="Rendezvous port; None: a "
                                      "free one for every stage, so that many runs share a host.")
    hostfile: str | None = Setting(None, same_result=True, description="Hosts, node 0 first ('host slots=N' a line): "
                                   "for node_launcher ssh and the deepspeed launcher across nodes.")
    zero_stage: int = Setting(2, ge=0, le=3, description="ZeRO stage 0-3 (configs/deepspeed/zero<N>.json).")
    offload_optimizer: bool = Setting(False, description="Offload optimizer state to CPU memory (ZeRO 1-3).")
    activation_checkpointing: bool = Setting(False, description="Recompute activations in backward to save memory.")
    precision: Literal["auto", "bf16", "fp32"] = Setting("auto", description="auto: bf16 on GPUs, fp32 on the CPU.")
    sequence_parallel: int = Setting(1, ge=1, same_result=True, description="Ranks that share each sequence "
                                     "(DeepSpeed-Ulysses; pretrain, SFT, DPO, GRPO, RLOO); data parallelism over the "
                                     "rest.")
    tiling: bool | Literal["auto"] = Setting("auto", same_result=True, description="Tiled logits+loss and MLPs "
                                             "(model/train/tiling.py): true, false, or auto (logits over "
                                             "logits_tile_mb, "
                                             "MLPs from 4096 tokens).")
    logits_tile_mb: int = Setting(1024, ge=1, same_result=True, description="Largest fp32 logits tile of a "
                                  "micro-batch's loss, in MiB (tiling auto and on).")
    timeout_minutes: float = Setting(30, ge=1, same_result=True, description="The process group's timeout: a "
                                     "rank that stops answering in a collective fails the stage after it.")

    @model_validator(mode="after")
    def _layout(self):
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage 1, 2 or 3")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be below nnodes={self.nnodes}")
        if self.launcher == "deepspeed" and self.nnodes > 1 and not self.hostfile:
            raise ValueError(f"launcher=deepspeed reaches the other {self.nnodes - 1} node(s) through a hostfile: set "
                             "distributed.hostfile, or use launcher torchrun with a node_launcher")
        if self.world_size % self.sequence_parallel:
            raise ValueError(f"distributed.sequence_parallel={self.sequence_parallel} does not divide the world size "
                             f"{self.world_size} (nproc_per_node x nnodes)")
        if self.node_launcher == "ssh" and self.nnodes > 1 and not self.hostfile:
            raise ValueError("node_launcher=ssh needs distributed.hostfile (one host a line, node 0 first)")
        return self

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def data_parallel(self, stage: str) -> int:
        """The data-parallel world of a stage: the world, over sequence_parallel for the stages it serves."""
        return self.world_size // (self.sequence_parallel if stage in SEQUENCE_PARALLEL_STAGES else 1)


class LoraSection(Section):
    """LoRA / QLoRA adapters (PEFT) of a training stage; r=0 trains the full weights."""

    r: int = Setting(0, ge=0, description="Adapter rank; 0: full fine-tuning (no adapters).")
    alpha: float = Setting(16.0, gt=0, description="LoRA alpha: the update is scaled by alpha/r.")
    dropout: float = Setting(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: str | list[str] = Setting("all-linear", description="Modules adapted: all-linear (every linear "
                                              "layer but the output head), or a list of module names (q_proj, ...).")
    modules_to_save: list[str] = Setting([], description="Modules trained in full beside the adapters (a reward "
                                         "model's head is always).")
    quantize: Literal[None, 4, 8] = Setting(None, description="QLoRA: load the frozen base in 4 or 8 bits "
                                            "(bitsandbytes, GPUs only).")

    @model_validator(mode="after")
    def _quantize_needs_lora(self):
        if self.quantize and not self.r:
            raise ValueError(f"quantize={self.quantize} needs adapters: set r > 0 (a quantized base trains through "
                             "LoRA only)")
        return self


class TrainSection(Section):
    enabled: bool = Setting(True, same_result=True, description="Run this stage.")
    lr: float = Setting(1e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr: float = Setting(1e-4, ge=0, description="Learning rate at the end of cosine decay.")
    warmup_steps: int = Setting(20, ge=0, description="Linear warmup steps.")
    max_steps: int = Setting(200, ge=1, description="Optimizer steps.")
    micro_batch_size: int = Setting(16, ge=1, description="Sequences per process per forward pass.")
    global_batch_size: int = Setting(32, ge=1, description="Sequences per optimizer step over all processes.")
    weight_decay: float = Setting(0.1, ge=0, description="AdamW weight decay.")
    grad_clip: float = Setting(1.0, ge=0, description="Gradient norm clip (0 disables).")
    log_every: int = Setting(10, ge=1, same_result=True, description="Steps between log lines.")
    eval_every: int = Setting(100, ge=1, same_result=True, description="Steps between evaluations.")
    save_every: int = Setting(100, ge=1, same_result=True, description="Steps between step checkpoints.")
    keep_last: int = Setting(2, ge=1, same_result=True, description="Step checkpoints kept.")
    lora: LoraSection = Setting(default_factory=LoraSection, description="LoRA/QLoRA adapters (r=0: full weights).")
    spike_factor: float | None = Setting(None, gt=1, description="Skip a step whose loss is over this factor times "
                                         "the median of the last spike_window steps (None: off); model/train/guard.py.")
    spike_window: int = Setting(32, ge=1, description="Good steps whose median loss spike_factor is taken against.")
    max_bad_steps: int = Setting(3, ge=1, description="Bad steps (NaN/Inf loss or gradient norm, spikes) in a row "
                                 "after which the stage rolls back to its newest valid checkpoint.")
    max_rollbacks: int = Setting(2, ge=0, description="Rollbacks after which more bad steps fail the stage.")


class PretrainSection(TrainSection):
    seq_len: int = Setting(96, ge=8, description="Training sequence length in tokens.")
    eval_batches: int = Setting(8, ge=1, same_result=True, description="Val batches per evaluation.")
    document_mask: bool = Setting(False, description="Inside a window, attention and positions restart after each "
                                  "end-of-text token (Llama 3, OLMo); false: windows attend across documents (GPT-2).")
    compile: bool = Setting(False, same_result=True, description="torch.compile the model (DeepSpeed engine.compile): "
                            "a slower first step, faster ones after; needs a C++ compiler on the CPU.")


class SFTSection(TrainSection):
    lr: float = Setting(5e-4, gt=0, description="Peak learning rate (AdamW).")
    max_length: int = Setting(96, ge=8, description="Maximum tokens per conversation.")
    assistant_only_loss: bool = Setting(True, description="Loss on assistant tokens only (else the full sequence).")
    packing: bool = Setting(False, description="Pack several conversations into each sequence; positions restart and "
                            "attention stays within each conversation.")
    chat_template: str | None = Setting(None, description="Jinja chat template for a model that has none (None: "
                                        "ChatML, its special tokens added to the vocabulary); a model's own is kept.")
    on_too_long: Literal["skip", "truncate"] = Setting("skip", description="What to do with examples over max_length.")


class RewardSection(TrainSection):
    pretrained: str | None = Setting(None, description="Start the reward model from this model (hub name or local "
                                     "directory; a causal LM gets a new head) instead of the SFT output.")
    lr: float = Setting(5e-4, gt=0, description="Peak learning rate (AdamW).")
    max_length: int = Setting(96, ge=8, description="Maximum tokens per prompt+response.")
    on_too_long: Literal["skip", "truncate"] = Setting("skip", description="What to do with pairs over max_length.")
    margin: float = Setting(0.0, ge=0, description="Margin term of the pairwise loss.")
    center_rewards_coefficient: float = Setting(0.0, ge=0, description="Weight of the reward-centering term.")
    policy_samples: int = Setting(0, ge=0, description="Sample the SFT model on this many prompts and pair each wrong "
                                  "answer, as rejected, with the known one (demo data only).")
    sample_temperature: float = Setting(1.0, gt=0, description="Sampling temperature of policy_samples.")
    sample_max_new_tokens: int = Setting(8, ge=1, description="Longest answer sampled for policy_samples, in tokens.")


class DPOSection(Section):
    loss_type: str | list[str] = Setting("sigmoid", description="TRL DPO loss (sigmoid, ipo, hinge, robust, ...), or a "
                                         "list combined with equal weights ([sigmoid, sft] is RPO).")


class OnlineSection(Section):
    """What each online algorithm (ppo, grpo, rloo) sets for itself: rollouts and the supervised ptx term (their
    rewards are preference.rewards, shared)."""

    max_new_tokens: int = Setting(8, ge=1, description="Response length of on-policy sampling, in tokens.")
    temperature: float = Setting(1.0, gt=0, description="Sampling temperature of rollouts.")
    top_k: int = Setting(0, ge=0, description="Top-k of rollouts (0 disables).")
    top_p: float = Setting(1.0, gt=0, le=1, description="Top-p of rollouts.")
    ptx_coef: float = Setting(0.0, ge=0, description="Weight of the chosen responses' loss added at every update "
                              "(InstructGPT's PPO-ptx); 0 disables.")
    ptx_batch_size: int | None = Setting(None, ge=1, description="Rows of chosen responses in each update's ptx loss "
                                         "over all processes; None: as many as the update's responses.")

    def ptx_rows(self, micro_batch_size: int, world: int, micro_steps_per_update: int) -> int:
        """Rows of chosen responses on each process in each micro-batch of the ptx loss, when a policy update
        takes `micro_steps_per_update` micro-batches of `micro_batch_size` on each process."""
        per_update = self.ptx_batch_size or micro_batch_size * world * micro_steps_per_update
        return per_update // (world * micro_steps_per_update)


REWARD_BUILT_IN = ("reward_model", "exact_match", "math_equal", "format", "length")  # gptforge.model.eval.rewards


class RewardSpec(Section):
    """One reward of the online stages: a built-in or the user's function by `name`, or a reward server at `url`."""

    name: str | None = Setting(None, description="reward_model, exact_match, math_equal, format, length, or the "
                               "user's package.module:function(prompts, responses, answers, **row) -> list[float]; "
                               "with url, the name its metric is logged under (default remote).")
    url: str | None = Setting(None, description="A reward server: each batch as one JSON POST {prompts, responses, "
                              "answers, ...}, answered by {rewards: [...]}.")
    weight: float = Setting(1.0, description="Weight of this reward in the total.")
    timeout_s: float = Setting(30.0, gt=0, description="Seconds a reward server has to answer one try.")
    retries: int = Setting(3, ge=1, description="Tries of a reward server before the stage fails.")

    @model_validator(mode="after")
    def _known(self):
        if self.url is None and not self.name:
            raise ValueError("a reward needs a name (a built-in or package.module:function) or a url")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward url {self.url!r} is not an http:// or https:// address")
        if self.url is None and self.name not in REWARD_BUILT_IN:
            module, colon, attr = self.name.partition(":")
            if not (colon and module and attr.isidentifier()):
                close = difflib.get_close_matches(self.name, REWARD_BUILT_IN, n=1)
                raise ValueError(f"reward name {self.name!r} is neither a built-in ({', '.join(REWARD_BUILT_IN)}) "
                                 "nor package.module:function" + (f"; did you mean {close[0]!r}?" if close else ""))
        return self

    def label(self) -> str:
        """The name its mean is logged under: rewards/<label>."""
        if self.url is not None:
            return self.name or "remote"
        return self.name.partition(":")[2] or self.name


class PPOSection(OnlineSection):
    ppo_epochs: int = Setting(2, ge=1, description="Passes over each rollout batch.")
    gamma: float = Setting(1.0, ge=0, le=1, description="Discount factor.")
    lam: float = Setting(0.95, ge=0, le=1, description="GAE lambda.")
    cliprange: float = Setting(0.2, gt=0, description="Policy ratio clip.")
    cliprange_value: float = Setting(0.2, gt=0, description="Value clip.")
    critic_lr: float = Setting(1e-4, gt=0, description="Critic learning rate.")
    critic: str | None = Setting(None, description="The critic's start (hub name or local directory); None: the "
                                 "reward model (if it shares the policy's tokenizer), else the SFT model with a new "
                                 "value head.")
    kl_target: float | None = Setting(None, gt=0, description="Adaptive KL controller target (None: fixed beta).")
    kl_horizon: int = Setting(10000, ge=1, description="Adaptive KL controller horizon, in samples.")


class GRPOSection(OnlineSection):
    num_generations: int = Setting(4, ge=2, description="Completions per prompt.")
    scale_rewards: Literal["group", "batch", "none"] = Setting(
        "group", description="Divide rewards less their group mean by the group's std, the batch's, or nothing "
        "(none, as Dr. GRPO).")


class RLOOSection(OnlineSection):
    num_generations: int = Setting(4, ge=2, description="Completions per prompt.")


class PreferenceSection(TrainSection):
    """What every preference algorithm shares; each algorithm's own fields are in its sub-section."""

    algorithm: Algorithm | list[Algorithm] = Setting("dpo", same_result=True,
                                                     description="Alignment algorithm(s); each runs as its own stage.")
    lr: float = Setting(5e-5, gt=0, description="Peak learning rate (AdamW).")
    min_lr: float = Setting(0.0, ge=0, description="Learning rate at the end of cosine decay.")
    beta: float = Setting(0.1, gt=0, description="KL strength (DPO beta, the initial KL coefficient of the others).")
    max_length: int = Setting(96, ge=8, description="Maximum tokens per prompt+response.")
    reward_model: str | None = Setting(None, description="A ready reward model (sequence classifier: hub name or local "
                                       "directory) that judges the policy; the pipeline then trains none.")
    rewards: list[RewardSpec] = Setting(default_factory=lambda: [RewardSpec(name="reward_model")],
                                        description="The online stages' rewards, weighed and summed: [{name, weight}] "
                                        "or [{url, weight}]; without reward_model there is no reward stage.")
    format_pattern: str | None = Setting(None, description="Regex the whole response must match for the format "
                                         "reward, e.g. '<think>.*</think>\\s*<answer>.*</answer>'.")
    length_target: int = Setting(64, ge=0, description="Tokens a response may have before the length reward "
                                 "subtracts one per token over.")
    reference: str | None = Setting(None, description="The reference policy (hub name or local directory); None: the "
                                    "SFT model (with adapters: the policy with its adapters disabled).")
    dpo: DPOSection = Setting(default_factory=DPOSection, description="DPO's own settings.")
    ppo: PPOSection = Setting(default_factory=PPOSection, description="PPO's own settings.")
    grpo: GRPOSection = Setting(default_factory=GRPOSection, description="GRPO's own settings.")
    rloo: RLOOSection = Setting(default_factory=RLOOSection, description="RLOO's own settings.")

    def algorithms(self) -> list[str]:
        return [self.algorithm] if isinstance(self.algorithm, str) else list(self.algorithm)

    def uses_reward_model(self) -> bool:
        """Whether a reward model is among the rewards (then it also judges the evaluation's win rate)."""
        return any(r.url is None and r.name == "reward_model" for r in self.rewards)

    def reward_weight(self) -> float:
        """The reward model's weight in the total (0 where it has none): the scale of PPO's first values."""
        return sum(r.weight for r in self.rewards if r.url is None and r.name == "reward_model")

    @model_validator(mode="after")
    def _rewards(self):
        if not self.rewards:
            raise ValueError("preference.rewards is empty: name at least one reward, e.g. [{name: reward_model}] or "
                             "[{name: math_equal}]")
        labels = [r.label() for r in self.rewards]
        for i, label in enumerate(labels):
            if label in labels[:i]:
                raise ValueError(f"preference.rewards[{i}]: a second reward logged as {label!r}; give it its own name")
        if "format" in [r.name for r in self.rewards if r.url is None]:
            if not self.format_pattern:
                raise ValueError("preference.rewards names format but preference.format_pattern is not set; set the "
                                 "regex a response must match")
            import re

            try:
                re.compile(self.format_pattern)
            except re.error as e:
                raise ValueError(f"preference.format_pattern {self.format_pattern!r} is not a regex: {e}") from None
        return self


class EvalSection(Section):
    max_new_tokens: int = Setting(8, ge=1, description="Tokens generated per held-out item.")
    items: int = Setting(200, ge=1, description="Held-out items evaluated.")
    batch_size: int = Setting(64, ge=1, description="Items generated and scored together; the batches are fixed, "
                              "whatever the number of processes.")
    processes: Literal["auto", "one", "all"] = Setting(
        "auto", same_result=True, description="one process, or all of the distributed layout's (a share of the "
        "batches each); auto: all with a GPU here or nodes over ssh/slurm.")
    samples: int = Setting(0, ge=0, description="Answers sampled per held-out prompt after a preference stage for "
                           "pass@k of each reward but the reward model (k = samples; 0: none).")
    kv_cache: Literal["full", "fp8", "quanto-int4"] = Setting("full", description="KV cache of generation: full "
                                                             "precision, fp8 (per tensor), or int4 (optimum-quanto).")
    harness_tasks: list[str] = Setting([], description="lm-evaluation-harness tasks run on the exported model of "
                                       "each of harness_stages, e.g. [arc_easy]; gptforge_demo: the demo's held-out "
                                       "items.")
    harness_stages: list[Literal["sft", Algorithm]] = Setting(["sft", *ALGORITHMS], description="The evaluated "
                                                              "stages whose evaluation step runs harness_tasks.")
    harness_include: list[str] = Setting([], description="Folders of the user's own task YAMLs for harness_tasks.")
    harness_limit: int | None = Setting(None, ge=1, description="Examples per harness task (None: all).")
    harness_num_fewshot: int | None = Setting(None, ge=0, description="Few-shot examples (None: each task's own).")

    def distributed(self, dist) -> bool:
        """Whether the evaluation step runs on every process of the `distributed` section's layout."""
        if self.processes != "auto":
            return self.processes == "all"
        import torch

        return torch.cuda.is_available() or dist.node_launcher != "local"


class PipelineConfig(Section):
    run: RunSection = Setting(default_factory=RunSection, description="Run name, root, seed, retries, schedule.")
    data: DataSection = Setting(default_factory=DataSection, description="Where each stage's rows come from.")
    tokenizer: TokenizerSection = Setting(default_factory=TokenizerSection, description="BPE training and shards.")
    model: ModelSection = Setting(default_factory=ModelSection, description="Architecture.")
    distributed: DistributedSection = Setting(default_factory=DistributedSection,
                                              description="Launcher, processes, nodes, ZeRO.")
    pretrain: PretrainSection = Setting(default_factory=PretrainSection, description="Pretraining.")
    sft: SFTSection = Setting(default_factory=SFTSection, description="Supervised fine-tuning.")
    reward: RewardSection = Setting(default_factory=RewardSection, description="Reward model.")
    preference: PreferenceSection = Setting(default_factory=PreferenceSection, description="Alignment.")
    eval: EvalSection = Setting(default_factory=EvalSection, description="Held-out evaluation of finished outputs.")

    def trains_reward_model(self) -> bool:
        """Whether the pipeline has a reward stage: it is enabled, no ready reward model is named, and a reward model
        is among preference.rewards."""
        return self.reward.enabled and not self.preference.reward_model and self.preference.uses_reward_model()

    @model_validator(mode="after")
    def _combinations(self):
        world = self.distributed.world_size
        for name in ("pretrain", "sft", "reward", "preference"):
            s, dp = getattr(self, name), self.distributed.data_parallel(name)
            per_step = s.micro_batch_size * dp
            if s.enabled and s.global_batch_size % per_step:
                raise ValueError(f"{name}.global_batch_size={s.global_batch_size} is not divisible by "
                                 f"micro_batch_size*{'world_size' if dp == world else 'data-parallel world'} = "
                                 f"{s.micro_batch_size}*{dp}")
        # What Ulysses cannot take: a length it does not divide, a mask it would drop (it attends over the whole
        # gathered sequence without one), heads it cannot share out, eager attention's whole 4D mask.
        sp = self.distributed.sequence_parallel
        for name, length_key, mask_key in (("pretrain", "seq_len", "document_mask"), ("sft", "max_length", "packing")):
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
            sp, groups = self.distributed.sequence_parallel, self.distributed.data_parallel(algo)
            if algo in SEQUENCE_PARALLEL_STAGES and sp > 1 and oc.ptx_coef:
                raise ValueError(f"preference.{algo}.ptx_coef with distributed.sequence_parallel={sp}: the ptx rows "
                                 "are each rank's own, which a sequence-parallel group cannot share; set one of them "
                                 "off")
            if algo in SEQUENCE_PARALLEL_STAGES and sp > 1 and pc.global_batch_size // groups % oc.num_generations:
                raise ValueError(f"preference.{algo}.num_generations={oc.num_generations} with distributed."
                                 f"sequence_parallel={sp}: a group's rollouts a step (preference.global_batch_size "
                                 f"over the {groups} data-parallel groups = {pc.global_batch_size // groups}) must "
                                 "hold whole prompt groups")
            if oc.ptx_coef and oc.ptx_batch_size and oc.ptx_batch_size % micro_steps:
                raise ValueError(f"preference.{algo}.ptx_batch_size={oc.ptx_batch_size} is not divisible by "
                                 f"global_batch_size/micro_batch_size = {micro_steps}, the micro-batches of one "
                                 "update over all processes")
        checks = [(i, r.name) for i, r in enumerate(pc.rewards) if r.url is None and r.name in ("exact_match",
                                                                                               "math_equal")]
        if online and checks and self.data.prompts.path is None and self.data.preference.path != "demo":
            i, name = checks[0]
            raise ValueError(f"preference.rewards[{i}] ({name}) compares responses with reference answers, but the "
                             f"prompts are data.preference's ({self.data.preference.path!r}), which have none: set "
                             "data.prompts to rows with answers ({prompt, answer}, or GSM8K's question/answer)")
        if self.reward.enabled and self.reward.policy_samples and self.data.preference.path != "demo":
            raise ValueError(f"reward.policy_samples needs data.preference: demo (the verifier knows the demo's "
                             f"answers), not {self.data.preference.path!r}; set it to 0")
        for name in ("pretrain", "sft", "reward", "preference"):
            if getattr(self, name).lora.quantize:
                import torch

                if not torch.cuda.is_available():
                    raise ValueError(f"{name}.lora.quantize={getattr(self, name).lora.quantize} loads the base "
                                     "through bitsandbytes, which needs a GPU; there is none here: set it to null")
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


def pipeline_stages(cfg: PipelineConfig) -> list[str]:
    """Stage names in order, the preference stage named after each algorithm; disabled stages left out (tokenize
    too when the pipeline starts from model.pretrained without pretraining it, and reward when
    preference.reward_model names a ready one or preference.rewards has no reward model)."""
    names = ["tokenize"] if cfg.pretrain.enabled or not cfg.model.pretrained else []
    for name in ("pretrain", "sft"):
        if getattr(cfg, name).enabled:
            names.append(name)
    if cfg.trains_reward_model():
        names.append("reward")
    if cfg.preference.enabled:
        names.extend(cfg.preference.algorithms())
    return names


def tokenizer_source(cfg: PipelineConfig) -> tuple[str | None, str | None]:
    """(name or directory, hub revision) of the pretrained tokenizer the tokenize stage loads: tokenizer.pretrained,
    else model.pretrained's own; (None, None): a BPE is trained."""
    if cfg.tokenizer.pretrained:
        return cfg.tokenizer.pretrained, None
    return cfg.model.pretrained, cfg.model.revision


def named_models(cfg: PipelineConfig, step: str) -> dict[str, tuple[str, str | None]]:
    """The models a step reads by name rather than from an upstream stage's output: {config key: (hub name or
    directory, revision)}."""
    out = {}
    if step == "tokenize":
        name, revision = tokenizer_source(cfg)
        if name:
            out["tokenizer.pretrained" if cfg.tokenizer.pretrained else "model.pretrained"] = (name, revision)
    if cfg.model.pretrained and (step == "pretrain" or (step in ("sft", "eval-sft") and not cfg.pretrain.enabled)):
        out["model.pretrained"] = (cfg.model.pretrained, cfg.model.revision)
    if step == "reward" and cfg.reward.pretrained:
        out["reward.pretrained"] = (cfg.reward.pretrained, None)
    pc, algorithm = cfg.preference, step.removeprefix("eval-")
    if algorithm in ALGORITHMS:
        judged = algorithm != "dpo" or step != algorithm  # DPO needs no reward model; its evaluation does
        if pc.reward_model and judged and pc.uses_reward_model():
            out["preference.reward_model"] = (pc.reward_model, None)
        if pc.reference and step == algorithm:
            out["preference.reference"] = (pc.reference, None)
        if pc.ppo.critic and step == "ppo":
            out["preference.ppo.critic"] = (pc.ppo.critic, None)
    return out
