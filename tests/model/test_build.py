import pytest
import torch

from gptforge.core.presets import PRESETS
from gptforge.model.build import build_model, flops_per_token

# Brown et al. 2020, Table 2.1: n_params
GPT3 = {"gpt3-small": 125e6, "gpt3-medium": 350e6, "gpt3-large": 760e6, "gpt3-xl": 1.3e9, "gpt3-2.7b": 2.7e9,
        "gpt3-6.7b": 6.7e9, "gpt3-13b": 13.0e9, "gpt3-175b": 175.0e9}


@pytest.mark.parametrize("name", GPT3)
def test_gpt3_presets_match_the_paper(name):
    arch = PRESETS[name]
    with torch.device("meta"):
        model = build_model(arch, arch.vocab_size)
    assert abs(model.num_parameters() - GPT3[name]) / GPT3[name] < 0.02
    assert arch.n_positions == 2048


def test_gpt3_175b_shape():
    a = PRESETS["gpt3-175b"]
    assert (a.n_layer, a.n_embd, a.n_head, a.n_embd // a.n_head) == (96, 12288, 96, 128)


def test_llama_preset_builds_rope_rmsnorm_swiglu_gqa():
    arch = PRESETS["llama-tiny"]
    model = build_model(arch, 320)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads == 2 and model.config.hidden_act == "silu"
    assert model.config._attn_implementation == "sdpa"
    out = model(input_ids=torch.randint(0, 320, (2, 8)))
    assert out.logits.shape == (2, 8, 320)


def test_flops_per_token_by_hand():
    a = PRESETS["gpt3-175b"]
    n = 175e9
    assert flops_per_token(n, a, 2048) == 6 * n + 12 * 96 * 12288 * 2048


def test_tied_embeddings_are_counted_once():
    model = build_model(PRESETS["tiny"], 320)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.num_parameters() == sum(p.numel() for n, p in model.named_parameters())
    assert model.num_parameters() < sum(p.numel() for p in model.state_dict().values())
