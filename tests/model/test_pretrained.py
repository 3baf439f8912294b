"""Models from elsewhere: hub names resolved offline through a hub cache laid out in tmp_path, fingerprints, the
checks before anything runs, tokenizers made ready for chat, and the model's own stop tokens."""

import json
import shutil

import pytest
import torch

from gptforge.core.errors import ConfigError, UserError
from gptforge.data.chat import assistant_mask
from gptforge.model import pretrained
from gptforge.model.pretrained import check_model, fingerprint, model_dir, prepare_tokenizer
from tests import hub_models


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return hub_models.save_model("llama3", tmp_path_factory.mktemp("llama3") / "m")


@pytest.fixture
def hub(tmp_path, monkeypatch, llama3):
    cache = tmp_path / "hub"
    hub_models.use_cache(monkeypatch, cache)
    monkeypatch.setattr(pretrained, "offline", lambda: True)
    hub_models.hub_cache(cache, "org/llama3-tiny", llama3)
    return cache


def test_a_hub_name_resolves_to_the_commit_main_points_at(hub, llama3):
    a = "a" * 40
    assert model_dir("org/llama3-tiny") == hub / "models--org--llama3-tiny" / "snapshots" / a
    assert fingerprint("org/llama3-tiny", None) == f"hub:org/llama3-tiny@{a}"
    b = "b" * 40  # a new upload: main moves, the fingerprint with it; a pinned revision stays
    hub_models.hub_cache(hub, "org/llama3-tiny", llama3, commit=b)
    assert fingerprint("org/llama3-tiny", None) == f"hub:org/llama3-tiny@{b}"
    assert fingerprint("org/llama3-tiny", a) == f"hub:org/llama3-tiny@{a}"


def test_a_local_directory_is_fingerprinted_by_its_content(tmp_path, llama3):
    d = tmp_path / "copy"
    shutil.copytree(llama3, d)
    before = fingerprint(str(d), None, tmp_path / "digests")
    assert before == fingerprint(str(d), None, tmp_path / "digests")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert fingerprint(str(d), None, tmp_path / "digests") != before


def test_models_that_cannot_be_used_are_one_error_naming_the_key(hub, tmp_path, llama3):
    with pytest.raises(UserError, match=r"model.pretrained='org/missing': revision main is not in the hub cache "
                                        rf"{hub} and HF_HUB_OFFLINE is set \(no copy of this model at all\)"):
        check_model("org/missing", None, False, "model.pretrained")
    with pytest.raises(UserError, match=r"revision v9 is not in the hub cache .* cached refs: main"):
        check_model("org/llama3-tiny", "v9", False, "model.pretrained")
    empty = tmp_path / "empty"
    shutil.copytree(llama3, empty, ignore=shutil.ignore_patterns("*.safetensors*"))
    with pytest.raises(UserError, match=r"holds no model weights"):
        check_model(str(empty), None, False, "model.pretrained")
    with pytest.raises(UserError, match=r"model.pretrained='/nowhere': no such directory"):
        check_model("/nowhere", None, False, "model.pretrained")
    remote = tmp_path / "remote"
    shutil.copytree(llama3, remote)
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "model_type": "mything", "auto_map": {"x": "y"}}))
    with pytest.raises(ConfigError, match=r"needs its own modelling code .* set model.trust_remote_code=true"):
        check_model(str(remote), None, False, "model.pretrained")
    with pytest.raises(UserError, match=r"preference.reward_model=.* is not a sequence classifier \(architectures: "
                                        r"\['LlamaForCausalLM'\]\)"):
        check_model(str(llama3), None, False, "preference.reward_model", kind="sequence-classifier")
    assert check_model("org/llama3-tiny", None, False, "model.pretrained").name == "a" * 40


@pytest.mark.parametrize("family", list(hub_models.FAMILIES))
def test_the_assistant_mask_covers_exactly_the_assistant_turns(family, tmp_path):
    """Templates without generation markers (Llama 3's headers, Qwen2's default system prompt, ChatML added to a
    base model): the masked tokens are each assistant turn's content and its end of turn, nothing else, over a
    multi-turn conversation; the ids are apply_chat_template's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hub_models.save_model(family, tmp_path / family))
    prepare_tokenizer(tokenizer)
    assert not pretrained.has_generation_markers(tokenizer.chat_template)
    conv = [{"role": "user", "content": "What is 3 plus 5?"}, {"role": "assistant", "content": "8"},
            {"role": "user", "content": "Repeat the word kite twice."}, {"role": "assistant", "content": "kite kite"}]
    ids, mask = assistant_mask(tokenizer, conv)
    assert ids == list(tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"])
    end = {"llama3": "<|eot_id|>", "qwen2": "<|im_end|>\n", "mistral": "<|im_end|>\n"}[family]
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == f"8{end}kite kite{end}"


def test_a_tokenizer_gets_a_template_and_a_pad_that_no_conversation_holds(tmp_path):
    from transformers import AutoTokenizer

    llama = AutoTokenizer.from_pretrained(hub_models.save_model("llama3", tmp_path / "l"))
    assert prepare_tokenizer(llama) == [] and llama.pad_token == "<|end_of_text|>"  # unused in chats: no growth
    base = AutoTokenizer.from_pretrained(hub_models.save_model("mistral", tmp_path / "m"))
    assert prepare_tokenizer(base) == ["<|im_start|>", "<|im_end|>"] and base.pad_token == "<unk>"
    rendered = base.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_grown_embeddings_start_around_the_mean_of_the_old_rows(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = hub_models.save_model("mistral", tmp_path / "m")
    tokenizer, model = AutoTokenizer.from_pretrained(d), AutoModelForCausalLM.from_pretrained(d)
    old = model.get_input_embeddings().weight.detach().clone()
    prepare_tokenizer(tokenizer)
    assert pretrained.fit_embeddings(model, tokenizer) == [old.shape[0], old.shape[0] + 1]
    assert pretrained.fit_embeddings(model, tokenizer) == []
    rows = model.get_input_embeddings().weight.detach()
    assert rows.shape[0] == len(tokenizer) == old.shape[0] + 2 and torch.equal(rows[:old.shape[0]], old)
    assert torch.allclose(rows[old.shape[0]:], old.mean(0).expand(2, -1), atol=0.05)  # the mean, with its spread


def test_generation_stops_at_the_models_own_stop_tokens(tmp_path):
    """Llama 3 stops at end of text as well as at the end of turn its template closes with: an exported model keeps
    both in its generation_config, and generation ends at the one the template does not show."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptforge.model.sampling.generate import generate_ids
    from gptforge.model.export import export_model

    d = hub_models.save_model("llama3", tmp_path / "l")
    tokenizer, model = AutoTokenizer.from_pretrained(d), AutoModelForCausalLM.from_pretrained(d)
    prepare_tokenizer(tokenizer)
    end_of_text = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    with torch.no_grad():  # a model that always says end of text
        model.lm_head.weight.zero_()
        model.lm_head.weight[end_of_text] = 1.0
    export_model(model, tokenizer, tmp_path / "out", rank=0, max_shard_size=10**9)
    stops = json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"]
    assert sorted(stops) == sorted(tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"]))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    out, attention, _ = generate_ids(exported, tokenizer, [[{"role": "user", "content": "hi"}]], max_new_tokens=5,
                                     do_sample=False)
    assert out.shape[1] == attention.shape[1] + 1 and out[0, -1] == end_of_text
