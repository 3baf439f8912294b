"""Attention kernels, windows and document masks, on models built here (presets, and a pretrained Qwen2-style one
saved in tmp_path)."""

import importlib.util

import pytest
import torch

from gptforge.core.config import load_config
from gptforge.core.errors import ConfigError
from gptforge.data.batches import document_positions
from gptforge.model.build import build_model
from gptforge.model.train.losses import causal_lm_loss
from gptforge.model.pretrained import load_causal_lm
from gptforge.stages.pretrain import model_inputs
from tests import hub_models


def preset_model(preset: str, attention: str, *overrides):
    cfg = load_config(None, [f"model.preset={preset}", f"model.attention={attention}", *overrides])
    torch.manual_seed(0)
    return build_model(cfg.model.arch(), 512, model_cfg=cfg.model).eval()


def left_padded(vocab: int, pad: int):
    """Two rows, the second left-padded by 5: ids, mask, position ids (from the mask, as generate makes them)."""
    torch.manual_seed(1)
    ids = torch.randint(5, vocab, (2, 24))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = pad, 0
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return hub_models.save_model("qwen2", tmp_path_factory.mktemp("qwen2") / "model")


@pytest.mark.parametrize("source", ["tiny", "llama-tiny", "moe-tiny", "qwen2"])
def test_eager_and_sdpa_give_the_same_logits_and_loss(source, qwen2):
    def load(attention):
        if source == "qwen2":
            cfg = load_config(None, [f"model.pretrained={qwen2}", "pretrain.enabled=false",
                                     f"model.attention={attention}"])
            return load_causal_lm(qwen2, cfg.model, bf16=False).eval()
        return preset_model(source, attention)

    eager, sdpa = load("eager"), load("sdpa")
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    vocab = eager.config.vocab_size
    ids, mask, pos = left_padded(vocab, pad=0)
    with torch.no_grad():
        a = eager(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        b = sdpa(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=2e-5, rtol=1e-4)
    targets = ids.roll(-1, 1).masked_fill(~(real & real.roll(-1, 1)), -100)
    targets[:, -1] = -100
    torch.testing.assert_close(causal_lm_loss(a, targets), causal_lm_loss(b, targets), atol=1e-5, rtol=1e-5)
    # The padded row's real tokens see what they see unpadded.
    with torch.no_grad():
        alone = sdpa(input_ids=ids[1:, 5:]).logits[0]
    torch.testing.assert_close(b[1, 5:], alone, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_banded_layer_does_not_see_past_its_window_and_a_dense_one_does(attention):
    window, t = 6, 20
    model = preset_model("tiny", attention, "model.attention_pattern=alternating", f"model.local_window={window}")
    assert model.config.attention_pattern == "alternating"
    dense, banded = model.transformer.h[0].attn, model.transformer.h[1].attn
    torch.manual_seed(2)
    h = torch.randn(1, t + 1, model.config.n_embd)
    far = h.clone()
    far[:, : t - window + 1] += torch.randn_like(far[:, : t - window + 1])  # every token beyond the band of t
    near = h.clone()
    near[:, t - window + 1] += 1.0  # the oldest token inside the band
    with torch.no_grad():
        out = {name: [layer(x)[0][0, t] for x in (h, far, near)] for name, layer in (("dense", dense),
                                                                                   ("banded", banded))}
    torch.testing.assert_close(out["banded"][0], out["banded"][1])  # beyond the window: unchanged
    assert not torch.allclose(out["banded"][0], out["banded"][2])  # inside it: changed
    assert not torch.allclose(out["dense"][0], out["dense"][1])  # a dense layer sees everything


def test_a_sliding_window_on_a_llama_preset_is_mistral_and_on_a_pretrained_llama_is_banded(tmp_path):
    model = preset_model("llama-tiny", "sdpa", "model.sliding_window=8")
    assert type(model).__name__ == "MistralForCausalLM" and model.config.sliding_window == 8
    path = hub_models.save_model("llama3", tmp_path / "llama")
    cfg = load_config(None, [f"model.pretrained={path}", "pretrain.enabled=false", "model.sliding_window=4"])
    llama = load_causal_lm(path, cfg.model, bf16=False).eval()
    assert llama.config._attn_implementation == "gptforge_banded_sdpa" and llama.config.local_window == 4
    # One layer's reach is the window: with 2 layers, token t sees t-6..t; what lies before does not matter.
    ids = torch.randint(10, 300, (1, 16))
    other = ids.clone()
    other[0, :9] = torch.randint(10, 300, (9,))
    with torch.no_grad():
        a, b = llama(input_ids=ids).logits[0, -1], llama(input_ids=other).logits[0, -1]
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_a_window_of_two_documents_gives_the_second_its_logits_alone(preset):
    model = preset_model(preset, "sdpa")
    cfg = load_config(None, [f"model.preset={preset}", "pretrain.document_mask=true"])
    eos = 3
    first, second = torch.randint(10, 500, (1, 9)), torch.randint(10, 500, (1, 14))
    window = torch.cat([first, torch.tensor([[eos]]), second], 1)
    assert document_positions(window, eos)[0].tolist() == list(range(10)) + list(range(14))
    with torch.no_grad():
        packed = model(**model_inputs(window, window, cfg.pretrain, eos, "cpu")[0]).logits[0, 10:]
        alone = model(input_ids=second).logits[0]
        mixed = model(input_ids=window).logits[0, 10:]  # without the mask: the first document is seen
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(mixed, alone, atol=1e-3)


@pytest.mark.parametrize("overrides, says", [
    (["model.attention=flash_attn"], "model.attention"),
    (["model.rope={type: ntk, factor: 2}"], "model.rope.type"),
    (["model.preset=llama-tiny", "model.rope={type: llama3, factor: 8}"],
     "needs original_max_position_embeddings, low_freq_factor, high_freq_factor"),
    (["model.rope={type: yarn, factor: 2}"], "model.rope: a gpt2 model has no rotary"),
    (["model.preset=llama-tiny", "model.sliding_window=4096"], "model.sliding_window=4096 is larger than the context"),
    (["model.attention_pattern=alternating", "model.local_window=1000"], "model.local_window=1000 is larger"),
    (["model.attention_pattern=alternating"], "needs model.local_window"),
    (["model.sliding_window=16"], "model.sliding_window is for Llama- and Mistral-style"),
])
def test_bad_attention_settings_are_one_error_naming_the_key(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.gpu
def test_flash_attention_without_a_gpu_is_an_error_naming_the_key():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="model.attention=flash_attention_2 needs a GPU"):
        preset_model("llama-tiny", "flash_attention_2")


def test_alternating_on_a_family_that_cannot_take_it_is_an_error(tmp_path):
    from gptforge.core.attention_rules import check

    cfg = load_config(None, ["model.attention_pattern=alternating", "model.local_window=8"])
    with pytest.raises(ConfigError, match="a falcon model's attention cannot take banded layers"):
        check("falcon", 128, cfg.model)


def test_greedy_answers_with_an_fp8_kv_cache_agree_with_the_full_cache_on_most_items():
    from gptforge.model.sampling.generate import kv_cache

    model = preset_model("llama-tiny", "sdpa")
    torch.manual_seed(3)
    prompts = torch.randint(5, 512, (32, 12))
    with torch.no_grad():
        full = model.generate(prompts, max_new_tokens=16, do_sample=False)[:, 12:]
        fp8 = model.generate(prompts, max_new_tokens=16, do_sample=False, **kv_cache("fp8"))[:, 12:]
    same = (full == fp8).all(1).float().mean().item()
    print(f"fp8 KV cache: {same:.0%} of 32 greedy 16-token answers equal the full cache's")
    # 24 of 32 (75%) here: whole 16-token answers of a random-weight model, whose nearly tied logits are the
    # hardest case for a quantized cache (one flipped argmax changes the rest of an answer).
    assert same >= 0.6, same
    assert not kv_cache("full")
    if not importlib.util.find_spec("optimum"):
        with pytest.raises(ConfigError, match="eval.kv_cache=quanto-int4 needs optimum-quanto"):
            kv_cache("quanto-int4")
