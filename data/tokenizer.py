"""Byte-level BPE training with `tokenizers`, and saving as Hugging Face files with a chat template."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gptforge.core.errors import ConfigError

def chat_template(start: str, end: str, markers: bool = True) -> str:
    """ChatML between `start` and `end` (the turn's special tokens), with tools in the Hermes / Qwen2.5 format: the
    tools' JSON schemas in the system turn, each call of an assistant turn as `<tool_call>{"name", "arguments"}
    </tool_call>`, consecutive tool results in one user turn as `<tool_response>...</tool_response>`. A conversation
    without tools renders as plain ChatML. With `markers`, {% generation %} marks every token of an assistant turn,
    its calls and its end of turn with the newline after it, so that `return_assistant_tokens_mask=True` gives the
    assistant-only loss mask and a preference trainer scoring the whole turn never meets a token the model was not
    taught."""
    gen, endgen = ("{%- generation %}", "{%- endgeneration %}") if markers else ("", "")
    return (
        "{%- if tools %}"
        "{{- 'START' + 'system\\n' }}"
        "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
        "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
        "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
        "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
        "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\\n</tool_call>' + 'END' + '\\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'system' and loop.first and tools %}"
        "{%- elif message['role'] == 'assistant' %}"
        "{{- 'START' + 'assistant\\n' }}" + gen +
        "{{- message['content'] or '' }}"
        "{%- for call in message['tool_calls'] or [] %}"
        "{%- set fn = call['function'] if call['function'] is defined else call %}"
        "{{- ('\\n' if message['content'] or not loop.first else '') + '<tool_call>\\n{\"name\": \"' + fn['name'] + "
        "'\", \"arguments\": ' + (fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson)) + "
        "'}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- 'END' + '\\n' }}" + endgen +
        "{%- elif message['role'] == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- 'START' + 'user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- 'END' + '\\n' }}{%- endif %}"
        "{%- else %}"
        "{{- 'START' + message['role'] + '\\n' + message['content'] + 'END' + '\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- 'START' + 'assistant\\n' }}{%- endif %}"
    ).replace("START", start).replace("END", end)


# Pre-tokenization of GPT-4's cl100k and Llama 3: words keep their leading space, but numbers are
# chunks of at most three digits with no space attached, so a number is the same token wherever it
# stands ("Which is larger, 89 or 3?" and the answer "89" share the token "89").
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int, special_tokens: list[str]) -> Tokenizer:
    """Train a byte-level BPE with the pre-tokenization above."""
    from tokenizers import Regex

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=None)
    return tok


def save_hf(tok: Tokenizer, out_dir: Path, special_tokens: list[str]) -> None:
    """Save as Hugging Face tokenizer files that `AutoTokenizer.from_pretrained` loads without gptforge.
    The context length (`model_max_length`) is the model's: the stage that builds the model sets it."""
    from transformers import PreTrainedTokenizerFast

    eos, start, end = special_tokens[0], special_tokens[1], special_tokens[2]
    pad = special_tokens[3] if len(special_tokens) > 3 else eos
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=eos, eos_token=eos, pad_token=pad, unk_token=None,
        clean_up_tokenization_spaces=False,
        additional_special_tokens=[t for t in special_tokens if t not in (eos, pad)])
    hf.chat_template = chat_template(start, end)
    hf.save_pretrained(out_dir)


def load_pretrained(name_or_path: str, out_dir: Path):
    """Load an existing tokenizer (hub name or local dir), save a copy in out_dir; return its backend."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
    if not hf.is_fast:
        raise ConfigError(f"tokenizer.pretrained={name_or_path}: this tokenizer has no fast (Rust) version")
    hf.save_pretrained(out_dir)
    return hf.backend_tokenizer, hf.eos_token_id
