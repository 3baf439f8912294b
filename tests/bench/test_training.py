"""The training benches of their own data, shrunk: long context, YaRN, ZeRO-3's memory, LoRA, Muon against AdamW."""

import json
import re
from pathlib import Path

import pytest

from tests.bench.run import bench

pytestmark = pytest.mark.slow


def test_long_context_bench():
    """bench/long_context.py at 256 tokens: its three setups compared on the same work, the same model, sequence and
    AdamW steps: the same tokens a step, and the same losses (tiling and sequence parallelism change how, not what)."""
    out = bench("long_context.py", "--cap-gib", "8", "--start", "256", "--max", "256", "--common", "256")
    assert re.search(r"targets: longest >= 3x baseline: [\d.]+x", out), out
    got = {s: re.search(rf"^  {re.escape(s)} +(\d+) tokens  losses ([\d. ]+)$", out, re.M)
           for s in ("baseline", "tiled", "tiled+sp")}
    assert all(m and int(m.group(1)) == 256 for m in got.values()), out
    losses = {s: [float(x) for x in m.group(2).split()] for s, m in got.items()}
    assert len(losses["baseline"]) == 3, out
    for s in ("tiled", "tiled+sp"):
        assert losses[s] == pytest.approx(losses["baseline"], abs=1e-3), out


def test_yarn_bench(tmp_path):
    """bench/yarn.py's seeds 0-2 with a base pretrained 200 steps at 64 tokens (the demo's data, a 2-layer model):
    YaRN extends the base to 256 tokens better than raising its context does, in the mean of the three seeds (the
    direction: one seed's margin is too thin to hold on every CPU). At these settings 6 seeds gave 0.032 ± 0.007,
    every seed above zero, the least 0.009 (2026-12-07; bench/RESULTS.md); seeds 0-2 0.022 ± 0.006. The bench's
    own 400 steps give the wider 0.047 ± 0.013, but a seed at -0.006 in six, and cost twice the time. The
    context-extended model it exports carries its scaling: from_pretrained alone reproduces it, and generates past
    64 tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = bench("yarn.py", "--seeds", "0", "1", "2", "--short-steps", "200", "--root", str(tmp_path),
                "--set", "model.n_layer=2", "--set", "tokenizer.num_workers=2", one_core=True)
    loss = {(s, n): float(re.search(rf"^seed {s} {n}: val_loss ([\d.]+) at 256 tokens", out, re.M).group(1))
            for s in range(3) for n in ("yarn", "raised")}
    margins = [loss[s, "raised"] - loss[s, "yarn"] for s in range(3)]
    mean = float(re.search(r"  YaRN's margin \(raised - yarn\): (-?[\d.]+) ± [\d.]+", out).group(1))
    assert mean == pytest.approx(sum(margins) / 3, abs=1e-3) and mean > 0, out
    model_dir = Path(re.search(r"seed 0 yarn: val_loss [\d.]+ at 256 tokens; model (\S+)", out).group(1))
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4 and rope["original_max_position_embeddings"] == 64
    assert rope["rope_theta"] == 500000 and model.config.max_position_embeddings == 256
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(" ".join(["the cat sat on the mat."] * 12), return_tensors="pt").input_ids[:, :60]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=120, min_new_tokens=120, do_sample=False)
        logits = model(gen).logits
    assert gen.shape[1] == 180 and torch.isfinite(logits).all()


def test_zero3_bench(tmp_path):
    """bench/zero3.py shrunk to 101M parameters (8 of its 12 layers): every ZeRO-3 rank peaks below either ZeRO-0
    rank by more than 1.5x the fp32 model. Over 2 ranks ZeRO-3 saves 8 of the 16 bytes a parameter that weights,
    gradients and Adam's two moments take (2x the model); a rank that held a whole copy beside its partition (an
    export gathering the model at once) would save at most 1x, so 1.5x stands half a model (0.19 GiB) from each.
    Its export, a parameter at a time into shards of at most 20 MB with an index naming every weight, loads as the
    model ZeRO-0 trained."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = bench("zero3.py", "--layers", "8", "--root", str(tmp_path))
    m = re.search(r"^([\d.]+)M parameters \(fp32 model ([\d.]+) GiB\); peak host memory per rank \(GiB\): "
                  r"ZeRO-0 \[([\d., ]+)\], ZeRO-3 \[([\d., ]+)\]$", out, re.M)
    assert m, out
    params, model_gib = float(m.group(1)), float(m.group(2))
    peak0, peak3 = ([float(x) for x in g.split(",")] for g in m.group(3, 4))
    assert 95 < params < 105 and len(peak0) == len(peak3) == 2, out
    assert min(peak0) - max(peak3) > 1.5 * model_gib, out  # every ZeRO-3 rank below every ZeRO-0 rank
    start, zero0, zero3 = (Path(re.search(rf"^{what} (\S+)$", out, re.M).group(1))
                           for what in ("start", "ZeRO-0 export", "ZeRO-3 export"))
    index = json.loads((zero3 / "model.safetensors.index.json").read_text())
    shards = sorted(zero3.glob("model-*.safetensors"))
    assert len(shards) > 5 and set(index["weight_map"].values()) == {f.name for f in shards}
    for f in shards:
        with safe_open(str(f), "pt") as st:
            assert f.stat().st_size <= 20e6 + 1e5 or len(list(st.keys())) == 1
    loaded, reference, initial = (AutoModelForCausalLM.from_pretrained(d) for d in (zero3, zero0, start))
    theirs, before = dict(reference.named_parameters()), dict(initial.named_parameters())
    moved = 0
    for name, p in loaded.named_parameters():  # ZeRO-3 and ZeRO-0 trained the same steps on the same data
        assert torch.allclose(p, theirs[name], atol=1e-5), name
        moved += not torch.equal(p, before[name])
    assert moved > 0 and loaded.lm_head.weight is loaded.transformer.wte.weight  # trained; tied once


def test_lora_bench():
    """bench/lora.py's smoke run: its speed ratio compares the same work, the same steps training the same adapter
    (LoRA r=16 on every linear layer: as many parameters on each side)."""
    out = bench("lora.py", "--smoke")
    assert re.search(r"memory: LoRA / full = [\d.]+x", out) and "speed: gptforge LoRA / TRL SFTTrainer" in out, out
    work = dict(re.findall(r"^work: (gptforge LoRA|TRL SFTTrainer): (.*)$", out, re.M))
    assert work["gptforge LoRA"] == work["TRL SFTTrainer"] and work["TRL SFTTrainer"].startswith("4 steps, "), out


def test_optimizers_bench(tmp_path):
    """bench/optimizers.py shrunk to one seed, one rate each and 60 steps of a 2-layer model (2 processes, ZeRO-2):
    Muon reaches AdamW's final validation loss before AdamW's last step (on 2026-12-07, at step 40 of 60; a Muon
    whose matrices were clipped to a tenth of its step, or left to AdamW, did not). The bench's 3 seeds at its own
    size: bench/RESULTS.md."""
    small = ["data.demo.pretrain_docs=1500", "tokenizer.vocab_size=320", "model.n_layer=2", "pretrain.warmup_steps=5",
             "pretrain.seq_len=64", "pretrain.micro_batch_size=8", "pretrain.global_batch_size=16",
             "pretrain.eval_batches=2"]
    out = bench("optimizers.py", "--seeds", "0", "--steps", "60", "--adamw-lrs", "2e-3", "--muon-lrs", "0.02",
                "--root", str(tmp_path), *[a for o in small for a in ("--set", o)])
    row = re.search(r"^\| 0 \| ([\d.]+) \| ([\d.]+) \| (\d+) \| ([\d.]+)x \| ([\d.]+)x \|$", out, re.M)
    assert row, out
    adam, muon, at = float(row[1]), float(row[2]), int(row[3])
    assert at <= 50 and muon < adam, out
    assert re.search(r"Muon reaches AdamW's final validation loss in [\d.]+ ± nan of its steps", out), out
