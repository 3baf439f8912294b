import pytest
import torch

from gptforge.core.errors import DataError
from gptforge.data.chat import (IGNORE, ChosenRows, assistant_mask, collate, encode_conversations, encode_pairs,
                                left_pad, pack, positions)
from gptforge.data.tokenizer import save_hf, train_bpe

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    tok = train_bpe(["user assistant hello there yes no"] * 50, 300, 2, SPECIALS)
    save_hf(tok, d, SPECIALS)
    return AutoTokenizer.from_pretrained(d)


def test_assistant_only_labels_by_hand(tokenizer):
    conv = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]}
    (ids, labels), = encode_conversations(tokenizer, [conv], 64, True, "skip").examples
    text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n"
    assert ids == tokenizer(text)["input_ids"]
    answer = tokenizer("yes<|im_end|>\n")["input_ids"]
    head = len(tokenizer("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    assert labels == [IGNORE] * head + answer  # the whole assistant turn, its closing newline included
    (_, full), = encode_conversations(tokenizer, [conv], 64, False, "skip").examples
    assert full == ids


def test_collate_shifts_labels_into_targets():
    x, a, y = collate([([5, 6, 7], [IGNORE, 6, 7]), ([8, 9], [8, 9])], pad_id=0)
    assert x.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert a.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert y.tolist() == [[6, 7, IGNORE], [9, IGNORE, IGNORE]]


def test_skips_and_truncation_are_counted(tokenizer):
    convs = [{"messages": [{"role": "user", "content": "hello"}]},
             {"messages": [{"role": "user", "content": "hello " * 40}, {"role": "assistant", "content": "yes"}]}]
    skipped = encode_conversations(tokenizer, convs, 32, True, "skip")
    assert skipped.examples == [] and skipped.skipped == {"no_assistant_turn": 1, "too_long": 1}
    long_answer = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes " * 40}]}]
    cut = encode_conversations(tokenizer, long_answer, 32, True, "truncate")
    assert cut.truncated == 1 and len(cut.examples[0][0]) == 32
    pairs = [{"prompt": [{"role": "user", "content": "q"}], "chosen": "yes", "rejected": "yes "},
             {"prompt": [{"role": "user", "content": "q"}], "chosen": "yes", "rejected": "no"}]
    enc = encode_pairs(tokenizer, pairs, 64, "skip")
    assert enc.skipped == {"identical_responses": 1} and len(enc.examples) == 1


def test_pack_fills_sequences():
    ex = [([1] * 3, [1] * 3), ([2] * 4, [2] * 4), ([3] * 2, [3] * 2)]
    rows = pack(ex, 7)
    assert [len(x) for x, _, _ in rows] == [7, 2]
    assert rows[0][2] == [0, 1, 2, 0, 1, 2, 3]  # positions restart at each example
    assert rows[0][1] == [1, 1, IGNORE, 2, 2, 2, IGNORE]  # an example's last token predicts nothing of the next


def test_the_prefix_mask_equals_the_generation_markers_mask(tokenizer):
    """On a template with {% generation %} markers, the assistant tokens found from rendered prefixes are exactly
    the ones the markers give, over multi-turn conversations with a system prompt."""
    conv = [{"role": "system", "content": "no"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "yes there"}, {"role": "user", "content": "no"},
            {"role": "assistant", "content": "hello yes"}]
    enc = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = assistant_mask(tokenizer, conv)
    assert ids == list(enc["input_ids"]) and mask == list(enc["assistant_masks"]) and sum(mask) > 4


def test_a_tool_use_demonstration_trains_on_the_calls_and_the_answer_not_the_results(tokenizer):
    from gptforge.data.formats import to_messages

    schema = {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}}
    conv = to_messages({"tools": [schema], "messages": [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 2}}]},
        {"role": "tool", "name": "add", "content": "yes no"},
        {"role": "assistant", "content": "there"}]})
    (ids, labels), = encode_conversations(tokenizer, [conv], 4096, True, "skip").examples
    text = tokenizer.decode(ids)
    assert '"name": "add"' in text[:text.index("<|im_start|>user\nhello")]  # the schema, in the system turn
    trained = tokenizer.decode([t for t in labels if t != IGNORE])
    assert trained == ('<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>\n'
                       "there<|im_end|>\n")  # the call and the answer; the tool's result is context
    enc = tokenizer.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    assert ids == list(enc["input_ids"]) and [int(t != IGNORE) for t in labels] == list(enc["assistant_masks"])
    plain = tokenizer.chat_template
    try:  # a template without tools drops the calls: an error, not a demonstration trained without them
        tokenizer.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                                   "'<|im_end|>\\n' }}{%- endfor %}")
        with pytest.raises(DataError, match="the chat template does not render tool calls .the call of add"):
            encode_conversations(tokenizer, [conv], 4096, True, "skip")
    finally:
        tokenizer.chat_template = plain


def test_chosen_rows_train_on_the_chosen_response_only(tokenizer):
    pairs = [{"prompt": [{"role": "user", "content": "hello"}], "chosen": "yes", "rejected": "no"},
             {"prompt": [{"role": "user", "content": "hello there"}], "chosen": "no", "rejected": "yes"}]
    rows = ChosenRows(tokenizer, pairs, 64, micro_batch=1, rank=0, world=1, seed=0)
    (ids, labels), = encode_conversations(tokenizer, [{"messages": pairs[0]["prompt"] + [
        {"role": "assistant", "content": "yes"}]}], 64, True, "skip").examples
    assert (ids, labels) in rows.examples and len(rows.examples) == 2
    x, _, y = rows.batch(0)
    (ids0, labels0), = [rows.examples[i] for i in rows.order.ids_at(0)]
    assert x[0].tolist() == ids0 and y[0].tolist() == labels0[1:] + [IGNORE]  # targets: the chosen response
    with pytest.raises(DataError, match="preference.max_length=4"):
        ChosenRows(tokenizer, pairs, 4, micro_batch=1, rank=0, world=1, seed=0)


def test_left_pad_by_hand():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_positions_skip_left_padding():
    assert positions(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
