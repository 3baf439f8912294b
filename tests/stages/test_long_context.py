"""Longer context through the stages: a model pretrained at 64 tokens, its context extended to 256 with YaRN by
continued pretraining (the same model with its context merely raised trains beside it)."""

import json
import shutil

import torch

from tests.helpers import config, logged, run_stage, tokenize_in_process

SHORT = ["model.preset=llama-tiny", "model.n_positions=64", "pretrain.seq_len=64", "pretrain.max_steps=60",
         "pretrain.save_every=100", "pretrain.eval_every=60", "pretrain.log_every=10", "pretrain.lr=3e-3"]
LONG = ["pretrain.seq_len=256", "pretrain.max_steps=12", "pretrain.warmup_steps=2", "pretrain.micro_batch_size=2",
        "pretrain.global_batch_size=4", "pretrain.eval_every=12", "pretrain.eval_batches=4", "pretrain.log_every=1",
        "pretrain.lr=3e-4", "pretrain.min_lr=3e-5"]


def test_yarn_extends_a_64_token_model_to_256_and_its_export_carries_the_scaling(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, path = config(tmp_path / "short", *SHORT)
    tokenize_in_process(cfg)
    _, short_dir, _ = run_stage(cfg, path, "pretrain")
    base = short_dir / "model"
    raised = shutil.copytree(base, tmp_path / "raised-model")  # no scaling: the context raised by hand
    conf = json.loads((raised / "config.json").read_text())
    (raised / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 256}))

    results = {}
    for name, model, extra in (("yarn", base, ["model.rope={type: yarn, factor: 4}"]), ("raised", raised, [])):
        cfg, path = config(tmp_path / name, f"model.pretrained={model}", *LONG, *extra)
        tokenize_in_process(cfg)
        results[name] = run_stage(cfg, path, "pretrain")
    yarn, raised_run = results["yarn"], results["raised"]
    # Both train at 256 tokens and predict there far better than the unigram entropy. At this scale, on the demo's
    # short documents, plain extrapolation is not worse than YaRN: both end within a few hundredths (1.755 YaRN,
    # 1.748 raised); bench/long_context.py prints the comparison.
    for run in (yarn, raised_run):
        assert run[0]["metrics"]["val_loss"] < run[0]["metrics"]["unigram_entropy"] - 1.0, run[0]["metrics"]
    assert abs(yarn[0]["metrics"]["val_loss"] - raised_run[0]["metrics"]["val_loss"]) < 0.2

    # The exported config carries the scaling: from_pretrained alone reproduces it, and generates past 64 tokens.
    out = yarn[1] / "model"
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.rope_parameters["rope_type"] == "yarn" and model.config.rope_parameters["factor"] == 4
    assert model.config.rope_parameters["original_max_position_embeddings"] == 64
    assert model.config.max_position_embeddings == 256
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(" ".join(["the cat sat on the mat."] * 12), return_tensors="pt").input_ids[:, :60]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=120, min_new_tokens=120, do_sample=False)
        logits = model(gen).logits
    assert gen.shape[1] == 180 and torch.isfinite(logits).all()
