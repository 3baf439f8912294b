"""LoRA and QLoRA adapters (PEFT), the one place every training stage goes through for them.

A stage loads its start model (in 4 or 8 bits through bitsandbytes where `lora.quantize` asks: `quantization`,
GPUs only) and hands it to `wrap`: with `<stage>.lora.r` 0 that is the plain model, trained in full; otherwise
the base is frozen and PEFT wraps it with adapters on `lora.target_modules`, a classifier's head (a reward
model's `score`) and any `modules_to_save` trained in full, and the rows of tokens the stage added to the
vocabulary trained as well (`trainable_token_indices`). The DeepSpeed engines then hold the adapters'
parameters only in their optimizer.

Under ZeRO-3 the base is loaded partitioned and the adapters are partitioned by `deepspeed.initialize` like any
parameter it has not seen; `save_adapter` gathers them first (ZeRO-3 otherwise saves empty adapters), and
`merged` folds the adapters into the base a layer at a time, each layer's parameters gathered alone, so that
the merged export is never gathered whole. The reference policy of an adapter stage is the same model with its
adapters disabled (`disabled`): no second copy in memory.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from gptforge.core.errors import ConfigError

HEADS = ("lm_head", "score", "classifier")  # output layers: trained in full (a head) or not at all, never adapted
TASKS = {"causal-lm": "CAUSAL_LM", "sequence-classifier": "SEQ_CLS", "token-classifier": "TOKEN_CLS"}


def is_peft(model) -> bool:
    from peft import PeftModel

    return isinstance(getattr(model, "module", model), PeftModel)


def linear_names(model) -> list[str]:
    """The names (last part) of the model's linear layers that adapters can target, output heads left out."""
    from transformers.pytorch_utils import Conv1D

    names = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))}
    return sorted(names - set(HEADS))


def targets(model, lora, key: str) -> list[str]:
    """lora.target_modules resolved on this model: all-linear is every linear layer but the heads; names that
    match no module are a ConfigError listing the ones that exist."""
    linear = linear_names(model)
    if lora.target_modules == "all-linear":
        return linear
    wanted = [lora.target_modules] if isinstance(lora.target_modules, str) else list(lora.target_modules)
    leaves = {n.rpartition(".")[2] for n, _ in model.named_modules()}
    missing = [t for t in wanted if t not in leaves]
    if missing:
        raise ConfigError(f"{key}.target_modules: {', '.join(missing)} match no module of the model; its linear "
                          f"modules are {', '.join(linear)}")
    return wanted


def quantization(lora, compute_dtype):
    """from_pretrained arguments that load the base in lora.quantize bits (bitsandbytes), or none. The 4-bit
    storage dtype is the compute dtype, which ZeRO-3 needs to partition the quantized weights."""
    if not lora.quantize:
        return {}
    from transformers import BitsAndBytesConfig

    if lora.quantize == 8:
        return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)}
    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=compute_dtype)}


def wrap(model, lora, task: str, key: str, new_tokens: list[int] = (), checkpointing: bool = False):
    """`model` with LoRA adapters (PEFT), or `model` itself when lora.r is 0. `new_tokens`: ids of rows the stage
    added to the vocabulary, trained too (and, for a model whose output head is not tied to its embeddings, the
    head in full, since the new tokens must be predicted)."""
    if not lora.r:
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    save = list(lora.modules_to_save)
    trainable_tokens = None
    if new_tokens:
        embed = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
        trainable_tokens = {embed.rpartition(".")[2]: list(new_tokens)}
        out = model.get_output_embeddings()
        if out is not None and out.weight is not model.get_input_embeddings().weight:
            save.append(next(n for n, m in model.named_modules() if m is out).rpartition(".")[2])
    if lora.quantize:  # (unquantized, PEFT itself makes the embeddings' output require grad under checkpointing)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=targets(model, lora, key), modules_to_save=save or None,
                        trainable_token_indices=trainable_tokens, task_type=TASKS[task])
    return get_peft_model(model, config)


def disabled(model):
    """The model's base, for the block: its adapters disabled (the reference policy of an adapter stage); a
    model without adapters as it is."""
    model = getattr(model, "module", model)
    return model.disable_adapter() if is_peft(model) else contextlib.nullcontext()


@contextlib.contextmanager
def as_reference(policy, reference):
    """The model that scores as the reference, for the block: `reference`, or, when it is None
    (gptforge.model.pretrained.reference_is_policy), the policy with its adapters disabled."""
    if reference is not None:
        yield reference
        return
    with disabled(policy):
        yield policy


def _gathered(params):
    import deepspeed

    params = [p for p in params if p is not None]
    return deepspeed.zero.GatheredParameters(params, modifier_rank=0,
                                             enabled=any(hasattr(p, "ds_id") for p in params))


def save_adapter(model, out: Path, rank: int) -> None:
    """The PEFT adapter alone (`PeftModel.from_pretrained(base, out)` loads it), written by rank 0, its
    parameters (and the embeddings, when the vocabulary grew) gathered under ZeRO-3 first. Every process calls it."""
    model = getattr(model, "module", model)
    embeddings = [model.get_input_embeddings(), model.get_output_embeddings()]
    params = [p for p in model.parameters() if p.requires_grad]
    params += [p for m in embeddings if m is not None for p in m.parameters()]
    with _gathered(list({id(p): p for p in params}.values())):
        if rank == 0:
            model.save_pretrained(out)


def merged(model):
    """The transformers model of a PEFT model with every adapter folded into its base weights, a layer at a time
    (each layer's parameters gathered alone under ZeRO-3), and the wrappers removed: what `export_model` writes.
    The PEFT model is used up. A model without adapters is returned as it is."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = getattr(model, "module", model)
    if not is_peft(model):
        return model
    for module in list(model.modules()):
        if isinstance(module, BaseTunerLayer):
            with _gathered(list(module.parameters())), torch.no_grad():
                module.merge()
    return model.unload()
