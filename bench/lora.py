"""LoRA benchmark: SFT with LoRA adapters against full fine-tuning (per-rank peak host memory) and against what a
user would write instead, TRL's SFTTrainer with the same PEFT config on the same conversations and batch
(tokens/s), side by side in one run, on a ~150M Llama-style model given to the pipeline as `model.pretrained`.

    .venv/bin/python bench/lora.py [--steps 30] [--nproc 1] [--smoke]

The model is built here (`llama-160m`'s shape with a demo-trained BPE vocabulary, random weights: speed and
memory do not depend on what it knows) and saved as a local Hugging Face directory. The three runs use one
process each by default (`--nproc` for the two gptforge ones), the same micro-batch, length and steps; tokens/s
counts non-padding tokens over the steps after WARMUP_STEPS, in our stage and, through the same TrainerMetrics
callback our TRL stages use, in SFTTrainer. Targets: LoRA's peak <= 0.5x full fine-tuning's, LoRA tokens/s
>= 1.0x SFTTrainer's. `--smoke`: a 2-layer model and 4 steps, to check the script runs (the test suite does).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gptforge.core.config import load_config  # noqa: E402
from gptforge.core.errors import StageFailed  # noqa: E402
from gptforge.core.files import MODEL_OUTPUTS  # noqa: E402
from gptforge.pipeline.launch.stage import run_stage  # noqa: E402
from gptforge.pipeline.store import RunRecord, locate  # noqa: E402

BATCH = ["sft.micro_batch_size=8", "sft.global_batch_size=8", "sft.max_length=128", "sft.warmup_steps=2",
         "data.demo.sft_items=2000", "data.demo.eval_items=40"]
LORA = {"r": 16, "alpha": 32.0, "dropout": 0.0}


def build(out: Path, smoke: bool) -> Path:
    """A llama-160m-shaped model with a 4096-token BPE trained on the demo text, saved with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from gptforge.data import demo
    from gptforge.data.tokenizer import save_hf, train_bpe

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    d = demo.generate(pretrain_docs=5000, sft_items=0, preference_pairs=0, eval_items=10)
    save_hf(train_bpe(d.pretrain, 4096, 2, specials), out, specials)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    layers, width = (2, 128) if smoke else (12, 768)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=width, intermediate_size=width * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=width // 64, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    return out


def ours(root: Path, model: Path, steps: int, nproc: int, lora: bool) -> dict:
    name = "lora" if lora else "full"
    overrides = [f"run.root={root / name}", f"model.pretrained={model}", "pretrain.enabled=false",
                 "reward.enabled=false", "preference.enabled=false", f"distributed.nproc_per_node={nproc}",
                 f"sft.max_steps={steps}", f"sft.eval_every={steps}", f"sft.save_every={steps}", "sft.lr=2e-4",
                 *BATCH, *([f"sft.lora.{k}={v}" for k, v in LORA.items()] if lora else [])]
    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides)
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    lines: list[str] = []
    try:
        metrics = run_stage(cfg, "sft", path, RunRecord(cfg), lines.append)["metrics"]
    except StageFailed as e:
        sys.exit(f"{e}\n" + "\n".join(lines[-60:]))
    adapter = locate(cfg, "sft")[0] / MODEL_OUTPUTS["adapter"] / "adapter_model.safetensors"
    return {**metrics, "trained_parameters": adapter_size(adapter) if lora else None}


def adapter_size(path: Path) -> int:
    """Parameters in a saved adapter: what LoRA trained."""
    import math

    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def trl_sft(root: Path, model: Path, steps: int) -> dict:
    """TRL's SFTTrainer, one process, the same PEFT config, data, batch, length and schedule length; tokens/s as
    our TRL stages count it (gptforge.model.train.hf_trainer.TrainerMetrics)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from gptforge.data import splits
    from gptforge.model.train.hf_trainer import TrainerMetrics

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [*BATCH, "distributed.nproc_per_node=1"])
    conversations = splits.conversations(cfg.data).train
    tokenizer = AutoTokenizer.from_pretrained(model)
    metrics = TrainerMetrics(root / "trl" / "logs")
    args = SFTConfig(output_dir=str(root / "trl"), max_steps=steps, per_device_train_batch_size=8, learning_rate=2e-4,
                     warmup_steps=2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                     max_length=128, assistant_only_loss=True, packing=False, dataloader_num_workers=0,
                     disable_tqdm=True)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), args=args,
                         train_dataset=Dataset.from_list(conversations), processing_class=tokenizer,
                         peft_config=LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                                target_modules="all-linear", task_type="CAUSAL_LM"),
                         callbacks=[metrics])
    trainer.train()
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {**metrics.final(), "peak_host_memory_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "global_step": trainer.state.global_step, "trained_parameters": trained}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nproc", type=int, default=1, help="processes of the two gptforge runs")
    p.add_argument("--smoke", action="store_true", help="a 2-layer model and 4 steps: check that it runs")
    args = p.parse_args()
    steps = 4 if args.smoke else args.steps
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    model = build(root / "model", args.smoke)
    t0 = time.perf_counter()
    full, lora = ours(root, model, steps, args.nproc, False), ours(root, model, steps, args.nproc, True)
    trl = trl_sft(root, model, steps)
    print(f"model {model}: {json.loads((model / 'config.json').read_text())['num_hidden_layers']} layers, "
          f"SFT {steps} steps of 8 conversations (max 128 tokens), LoRA r={LORA['r']} on all linear layers; "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"gptforge full fine-tuning ({args.nproc} process): peak host {full['peak_host_memory_gib']:.3f} GiB a "
          f"rank, {full['tokens_per_sec']} tokens/s")
    print(f"gptforge LoRA            ({args.nproc} process): peak host {lora['peak_host_memory_gib']:.3f} GiB a "
          f"rank, {lora['tokens_per_sec']} tokens/s")
    print(f"TRL SFTTrainer + PEFT    (1 process): peak host {trl['peak_host_memory_gib']:.3f} GiB, "
          f"{trl['tokens_per_sec']} tokens/s")
    for name, r in (("gptforge LoRA", lora), ("TRL SFTTrainer", trl)):  # the ratio compares the same work
        print(f"work: {name}: {r['global_step']} steps, {r['trained_parameters']:,} parameters trained")
    if full["peak_host_memory_gib"] and lora["tokens_per_sec"] and trl["tokens_per_sec"]:
        print(f"memory: LoRA / full = {lora['peak_host_memory_gib'] / full['peak_host_memory_gib']:.2f}x "
              f"(target <= 0.5x)")
        print(f"speed: gptforge LoRA / TRL SFTTrainer = {lora['tokens_per_sec'] / trl['tokens_per_sec']:.2f}x "
              f"(target >= 1.0x)")


if __name__ == "__main__":
    main()
