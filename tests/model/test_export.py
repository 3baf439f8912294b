import json

import pytest
import torch

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


def test_shard_plan_keeps_order_and_size():
    from gptforge.model.export import shard_plan

    sizes = [("a", 6), ("b", 6), ("c", 2), ("d", 12), ("e", 2), ("f", 2)]
    assert shard_plan(sizes, 10) == [["a"], ["b", "c"], ["d"], ["e", "f"]]  # d alone: larger than a shard
    assert shard_plan(sizes, 100) == [["a", "b", "c", "d", "e", "f"]]


@pytest.mark.parametrize("preset", ["tiny", "moe-tiny"])
def test_export_in_small_shards_loads_the_same_model(tmp_path, preset):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptforge.core.presets import PRESETS
    from gptforge.model.build import build_model
    from gptforge.model.export import export_model, hf_tensor

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    save_hf(train_bpe(TEXTS, 300, 2, specials), tmp_path / "tok", specials)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    model = build_model(PRESETS[preset], len(tokenizer))
    export_model(model, tokenizer, tmp_path / "out", rank=0, max_shard_size=200_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert "lm_head.weight" not in index["weight_map"] or preset != "tiny"  # a tied weight is stored once
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded) is type(model)
    want = model.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want[k]), k
    name = next(iter(index["weight_map"]))
    assert torch.equal(hf_tensor(tmp_path / "out", name), want[name])
    assert AutoTokenizer.from_pretrained(tmp_path / "out").get_vocab() == tokenizer.get_vocab()
