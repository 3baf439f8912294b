"""LoRA through gptforge.model.lora on models from elsewhere: a few real optimizer steps in this process, then
the export a stage writes (merged model/ and adapter/) checked against the PEFT model it came from."""

import pytest
import torch

from gptforge.core.config import LoraSection
from gptforge.core.errors import ConfigError
from gptforge.data.chat import IGNORE, model_batch, pack
from gptforge.model.lora import disabled, linear_names, targets, wrap
from gptforge.model.export import export_model
from gptforge.model.train.losses import causal_lm_loss
from gptforge.model.pretrained import fit_embeddings, prepare_tokenizer
from tests import hub_models

LORA = LoraSection(r=4, alpha=8.0)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: hub_models.save_model(f, root / f) for f in hub_models.FAMILIES}


def train(model, batches: list, steps: int = 4, lr: float = 5e-2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        for inputs, y in batches:
            loss = causal_lm_loss(model(**inputs).logits, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return model


def chat_batch(tokenizer, n: int = 4):
    from gptforge.data.chat import encode_conversations

    convs = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                           {"role": "assistant", "content": str(2 * i)}]} for i in range(n)]
    examples = encode_conversations(tokenizer, convs, 64, True, "skip").examples
    inputs, y, _ = model_batch(examples, tokenizer.pad_token_id)
    return inputs, y


@pytest.mark.parametrize("family", list(hub_models.FAMILIES))
def test_the_merged_export_and_the_adapter_give_the_peft_models_outputs(family, families, tmp_path):
    """For each family (Llama 3 untied, Qwen2 tied, a templateless base that gets ChatML's tokens): train LoRA, the
    rows of the added tokens included; model/ loads with no peft and gives the PEFT model's logits, adapter/ loads
    on the base with PeftModel, and the adapters disabled give the base's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(families[family])
    added = prepare_tokenizer(tokenizer)
    base = AutoModelForCausalLM.from_pretrained(families[family])
    new = fit_embeddings(base, tokenizer)
    assert new == tokenizer.convert_tokens_to_ids(added)  # Llama 3 takes a pad it has; the base needs ChatML's
    assert bool(new) == (family == "mistral")
    inputs, y = chat_batch(tokenizer)
    with torch.no_grad():
        base_logits = base(**inputs).logits
    model = train(wrap(base, LORA, "causal-lm", "sft.lora", new), [(inputs, y)])
    model.eval()
    with torch.no_grad():
        tuned = model(**inputs).logits
        with disabled(model):
            assert torch.allclose(model(**inputs).logits, base_logits, atol=1e-5)
    assert not torch.allclose(tuned, base_logits, atol=1e-3)
    if new:  # the new tokens' rows were trained: their embedding moved off the mean they started at
        start = base.get_input_embeddings().token_adapter.base_layer.weight[new]
        assert not torch.allclose(model.get_input_embeddings().weight[new], start)

    base_dir = tmp_path / "base"
    AutoModelForCausalLM.from_pretrained(families[family]).save_pretrained(base_dir)  # the base as given
    export_model(model, tokenizer, tmp_path / "model", rank=0, max_shard_size=10**9)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    reloaded_base = AutoModelForCausalLM.from_pretrained(base_dir)
    fit_embeddings(reloaded_base, tokenizer)
    adapter = PeftModel.from_pretrained(reloaded_base, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.allclose(merged(**inputs).logits, tuned, atol=1e-4)
        assert torch.allclose(adapter(**inputs).logits, tuned, atol=1e-4)


def test_lora_trains_through_activation_checkpointing(families):
    """With gradient checkpointing and a frozen base, the adapters still get gradients (reentrant checkpoints need
    the embeddings' output to require grad, which PEFT arranges when checkpointing is on before it wraps)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(families["qwen2"])
    model = AutoModelForCausalLM.from_pretrained(families["qwen2"])
    model.gradient_checkpointing_enable()
    model = wrap(model, LORA, "causal-lm", "sft.lora", checkpointing=True).train()
    inputs, y = chat_batch(tokenizer)
    causal_lm_loss(model(**inputs).logits, y).backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]  # A gets none while B is 0
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_a_reward_models_lora_trains_its_head_in_full(families):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(families["qwen2"], num_labels=1)
    model = wrap(model, LORA, "sequence-classifier", "reward.lora")
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("score" in n for n in trained) and any("lora_A" in n for n in trained)
    assert not any("embed_tokens" in n for n in trained)


def test_target_modules_that_match_nothing_list_the_linear_modules(families):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(families["llama3"])
    assert targets(model, LORA, "sft.lora") == linear_names(model) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    with pytest.raises(ConfigError, match=r"sft.lora.target_modules: c_attn match no module of the model; its linear "
                                          r"modules are down_proj, gate_proj, k_proj"):
        targets(model, LoraSection(r=4, target_modules=["q_proj", "c_attn"]), "sft.lora")


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gpt2"])
def test_a_packed_batch_gives_the_losses_of_its_conversations_alone(family, families):
    """Packed rows keep conversations apart (positions restart, no attention across): each token's loss is the one
    it has in its conversation alone, for rotary (Llama, Qwen2) and learned-position (GPT-2) models."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptforge.core.presets import PRESETS
    from gptforge.data.chat import encode_conversations
    from gptforge.model.build import build_model

    if family == "gpt2":
        tokenizer = AutoTokenizer.from_pretrained(families["qwen2"])
        torch.manual_seed(0)
        model = build_model(PRESETS["tiny"].with_overrides(n_layer=2), len(tokenizer)).eval()
    else:
        tokenizer = AutoTokenizer.from_pretrained(families[family])
        prepare_tokenizer(tokenizer)
        model = AutoModelForCausalLM.from_pretrained(families[family]).eval()
    convs = [{"messages": [{"role": "user", "content": "Repeat the word kite " + "twice." * (i % 3 + 1)},
                           {"role": "assistant", "content": "kite " * (i % 4 + 1)}]} for i in range(6)]
    examples = encode_conversations(tokenizer, convs, 96, False, "skip").examples
    packed = pack(examples, 2 * max(len(x) for x, _ in examples))
    assert len(packed) < len(examples)
    with torch.no_grad():
        inputs, y, _ = model_batch(packed, tokenizer.pad_token_id)
        logp = torch.log_softmax(model(**inputs).logits, -1)
        packed_losses = [-logp[r, t, y[r, t]].item() for r in range(y.shape[0]) for t in range(y.shape[1])
                         if y[r, t] != IGNORE]
        alone = []
        for ex in examples:
            inputs, y, _ = model_batch([ex], tokenizer.pad_token_id)
            logp = torch.log_softmax(model(**inputs).logits, -1)
            alone += [-logp[0, t, y[0, t]].item() for t in range(y.shape[1]) if y[0, t] != IGNORE]
    assert len(packed_losses) == len(alone)
    assert torch.allclose(torch.tensor(packed_losses), torch.tensor(alone), atol=1e-4)

