"""ZeRO-3 from load to export on a model large enough to measure (152M parameters): SFT on 2 processes loads the
upstream model partitioned, and exports it a parameter at a time into small safetensors shards that load as the
model ZeRO-0 trained.

The memory check is on what ZeRO-3 saves. In fp32 the model states (weights, gradients, Adam's two moments) are 16
bytes a parameter; over 2 ranks ZeRO-3 holds 8 of them, saving 8 bytes a parameter: twice the model's own fp32
size. Each rank's peak must come out at least 1.5x that size below ZeRO-0's (measured: 3.46 against 2.35 GiB,
1.11 GiB saved, 2.0x the 0.57 GiB model). A rank that held a whole copy of the weights beside its partitioned
states (an export gathering the model at once, say) would save at most 1x and fail. A ratio of the two peaks
would not do: the ~1 GiB each process holds besides the model states (libraries, data, activations) brings it
within a hair of any threshold (0.637, where the states alone give 0.625)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from gptforge.core.config import dump_config, load_config
from gptforge.data.tokenizer import save_hf, train_bpe
from gptforge.model.build import build_model
from tests.conftest import ROOT, TINY
from tests.helpers import free_port

pytestmark = pytest.mark.slow
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
ARCH = ["model.preset=gpt2-124m", "model.n_layer=12", "model.n_embd=1024", "model.n_head=16", "model.n_positions=128"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 'pretrain' output: the demo's tokenizer and a freshly initialised GPT-2 of 152M parameters."""
    from transformers import AutoTokenizer

    from gptforge.data.demo import generate

    root = tmp_path_factory.mktemp("zero3")
    model_dir = root / "pretrain" / "model"
    save_hf(train_bpe(generate(pretrain_docs=2000).pretrain, 512, 2, SPECIALS), model_dir, SPECIALS)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = load_config(TINY, ARCH)
    torch.manual_seed(0)
    model = build_model(cfg.model.arch(), len(tokenizer), tokens={"bos_token_id": tokenizer.bos_token_id,
                        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
    model.save_pretrained(model_dir)
    return root, model.num_parameters()


def sft(root, zero_stage: int, *overrides):
    """SFT on 2 processes (torchrun), 2 steps; returns (output dir, each rank's peak host memory in GiB)."""
    cfg = load_config(TINY, [
        f"run.root={root}", *ARCH,
        "data.demo.sft_items=120", "data.demo.eval_items=16", "sft.max_length=64", "sft.max_steps=2",
        "sft.micro_batch_size=1",
        "sft.global_batch_size=2", "sft.eval_every=2", "sft.save_every=100", "sft.warmup_steps=1",
        f"distributed.zero_stage={zero_stage}", *overrides])
    path = root / f"zero{zero_stage}.yaml"
    path.write_text(dump_config(cfg))
    out = root / f"sft-zero{zero_stage}"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "gptforge.stages.sft",
                           "--config", str(path), "--out", str(out), "--input", f"pretrain={root / 'pretrain'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    peaks = [float(x) for x in re.findall(r"\[memory\] rank \d: peak host ([\d.]+) GiB", proc.stderr)]
    assert len(peaks) == 2
    return out, peaks


def test_zero3_holds_a_partition_from_load_to_export(base):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    root, n_params = base
    assert 140e6 < n_params < 160e6
    zero0, peak0 = sft(root, 0)
    zero3, peak3 = sft(root, 3, "model.max_shard_size=20MB")
    print(f"\n{n_params / 1e6:.1f}M parameters, peak host memory per rank (GiB): ZeRO-0 {peak0}, ZeRO-3 {peak3}, "
          f"saved {min(peak0) - max(peak3):.3f} GiB, the fp32 model {n_params * 4 / 2**30:.3f} GiB")
    assert min(peak0) - max(peak3) > 1.5 * n_params * 4 / 2**30  # every ZeRO-3 rank below either ZeRO-0 rank

    # The export: shards of at most 20 MB (a larger tensor alone in its own), an index naming every weight.
    model_dir = zero3 / "model"
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(model_dir.glob("model-*.safetensors"))
    assert len(shards) > 5 and set(index["weight_map"].values()) == {f.name for f in shards}
    for f in shards:
        with safe_open(str(f), "pt") as st:
            keys = list(st.keys())
            assert f.stat().st_size <= 20e6 + 1e5 or len(keys) == 1
    loaded = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(zero0 / "model")
    start = AutoModelForCausalLM.from_pretrained(root / "pretrain" / "model")
    theirs = dict(reference.named_parameters())
    moved = 0
    for name, p in loaded.named_parameters():  # ZeRO-3 and ZeRO-0 trained the same steps on the same data
        assert torch.allclose(p, theirs[name], atol=1e-5), name
        moved += not torch.equal(p, dict(start.named_parameters())[name])
    assert moved > 0 and loaded.lm_head.weight is loaded.transformer.wte.weight  # trained; tied once
