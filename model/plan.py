"""The memory and compute planner behind `gptforge plan`, and the verdict an out-of-memory error quotes.

Model states (weights, gradients, optimizer) follow DeepSpeed's own estimators
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`, parameters partitioned as
they load): per parameter 2 bytes of 16-bit weights, and 18 bytes partitioned over the GPUs (16-bit and fp32
gradients, fp32 master weights, Adam's two moments); ZeRO-3 adds the largest layer gathered in fp32, and CPU
offload moves the 18 bytes (less the 16-bit gradients' 2 under ZeRO-3) to host memory, which the estimators
count with a 1.5x buffer factor. ZeRO-0 and ZeRO-1, which DeepSpeed does not estimate, take the same byte
counts unpartitioned where those stages do not partition. One departure: for ZeRO-2 with offload on several
nodes the ZeRO-2 estimator multiplies host memory by the GPUs of all nodes; we count a node's share as its
ZeRO-3 estimator does (equal on one node).

Activations per layer follow Korthikanti et al. 2022 (34·s·b·h + 5·a·s²·b bytes in 16 bits, the MLP's share
19·s·b·h scaled by a wider or routed MLP); with activation checkpointing every layer keeps its 2·s·b·h input and
one layer at a time is recomputed whole in the backward pass. The logits add 10·s·b·V bytes (16-bit, the fp32
copy the loss takes, its gradient), and ZeRO-3 keeps the parameters it has gathered live: the largest layer and
the prefetch bucket (0.9·h² elements, the size the engine gives it) in 16 bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from gptforge.core.declarations import DENSE_MASKS, TRAINED_SECTIONS
from gptforge.core.presets import Arch
from gptforge.model.build import attention_span, build_model, flops_per_token, parameter_counts

GiB = 1024 ** 3
TOKENS_PER_PARAM = 20  # compute-optimal budget (Hoffmann et al. 2022)
BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor for host memory
STAGES = [(0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]  # (ZeRO stage, offload)


def model_state_bytes(n: int, largest_layer: int, zero_stage: int, gpus_per_node: int, nodes: int,
                      offload: bool, muon: int = 0) -> tuple[float, float]:
    """(bytes per GPU, host bytes per node) of model states, as DeepSpeed's estimators count them for ZeRO-2 and
    ZeRO-3 (zero_init: partitioned as they load) with the same byte counts for ZeRO-0 and ZeRO-1. `muon`: the
    parameters Muon steps (optimizer: muon), whose one fp32 momentum takes the place of Adam's two moments (4
    bytes a parameter less, where the optimizer's states are)."""
    gpus = gpus_per_node * nodes
    load = n * 4 * gpus_per_node * BUFFER_FACTOR  # each process of a node loads the fp32 model on the host
    saved = 4 * muon
    if zero_stage == 3:
        largest = 4 * largest_layer
        if offload:
            return largest + 2 * n / gpus, (n * 16 - saved) / nodes * BUFFER_FACTOR
        return largest + (18 * n - saved) / gpus, largest_layer * 4 * gpus_per_node * BUFFER_FACTOR
    # DeepSpeed's on one node (see below)
    offloaded = max(n * 4 * gpus_per_node, (n * 16 - saved) / nodes) * BUFFER_FACTOR
    if zero_stage == 2:
        return (2 * n, offloaded) if offload else (2 * n + (18 * n - saved) / gpus, load)
    if zero_stage == 1:  # gradients whole on every GPU
        return (4 * n, offloaded) if offload else (4 * n + (16 * n - saved) / gpus, load)
    return 20 * n - saved, load


def muon_params(model) -> int:
    """The parameters DeepSpeed's Muon steps under gptforge (gptforge.model.train.engine.muon_matrices): the 2-D
    weights other than the embedding tables and the head."""
    from gptforge.model.train.engine import embedding_params

    tables = embedding_params(model)
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in tables)


def largest_layer_params(model) -> int:
    """The most parameters any one module holds itself (DeepSpeed's `largest_layer_params`): what ZeRO-3 gathers
    at once."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


@dataclass(frozen=True)
class LongContext:
    """What changes a micro-batch's activations at length: sequence-parallel ranks (each holds seq_len/N tokens
    and N-th of the heads in attention), the logits' tiles, the MLPs' slices, a document mask (a (s, s) block
    mask where the kernel takes no varlen)."""

    sequence_parallel: int = 1
    logit_tiles: int = 1
    mlp_shards: int = 1
    document_mask: bool = False
    scores: bool = True  # the kernel materialises the (s, s) attention scores (eager; sdpa and FlashAttention do not)


def logits_bytes(vocab_size: int, seq_len: int, micro_batch: int, lc: LongContext = LongContext()) -> float:
    """The logits of one micro-batch's loss on one GPU (16-bit, the fp32 copy, its gradient): a tile's."""
    return 10 * seq_len / lc.sequence_parallel * micro_batch * vocab_size / lc.logit_tiles


def activation_bytes(arch: Arch, vocab_size: int, seq_len: int, micro_batch: int, checkpointing: bool,
                     lc: LongContext = LongContext()) -> float:
    """Activation memory of one micro-batch (bytes per GPU), logits included. Attention scores (where the kernel
    materialises them) count the keys a layer attends (the window in banded layers); sequence parallelism divides
    everything by N."""
    s, b, h, a, L = seq_len, micro_batch, arch.n_embd, arch.n_head, arch.n_layer
    local = s / lc.sequence_parallel  # this rank's tokens
    mlp_width = (arch.intermediate_size or 4 * h) * (arch.experts_per_token or 1)  # a token's MLP width
    mlp = 19 * mlp_width / (4 * h) * local * b * h
    if lc.mlp_shards > 1:  # the MLP's input kept, one slice's intermediates at a time
        mlp = 2 * local * b * h + mlp / lc.mlp_shards
    scores = 5 * a / lc.sequence_parallel * s * attention_span(arch, s) * b if lc.scores else 0
    layer = 15 * local * b * h + mlp + scores
    mask = s * s * b if lc.document_mask else 0
    acts = L * 2 * local * b * h + layer if checkpointing else L * layer
    return acts + mask + logits_bytes(vocab_size, s, b, lc)


def live_parameter_bytes(arch: Arch, largest_layer: int) -> float:
    """ZeRO-3's gathered 16-bit parameters: the largest layer and the prefetch bucket."""
    return 2 * (largest_layer + 0.9 * arch.n_embd ** 2)


@dataclass
class Plan:
    n_params: int
    active_params: int
    largest_layer: int
    flops_per_token: float
    optimal_tokens: float
    train_flops: float
    memory: dict  # {(zero_stage, offload): (model-state bytes per GPU, host bytes per node)}
    activations: dict  # {checkpointing: bytes per GPU}
    live_parameters: float  # ZeRO-3's gathered parameters, bytes per GPU
    days: float | None
    long_context: LongContext = LongContext()
    logits: float = 0.0  # the loss's logits (a tile's), bytes per GPU

    def gpu_bytes(self, zero_stage: int, offload: bool, checkpointing: bool) -> float:
        """Everything one GPU holds: model states, activations and, under ZeRO-3, the gathered parameters."""
        return (self.memory[(zero_stage, offload)][0] + self.activations[checkpointing]
                + (self.live_parameters if zero_stage == 3 else 0))


def adapter_params(model, lora) -> int:
    """Parameters of LoRA adapters of rank lora.r on the model's targeted linear layers: r * (in + out) each."""
    from gptforge.model.lora import targets

    names = set(targets(model, lora, "lora"))
    return sum(lora.r * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] in names)


def lora_state_bytes(n: int, adapters: int, largest_layer: int, zero_stage: int, gpus_per_node: int, nodes: int,
                     offload: bool, base_bytes: float) -> tuple[float, float]:
    """(bytes per GPU, host bytes per node) of a LoRA run: the frozen base at `base_bytes` a parameter (2 in bf16,
    0.5 in 4 bits), partitioned only under ZeRO-3, plus the adapters' own weights, gradients and Adam states
    counted as any trained parameters are."""
    gpu, host = model_state_bytes(adapters, min(adapters, largest_layer), zero_stage, gpus_per_node, nodes, offload)
    return gpu + base_bytes * n / (gpus_per_node * nodes if zero_stage == 3 else 1), host


def make_plan(arch: Arch, vocab_size: int, seq_len: int, micro_batch: int, gpus: int, tokens: float | None = None,
              peak_tflops: float = 989.0, mfu: float = 0.4, gpus_per_node: int = 8, config=None,
              lora=None, lc: LongContext = LongContext(), optimizer: str = "adamw") -> Plan:
    """The plan for `gpus` GPUs, gpus_per_node a node (fewer on one node). FLOPs and time count the active
    parameters (a mixture of experts computes only its routed experts); memory counts them all. `config`: a
    pretrained model's transformers config, counted as that model is built; `lora`: a lora section with r > 0,
    whose run holds the base frozen (in 16 bits, or lora.quantize bits) and trains only the adapters; `optimizer`:
    the section's (muon: one moment for the hidden matrices, not two)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = build_model(arch, vocab_size) if config is None else AutoModelForCausalLM.from_config(config)
    n, active = parameter_counts(model)
    largest = largest_layer_params(model)
    per_node = min(gpus, gpus_per_node)
    nodes = -(-gpus // per_node)
    fpt = flops_per_token(active, arch, seq_len)
    tokens = tokens or TOKENS_PER_PARAM * n
    if lora is not None and lora.r:
        adapters, base_bytes = adapter_params(model, lora), {None: 2, 8: 1, 4: 0.5}[lora.quantize]
        memory = {(z, off): lora_state_bytes(n, adapters, largest, z, per_node, nodes, off, base_bytes)
                  for z, off in STAGES}
    else:
        muon = muon_params(model) if optimizer == "muon" else 0
        memory = {(z, off): model_state_bytes(n, largest, z, per_node, nodes, off, muon) for z, off in STAGES}
    acts = {ckpt: activation_bytes(arch, vocab_size, seq_len, micro_batch, ckpt, lc) for ckpt in (False, True)}
    days = fpt * tokens / (gpus * peak_tflops * 1e12 * mfu) / 86400
    return Plan(n, active, largest, fpt, TOKENS_PER_PARAM * n, fpt * tokens, memory, acts,
                live_parameter_bytes(arch, largest), days, lc, logits_bytes(vocab_size, seq_len, micro_batch, lc))


def assumptions(p: Plan, micro_batch: int, seq_len: int, checkpointing: bool) -> str:
    return (f"assumed: bf16 weights and gradients with fp32 Adam (DeepSpeed's estimators), micro-batch {micro_batch} "
            f"of {seq_len} tokens, activation checkpointing {'on' if checkpointing else 'off'}"
            f"{' (one layer recomputed at a time)' if checkpointing else ''}, logits in fp32 for the loss, ZeRO-3's "
            f"live parameters ({p.live_parameters / GiB:.2f} GiB), host memory with DeepSpeed's 1.5x buffer; no "
            "allowance for fragmentation or the framework's own buffers")


def verdict(p: Plan, zero_stage: int, offload: bool, checkpointing: bool, gpus: int, gpu_mem: float | None) -> str:
    """One line: what one GPU needs at this ZeRO stage, and whether it fits in gpu_mem GiB."""
    states, host = p.memory[(zero_stage, offload)]
    total = p.gpu_bytes(zero_stage, offload, checkpointing)
    fits = "" if gpu_mem is None else f" {'fits' if total <= gpu_mem * GiB else 'does not fit'} in {gpu_mem:g} GiB"
    return (f"ZeRO-{zero_stage}{' + CPU offload' if offload else ''} on {gpus} devices needs {total / GiB:.1f} GiB per "
            f"device (model states {states / GiB:.1f}, activations {p.activations[checkpointing] / GiB:.1f}"
            f"{f', live parameters {p.live_parameters / GiB:.1f}' if zero_stage == 3 else ''}){fits}; host "
            f"{host / GiB:.1f} GiB per node")


def render(p: Plan, name: str, gpus: int, gpu_mem: float | None, seq_len: int, micro_batch: int, tokens_given: bool,
           peak_tflops: float, mfu: float, checkpointing: bool) -> str:
    active = f" ({p.active_params / 1e9:.3f}B active per token)" if p.active_params != p.n_params else ""
    lc = p.long_context
    lines = [f"model {name}: {p.n_params / 1e9:.3f}B parameters{active}",
             f"training FLOPs per token (seq {seq_len}): {p.flops_per_token:.4g}",
             f"compute-optimal tokens (20 per parameter): {p.optimal_tokens / 1e9:.1f}B",
             f"training FLOPs for {'the given' if tokens_given else 'the compute-optimal'} tokens: {p.train_flops:.4g}",
             f"time on {gpus} GPUs at {mfu:.0%} MFU of {peak_tflops:g} TFLOP/s: {p.days:.1f} days",
             f"activations per GPU (micro-batch {micro_batch}"
             f"{f', {seq_len // lc.sequence_parallel} tokens a rank' if lc.sequence_parallel > 1 else ''}"
             f"): {p.activations[False] / GiB:.1f} GiB, "
             f"{p.activations[True] / GiB:.1f} GiB with activation checkpointing",
             f"logits of the loss per GPU: {p.logits / GiB:.2f} GiB"
             f"{f' (a tile of {lc.logit_tiles})' if lc.logit_tiles > 1 else ' (untiled)'}"
             f"{f'; MLPs in {lc.mlp_shards} slices' if lc.mlp_shards > 1 else ''}"
             f"{f'; sequence parallel {lc.sequence_parallel}' if lc.sequence_parallel > 1 else ''}"
             f"{'; document mask' if lc.document_mask else ''}",
             f"per GPU on {gpus} GPUs: model states + activations{' (checkpointed)' if checkpointing else ''} "
             "[+ ZeRO-3 live parameters] = total; host memory per node:"]
    for z, off in STAGES:
        states, host = p.memory[(z, off)]
        total = p.gpu_bytes(z, off, checkpointing)
        fits = "" if gpu_mem is None else ("  fits" if total <= gpu_mem * GiB else "  does not fit")
        lines.append(f"  ZeRO-{z}{' + CPU offload' if off else '':15s} {states / GiB:10.1f} + "
                     f"{p.activations[checkpointing] / GiB:.1f}{f' + {p.live_parameters / GiB:.1f}' if z == 3 else ''}"
                     f" = {total / GiB:.1f} GiB{fits}; host {host / GiB:.1f} GiB")
    lines.append(assumptions(p, micro_batch, seq_len, checkpointing))
    return "\n".join(lines)


def device_memory_gib(device: torch.device, local_ranks: int | None = None) -> float | None:
    """What one process may use: the GPU's memory, or on the CPU the host's memory shared by its local ranks
    (`local_ranks`, else this process's LOCAL_WORLD_SIZE)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GiB
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError):
        return None
    return host / (local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def long_context(cfg, section: str, sp: int, seq_len: int, micro_batch: int, vocab_size: int,
                 hidden: int) -> LongContext:
    """The LongContext of a stage with the training settings `section` (its declaration's), as the config runs it
    (gptforge.model.train.tiling and .sequence_parallel decide); `sp`: the ranks that share each of its sequences (1
    where the stage takes no sequence parallelism)."""
    from gptforge.model.train.tiling import logit_tiles, mlp_shards

    dist = cfg.distributed
    local = seq_len // sp
    flash = cfg.model.attention.startswith("flash")
    mask = DENSE_MASKS.get(section)  # a whole (s, s) document mask, where the section turns one on
    return LongContext(sp, logit_tiles(dist, micro_batch, local, vocab_size), mlp_shards(dist, local, hidden),
                       bool(mask and getattr(getattr(cfg, section), mask)) and not flash,
                       scores=cfg.model.attention == "eager")


def stage_verdict(cfg, train, world: int, device: torch.device, vocab_size: int, sp: int = 1) -> str:
    """The planner's verdict for a stage as configured (the preset or model.pretrained, its micro-batch, sequence
    length and lora, the distributed section's ZeRO stage, offload and checkpointing, this device's memory), for an
    out-of-memory message."""
    dist = cfg.distributed
    from gptforge.model.pretrained import architecture

    arch, config = architecture(cfg.model)
    seq_len = getattr(train, "seq_len", None) or getattr(train, "max_length", None) or arch.n_positions
    section = next(name for name in TRAINED_SECTIONS if getattr(cfg, name) is train)
    p = make_plan(arch, vocab_size, seq_len, train.micro_batch_size, world, gpus_per_node=dist.nproc_per_node,
                  config=config, lora=train.lora,
                  lc=long_context(cfg, section, sp, seq_len, train.micro_batch_size, vocab_size, arch.n_embd),
                  optimizer=getattr(train, "optimizer", "adamw"))
    line = verdict(p, dist.zero_stage, dist.offload_optimizer, dist.activation_checkpointing, world,
                   device_memory_gib(device))
    return f"the planner ({cfg.model.name()}): {line}"


def fits(cfg, train, student_dir, teacher_dir, section: str) -> str | None:
    """Why a model given by directory (`student_dir`, trained with the section `train`) does not fit the run's
    devices by the planner, beside a frozen teacher (`teacher_dir`, its 16-bit weights partitioned over the
    processes under ZeRO-3), or None where it fits or the memory is unknown. The devices: this host's GPUs, else
    its memory shared by the local processes."""
    from transformers import AutoConfig

    from gptforge.model.build import arch_of

    dist = cfg.distributed
    config = AutoConfig.from_pretrained(student_dir, trust_remote_code=cfg.model.trust_remote_code)
    arch, world = arch_of(config), dist.world_size
    seq_len = getattr(train, "max_length", None) or arch.n_positions
    p = make_plan(arch, config.vocab_size, seq_len, train.micro_batch_size, world, gpus_per_node=dist.nproc_per_node,
                  config=config, lora=train.lora,
                  lc=long_context(cfg, section, 1, seq_len, train.micro_batch_size, config.vocab_size, arch.n_embd),
                  optimizer=getattr(train, "optimizer", "adamw"))
    teacher = 0.0
    if teacher_dir is not None:
        from transformers import AutoModelForCausalLM

        t_config = AutoConfig.from_pretrained(teacher_dir, trust_remote_code=cfg.model.trust_remote_code)
        with torch.device("meta"):
            n = parameter_counts(AutoModelForCausalLM.from_config(t_config))[0]
        teacher = 2 * n / (world if dist.zero_stage == 3 else 1)
    need = p.gpu_bytes(dist.zero_stage, dist.offload_optimizer, dist.activation_checkpointing) + teacher
    memory = device_memory_gib(torch.device("cuda" if torch.cuda.is_available() else "cpu"), dist.nproc_per_node)
    if memory is None or need <= memory * GiB:
        return None
    line = verdict(p, dist.zero_stage, dist.offload_optimizer, dist.activation_checkpointing, world, None)
    return (f"the planner ({p.n_params / 1e9:.2f}B parameters): {line}"
            f"{f', and the teacher {teacher / GiB:.1f} GiB' if teacher >= 0.05 * GiB else ''}; {need / GiB:.1f} GiB a "
            "device, "
            f"over the {memory:.1f} GiB each has")
