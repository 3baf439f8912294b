"""The pipeline on models gptforge did not build (tests/hub_models.py), real 2-process DeepSpeed runs:

- a Llama 3-style model by hub name (a hub cache in tmp_path, offline) with LoRA under ZeRO-3: SFT, a LoRA reward
  model, then DPO, PPO and GRPO, each reference the policy with its adapters disabled;
- a Qwen2-style local directory under ZeRO-2: continued pretraining (its tokenizer makes the shards), packed LoRA
  SFT whose checkpoints hold the adapters alone, killed and resumed to the uninterrupted run's result;
- the demo's own pretrained model given back as `model.pretrained` with a new chat format and new special tokens:
  LoRA SFT keeps what it learned in pretraining and reaches held-out exact match well above the base.
"""

import json
import re
import shutil

import pytest
import torch

from gptforge.model.train.checkpoints import no_pickled_code
from gptforge.model.eval.generation import win_rate
from gptforge.model.train.metrics import MEASURED
from tests import hub_models
from tests.helpers import config, kill_after_checkpoint, logged, run_stage, tokenize_in_process

pytestmark = pytest.mark.slow
LORA = ["sft.lora.r=8", "sft.lr=3e-3", "reward.lora.r=8", "reward.lr=3e-3", "preference.lora.r=8",
        "reward.policy_samples=0"]


def outputs_agree(out_dir, family_dir, model_cls, **kwargs):
    """model/ (merged, loaded with no peft) gives the logits of adapter/ loaded on the base with PeftModel."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir / "model")
    ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 plus 5?"},
                                                       {"role": "assistant", "content": "8"}], tokenize=True,
                                                      return_dict=True)["input_ids"]])
    merged = model_cls.from_pretrained(out_dir / "model").eval()
    base = model_cls.from_pretrained(family_dir, **kwargs)
    base.resize_token_embeddings(len(tokenizer))
    adapter = PeftModel.from_pretrained(base, out_dir / "adapter").eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapter(input_ids=ids).logits, atol=1e-4)


@pytest.fixture(scope="module")
def llama3_hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3")
    src = hub_models.save_model("llama3", root / "src")
    hub_models.hub_cache(root / "hub", "org/llama3-tiny", src)
    return root, src


def test_lora_from_a_hub_model_under_zero3_through_every_stage(llama3_hub, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root, src = llama3_hub
    hub_models.use_cache(monkeypatch, root / "hub")
    cfg, path = config(root / "runs", "model.pretrained=org/llama3-tiny", "pretrain.enabled=false",
                       "distributed.zero_stage=3", "preference.algorithm=[dpo,ppo,grpo]", "preference.max_steps=6",
                       "preference.save_every=3", *LORA)
    sft, sft_dir, _ = run_stage(cfg, path, "sft")
    assert sft["inputs"] == {} and sft["outputs"] == {"model": "model", "adapter": "adapter"}
    assert sft["metrics"]["val_loss"] < sft["metrics"]["base_val_loss"] - 0.2
    outputs_agree(sft_dir, src, AutoModelForCausalLM)  # the adapter was gathered whole before it was saved
    reward, reward_dir, out = run_stage(cfg, path, "reward")
    held_out = int(re.search(r"\[reward\] \d+ pairs, (\d+) held out", out).group(1))
    accuracy = reward["metrics"]["reward_accuracy"]  # the share of held-out pairs ranked right, at the last step
    assert accuracy * held_out == pytest.approx(round(accuracy * held_out), abs=1e-4)
    assert accuracy == pytest.approx(logged(reward_dir, "reward_accuracy")[-1])
    outputs_agree(reward_dir, sft_dir / "model", AutoModelForSequenceClassification, num_labels=1)
    dirs = {}
    for algorithm in ("dpo", "ppo", "grpo"):
        manifest, dirs[algorithm], _ = run_stage(cfg, path, algorithm)
        assert manifest["metrics"]["global_step"] == 6
        before, after = (load_file(d / "model" / "model.safetensors") for d in (sft_dir, dirs[algorithm]))
        assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
        outputs_agree(dirs[algorithm], sft_dir / "model", AutoModelForCausalLM)
    # PPO's reference is the actor with its adapters disabled: equal to it before the first update (LoRA's B starts
    # at zero), apart after
    kl = logged(dirs["ppo"], "kl")
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 1e-4


def test_continued_pretraining_then_packed_lora_sft_resumes_exactly(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    src = hub_models.save_model("qwen2", tmp_path / "qwen2")
    cfg, path = config(tmp_path / "runs", f"model.pretrained={src}", "distributed.zero_stage=2", "sft.packing=true",
                       *LORA)
    tokenize_in_process(cfg)
    pretrain, pretrain_dir, _ = run_stage(cfg, path, "pretrain")
    assert pretrain["metrics"]["val_loss"] < logged(pretrain_dir, "loss")[0] - 1.0
    assert AutoConfig.from_pretrained(pretrain_dir / "model").tie_word_embeddings  # Qwen2's own architecture
    assert AutoTokenizer.from_pretrained(pretrain_dir / "model").get_vocab() == \
        AutoTokenizer.from_pretrained(src).get_vocab()
    sft, sft_dir, _ = run_stage(cfg, path, "sft")
    assert sft["metrics"]["val_loss"] < sft["metrics"]["base_val_loss"]
    # a ZeRO-2 step checkpoint holds the adapters (and their optimizer), not the frozen base
    with no_pickled_code():
        states = torch.load(next((sft_dir / "checkpoints").glob("step-*/model/mp_rank_00_model_states.pt")))
    assert states["module"] and all("lora_" in k for k in states["module"]), sorted(states["module"])[:5]

    # killed after its step-10 checkpoint, then run again: it resumes and ends where the uninterrupted run did
    other, other_path = config(tmp_path / "again", f"model.pretrained={src}", "distributed.zero_stage=2",
                               "sft.packing=true", *LORA)
    shutil.copytree(tmp_path / "runs" / "store", tmp_path / "again" / "store", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("sft"))
    kill_after_checkpoint(other, other_path, "sft", step=10)
    resumed, resumed_dir, out = run_stage(other, other_path, "sft")
    assert "[sft] resumed from" in out
    for key, value in resumed["metrics"].items():
        if key not in MEASURED:
            assert value == pytest.approx(sft["metrics"][key], abs=1e-6), key
    want, got = load_file(sft_dir / "adapter" / "adapter_model.safetensors"), \
        load_file(resumed_dir / "adapter" / "adapter_model.safetensors")
    assert want.keys() == got.keys() and all(torch.allclose(want[k], got[k], atol=1e-6) for k in want)


def test_a_model_given_back_with_a_new_chat_format_trains_its_new_tokens_under_lora(chain, tmp_path):
    """The demo's pretrained model (GPT-2-style, tied embeddings), given back as model.pretrained with a Llama
    3-style template whose header and end-of-turn tokens are new special tokens, under ZeRO-3: the embeddings grow
    by those three rows, LoRA SFT trains them (they leave the mean they started at) and learns the format, and the
    merged export gives the adapter's outputs. (That it also keeps what pretraining taught, held-out
    exact match well above the base's, takes longer runs: bench/from_pretrained.py, README.)"""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tmp_path / "demo-model"
    shutil.copytree(chain["pretrain"][1] / "model", model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_special_tokens({"extra_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                           "<|eot_id|>"]}, replace_extra_special_tokens=False)
    tokenizer.chat_template = hub_models.LLAMA3_TEMPLATE.replace("{{- bos_token }}", "")
    tokenizer.save_pretrained(model)
    cfg, path = config(tmp_path / "runs", f"model.pretrained={model}", "pretrain.enabled=false",
                       "distributed.zero_stage=3", "sft.lora.r=16", "sft.lr=3e-3")
    sft, sft_dir, out = run_stage(cfg, path, "sft")
    assert "embeddings grown by 3 rows (trained)" in out
    outputs_agree(sft_dir, model, AutoModelForCausalLM)  # the new rows' adapter, partitioned, gathered and merged
    assert sft["metrics"]["val_loss"] < sft["metrics"]["base_val_loss"] - 1.0
    old = load_file(model / "model.safetensors")["transformer.wte.weight"]
    new = load_file(sft_dir / "model" / "model.safetensors")["transformer.wte.weight"]
    assert new.shape[0] == old.shape[0] + 3 and torch.equal(new[:old.shape[0]], old)  # the old rows: frozen
    assert (new[old.shape[0]:] - old.mean(0)).abs().max() > 1e-3


def test_named_roles_from_models_with_other_tokenizers(tmp_path):
    """Full weights under ZeRO-2: SFT of a Qwen2-style model straight from its directory (no tokenize or pretrain),
    a reward model started from a templateless Mistral-style base (reward.pretrained: its own tokenizer, ChatML and
    its tokens added, the embeddings grown), then PPO judged by that reward model given as a ready one
    (preference.reward_model: no reward stage in the lineage), its responses reaching it as text through its own
    template, with a named reference and, the vocabularies differing, a critic started from the SFT model with a
    new value head; then the held-out report, judged the same way; and GRPO (TRL) with the same judge and
    reference."""
    from transformers import AutoTokenizer

    policy = hub_models.save_model("qwen2", tmp_path / "qwen2")
    judge = hub_models.save_model("mistral", tmp_path / "mistral")
    common = [f"model.pretrained={policy}", "pretrain.enabled=false", "distributed.zero_stage=2",
              "reward.policy_samples=0", "preference.algorithm=[ppo,grpo]", "preference.max_steps=4"]
    cfg, path = config(tmp_path / "runs", *common, f"reward.pretrained={judge}")
    sft, sft_dir, _ = run_stage(cfg, path, "sft")
    assert sft["metrics"]["val_loss"] < sft["metrics"]["base_val_loss"] - 0.2
    reward, reward_dir, _ = run_stage(cfg, path, "reward")
    assert reward["inputs"] == {} and len(AutoTokenizer.from_pretrained(reward_dir / "model")) == \
        len(AutoTokenizer.from_pretrained(judge)) + 2  # ChatML's two tokens
    cfg, path = config(tmp_path / "runs", *common, f"preference.reward_model={reward_dir / 'model'}",
                       f"preference.reference={policy}")
    ppo, ppo_dir, out = run_stage(cfg, path, "ppo")
    assert ppo["inputs"].keys() == {"sft"} and ppo["metrics"]["global_step"] == 4
    scores = logged(ppo_dir, "rewards/reward_model")
    assert scores and all(s == s for s in scores)  # scored through the judge's own tokenizer, finite
    report, report_dir, _ = run_stage(cfg, path, "eval-ppo")
    assert report["inputs"].keys() == {"ppo", "sft"}
    rows = [json.loads(line) for line in (report_dir / "answers.jsonl").read_text().splitlines()]
    assert report["metrics"]["win_rate_vs_sft"] == pytest.approx(win_rate(*zip(*[
        (r["response"], r["sft_response"], r["score"], r["sft_score"]) for r in rows])))  # judged as recorded
    grpo, grpo_dir, _ = run_stage(cfg, path, "grpo")  # TRL's trainer: the judge through its own tokenizer too, and
    assert grpo["metrics"]["global_step"] == 4 and logged(grpo_dir, "rewards/reward_model")  # the named reference
