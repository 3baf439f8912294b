"""The network and how it is laid out over processes: the model, RoPE scaling, the distributed layout, LoRA."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import field_validator, model_validator

from gptforge.core.config.base import Section, Setting, size_in_bytes
from gptforge.core.presets import PRESETS


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


def is_loopback(addr: str) -> bool:
    """Whether an address or host name is this host's loopback (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


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
    node_addrs: list[str] = Setting([], same_result=True, description="Each node's address the others reach, node 0 "
                                    "first; empty: the hostfile's addresses, else each node's route to master_addr.")
    env: dict[str, str] = Setting({}, same_result=True, description="Environment of every node's processes, over "
                                  "what is forwarded (NCCL_*, GLOO_*, HF_*, OMP_NUM_THREADS, PYTHONPATH).")
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
    timeout_minutes: float = Setting(30, gt=0, same_result=True, description="The process group's timeout: a "
                                     "rank that stops answering in a collective fails the stage after it (0.5: "
                                     "30 s).")

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, v):  # YAML's numbers and booleans (OMP_NUM_THREADS: 4, X: yes) as a shell would write them
        if isinstance(v, dict):
            return {k: str(x).lower() if isinstance(x, bool) else str(x) if isinstance(x, (int, float)) else x
                    for k, x in v.items()}
        return v

    @model_validator(mode="after")
    def _layout(self):
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage 1, 2 or 3")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be below nnodes={self.nnodes}")
        if self.launcher == "deepspeed" and self.nnodes > 1 and self.node_launcher == "local" and not self.hostfile:
            raise ValueError(f"launcher=deepspeed reaches the other {self.nnodes - 1} node(s) through a hostfile: set "
                             "distributed.hostfile (DeepSpeed's runner, pdsh), or node_launcher ssh or slurm")
        if self.world_size % self.sequence_parallel:
            raise ValueError(f"distributed.sequence_parallel={self.sequence_parallel} does not divide the world size "
                             f"{self.world_size} (nproc_per_node x nnodes)")
        if self.node_launcher == "ssh" and self.nnodes > 1 and not self.hostfile:
            raise ValueError("node_launcher=ssh needs distributed.hostfile (one host a line, node 0 first)")
        if self.node_addrs and len(self.node_addrs) != self.nnodes:
            raise ValueError(f"node_addrs gives {len(self.node_addrs)} address(es) for nnodes={self.nnodes}: one "
                             "a node, node 0 first")
        if self.node_launcher != "local" and self.nnodes > 1 and is_loopback(self.master_addr):
            raise ValueError(f"master_addr={self.master_addr} is this host's loopback, which node_launcher="
                             f"{self.node_launcher} sends the other nodes to: set it to an address they reach")
        if bad := [k for k in self.env if not k.isidentifier()]:
            raise ValueError(f"env: {bad[0]!r} is not an environment variable's name")
        return self

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


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

