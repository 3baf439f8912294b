"""The body the grpo and rloo stages share: TRL's online trainer (GRPOTrainer or RLOOTrainer) on the SFT policy,
rewarded by preference.rewards (gptforge.model.rewards: the reward model, checks of the reference answers,
the user's functions or a reward server) on the online prompts (data.prompts), with an optional ptx term (the
chosen responses' loss), sequence parallelism where set, our metrics, checkpoints, guard and resume. The two
algorithms differ only in their advantage (the group's mean against the leave-one-out mean), which is TRL's; each
stage names its trainer and its own arguments. With tools (preference.environment, preference.tools), the
rollouts of both are episodes of gptforge.model.agents (through `online`).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from gptforge.core.config import PipelineConfig
from gptforge.core.declarations import Stage
from gptforge.data import splits
from gptforge.data.chat import ChosenRows
from gptforge.model import rewards
from gptforge.model.sampling.generate import policy_and_judge
from gptforge.model.export import export_trainer
from gptforge.model.pretrained import load_policy, reference_dir
from gptforge.model.trainers import dynamic
from gptforge.model.agents.calls import format_of
from gptforge.model.trainers.online import rollout_trainer
from gptforge.model.agents.episode import agent_spec
from gptforge.model.agents.tools import Setup
from gptforge.model.sampling.workers import GenerationOrder, Timeline, Workers, step_spans, trainer_callback
from gptforge.model.trainers import sequence_parallel
from gptforge.model.trainers.ptx import with_ptx
from gptforge.model.train.checkpoints import no_pickled_code
from gptforge.model.train.distributed import barrier, setup_distributed
from gptforge.model.train.engine import uses_bf16
from gptforge.model.train.hf_trainer import (Checkpoints, TrainerGuard, TrainerMetrics, our_console,
                                             positions_from_mask, prompts_dataset, resume_point, trainer_kwargs,
                                             use_reference)


def arguments(cfg: PipelineConfig, decl: Stage, out_dir: Path, reward_weights: list[float],
              **algorithm_args) -> dict:
    """The fields of TRL's `<trainer>Config` the stage trains with: the shared ones from preference and
    preference.<stage>, the rewards' weights, and the algorithm's own `algorithm_args` (its stage module's
    `algorithm_args(cfg)`)."""
    pc, oc, dist = cfg.preference, getattr(cfg.preference, decl.name), cfg.distributed
    data_parallel = dist.world_size // dist.sequence_parallel
    return dict(**trainer_kwargs(pc, dist, data_parallel, out_dir, cfg.run.seed), beta=pc.beta,
                num_generations=oc.num_generations, max_completion_length=oc.max_new_tokens,
                temperature=oc.temperature, top_k=oc.top_k, top_p=oc.top_p,
                mask_truncated_completions=oc.overlong == "mask", reward_weights=reward_weights, **algorithm_args)


def train(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path, decl: Stage, **algorithm_args) -> dict:
    """Train the policy (each sequence shared by distributed.sequence_parallel ranks) with TRL's `<trainer>Config`
    and `<trainer>Trainer` (the stage's declared trainer: "GRPO" or "RLOO"): the shared arguments from preference and
    preference.<stage>, plus the algorithm's own `algorithm_args`; export it to `out_dir/model` and return the
    stage's metrics."""
    stage, trainer = decl.name, decl.trainer
    pc, oc, dist = cfg.preference, getattr(cfg.preference, stage), cfg.distributed
    # rollout workers (a CPU node leaves each a core): async, or an engine other than hf, which runs in a worker at
    # staleness 0 in sync mode, as PPO's and distill's do (gptforge.model.sampling.workers.rollout_source)
    apart = pc.rollout.mode == "async" or pc.rollout.engine != "hf"
    rank, world, device = setup_distributed(cfg.distributed, reserve=pc.rollout.workers if apart else 0)
    trl = importlib.import_module("trl")  # after setup_distributed, whose environment spares TRL's import of MLflow
    config_cls, trainer_cls = getattr(trl, f"{trainer}Config"), getattr(trl, f"{trainer}Trainer")
    sft_dir, reward_dir, tokenizer, reward_tokenizer = policy_and_judge(cfg, inputs)
    scoring, prompts = rewards.for_stage(cfg, tokenizer, pc.global_batch_size // oc.num_generations, sampling=oc)
    tools = bool(pc.environment or pc.tools)
    fmt = format_of(tokenizer.chat_template, str(sft_dir)) if tools else None
    corrected = pc.rollout.correction != "none" or pc.rollout.max_mismatch is not None
    if tools or apart or corrected:  # episodes, workers' rollouts, their log-probabilities
        agent = Setup.of(pc) if tools else None
        trainer_cls = rollout_trainer(trainer_cls, trainer, pc, oc, out_dir / "rollouts", agent, fmt)
    # zero-advantage groups logged, and replaced where preference.<stage>.dynamic_sampling
    trainer_cls = dynamic.trainer(trainer_cls, oc, rank // dist.sequence_parallel, cfg.run.seed)
    trl_rewards = rewards.trl_functions(scoring, reward_dir, reward_tokenizer)
    args = config_cls(**arguments(cfg, decl, out_dir, trl_rewards.pop("reward_weights"), **algorithm_args))
    if oc.ptx_coef:  # an update: one optimizer step, gradient_accumulation_steps micro-batches
        rows = ChosenRows(tokenizer, splits.preference_pairs(cfg.data).train, pc.max_length,
                          oc.ptx_rows(pc.micro_batch_size, world, args.gradient_accumulation_steps),
                          rank, world, cfg.run.seed)
        trainer_cls = with_ptx(trainer_cls, rows, oc.ptx_coef)
    metrics = TrainerMetrics(out_dir / "logs")
    policy = positions_from_mask(load_policy(sft_dir, cfg, uses_bf16(dist, device)))
    trainer_cls = sequence_parallel.trainer(trainer_cls, policy, dist, pc.micro_batch_size, stage)
    trainer = trainer_cls(model=policy, args=args, train_dataset=prompts_dataset(prompts),
                          processing_class=tokenizer, callbacks=[metrics, Checkpoints()], **trl_rewards)
    our_console(trainer)
    rewards.name_rewards(trainer, scoring)  # logged as rewards/<label>
    if pc.reference and pc.beta:
        use_reference(trainer, reference_dir(cfg, inputs), cfg.model)
    if trainer.ref_model is not None:  # a DeepSpeed engine by now: hook the module it runs
        positions_from_mask(getattr(trainer.ref_model, "module", trainer.ref_model))
    source = None
    if apart:  # rollout workers sample the generation batches (ahead, in async mode: gptforge.model.sampling.workers)
        spec = agent_spec(pc, fmt, pc.max_length) if tools else None
        order = GenerationOrder(len(prompts), args.per_device_train_batch_size * args.steps_per_generation,
                                oc.num_generations, rank, world, cfg.run.seed)
        source = Workers(cfg, oc, sft_dir, spec, lambda ids: ([prompts[i]["prompt"] for i in ids],
                                                              [prompts[i] for i in ids]),
                         rank, world, Timeline(out_dir / "logs", rank),
                         pc.rollout.max_staleness if pc.rollout.mode == "async" else 0)
        trainer.attach(source, order)
        resume_rollouts = trainer_callback(trainer, source, order, policy, out_dir)
    else:  # each step's span beside async's (gptforge.model.sampling.workers.Timeline)
        trainer.add_callback(step_spans(Timeline(out_dir / "logs", rank))())
    try:
        with no_pickled_code():
            resumed = resume_point(out_dir, stage, rank, world)
            guard = TrainerGuard(trainer, pc, stage, out_dir, resumed)
            if source is not None:
                resume_rollouts(resumed)
            trainer.train(resume_from_checkpoint=resumed)
    finally:
        if source is not None:
            source.close()
    export_trainer(trainer, tokenizer, out_dir / "model", cfg.model.shard_bytes)
    barrier()
    return {"global_step": trainer.state.global_step, **metrics.final(), **guard.final()}
