"""DPO stage: Direct Preference Optimization of the SFT policy with TRL's DPOTrainer, the frozen SFT
model as reference, under DeepSpeed ZeRO (accelerate launch).

    gptforge stage dpo -c configs/tiny.yaml      (finds its inputs and output in the stage store)
    accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 -m gptforge.stages.dpo \\
        --config CONFIG --out DIR --input sft=DIR

`preference.dpo.loss_type` selects any loss TRL implements (sigmoid, ipo, hinge, robust, ...) or a list of
them ([sigmoid, sft] is RPO). With `distributed.sequence_parallel: N`, groups of N ranks share each pair
(gptforge.model.trainers.sequence_parallel.trainer). The held-out report is the evaluation step's
(gptforge.stages.evaluate).
"""

from __future__ import annotations

from pathlib import Path

from gptforge.core.config import PipelineConfig
from gptforge.data import splits
from gptforge.model.train.checkpoints import no_pickled_code
from gptforge.model.train.distributed import barrier, setup_distributed
from gptforge.model.train.engine import uses_bf16
from gptforge.model.export import export_trainer
from gptforge.model.train.hf_trainer import (Checkpoints, TrainerGuard, TrainerMetrics, our_console, resume_point,
                                             trainer_kwargs)
from gptforge.model.trainers import sequence_parallel
from gptforge.model.attention import load_kwargs
from gptforge.model.pretrained import load_policy, reference_dir
from gptforge.stages.entry import exit_process, main
from gptforge.core.registry import data_parallel

# imported by its ranks once they have joined their group; by the warm agent before (gptforge.stages.entry.preload)
RANK_IMPORTS = ("datasets", "trl.trainer.dpo_trainer")


def as_dataset(pairs: list[dict]):
    """TRL's conversational preference format: prompt messages, chosen/rejected assistant turns."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": p["prompt"], "chosen": [{"role": "assistant", "content": p["chosen"]}],
                               "rejected": [{"role": "assistant", "content": p["rejected"]}]}
                              for p in pairs if p["chosen"].strip() != p["rejected"].strip()])


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pc, dist = cfg.preference, cfg.distributed
    rank, world, device = setup_distributed(cfg.distributed)
    from trl import DPOConfig, DPOTrainer  # after setup_distributed, whose environment spares TRL's import of MLflow
    sft_dir = inputs["sft"] / "model"  # the policy and its reference; DPO needs no reward model
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    train = as_dataset(splits.preference_pairs(cfg.data).train)
    splits.require(len(train), pc.global_batch_size, "usable preference pairs", "preference.global_batch_size",
                    "data.preference")

    loss_type = pc.dpo.loss_type
    args = DPOConfig(**trainer_kwargs(pc, dist, data_parallel(dist, "dpo"), out_dir, cfg.run.seed), beta=pc.beta,
                     loss_type=[loss_type] if isinstance(loss_type, str) else loss_type, max_length=pc.max_length)
    metrics = TrainerMetrics(out_dir / "logs")
    policy = load_policy(sft_dir, cfg, uses_bf16(dist, device))
    ref_dir = reference_dir(cfg, inputs)
    reference = AutoModelForCausalLM.from_pretrained(ref_dir, **load_kwargs(ref_dir, cfg.model)) if pc.reference \
        else None
    # a micro-batch holds a chosen and a rejected row per pair
    trainer_cls = sequence_parallel.trainer(DPOTrainer, policy, dist, 2 * pc.micro_batch_size, "dpo")
    trainer = trainer_cls(model=policy, ref_model=reference, args=args,
                          train_dataset=train, processing_class=tokenizer, callbacks=[metrics, Checkpoints()])
    our_console(trainer)
    with no_pickled_code():
        resumed = resume_point(out_dir, "dpo", rank, world)
        guard = TrainerGuard(trainer, pc, "dpo", out_dir, resumed)
        trainer.train(resume_from_checkpoint=resumed)
    export_trainer(trainer, tokenizer, out_dir / "model", cfg.model.shard_bytes)
    barrier()
    return {"global_step": trainer.state.global_step, **metrics.final(), **guard.final()}


if __name__ == "__main__":
    exit_process(main("dpo", run))
