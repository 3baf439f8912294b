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
    # the dense half of the layers attend over 2048 tokens, the banded half over their 256-token band
    assert flops_per_token(n, a, 2048) == 6 * n + 12 * 12288 * (48 * 2048 + 48 * 256)


def test_tied_embeddings_are_counted_once():
    model = build_model(PRESETS["tiny"], 320)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.num_parameters() == sum(p.numel() for n, p in model.named_parameters())
    assert model.num_parameters() < sum(p.numel() for p in model.state_dict().values())


def test_moe_preset_routes_each_token_to_top_k_experts_with_a_load_balancing_loss():
    from gptforge.model.build import parameter_counts
    from gptforge.model.train.losses import router_loss

    arch = PRESETS["moe-tiny"]
    torch.manual_seed(0)
    model = build_model(arch, 320)
    assert type(model).__name__ == "MixtralForCausalLM" and model.config.num_experts_per_tok == 2
    out = model(input_ids=torch.randint(0, 320, (2, 8)), attention_mask=torch.ones(2, 8, dtype=torch.long))
    assert out.aux_loss is not None and out.aux_loss.item() > 0  # the routers' load-balancing loss
    # It is weighed by the config's coefficient, and its gradient reaches the routers.
    aux = router_loss(out, model.config)
    assert aux.item() == pytest.approx(model.config.router_aux_loss_coef * out.aux_loss.item())
    aux.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    total, active = parameter_counts(model)
    per_layer_experts = 4 * 3 * 128 * 176  # n_experts * (gate, up, down) * n_embd * intermediate_size
    assert total - active == arch.n_layer * per_layer_experts * (4 - 2) // 4  # 2 of 4 experts idle per token
    assert router_loss(build_model(PRESETS["tiny"], 320)(input_ids=torch.ones(1, 4, dtype=torch.long)), None) is None


def test_a_model_built_partitioned_under_zero3_has_the_weights_of_one_built_whole(tmp_path):
    """ZeRO-3 builds the model a module at a time (deepspeed.zero.Init) yet draws the same random numbers in the
    same order: the same initial weights, so a from-scratch run does not depend on the ZeRO stage."""
    import subprocess
    import sys

    script = """
import os
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="FREE_PORT", RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
import torch
from gptforge.model.train.distributed import import_deepspeed
deepspeed = import_deepspeed()
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as setup_distributed: no JIT build of its op
deepspeed.init_distributed("gloo")
from gptforge.core.presets import PRESETS
from gptforge.model.build import build_model
from gptforge.model.train.engine import param_groups
for name in ("moe-tiny",):  # (a tied GPT-2: tests/stages/test_pretrain.py, ZeRO-3's curve that of ZeRO-2)
    torch.manual_seed(0)
    whole = build_model(PRESETS[name], 320).state_dict()
    torch.manual_seed(0)
    parts = build_model(PRESETS[name], 320, zero3={"train_micro_batch_size_per_gpu": 1,
                                                   "zero_optimization": {"stage": 3}})
    for key, p in parts.named_parameters():
        assert p.ds_numel > 0 and p.numel() == 0, key  # partitioned (one process: its partition is elsewhere)
        with deepspeed.zero.GatheredParameters([p]):
            assert torch.equal(p.data, whole[key]), (name, key)
    decay = {id(p) for p in param_groups(parts, 0.1)[0]["params"]}  # matrices decay, though their tensors are empty
    assert {k for k, p in parts.named_parameters() if id(p) in decay} == \
        {k for k, _ in parts.named_parameters() if whole[k].dim() >= 2}, name
torch.distributed.destroy_process_group()  # gloo's threads would outlive the interpreter (an abort at exit)
print("same")
"""
    from tests.helpers import free_port

    script = script.replace("FREE_PORT", str(free_port()))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and "same" in proc.stdout, proc.stderr[-3000:]
