"""Every stage's output model as a Hugging Face directory: safetensors weights in shards (written a parameter at
a time, so a ZeRO-3 model is never gathered whole), config, the tokenizer with its chat template, and a
generation config whose stop tokens come from the tokenizer (`stop_token_ids`), the one place they are decided."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gptforge.core.errors import UserError
from gptforge.core.files import MODEL_OUTPUTS


def stop_token_ids(tokenizer) -> list[int]:
    """The tokens generation stops at: the special token the chat template closes an assistant turn with (found
    by rendering one) and end-of-text. Without a chat template, end-of-text alone."""
    stops = []
    if tokenizer.chat_template:
        user = [{"role": "user", "content": "x"}]
        prompt = tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True,
                                               return_dict=True)["input_ids"]
        turn = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": "y"}], tokenize=True,
                                             return_dict=True)["input_ids"]
        special = set(tokenizer.all_special_ids)
        end_of_turn = next((t for t in turn[len(prompt):] if t in special), None)
        if end_of_turn is not None:
            stops.append(end_of_turn)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
        stops.append(tokenizer.eos_token_id)
    return stops


def save_tokenizer_and_generation_config(tokenizer, out: Path, context_length: int,
                                         model_stops: list[int] = ()) -> None:
    """The tokenizer (its model_max_length the model's context) and a generation config stopping at
    `stop_token_ids(tokenizer)` and at the model's own stop tokens (`model_stops`: a pretrained model's
    generation_config, such as Llama 3's end of text and end of turn)."""
    from transformers import GenerationConfig

    tokenizer.model_max_length = context_length
    tokenizer.save_pretrained(out)
    # no length: callers bound generation themselves (lm-evaluation-harness by max_length, which a stored
    # max_new_tokens would override)
    stops = list(dict.fromkeys([*stop_token_ids(tokenizer), *model_stops]))
    GenerationConfig(eos_token_id=stops, pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=tokenizer.bos_token_id).save_pretrained(out)


def context_length(config) -> int:
    from gptforge.model.build import context_of

    return context_of(config)


def shard_plan(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Names grouped into shards in order, each shard at most max_shard_size bytes unless one tensor alone is
    larger (as huggingface_hub splits a state dict)."""
    shards, current, used = [], [], 0
    for name, size in sizes:
        if current and used + size > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    return shards + [current] if current else shards


def saved_tensors(model) -> dict[str, torch.Tensor]:
    """What a checkpoint of `model` stores: its parameters (a tied weight once, under the name it is tied to) and
    persistent buffers, by state-dict name. Under ZeRO-3 the parameters are the partitioned ones."""
    keys = set(model.state_dict())
    tied = set(model.all_tied_weights_keys)  # {tied name: the weight it is}
    tensors = dict(model.named_parameters())
    tensors.update((k, b) for k, b in model.named_buffers() if k in keys)
    return {k: t for k, t in tensors.items() if k in keys and k not in tied}


def export_model(model, tokenizer, out: Path, rank: int, max_shard_size: int) -> None:
    """Write `model` (a transformers model, or the DeepSpeed engine holding one) as a Hugging Face directory (a
    PEFT model: its adapter alone in `adapter/` beside `out`, then the model with the adapter merged in `out`):
    weights in safetensors shards of at most max_shard_size bytes (`model.safetensors`, or
    `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`), its config, the tokenizer and a
    generation config. Every process calls this. A ZeRO-3 partitioned parameter is gathered alone, written into
    rank 0's current shard and released: no process ever holds more than one shard and one parameter, never the
    whole model. Non-finite weights are never written: every rank checks each tensor, and all stop at the first
    one with one error naming it."""
    import deepspeed
    from safetensors.torch import save_file

    from gptforge.model.lora import is_peft, merged, save_adapter
    from gptforge.model.pretrained import stop_tokens_of

    if hasattr(model, "empty_partition_cache"):  # an engine: release what ZeRO-3 prefetched for a next step
        model.empty_partition_cache()
    model = getattr(model, "module", model)
    if is_peft(model):  # an adapter stage: the adapter alone beside the model, then the model with it merged
        save_adapter(model, out.parent / MODEL_OUTPUTS["adapter"], rank)
        model = merged(model)
    tensors = saved_tensors(model)
    sizes = [(k, getattr(t, "ds_numel", t.numel()) * t.element_size()) for k, t in tensors.items()]
    shards = shard_plan(sizes, max_shard_size)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    for shard, name in zip(shards, names):
        part = {}
        for key in shard:
            t = tensors[key]
            with deepspeed.zero.GatheredParameters([t], enabled=hasattr(t, "ds_id")):
                if not bool(torch.isfinite(t).all()):
                    raise UserError(f"refusing to export {out}: weight {key} holds NaN/Inf")
                if rank == 0:
                    part[key] = t.detach().to("cpu", copy=True).contiguous()
        if rank == 0:
            save_file(part, str(out / name), metadata={"format": "pt"})
    if rank != 0:
        return
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(size for _, size in sizes)},
                 "weight_map": {key: name for shard, name in zip(shards, names) for key in shard}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    model.config.architectures = [type(model).__name__]  # as save_pretrained records them
    model.config.dtype = str(model.dtype).removeprefix("torch.")
    model.config.save_pretrained(out)
    save_tokenizer_and_generation_config(tokenizer, out, context_length(model.config), stop_tokens_of(model))


def export_trainer(trainer, tokenizer, out: Path, max_shard_size: int) -> None:
    """Write a TRL trainer's model as `export_model` does (partitions gathered one parameter at a time); every
    process calls this."""
    export_model(trainer.model_wrapped, tokenizer, out, trainer.accelerator.process_index, max_shard_size)


def hf_tensor(model_dir: Path, name: str) -> torch.Tensor:
    """One tensor of a Hugging Face directory's safetensors weights (sharded or not), read alone."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    file = json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors"
    with safe_open(str(model_dir / file), "pt") as f:
        return f.get_tensor(name)
