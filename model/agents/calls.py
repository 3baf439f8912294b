"""Tool calls in the model's own format, told by its chat template:

- `hermes` (Hermes, Qwen2.5 and gptforge's own template, gptforge.data.tokenizer.chat_template): each call a JSON
  object {"name", "arguments"} between `<tool_call>` and `</tool_call>`, after any text;
- `llama3_json` (Llama 3.1 and 3.2): the whole turn one JSON object {"name", "parameters"}, after an optional
  `<|python_tag|>`.

A call that does not parse is kept as a malformed call, which the model is answered with an error for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from gptforge.core.errors import ConfigError

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class Parsed:
    """A turn's text before its calls, and its calls: (name, arguments) or (None, why it did not parse)."""

    content: str
    calls: list[tuple[str | None, dict | str]]

    def message(self) -> dict:
        """The turn as an assistant message, its calls as transformers' chat templates take them."""
        calls = [{"type": "function", "function": {"name": name or "malformed", "arguments": args if name else {}}}
                 for name, args in self.calls]
        return {"role": "assistant", "content": self.content, **({"tool_calls": calls} if calls else {})}


def format_of(template: str | None, model: str) -> str:
    """The tool-call format a chat template renders; a ConfigError naming the model where it renders no tools."""
    if template and "<tool_call>" in template:
        return "hermes"
    if template and "<|python_tag|>" in template or template and "ipython" in template and "parameters" in template:
        return "llama3_json"
    raise ConfigError(f"the chat template of {model} cannot render tools (neither Hermes / Qwen2.5 <tool_call> nor "
                      "Llama 3.1 JSON calls): give a model whose template does, or sft.chat_template")


def _call(text: str, args_key: str) -> tuple[str | None, dict | str]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"the tool call is not JSON ({e.msg} at character {e.pos}): {text[:120]}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, f"a tool call needs a \"name\" and \"{args_key}\": {text[:120]}"
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, f"the arguments of {obj['name']} are not a JSON object: {args[:120]}"
    return obj["name"], args


def parse(text: str, fmt: str) -> Parsed:
    """The calls of one turn's text (its special tokens removed)."""
    if fmt == "hermes":
        first = text.find("<tool_call>")
        if first < 0:
            return Parsed(text, [])
        return Parsed(text[:first].rstrip("\n"), [_call(m.group(1), "arguments") for m in HERMES.finditer(text)])
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return Parsed(text, [])
    return Parsed("", [_call(part, "parameters") for part in _json_objects(body)])


def _json_objects(body: str) -> list[str]:
    """Llama 3.1 turns hold one call, or several separated by `;`: each JSON object in turn, the rest (what does not
    parse) as one more part, which then reads as a malformed call."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(body):
        while at < len(body) and body[at] in " \n\t;":
            at += 1
        if at >= len(body):
            break
        try:
            _, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            parts.append(body[at:])
            break
        parts.append(body[at:end])
        at = end
    return parts
