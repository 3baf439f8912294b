"""What the TRL-based preference stages (dpo, grpo, rloo) share: the Trainer arguments built from the config
(the ZeRO config, batch, the schedule our loops use, checkpoints), their logs in our metric names, resume from
the newest Trainer checkpoint, the rewards of the online ones, their ptx term, and the position-id hook.

TRL trainers run under `accelerate launch` with DeepSpeed (under the plain `deepspeed` launcher on a CPU each
rank believes it is alone), so gptforge.pipeline.launch.stage starts these stages with accelerate.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from gptforge.core.files import write_json_atomic
from gptforge.data.chat import positions
from gptforge.model.train.checkpoints import newest_valid_checkpoint, record_complete
from gptforge.model.train.engine import min_lr_rate, zero_config
from gptforge.model.train.metrics import WARMUP_STEPS, MetricsLog, Throughput, from_trainer, step_line


def trainer_kwargs(section, dist, data_parallel: int, out_dir: Path, seed: int) -> dict:
    """TrainingArguments fields shared by every TRL stage; `data_parallel`: the ranks that read different batches
    (the world, over distributed.sequence_parallel where the stage takes it)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    return dict(
        output_dir=str(out_dir / "checkpoints"), seed=seed, data_seed=seed, deepspeed=zero_config(dist, device),
        per_device_train_batch_size=section.micro_batch_size,
        gradient_accumulation_steps=section.global_batch_size // (section.micro_batch_size * data_parallel),
        learning_rate=section.lr, **schedule_kwargs(section), warmup_steps=section.warmup_steps,
        max_steps=section.max_steps, weight_decay=section.weight_decay, max_grad_norm=section.grad_clip,
        adam_beta2=0.95, logging_steps=section.log_every, save_strategy="steps", save_steps=section.save_every,
        save_total_limit=section.keep_last, report_to=[],  # our TrainerMetrics writes the JSONL and TensorBoard
        use_cpu=not cuda, bf16=cuda and dist.precision in ("auto", "bf16"),
        activation_checkpointing=dist.activation_checkpointing,
        disable_tqdm=False, dataloader_num_workers=0, remove_unused_columns=False,
        ddp_timeout=int(dist.timeout_minutes * 60),
    )


def schedule_kwargs(section) -> dict:
    """The section's schedule as transformers names it: `cosine_with_min_lr`, or `warmup_stable_decay` with a
    linear decay over the last decay_fraction of the steps to min_lr (gptforge.model.train.engine.lr_factor's)."""
    if section.schedule == "wsd":
        decay = section.max_steps - max(section.warmup_steps, section.max_steps - round(section.decay_fraction
                                                                                      * section.max_steps))
        return dict(lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs={
            "num_decay_steps": decay, "min_lr_ratio": min_lr_rate(section), "decay_type": "linear"})
    return dict(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": min_lr_rate(section)})


class ProgressBar(ProgressCallback):
    """The Trainer's progress bar (which the pipeline follows) without its raw dict of every log: TrainerMetrics
    prints each logged step in gptforge's names, as our own loops do."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return None


def our_console(trainer) -> None:
    """A Trainer's console as our loops': its progress bar, its logs as gptforge's step lines (TrainerMetrics)."""
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(ProgressBar())


class TrainerMetrics(TrainerCallback):
    """The Trainer's logs in our metric names, through our MetricsLog (logs/metrics.jsonl and TensorBoard,
    truncated to the checkpoint a resumed run starts from), with `tokens_per_sec` counted as our loops count it:
    TRL's token counter over the time spent in training steps, log windows that hold any of the first
    WARMUP_STEPS steps of a start left out."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.last: dict = {}  # the last record logged

    def on_train_begin(self, args, state, control, **kwargs):
        self.log = MetricsLog(self.log_dir, 0 if state.is_world_process_zero else 1, resume_step=state.global_step)
        self.throughput = Throughput(warmup=0)  # fed whole log windows, warm-up windows left out
        self.steps = 0
        self.window_seconds, self.window_steps, self.window_timed = 0.0, 0, 0
        self.tokens_seen = None
        self.all_seconds, self.tokens_at_start = 0.0, 0 if state.global_step == 0 else None

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        self.window_steps += 1
        self.all_seconds += time.perf_counter() - self.t0
        if self.steps > WARMUP_STEPS:
            self.window_timed += 1
            self.window_seconds += time.perf_counter() - self.t0
        if state.global_step >= state.max_steps:  # the last step is logged, whatever log_every says
            control.should_log = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = from_trainer(logs or {})
        tokens = (logs or {}).get("num_tokens")
        if tokens is not None:
            if self.tokens_seen is not None and self.window_timed == self.window_steps and self.window_seconds:
                self.throughput.step(self.window_seconds, tokens - self.tokens_seen)
                metrics["tokens_per_sec"] = self.throughput.window_rate()
            self.tokens_seen = tokens
            self.window_seconds, self.window_steps, self.window_timed = 0.0, 0, 0
        if metrics:
            self.log.log(state.global_step, **metrics)
            self.last = metrics
            if state.is_world_process_zero and "loss" in metrics:  # the step as our own loops print it
                from tqdm import tqdm

                tqdm.write(step_line(state.global_step, metrics["loss"], metrics.get("lr", 0.0),
                                     metrics.get("tokens_per_sec")), file=sys.stderr)

    def on_train_end(self, args, state, control, **kwargs):
        self.log.close()

    def final(self) -> dict:
        """The stage's final training metrics; a start no longer than the warm-up is timed whole."""
        rate = self.throughput.rate()
        if rate is None and self.tokens_seen is not None and self.tokens_at_start is not None and self.all_seconds:
            rate = round((self.tokens_seen - self.tokens_at_start) / self.all_seconds, 1)
        return {"train_loss": self.last.get("loss"), "tokens_per_sec": rate}


class Checkpoints(TrainerCallback):
    """The Trainer's checkpoints kept as ours are: none at the last step (the export follows at once, and a
    Trainer resumed from a checkpoint at max_steps takes one step more than max_steps, seen with DPO), and each
    marked complete (gptforge.model.train.checkpoints.record_complete: every file with its size and sha256), so that
    a resumed stage skips one that is incomplete or changed."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_save = False
        return control

    def on_save(self, args, state, control, **kwargs):
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        rank = torch.distributed.get_rank() if world > 1 else 0
        record_complete(Path(args.output_dir) / f"checkpoint-{state.global_step}", state.global_step, rank, world)


class TrainerGuard(TrainerCallback):
    """model/train/guard.py's bad-step guard in a TRL trainer. Its `compute_loss` is wrapped: each training
    micro-batch's loss is observed (drills applied), and at the step's last one every rank learns whether the step
    is bad; a bad one's loss goes to backward as NaN, so that DeepSpeed drops its update and the Trainer steps no
    scheduler. A step whose gradient norm is not finite is dropped by DeepSpeed alone. As the Trainer counts,
    a skipped step is one of max_steps. After max_bad_steps in a row the newest valid checkpoint's weights,
    optimizer and schedule are loaded; the step count, and with it the data order, go on, so that a resume
    (which skips global_step x accumulation batches) repeats it. The guard's counts travel in guard.json of
    each checkpoint."""

    FILE = "guard.json"

    def __init__(self, trainer, section, stage: str, out_dir: Path, resumed: str | None):
        from gptforge.model.train.guard import StepGuard

        acc = trainer.accelerator
        self.trainer, self.out_dir = trainer, out_dir
        self.guard = StepGuard(section, stage, None, acc.device, acc.process_index, acc.num_processes,
                               key="preference", judge_every_step=True)
        if resumed and (Path(resumed) / self.FILE).is_file():
            self.guard.load_state_dict(json.loads((Path(resumed) / self.FILE).read_text()))
        compute = trainer.compute_loss

        def compute_loss(model, inputs, *args, **kwargs):
            out = compute(model, inputs, *args, **kwargs)
            if not model.training:
                return out
            loss = out[0] if isinstance(out, tuple) else out
            self.guard.next(lambda: None)  # counts the micro-batch for drills
            self.guard.observe(loss, boundary=acc.sync_gradients)
            rollouts = getattr(trainer, "rollout_verdict", None)  # gptforge.model.trainers.online: a mismatch
            if rollouts and acc.sync_gradients:
                self.guard.verdict = rollouts
            loss = self.guard.gate(loss)
            return (loss, *out[1:]) if isinstance(out, tuple) else loss

        trainer.compute_loss = compute_loss
        handler = trainer.callback_handler  # before Checkpoints, which records the checkpoint's files
        at = next((i for i, c in enumerate(handler.callbacks) if isinstance(c, Checkpoints)), len(handler.callbacks))
        handler.callbacks.insert(at, self)

    def on_step_end(self, args, state, control, **kwargs):
        self.guard.applied = not self.trainer.accelerator.optimizer_step_was_skipped
        if self.guard.settle(state.global_step) == "rollback":
            self.rollback(state.global_step)
        return control

    def rollback(self, step: int) -> None:
        from transformers.integrations.deepspeed import deepspeed_load_checkpoint

        from gptforge.model.lora import is_peft
        from gptforge.model.train.checkpoints import no_pickled_code

        ckpt = self.guard.rollback_point(self.out_dir / "checkpoints", step, pattern="checkpoint-*")
        with no_pickled_code():
            deepspeed_load_checkpoint(self.trainer.model_wrapped, str(ckpt),
                                      load_module_strict=not is_peft(self.trainer.model))
            if (ckpt / "scheduler.pt").is_file():  # the Trainer's own schedule, where DeepSpeed does not hold it
                self.trainer.lr_scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt"))
        if hasattr(self.trainer, "rolled_back"):  # async rollouts: the batches in flight dropped, these weights sent
            self.trainer.rolled_back(ckpt)

    def on_save(self, args, state, control, **kwargs):
        if self.guard.rank == 0:
            d = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            write_json_atomic(d / self.FILE, self.guard.state_dict())

    def final(self) -> dict:
        return {"bad_steps": self.guard.bad_steps, "rollbacks": self.guard.rollbacks}


def resume_point(out_dir: Path, stage: str, rank: int, world: int) -> str | None:
    """The newest complete Trainer checkpoint to resume from, if any (newer incomplete or changed ones skipped
    with a warning); log that we resume."""
    last = newest_valid_checkpoint(out_dir / "checkpoints", rank, world, pattern="checkpoint-*")
    if last and rank == 0:
        print(f"[{stage}] resumed from {last}", file=sys.stderr, flush=True)
    return str(last) if last else None


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


def use_reference(trainer, path: Path, model_cfg=None) -> None:
    """Make the model at `path` (preference.reference) the reference of a TRL GRPO or RLOO trainer, which otherwise
    builds its own from the policy's start (or, with adapters, disables them): loaded (partitioned under ZeRO-3,
    as the trainer's arguments set it up), given TRL's fused LM head and prepared as TRL prepares its own."""
    from transformers import AutoModelForCausalLM
    from trl.models.utils import prepare_deepspeed
    from trl.trainer.utils import add_fused_lm_head

    from gptforge.model.attention import load_kwargs

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=trainer.model.dtype, **load_kwargs(path, model_cfg))
    add_fused_lm_head(ref, temperature=trainer.temperature,
                      cast_lm_head_to_fp32=getattr(trainer.args, "cast_lm_head_to_fp32", False))
    trainer.ref_model = prepare_deepspeed(ref, trainer.accelerator)


def prompts_dataset(items: list[dict]):
    """The online prompts (gptforge.data.splits.online_prompts: prompt, answer and the rows' other columns) as the
    online trainers' dataset; TRL hands every column but the prompt to the reward functions."""
    from datasets import Dataset

    return Dataset.from_list(items)
