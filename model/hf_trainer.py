"""What the TRL-based preference stages (dpo, grpo, rloo) share: the Trainer arguments built from a
config section (DeepSpeed ZeRO config, batch, schedule, checkpoints), resume from the newest Trainer
checkpoint, metrics into logs/metrics.jsonl, export and the held-out report.

TRL trainers run under `accelerate launch` with DeepSpeed (under the plain `deepspeed` launcher on a
CPU each rank believes it is alone), so pipeline.launch starts these stages with accelerate.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from data.chat import ChosenRows, positions
from model.train import DS_CONFIGS


def trainer_kwargs(section, dist, world: int, out_dir: Path, seed: int) -> dict:
    """TrainingArguments fields shared by every TRL stage."""
    cuda = torch.cuda.is_available()
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out_dir / "logs" / "tb")  # transformers 5 reads it from here
    ds = json.loads((DS_CONFIGS / f"zero{dist.zero_stage}.json").read_text())
    if dist.offload_optimizer:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
        ds["zero_force_ds_cpu_optimizer"] = False
    return dict(
        output_dir=str(out_dir / "checkpoints"), seed=seed, data_seed=seed, deepspeed=ds,
        per_device_train_batch_size=section.micro_batch_size,
        gradient_accumulation_steps=section.global_batch_size // (section.micro_batch_size * world),
        learning_rate=section.lr, lr_scheduler_type="cosine", warmup_steps=section.warmup_steps,
        max_steps=section.max_steps, weight_decay=section.weight_decay, max_grad_norm=section.grad_clip,
        adam_beta2=0.95, logging_steps=section.log_every, save_strategy="steps", save_steps=section.save_every,
        save_total_limit=section.keep_last, report_to=["tensorboard"],
        use_cpu=not cuda, bf16=cuda and dist.precision in ("auto", "bf16"), gradient_checkpointing=dist.activation_checkpointing,
        disable_tqdm=False, dataloader_num_workers=0, remove_unused_columns=False,
    )


class JsonlMetrics(TrainerCallback):
    """Each Trainer log record as a line of logs/metrics.jsonl (rank 0), as the other stages write."""

    def __init__(self, path: Path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, **logs}) + "\n")


def resume_point(out_dir: Path, stage: str, rank: int) -> str | None:
    """The newest Trainer checkpoint to resume from, if any; log that we do."""
    ckpt_dir = out_dir / "checkpoints"
    last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.is_dir() else None
    if last and rank == 0:
        print(f"[{stage}] resumed from {last}", flush=True)
    return last


def export(trainer, tokenizer, sft_dir: Path, out: Path) -> None:
    """The trained policy as a Hugging Face directory (ZeRO-3 gathered by the Trainer), with the SFT
    model's generation config."""
    trainer.save_model(str(out))
    if trainer.accelerator.is_main_process:
        tokenizer.save_pretrained(out)
        shutil.copy(sft_dir / "generation_config.json", out / "generation_config.json")


def positions_from_mask(model: torch.nn.Module) -> torch.nn.Module:
    """Make `model` derive position ids from the attention mask when a caller gives none, as generate() does.

    TRL's GRPO and RLOO trainers score left-padded prompt + completion batches with input_ids and
    attention_mask only (the same gap as huggingface/trl#6800 in Online DPO); GPT-2 then falls back to
    positions 0..T-1, so every row shorter than the longest prompt is scored at shifted learned positions,
    not where it was sampled. On the tiny model that gradient lowered the training prompts' hit rate (0.54 to
    0.31 greedy in 50 REINFORCE steps) instead of raising it. Harmless for rotary models."""

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if kwargs.get("position_ids") is None and mask is not None and mask.dim() == 2:
            ids = kwargs.get("input_ids", args[0] if args else None)
            length = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
            kwargs["position_ids"] = positions(mask)[:, -length:]  # with a KV cache: the new tokens' positions
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def with_ptx(trainer_cls, rows, coef: float):
    """`trainer_cls` with coef * the loss of `rows` (data.chat.ChosenRows) added to each micro-batch's policy
    loss: PPO-ptx (InstructGPT), for TRL's GRPO and RLOO. The update that picks the rows is counted from the
    optimizer step and the micro-step within it, so a resumed run draws the same."""

    class PtxTrainer(trainer_cls):
        _ptx_at = (-1, 0)  # (optimizer step, micro-steps taken in it)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            step, k = self._ptx_at if self._ptx_at[0] == self.state.global_step else (self.state.global_step, 0)
            self._ptx_at = (step, k + 1)
            ptx = rows.loss(model, step * self.args.gradient_accumulation_steps + k, loss.device)
            self._metrics["train"]["ptx_loss"].append(self.accelerator.gather(ptx.detach()).mean().item())
            return loss + coef * ptx

    PtxTrainer.__name__ = PtxTrainer.__qualname__ = f"Ptx{trainer_cls.__name__}"
    return PtxTrainer


def verifier(prompts, completions, answer, **kwargs) -> list[float]:
    """Rule-based reward for the demo items: 1 when the completion is exactly the known answer."""
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]


def run_online(cfg, inputs: dict[str, Path], out_dir: Path, stage: str, trainer_cls, config_cls) -> dict:
    """GRPO or RLOO with TRL: sample num_generations completions per prompt, reward them with the trained
    reward model (and optionally the demo verifier), update the policy against a group baseline."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from data import loaders
    from model import train as T
    from model.evaluate import policy_and_judge, preference_metrics

    pc, dist = cfg.preference, cfg.distributed
    rank, world, _ = T.setup_distributed()
    sft_dir, reward_dir, tokenizer, reward_tokenizer = policy_and_judge(inputs)
    pairs = loaders.preference_pairs(cfg.data).train
    # The demo's chosen responses are the verified answers.
    train = Dataset.from_list([{"prompt": p["prompt"], "answer": p["chosen"]} for p in pairs])
    # (reward function, its weight, its tokenizer): the reward model, and the demo verifier if asked for
    rewards = [(str(reward_dir), pc.reward_model_weight, reward_tokenizer)]
    rewards += [(verifier, pc.verifier_weight, None)] if pc.verifier_reward else []
    reward_funcs, reward_weights, reward_tokenizers = map(list, zip(*rewards))
    args = config_cls(**trainer_kwargs(pc, dist, world, out_dir, cfg.run.seed), beta=pc.beta,
                      num_generations=pc.num_generations, max_completion_length=pc.max_new_tokens,
                      temperature=pc.temperature, top_k=pc.top_k, top_p=pc.top_p,
                      reward_weights=reward_weights,
                      **({"scale_rewards": pc.scale_rewards} if stage == "grpo" else {}))
    if pc.ptx_coef:  # an update: one optimizer step, gradient_accumulation_steps micro-batches
        rows = ChosenRows(tokenizer, pairs, pc.max_length, pc.ptx_rows(world, args.gradient_accumulation_steps),
                          rank, world, cfg.run.seed)
        trainer_cls = with_ptx(trainer_cls, rows, pc.ptx_coef)
    policy = positions_from_mask(AutoModelForCausalLM.from_pretrained(sft_dir))
    trainer = trainer_cls(model=policy, reward_funcs=reward_funcs, args=args, train_dataset=train,
                          processing_class=tokenizer, reward_processing_classes=reward_tokenizers,
                          callbacks=[JsonlMetrics(out_dir / "logs" / "metrics.jsonl")])
    if trainer.ref_model is not None:  # a DeepSpeed engine by now: hook the module it runs
        positions_from_mask(getattr(trainer.ref_model, "module", trainer.ref_model))
    trainer.train(resume_from_checkpoint=resume_point(out_dir, stage, rank))
    export(trainer, tokenizer, sft_dir, out_dir / "model")
    T.barrier()
    metrics = {"global_step": trainer.state.global_step}
    if rank == 0:
        metrics.update(preference_metrics(cfg, stage, out_dir / "model", sft_dir, reward_dir))
    T.barrier()
    return metrics
