"""DPO stage: Direct Preference Optimization of the SFT policy with TRL's DPOTrainer, the frozen SFT
model as reference, under DeepSpeed ZeRO (accelerate launch).

    accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 -m stages.dpo --config configs/tiny.yaml

`preference.loss_type` selects any loss TRL implements (sigmoid, ipo, hinge, robust, ...).
"""

from __future__ import annotations

import sys
from pathlib import Path

from data import loaders
from model import hf_trainer as H
from model import train as T
from model.evaluate import policy_and_judge, preference_metrics
from pipeline.config import PipelineConfig
from pipeline.entry import stage_main
from pipeline.errors import DataError

OUTPUTS = {"model": "model"}


def as_dataset(pairs: list[dict]):
    """TRL's conversational preference format: prompt messages, chosen/rejected assistant turns."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": p["prompt"], "chosen": [{"role": "assistant", "content": p["chosen"]}],
                               "rejected": [{"role": "assistant", "content": p["rejected"]}]}
                              for p in pairs if p["chosen"].strip() != p["rejected"].strip()])


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    pc, dist = cfg.preference, cfg.distributed
    rank, world, _ = T.setup_distributed()
    sft_dir, reward_dir, tokenizer, _ = policy_and_judge(inputs)
    data = loaders.preference_pairs(cfg.data)
    train = as_dataset(data.train)
    if len(train) < pc.micro_batch_size * world:
        raise DataError(f"too few usable preference pairs for DPO: {len(train)}")

    args = DPOConfig(**H.trainer_kwargs(pc, dist, world, out_dir, cfg.run.seed), beta=pc.beta,
                     loss_type=[pc.loss_type] if isinstance(pc.loss_type, str) else pc.loss_type, max_length=pc.max_length)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(sft_dir), ref_model=None, args=args,
                         train_dataset=train, processing_class=tokenizer,
                         callbacks=[H.JsonlMetrics(out_dir / "logs" / "metrics.jsonl")])
    trainer.train(resume_from_checkpoint=H.resume_point(out_dir, "dpo", rank))
    H.export(trainer, tokenizer, sft_dir, out_dir / "model")
    T.barrier()
    metrics = {"global_step": trainer.state.global_step}
    if rank == 0:
        metrics.update(preference_metrics(cfg, "dpo", out_dir / "model", sft_dir, reward_dir))
    T.barrier()
    return metrics


if __name__ == "__main__":
    sys.exit(stage_main("dpo", run, OUTPUTS))
