import pytest
import torch

from gptforge.core.errors import UserError
from gptforge.core.presets import PRESETS
from gptforge.data.tokenizer import save_hf, train_bpe
from gptforge.model.build import build_model, hf_config
from gptforge.model.evaluate import check_same_vocabulary, preference_report, verify, win_rate

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def test_the_verifier_accepts_the_known_answer_alone():
    assert verify(["52", " 52 ", "53", "", "52 52"], ["52"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_win_rate_counts_ties_half():
    assert win_rate(["a", "b", "c", "d"], ["a", "x", "y", "z"], [5.0, 1.0, 2.0, 3.0], [0.0, 1.0, 1.0, 4.0]) == \
        pytest.approx((0.5 + 0.5 + 1 + 0) / 4)  # same answer, same score, better, worse


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    save_hf(train_bpe([f"What is {i} plus {i}? {2 * i}" for i in range(50)] * 4, 300, 2, SPECIALS), d, SPECIALS)
    return AutoTokenizer.from_pretrained(d)


ARCH = PRESETS["tiny"].with_overrides(n_layer=1)


def policy(tokenizer, seed):
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    m = build_model(ARCH, len(tokenizer))
    m.generation_config = GenerationConfig(eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>")],
                                           pad_token_id=tokenizer.pad_token_id)
    return m.eval()


def judge(tokenizer, seed):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = hf_config(ARCH, len(tokenizer))
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    return AutoModelForSequenceClassification.from_config(config).eval()


def test_report_of_a_policy_against_itself_and_another(tokenizer):
    items = [{"prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}], "answer": str(2 * i)}
             for i in range(12)]
    sft, other, rm = policy(tokenizer, 0), policy(tokenizer, 1), judge(tokenizer, 2)
    same, answers = preference_report(sft, sft, rm, tokenizer, items, max_new_tokens=4)
    assert same["kl"] == pytest.approx(0.0, abs=1e-5) and same["win_rate_vs_sft"] == 0.5
    assert same["exact_match"] == same["sft_exact_match"] and len(answers) == len(items)
    with torch.no_grad():  # a policy far from the SFT model: KL(policy || SFT) on the policy's samples is large
        other.lm_head.weight.mul_(20.0)
    far, _ = preference_report(other, sft, rm, tokenizer, items, max_new_tokens=4)
    assert far["kl"] > 1.0


def test_a_reward_model_with_another_vocabulary_is_an_error(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    save_hf(train_bpe(["completely different text"] * 20, 280, 2, SPECIALS), tmp_path, SPECIALS)
    with pytest.raises(UserError, match="vocabularies differ"):
        check_same_vocabulary(tokenizer, AutoTokenizer.from_pretrained(tmp_path), "reward model")
    check_same_vocabulary(tokenizer, tokenizer, "the same")
