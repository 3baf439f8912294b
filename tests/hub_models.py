"""Tiny models "from elsewhere", built in the test: three families with their own byte-level BPE, special tokens,
chat templates and stop tokens, saved sharded and laid out as a Hugging Face hub cache (no network).

- llama3: Llama 3's header tokens and template (no generation markers, a bos in the template), no pad token, two
  stop tokens (end of text, end of turn) in its generation_config.
- qwen2: ChatML with a default system prompt, tied embeddings, pad `<|endoftext|>`, stops im_end and endoftext.
- mistral: a base model with no chat template and no pad token (`<s>`, `</s>`).
"""

from __future__ import annotations

import json
from pathlib import Path

from gptforge.data import demo

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")
QWEN2_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

FAMILIES = {
    "llama3": {"special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                           "<|eot_id|>"], "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": None,
               "stops": ["<|end_of_text|>", "<|eot_id|>"], "template": LLAMA3_TEMPLATE},
    "qwen2": {"special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "bos": None, "eos": "<|im_end|>",
              "pad": "<|endoftext|>", "stops": ["<|im_end|>", "<|endoftext|>"], "template": QWEN2_TEMPLATE},
    "mistral": {"special": ["<unk>", "<s>", "</s>"], "bos": "<s>", "eos": "</s>", "pad": None, "stops": ["</s>"],
                "template": None},
}


def texts(n: int = 600) -> list[str]:
    """Text the tokenizers learn from: the demo's documents and conversations."""
    d = demo.generate(pretrain_docs=n, sft_items=100, preference_pairs=10, eval_items=10)
    return list(d.pretrain) + [m["content"] for c in d.sft for m in c["messages"]]


def tokenizer(family: str, vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=spec["special"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"],
                                 pad_token=spec["pad"], unk_token="<unk>" if family == "mistral" else None,
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = spec["template"]
    return hf


def model_config(family: str, vocab_size: int, tok):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family == "llama3":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    return MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)


def save_model(family: str, out: Path, seed: int = 0, vocab_size: int = 400) -> Path:
    """A tiny randomly initialised model of `family` with its tokenizer and generation config, sharded."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = tokenizer(family, vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(family, len(tok), tok))
    model.save_pretrained(out, max_shard_size="100KB")  # sharded, with an index, as large models are
    tok.save_pretrained(out)
    stops = FAMILIES[family]["stops"]
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids(stops),
                     pad_token_id=tok.pad_token_id).save_pretrained(out)
    return out


def hub_cache(cache: Path, repo: str, folder: Path, commit: str = "a" * 40) -> str:
    """Lay `folder` out in a hub cache as repo `org/name` at `commit`, main pointing at it; returns the repo."""
    import shutil

    base = cache / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    shutil.copytree(folder, snap, dirs_exist_ok=True)
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(commit)
    return repo


def use_cache(monkeypatch, cache: Path) -> None:
    """Point this process (huggingface_hub reads its cache path at import) and the stages it starts at `cache`."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


def shards(folder: Path) -> list[str]:
    return sorted(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
