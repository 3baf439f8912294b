import pytest

from gptforge.data.tokenizer import save_hf, train_bpe
from gptforge.model.export import stop_token_ids

TEXTS = ["What is 2 plus 3? 5", "hello there"] * 20


@pytest.mark.parametrize("specials", [["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"],
                                      ["</s>", "<turn>", "</turn>"]])
def test_stop_tokens_come_from_the_tokenizer(tmp_path, specials):
    from transformers import AutoTokenizer

    save_hf(train_bpe(TEXTS, 300, 2, specials), tmp_path, specials)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert stop_token_ids(tok) == [tok.convert_tokens_to_ids(specials[2]), tok.convert_tokens_to_ids(specials[0])]
    tok.chat_template = None
    assert stop_token_ids(tok) == [tok.convert_tokens_to_ids(specials[0])]
