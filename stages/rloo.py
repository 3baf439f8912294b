"""RLOO stage: online RL of the SFT policy with TRL's RLOOTrainer: num_generations completions a prompt,
each one's advantage its reward less the mean reward of the others (REINFORCE leave-one-out). Rewarded by
preference.rewards (gptforge.model.eval.rewards) on the online prompts (data.prompts), with an optional ptx term (the
chosen responses' loss), under DeepSpeed ZeRO (accelerate launch).

    gptforge stage rloo -c CONFIG      (finds its inputs and output in the stage store)
    accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 -m gptforge.stages.rloo \\
        --config CONFIG --out DIR --input sft=DIR [--input reward=DIR]

The held-out report is the evaluation step's (gptforge.stages.evaluate).
"""

from __future__ import annotations

from pathlib import Path

from gptforge.core.config import PipelineConfig
from gptforge.data import splits
from gptforge.data.chat import ChosenRows
from gptforge.model.train.checkpoints import no_pickled_code
from gptforge.model.train.distributed import barrier, setup_distributed
from gptforge.model.train.engine import uses_bf16
from gptforge.model.eval.generation import policy_and_judge
from gptforge.model.export import export_trainer
from gptforge.model.eval import rewards
from gptforge.model.train.hf_trainer import (Checkpoints, TrainerGuard, TrainerMetrics, positions_from_mask,
                                             prompts_dataset, resume_point, trainer_kwargs, use_reference, with_ptx)
from gptforge.model.train import sequence_parallel
from gptforge.model.pretrained import load_policy, reference_dir
from gptforge.stages.entry import exit_process, main



def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    pc, oc, dist = cfg.preference, cfg.preference.rloo, cfg.distributed
    rank, world, device = setup_distributed(cfg.distributed)
    from trl import RLOOConfig, RLOOTrainer  # after setup_distributed, whose environment spares TRL's import of MLflow
    sft_dir, reward_dir, tokenizer, reward_tokenizer = policy_and_judge(cfg, inputs)
    scoring, prompts = rewards.for_stage(cfg, tokenizer, pc.global_batch_size // oc.num_generations)
    trl_rewards = rewards.trl_functions(scoring, reward_dir, reward_tokenizer)
    args = RLOOConfig(**trainer_kwargs(pc, dist, dist.data_parallel("rloo"), out_dir, cfg.run.seed), beta=pc.beta,
                      num_generations=oc.num_generations, max_completion_length=oc.max_new_tokens,
                      temperature=oc.temperature, top_k=oc.top_k, top_p=oc.top_p,
                      reward_weights=trl_rewards.pop("reward_weights"))
    trainer_cls = RLOOTrainer
    if oc.ptx_coef:  # an update: one optimizer step, gradient_accumulation_steps micro-batches
        rows = ChosenRows(tokenizer, splits.preference_pairs(cfg.data).train, pc.max_length,
                          oc.ptx_rows(pc.micro_batch_size, world, args.gradient_accumulation_steps),
                          rank, world, cfg.run.seed)
        trainer_cls = with_ptx(trainer_cls, rows, oc.ptx_coef)
    metrics = TrainerMetrics(out_dir / "logs")
    policy = positions_from_mask(load_policy(sft_dir, cfg, uses_bf16(dist, device)))
    trainer_cls = sequence_parallel.trainer(trainer_cls, policy, dist, pc.micro_batch_size, "rloo")
    trainer = trainer_cls(model=policy, args=args, train_dataset=prompts_dataset(prompts),
                          processing_class=tokenizer, callbacks=[metrics, Checkpoints()], **trl_rewards)
    rewards.name_rewards(trainer, scoring)  # logged as rewards/<label>
    if pc.reference and pc.beta:
        use_reference(trainer, reference_dir(cfg, inputs), cfg.model)
    if trainer.ref_model is not None:  # a DeepSpeed engine by now: hook the module it runs
        positions_from_mask(getattr(trainer.ref_model, "module", trainer.ref_model))
    with no_pickled_code():
        resumed = resume_point(out_dir, "rloo", rank, world)
        guard = TrainerGuard(trainer, pc, "rloo", out_dir, resumed)
        trainer.train(resume_from_checkpoint=resumed)
    export_trainer(trainer, tokenizer, out_dir / "model", cfg.model.shard_bytes)
    barrier()
    return {"global_step": trainer.state.global_step, **metrics.final(), **guard.final()}


if __name__ == "__main__":
    exit_process(main("rloo", run))
