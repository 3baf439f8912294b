"""Format adapters: raw rows -> one normalised shape per kind.

- text:       str (pretraining)
- messages:   {"messages": [{"role": "system|user|assistant|tool", "content": str}, ...], "tools"?: [schema, ...]}
              from Alpaca (instruction/input/output), ShareGPT (conversations from/value) or OpenAI messages;
              OpenAI's tool use too: an assistant turn's `tool_calls` (normalised to {"type": "function",
              "function": {"name", "arguments": {...}}}), `tool` turns with the results, and the row's `tools`
              (the JSON schemas the template lists)
- preference: {"prompt": [messages...], "chosen": str, "rejected": str}
              from flat prompt/chosen/rejected strings, UltraFeedback-style message lists, or
              Anthropic HH full transcripts ("\\n\\nHuman: ... \\n\\nAssistant: ...")
- evaluation: {"prompt": [messages...], "answer": str | None}
              from a prompt with an optional reference answer, or a conversation in any chat format
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gptforge.core.errors import DataError
from gptforge.data.sources import Row


class BadRow(ValueError):
    """A row that cannot be normalised; the message says why."""


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
ROLES = ("system", "user", "assistant", "tool")


def _str(row: dict, key: str) -> str:
    if key not in row:
        raise BadRow(f"missing field {key!r}")
    v = row[key]
    if not isinstance(v, str):
        raise BadRow(f"field {key!r} should be a string, got {type(v).__name__}")
    return v


def to_text(value, text_field: str = "text") -> str:
    text = value if isinstance(value, str) else _str(value, text_field) if isinstance(value, dict) else None
    if text is None:
        raise BadRow(f"expected a string or an object with {text_field!r}, got {type(value).__name__}")
    if not text.strip():
        raise BadRow("empty text")
    return text


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadRow("messages should be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRow(f"message {i} should be an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise BadRow(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        calls = _tool_calls(m.get("tool_calls"), i) if role == "assistant" else []
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise BadRow(f"message {i} content should be a string")
        out.append({"role": role, "content": content, **({"tool_calls": calls} if calls else {}),
                    **({"name": m["name"]} if role == "tool" and isinstance(m.get("name"), str) else {})})
    return out


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant turn's tool calls, OpenAI's ({"type": "function", "function": {"name", "arguments"}}, the
    arguments an object or its JSON text) or bare ({"name", "arguments"}), as the chat templates take them."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise BadRow(f"message {i} tool_calls should be a list")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRow(f"message {i} tool call {k} needs a function name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise BadRow(f"message {i} tool call {k} ({fn['name']}): arguments are not JSON") from None
        if not isinstance(args, dict):
            raise BadRow(f"message {i} tool call {k} ({fn['name']}): arguments should be an object")
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _tools(tools) -> list[dict]:
    """A row's tool schemas: JSON schemas as transformers' get_json_schema writes them, or their function part."""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRow("tools should be a list of JSON schemas")
    for k, t in enumerate(tools):
        if not isinstance(t.get("function", t).get("name"), str):
            raise BadRow(f"tool {k} needs a name")
    return [t if "function" in t else {"type": "function", "function": t} for t in tools]


def to_messages(value) -> dict:
    """Alpaca, ShareGPT or OpenAI messages -> {"messages": [...]}."""
    if not isinstance(value, dict):
        raise BadRow(f"expected an object, got {type(value).__name__}")
    if "messages" in value:
        messages = _check_messages(value["messages"])
    elif "conversations" in value:
        conv = value["conversations"]
        if not isinstance(conv, list) or not conv:
            raise BadRow("conversations should be a non-empty list")
        messages = []
        for i, turn in enumerate(conv):
            if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES:
                raise BadRow(f"conversation turn {i} needs 'from' in {', '.join(SHAREGPT_ROLES)}")
            if not isinstance(turn.get("value"), str):
                raise BadRow(f"conversation turn {i} needs a string 'value'")
            messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    elif "instruction" in value:
        instruction = _str(value, "instruction")
        extra = value.get("input") or ""
        if not isinstance(extra, str):
            raise BadRow("field 'input' should be a string")
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": _str(value, "output")}]
        if isinstance(value.get("system"), str) and value["system"].strip():
            messages.insert(0, {"role": "system", "content": value["system"]})
    else:
        raise BadRow("no 'messages', 'conversations' or 'instruction' field")
    if not any(m["content"].strip() or m.get("tool_calls") for m in messages):
        raise BadRow("empty conversation")
    tools = _tools(value["tools"]) if value.get("tools") is not None else None
    return {"messages": messages, **({"tools": tools} if tools else {})}


HH_TURN = re.compile(r"\n\n(Human|Assistant): ")


def parse_hh(transcript: str) -> list[dict]:
    """'\\n\\nHuman: hi\\n\\nAssistant: hello' -> [{"role": "user", ...}, {"role": "assistant", ...}]."""
    parts = HH_TURN.split("\n\n" + transcript.lstrip("\n"))
    if len(parts) < 3 or parts[0].strip():
        raise BadRow("not an HH transcript ('\\n\\nHuman: ... \\n\\nAssistant: ...')")
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[r], "content": c.strip()} for r, c in zip(parts[1::2], parts[2::2])]


def _split_last_assistant(messages: list[dict], what: str) -> tuple[list[dict], str]:
    if messages[-1]["role"] != "assistant":
        raise BadRow(f"{what} does not end with an assistant turn")
    return messages[:-1], messages[-1]["content"]


def to_pair(value) -> dict:
    """Preference pair -> {"prompt": [messages], "chosen": str, "rejected": str}."""
    if not isinstance(value, dict):
        raise BadRow(f"expected an object, got {type(value).__name__}")
    for key in ("chosen", "rejected"):
        if key not in value:
            raise BadRow(f"missing field {key!r}")
    chosen, rejected = value["chosen"], value["rejected"]
    if isinstance(chosen, list) and isinstance(rejected, list):  # UltraFeedback-style message lists
        c_prompt, c = _split_last_assistant(_check_messages(chosen), "chosen")
        r_prompt, r = _split_last_assistant(_check_messages(rejected), "rejected")
        prompt = c_prompt
        if isinstance(value.get("prompt"), str) and not prompt:
            prompt = [{"role": "user", "content": value["prompt"]}]
        if c_prompt and r_prompt and c_prompt != r_prompt:
            raise BadRow("chosen and rejected continue different conversations")
    elif isinstance(chosen, str) and isinstance(rejected, str):
        if "prompt" in value:
            p = value["prompt"]
            if isinstance(p, str):
                prompt = [{"role": "user", "content": p}]
            else:
                prompt = _check_messages(p)
            c, r = chosen, rejected
        else:  # Anthropic HH: two full transcripts sharing the prompt
            c_msgs, r_msgs = parse_hh(chosen), parse_hh(rejected)
            prompt, c = _split_last_assistant(c_msgs, "chosen")
            r_prompt, r = _split_last_assistant(r_msgs, "rejected")
            if prompt != r_prompt:
                raise BadRow("chosen and rejected transcripts have different prompts")
    else:
        raise BadRow("chosen and rejected should both be strings or both message lists")
    if not prompt:
        raise BadRow("no prompt")
    if not c.strip() or not r.strip():
        raise BadRow("empty chosen or rejected response")
    return {"prompt": prompt, "chosen": c, "rejected": r}


REFERENCE_FIELDS = ("answer", "reference", "output", "completion", "response", "chosen")


def to_eval_item(value) -> dict:
    """An evaluation row -> {"prompt": [messages], "answer": str | None}: a prompt (string or messages) with an
    optional reference in one of REFERENCE_FIELDS, or a conversation in any chat format whose last assistant turn,
    if it ends with one, is the reference (an Alpaca row may leave out its output)."""
    if isinstance(value, dict) and "prompt" in value:
        p = value["prompt"]
        prompt = [{"role": "user", "content": p}] if isinstance(p, str) else _check_messages(p)
        answer = next((value[k] for k in REFERENCE_FIELDS if isinstance(value.get(k), str)), None)
    else:
        if isinstance(value, dict) and "instruction" in value and "output" not in value:
            value = {**value, "output": ""}  # a prompt without its reference
        messages = to_messages(value)["messages"]
        ends_answered = messages[-1]["role"] == "assistant"
        prompt, answer = (messages[:-1], messages[-1]["content"]) if ends_answered else (messages, None)
    if not prompt or prompt[-1]["role"] == "assistant" or not any(m["content"].strip() for m in prompt):
        raise BadRow("no prompt to answer")
    return {"prompt": prompt, "answer": answer if answer and answer.strip() else None}


FINAL_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)  # GSM8K's last line: #### 42


def final_answer(reference: str | None) -> str | None:
    """A reference's final answer: what follows GSM8K's `####` where it has one (its thousands' commas dropped,
    `1,000` -> `1000`), else the reference whole."""
    if reference is None:
        return None
    found = FINAL_ANSWER.search(reference)
    if found is None:
        return reference.strip() or None
    value = found.group(1).strip()
    return value.replace(",", "") if re.fullmatch(r"-?[\d,]+(\.\d+)?", value) else value


PROMPT_FIELDS = ("prompt", "question", "messages", "conversations", "instruction", "input", "problem")


def to_prompt_item(value) -> dict:
    """A row of data.prompts -> {"prompt": [messages], "answer": str | None, **its other columns}: a prompt
    (string or messages) with an optional reference (to_eval_item), a conversation whose final assistant turn is the
    reference, or a GSM8K-style {question, answer} whose answer ends in `#### 42` (the reference is then 42). The
    other columns go to the reward functions (`**row`)."""
    if isinstance(value, dict) and "question" in value and "prompt" not in value:
        reference = value.get("answer")
        if reference is not None and not isinstance(reference, (str, int, float)):
            raise BadRow(f"answer is {type(reference).__name__}, not text")
        item = to_eval_item({"prompt": value["question"], "answer": None if reference is None else str(reference)})
    else:
        if isinstance(value, dict) and isinstance(value.get("answer"), (int, float)):
            value = {**value, "answer": str(value["answer"])}
        item = to_eval_item(value)
    item["answer"] = final_answer(item["answer"])
    extra = {k: v for k, v in value.items() if k not in PROMPT_FIELDS and k not in REFERENCE_FIELDS} \
        if isinstance(value, dict) else {}
    return {**extra, **item}


@dataclass
class Normalised:
    items: list = field(default_factory=list)
    bad_rows: int = 0


def normalise(rows: Iterable[Row], adapt: Callable, on_bad_row: str, what: str, max_warnings: int = 5) -> Normalised:
    """Apply an adapter to every row; a bad row is skipped and counted, or fails, naming file:line."""
    out = Normalised()
    for row in rows:
        reason = row.error
        if reason is None:
            try:
                out.items.append(adapt(row.value))
                continue
            except BadRow as e:
                reason = str(e)
        if on_bad_row == "fail":
            raise DataError(f"{row.where}: bad {what} row: {reason} (data.on_bad_row=fail)")
        out.bad_rows += 1
        if out.bad_rows <= max_warnings:
            print(f"warning: {row.where}: skipped bad {what} row: {reason}", file=sys.stderr)
    if out.bad_rows > max_warnings:
        print(f"warning: skipped {out.bad_rows} bad {what} rows in all", file=sys.stderr)
    if not out.items:
        raise DataError(f"no usable {what} rows after filtering ({out.bad_rows} bad rows skipped)")
    return out
