import math

import pytest
import torch

from model.build import build_model, count_params, flops_per_token
from model.losses import IGNORE, causal_lm_loss
from model.presets import PRESETS

# Brown et al. 2020, Table 2.1: n_params
GPT3 = {"gpt3-small": 125e6, "gpt3-medium": 350e6, "gpt3-large": 760e6, "gpt3-xl": 1.3e9, "gpt3-2.7b": 2.7e9,
        "gpt3-6.7b": 6.7e9, "gpt3-13b": 13.0e9, "gpt3-175b": 175.0e9}


@pytest.mark.parametrize("name", GPT3)
def test_gpt3_presets_match_the_paper(name):
    arch = PRESETS[name]
    with torch.device("meta"):
        model = build_model(arch, arch.vocab_size)
    assert abs(count_params(model) - GPT3[name]) / GPT3[name] < 0.02
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


def test_causal_lm_loss_by_hand():
    # logits favour token 0 with log-odds ln(3) over token 1; targets 0 and 1, third ignored
    logits = torch.tensor([[[math.log(3.0), 0.0], [math.log(3.0), 0.0], [5.0, 0.0]]])
    targets = torch.tensor([[0, 1, IGNORE]])
    want = (-math.log(3 / 4) - math.log(1 / 4)) / 2
    assert causal_lm_loss(logits, targets).item() == pytest.approx(want, rel=1e-6)
