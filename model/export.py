"""Every stage's output model as a Hugging Face directory: safetensors weights, config, the tokenizer with its
chat template, and a generation config whose stop tokens come from the tokenizer (`stop_token_ids`), the
one place they are decided."""

from __future__ import annotations

from pathlib import Path

import torch


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


def full_state_dict(model: torch.nn.Module, zero_stage: int, rank: int) -> dict | None:
    """The whole model's weights on rank 0 (ZeRO-3 partitions gathered); None on other ranks."""
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            sd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if rank == 0 else None
        return sd
    return {k: v.detach().cpu() for k, v in model.state_dict().items()} if rank == 0 else None


def save_tokenizer_and_generation_config(tokenizer, out: Path, context_length: int) -> None:
    """The tokenizer (its model_max_length the model's context) and a generation config stopping at
    `stop_token_ids(tokenizer)`."""
    from transformers import GenerationConfig

    tokenizer.model_max_length = context_length
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=tokenizer.bos_token_id, max_new_tokens=64).save_pretrained(out)


def context_length(config) -> int:
    return getattr(config, "n_positions", None) or config.max_position_embeddings


def export_hf(model, state_dict: dict, tokenizer, out: Path) -> None:
    """Write a model and its weights (from `full_state_dict`) as a Hugging Face directory (rank 0); a tied weight
    (GPT-2's lm_head is its embedding) is stored once, even when gathered as a copy."""
    out.mkdir(parents=True, exist_ok=True)
    tied = model.all_tied_weights_keys  # {tied: the weight it is}
    model.save_pretrained(out, state_dict={k: v for k, v in state_dict.items() if k not in tied},
                          safe_serialization=True)
    save_tokenizer_and_generation_config(tokenizer, out, context_length(model.config))


def drop_tied_copies(model, out: Path) -> None:
    """Rewrite the safetensors files of `out` without the tied weights' copies (the Trainer's ZeRO-3 gather)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tied = set(model.all_tied_weights_keys)
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            keys, meta = list(st.keys()), st.metadata()
            if tied & set(keys):
                save_file({k: st.get_tensor(k) for k in keys if k not in tied}, str(f), metadata=meta)
    index = out / "model.safetensors.index.json"
    if index.is_file():
        import json

        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if k not in tied}
        index.write_text(json.dumps(data, indent=2))


def export_trainer(trainer, tokenizer, out: Path) -> None:
    """Write a TRL trainer's model as a Hugging Face directory (the Trainer gathers ZeRO-3 partitions); every
    process calls this."""
    trainer.save_model(str(out))
    if trainer.accelerator.is_main_process:
        (out / "training_args.bin").unlink(missing_ok=True)  # a pickle; the manifest holds the config
        model = getattr(trainer.model, "module", trainer.model)
        drop_tied_copies(model, out)
        save_tokenizer_and_generation_config(tokenizer, out, context_length(model.config))
