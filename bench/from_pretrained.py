"""A model that has learned something keeps it: the demo's pretrained model, handed back to the pipeline as
`model.pretrained` with another chat format (Llama 3's header and end-of-turn tokens, new special tokens: the
embeddings grow and, under LoRA, their rows are trained), fine-tuned with LoRA and in full; held-out exact match of
each against the base model prompted in the same format, in one run.

    .venv/bin/python bench/from_pretrained.py [--sft-steps 1500] [--root DIR] [--set k=v ...]

The pretraining is configs/tiny.yaml's (`make run`'s first two stages); SFT uses tiny.yaml's SFT settings, LoRA
r=16 on all linear layers at a 4x larger learning rate. On 2 CPU cores it takes about 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gptforge.core.config import load_config  # noqa: E402
from gptforge.core.errors import StageFailed  # noqa: E402
from gptforge.pipeline.launch.stage import run_stage  # noqa: E402
from gptforge.pipeline.store import RunRecord, locate  # noqa: E402

HEADERS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TEMPLATE = ("{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + "
            "m['content'] + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
            "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def stages(cfg, path: Path, names) -> dict:
    lines: list[str] = []
    try:
        return {n: run_stage(cfg, n, path, RunRecord(cfg), lines.append)["metrics"] for n in names}
    except StageFailed as e:
        sys.exit(f"{e}\n" + "\n".join(lines[-60:]))


def config(root: Path, *overrides):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"run.root={root}", *overrides])
    path = root / "pipeline.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    return cfg, path


def main() -> None:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser()
    p.add_argument("--sft-steps", type=int, default=1500)
    p.add_argument("--root", type=Path, help="the stage stores' folder (default: a new temporary one); a complete "
                   "tokenize and pretrain of the same settings in <root>/demo is reused")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="bench-from-pretrained-"))
    cfg, path = config(root / "demo", *args.set)
    pretrain = stages(cfg, path, ["tokenize", "pretrain"])["pretrain"]
    model = root / "demo-model"
    shutil.copytree(locate(cfg, "pretrain")[0] / "model", model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_special_tokens({"extra_special_tokens": HEADERS}, replace_extra_special_tokens=False)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model)
    results = {}
    sft_lr = load_config(ROOT / "configs" / "tiny.yaml").sft.lr
    for name, lora in (("lora", ["sft.lora.r=16", "sft.lora.alpha=32", f"sft.lr={4 * sft_lr}"]), ("full", [])):
        cfg, path = config(root / name, f"model.pretrained={model}", "pretrain.enabled=false",
                           "reward.enabled=false", "preference.enabled=false", f"sft.max_steps={args.sft_steps}",
                           *lora, *args.set)
        results[name] = stages(cfg, path, ["sft", "eval-sft"])
    print(f"pretrained demo model (configs/tiny.yaml): val_loss {pretrain['val_loss']}; chat format changed to "
          f"Llama 3's headers, {len(HEADERS)} new special tokens; SFT {args.sft_steps} steps")
    base = results["lora"]["eval-sft"]["base_exact_match"]
    print(f"base model, same format:  exact_match {base:.3f}")
    for name, r in results.items():
        print(f"{name:4s} SFT:                 exact_match {r['eval-sft']['exact_match']:.3f} "
              f"(+{r['eval-sft']['exact_match'] - base:.3f} over the base), val_loss {r['sft']['val_loss']:.3f} "
              f"(base {r['sft']['base_val_loss']:.3f}), {r['sft']['tokens_per_sec']} tokens/s, peak host "
              f"{r['sft']['peak_host_memory_gib']} GiB")


if __name__ == "__main__":
    main()
