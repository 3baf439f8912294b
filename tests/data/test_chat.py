import pytest
import torch

from data.chat import ChosenRows, collate, encode_conversations, encode_pairs, pack, positions
from data.tokenizer import save_hf, train_bpe
from model.losses import IGNORE, pairwise_reward_loss

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    tok = train_bpe(["user assistant hello there yes no"] * 50, 300, 2, SPECIALS)
    save_hf(tok, d, SPECIALS, 128)
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
    assert [len(x) for x, _ in pack(ex, 7)] == [7, 2]


def test_pairwise_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    softplus = lambda v: torch.log1p(torch.exp(torch.tensor(v))).item()  # noqa: E731  -log sigmoid(x) = softplus(-x)
    assert pairwise_reward_loss(chosen, rejected).item() == pytest.approx((softplus(-2.0) + softplus(0.0)) / 2)
    # margin 1: -log sigmoid(2 - 1), -log sigmoid(0 - 1)
    assert pairwise_reward_loss(chosen, rejected, margin=1.0).item() == pytest.approx((softplus(-1.0) + softplus(1.0)) / 2)
    # centering: 0.5 * mean((2+0)^2, (0+0)^2) = 1
    with_center = pairwise_reward_loss(chosen, rejected, center_coefficient=0.5).item()
    assert with_center == pytest.approx((softplus(-2.0) + softplus(0.0)) / 2 + 1.0)


def test_chosen_rows_train_on_the_chosen_response_only(tokenizer):
    pairs = [{"prompt": [{"role": "user", "content": "hello"}], "chosen": "yes", "rejected": "no"},
             {"prompt": [{"role": "user", "content": "hello there"}], "chosen": "no", "rejected": "yes"}]
    rows = ChosenRows(tokenizer, pairs, 64, micro_batch=1, rank=0, world=1, seed=0)
    (ids, labels), = encode_conversations(tokenizer, [{"messages": pairs[0]["prompt"] + [
        {"role": "assistant", "content": "yes"}]}], 64, True, "skip").examples
    assert (ids, labels) in rows.examples and len(rows.examples) == 2
    with pytest.raises(Exception, match="preference.max_length=4"):
        ChosenRows(tokenizer, pairs, 4, micro_batch=1, rank=0, world=1, seed=0)


def test_positions_skip_left_padding():
    assert positions(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
