"""Chat-template encoding for SFT and preference data, and padded batches.

An encoded example is (input_ids, labels) of equal length; labels hold the token where the loss
applies and IGNORE elsewhere. `collate` shifts them into next-token targets.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from gptforge.core.errors import DataError
from gptforge.data.batches import DistributedOrder

IGNORE = -100  # the label of a token without loss (PyTorch's cross-entropy ignore_index)


def pad(rows: list[torch.Tensor], value: int, side: str = "right") -> torch.Tensor:
    """1-D tensors of any lengths as one (B, T_max) tensor, filled with `value` on the `side` each row ends short."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value, padding_side=side)


@dataclass
class Encoded:
    examples: list[tuple[list[int], list[int]]] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    truncated: int = 0


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
           tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages: list[dict],
                    tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as its chat template renders it, and the character span of each assistant turn: from the
    end of the conversation before it rendered with the generation prompt (the assistant header) to where the
    conversation rendered through that turn stops agreeing with the whole. Exact for every template that renders
    a conversation's earlier turns as it renders them alone (a default system prompt, Llama 3's headers, ChatML,
    Mistral's [INST] ...), generation markers or not; a template that does not is a DataError naming the turn.
    A tool-use demonstration (`tools`, the assistant turns' tool_calls, tool turns) is rendered with its tools; its
    calls are part of the assistant turns trained on, its tool results are not; a template that drops the calls is
    a DataError."""
    text = render(tokenizer, messages, tools=tools)
    dropped = [c["function"]["name"] for m in messages for c in m.get("tool_calls") or []
               if c["function"]["name"] not in text]
    if dropped:
        raise DataError(f"the chat template does not render tool calls (the call of {dropped[0]} is missing from the "
                        "rendered conversation): give a model whose template does, or sft.chat_template")
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        if not text.startswith(head):
            raise DataError(f"the chat template renders the conversation before assistant turn {i} differently on its "
                            "own than inside the whole conversation, so its assistant tokens cannot be found; "
                            f"conversation starts {text[:80]!r}")
        through = render(tokenizer, messages[:i + 1], tools=tools)
        end = next((k for k, (a, b) in enumerate(zip(through, text)) if a != b), min(len(through), len(text)))
        spans.append((len(head), end))
    return text, spans


def assistant_mask(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, mask): the conversation's tokens, as apply_chat_template tokenizes it, and 1 on every token of an
    assistant turn (its content, its tool calls and the template's end of turn), 0 elsewhere."""
    text, spans = assistant_spans(tokenizer, messages, tools)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < b and e > a for a, b in spans)) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def encode_conversations(tokenizer, conversations: list[dict], max_length: int, assistant_only: bool,
                         on_too_long: str) -> Encoded:
    """Chat-template each conversation; labels on assistant tokens only (or on all tokens).
    Conversations without an assistant turn are skipped; longer ones skipped or truncated."""
    out = Encoded()
    for conv in conversations:
        messages = conv["messages"]
        if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
            out.skipped["no_assistant_turn"] += 1
            continue
        ids, mask = assistant_mask(tokenizer, messages, conv.get("tools"))
        if len(ids) > max_length:
            if on_too_long == "skip" or not any(mask[:max_length]):
                out.skipped["too_long"] += 1
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            out.truncated += 1
        labels = [t if (m or not assistant_only) else IGNORE for t, m in zip(ids, mask)]
        out.examples.append((ids, labels))
    return out


def pack(examples: list[tuple[list[int], list[int]]], max_length: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Consecutive examples concatenated into rows of at most max_length tokens: (input_ids, targets, position_ids),
    each example's targets shifted within it (its last token predicts nothing of the next) and its positions
    starting at 0, so that a packed row trains as its examples would one by one."""
    packed, row = [], ([], [], [])
    for x, y in examples:
        if row[0] and len(row[0]) + len(x) > max_length:
            packed.append(row)
            row = ([], [], [])
        row[0].extend(x)
        row[1].extend(y[1:] + [IGNORE])
        row[2].extend(range(len(x)))
    if row[0]:
        packed.append(row)
    return packed


def model_batch(examples: list[tuple], pad_id: int) -> tuple[dict, torch.Tensor, int]:
    """A training batch as the model takes it: (inputs, targets (B, T), tokens that are not padding). Plain rows
    (input_ids, labels) are right-padded with an attention mask. Packed rows (`pack`) carry position ids that
    restart at each example and no attention mask, the padding a segment of its own: transformers keeps the
    segments apart from the position ids (varlen with FlashAttention, a block mask otherwise), which it does only
    with no mask and no KV cache."""
    if len(examples[0]) == 2:
        x, a, y = collate(examples, pad_id)
        return {"input_ids": x, "attention_mask": a}, y, int(a.sum())
    ids = [torch.tensor(x) for x, _, _ in examples]
    x = pad(ids, pad_id)
    tail = x.shape[1] - torch.tensor([len(r) for r in ids])  # each row's padding restarts at position 0
    positions = pad([torch.cat([torch.tensor(p), torch.arange(int(t))]) for (_, _, p), t in zip(examples, tail)], 0)
    y = pad([torch.tensor(t) for _, t, _ in examples], IGNORE)
    return {"input_ids": x, "position_ids": positions, "use_cache": False}, y, sum(len(r) for r in ids)


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded batch: input_ids (B, T), attention_mask (B, T), targets (B, T) = labels shifted left."""
    ids = [torch.tensor(x) for x, _ in examples]
    return (pad(ids, pad_id), pad([torch.ones_like(x) for x in ids], 0),
            pad([torch.tensor(y[1:] + [IGNORE]) for _, y in examples], IGNORE))


def encode_pairs(tokenizer, pairs: list[dict], max_length: int, on_too_long: str) -> Encoded:
    """Each pair as (chosen ids, rejected ids): the prompt plus the response as an assistant turn.
    Pairs whose responses are identical are skipped; longer ones skipped or truncated."""
    out = Encoded()
    for p in pairs:
        if p["chosen"].strip() == p["rejected"].strip():
            out.skipped["identical_responses"] += 1
            continue
        seqs = [tokenizer.apply_chat_template(p["prompt"] + [{"role": "assistant", "content": r}], tokenize=True,
                                              return_dict=True)["input_ids"] for r in (p["chosen"], p["rejected"])]
        if max(len(s) for s in seqs) > max_length:
            if on_too_long == "skip":
                out.skipped["too_long"] += 1
                continue
            seqs = [s[:max_length] for s in seqs]
            out.truncated += 1
        out.examples.append((list(seqs[0]), list(seqs[1])))
    return out


def prompt_ids(tokenizer, prompt: list[dict]) -> list[int]:
    """The prompt in the chat template, ending with the assistant header (generation prompt)."""
    return list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded batch for generation: input_ids (B, T) and attention_mask (B, T)."""
    ids = [torch.tensor(r, dtype=torch.long) for r in rows]
    return pad(ids, pad_id, "left"), pad([torch.ones_like(x) for x in ids], 0, "left")


def positions(attention: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding, as generation uses them: a model with learned absolute
    positions (GPT-2) otherwise reads a left-padded row at positions shifted by its padding."""
    return (attention.long().cumsum(-1) - 1).clamp(min=0)


class ChosenRows:
    """The preference pairs' prompts with their chosen responses, labels on the response: the supervised (ptx)
    rows of the online preference stages. The rows of update `u` on a rank are DistributedOrder's micro-step
    `u`, so a resumed run draws what an uninterrupted one would have."""

    def __init__(self, tokenizer, pairs: list[dict], max_length: int, micro_batch: int, rank: int, world: int,
                 seed: int):
        conversations = [{"messages": p["prompt"] + [{"role": "assistant", "content": p["chosen"]}]} for p in pairs]
        self.examples = encode_conversations(tokenizer, conversations, max_length, True, "skip").examples
        if len(self.examples) < micro_batch * world:
            raise DataError(f"{len(self.examples)} preference pairs fit preference.max_length={max_length}, fewer "
                            f"than the {micro_batch}x{world} rows of one micro-batch of the ptx loss")
        self.order = DistributedOrder(len(self.examples), micro_batch, rank, world, seed)
        self.pad_id = tokenizer.pad_token_id

    def batch(self, update: int):
        """This rank's rows of update `update`, collated: input_ids, attention_mask, targets, (B, T) each."""
        return collate([self.examples[i] for i in self.order.ids_at(update)], self.pad_id)
