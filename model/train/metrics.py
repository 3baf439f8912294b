"""One vocabulary of metrics for every stage, ours and the TRL ones: the same name, the same meaning, in the
JSONL log, TensorBoard, the manifest and the report. `MetricsLog` refuses a name that is not in
`NAMES`; `from_trainer` translates what TRL's trainers log into these names."""

from __future__ import annotations

import json
from pathlib import Path

from gptforge.model.train import tracking

# name -> what it means (units where it has them)
NAMES = {
    # training steps
    "loss": "training loss of the step, mean over its micro-batches and processes",
    "lr": "learning rate of the step",
    "grad_norm": "global gradient norm before clipping",
    "tokens_per_sec": "training stages: tokens of the training batches (padding excluded, all processes) per second "
                      "spent in training steps, leaving out evaluation, checkpoints and the first 5 steps of each "
                      "start; tokenize: tokens encoded and written per second",
    "mfu": "model FLOPs utilisation: achieved over peak dense bf16 FLOP/s (null where the peak is unknown)",
    "train_loss": "the last logged training loss",
    "global_step": "optimizer steps taken",
    "val_loss": "mean next-token loss on held-out data (nats/token)",
    "val_ppl": "exp(val_loss)",
    "base_val_loss": "val_loss of the stage's input model, before training",
    "unigram_entropy": "entropy of the training tokens' frequencies (nats/token): the loss of a context-blind model",
    "parameters": "model parameters (tied weights counted once)",
    "active_parameters": "parameters one token passes through: a mixture of experts counts its routed experts only",
    "flops_per_token": "training FLOPs per token (6 x active parameters, plus attention)",
    "aux_loss": "mixture of experts: the routers' load-balancing loss (before router_aux_loss_coef), mean over the "
                "step; the training loss excludes it",
    "peak_host_memory_gib": "the largest peak resident host memory of any one process of the stage (GiB)",
    "peak_device_memory_gib": "the largest peak accelerator memory allocated by any one process of the stage (GiB)",
    # preference pairs
    "reward_accuracy": "share of held-out pairs whose chosen response the reward model scores higher",
    "reward_margin": "mean reward of chosen minus rejected, held-out pairs",
    "train_reward_accuracy": "share of the step's training pairs ranked chosen over rejected (reward model or DPO's "
                             "implicit reward)",
    "train_reward_margin": "mean reward of chosen minus rejected in the step's training pairs",
    "chosen_rewards": "mean reward of the step's chosen responses (reward model or DPO's implicit reward)",
    "rejected_rewards": "mean reward of the step's rejected responses",
    "chosen_logps": "mean log-probability of the step's chosen responses under the policy (nats)",
    "rejected_logps": "mean log-probability of the step's rejected responses under the policy (nats)",
    "token_accuracy": "share of the step's chosen-response tokens the policy predicts (argmax)",
    # online algorithms
    "reward_mean": "mean reward of the policy's responses",
    "reward_std": "standard deviation of the rewards of the policy's responses",
    "frac_reward_zero_std": "share of prompt groups whose responses all got the same reward",
    "kl": "KL(policy || reference) in nats per response",
    "kl_stderr": "standard error of the held-out kl estimate (a small negative kl within it is noise)",
    "kl_per_token": "KL(policy || reference) in nats per response token",
    "kl_coef": "KL penalty coefficient",
    "entropy": "mean entropy of the policy's next-token distribution over response tokens (nats)",
    "response_length": "mean response length in tokens (the policy's own, with tools)",
    "turns_per_episode": "mean turns of the policy in a rollout with tools",
    "tool_calls_per_episode": "mean tool calls in a rollout (held out: an episode of the policy's)",
    "sft_tool_calls_per_episode": "held out: mean tool calls in an episode of the SFT model's",
    "tool_wait_s": "seconds the step's rollouts waited on tools, environment resets and get_reward() (wall time, "
                   "mean over the processes; preference.tool_concurrency runs them at once)",
    "tool_errors": "tool calls that failed (an exception, a timeout, a malformed or unknown call) in the step",
    "policy_loss": "PPO clipped surrogate loss",
    "value_loss": "PPO clipped value loss",
    "clip_frac": "share of response tokens where the clipped policy ratio was taken",
    "ptx_loss": "loss of the preference pairs' chosen responses (PPO-ptx)",
    "gen_tokens_per_sec": "response tokens sampled per second (all processes)",
    "rollout/staleness": "updates the weights that sampled the step's rollouts were behind the trainer's",
    "rollout/version": "the version (updates behind them) of the weights that sampled the step's rollouts",
    "rollout/truncated": "PPO: share of the step's responses cut at their length budget (overlong: mask leaves them "
                         "out of the loss)",
    "rollout_wait_s": "seconds the trainer spent getting the step's rollouts: sampling them (sync) or waiting (async)",
    "rollout/zero_advantage_groups": "GRPO, RLOO: share of the step's first draw of groups whose rewards were "
                                     "all equal (no advantage; what dynamic_sampling replaces)",
    "rollout/zero_advantage_trained": "GRPO, RLOO: share of the groups trained whose rewards are all equal",
    "rollout/draws": "GRPO, RLOO: generation batches drawn for the step (more than one with dynamic_sampling)",
    "mismatch/logp_abs_diff": "mean |log pi_train - log pi_sampling| over the rollouts' policy tokens",
    "mismatch/kl": "KL(sampling policy || trainer's) per policy token (k3 estimate); preference.rollout.max_mismatch",
    "mismatch/ratio_p05": "5th percentile of pi_train / pi_sampling over the policy tokens",
    "mismatch/ratio_p50": "median of pi_train / pi_sampling over the policy tokens",
    "mismatch/ratio_p95": "95th percentile of pi_train / pi_sampling over the policy tokens",
    "mismatch/capped": "share of policy tokens whose ratio preference.rollout.tis_cap capped",
    "mismatch/masked": "share of policy tokens outside preference.rollout.icepop_band, left out of the loss",
    "distill_kl": "distill: KL(student || teacher) per student token over the teacher's support (whole vocabulary "
                  "or its top k), whatever distill.beta",
    "teacher_logp": "distill: mean log-probability of the student's sampled tokens under the teacher (nats/token)",
    "teacher_scored_tokens": "distill: the student's sampled tokens the teacher scored over the whole run",
    "student_logp": "distill: mean log-probability of the student's sampled tokens under the student (nats/token)",
    "bad_steps": "steps skipped: NaN/Inf loss, reward or gradient norm, or a loss spike (model/train/guard.py)",
    "rollbacks": "returns to the newest valid checkpoint after max_bad_steps bad steps in a row",
    # held-out evaluation of a finished output
    "exact_match": "share of held-out items whose greedy answer is the known answer",
    "base_exact_match": "exact_match of the stage's input model in the same prompt format",
    "sft_exact_match": "exact_match of the SFT model",
    "rouge_l": "mean ROUGE-L F1 (longest common word subsequence) of held-out greedy answers against the reference "
               "answers",
    "base_rouge_l": "rouge_l of the stage's input model in the same prompt format",
    "sft_reward_mean": "mean reward of the SFT model's greedy answers to the held-out prompts",
    "unscored": "the reference-based metrics the evaluation data could not give, and why",
    "win_rate_vs_sft": "share of held-out prompts where the reward model prefers the policy's answer to the SFT "
                       "model's (ties count half)",
    "start_reward_mean": "distill: sft_reward_mean of the model the student started from",
    "teacher_reward_mean": "distill: sft_reward_mean of the teacher",
    "start_exact_match": "distill: exact_match of the model the student started from",
    "teacher_exact_match": "distill: exact_match of the teacher",
    "win_rate_vs_start": "distill: win_rate_vs_sft against the model the student started from",
    "win_rate_vs_teacher": "distill: win_rate_vs_sft against the teacher",
    "kl_teacher": "distill: KL(student || teacher) in nats per response, on held-out samples of the student",
    "kl_teacher_stderr": "standard error of the held-out kl_teacher estimate",
    "start_tool_calls_per_episode": "distill, held out: mean tool calls in an episode of the model it started from",
    "teacher_tool_calls_per_episode": "distill, held out: mean tool calls in an episode of the teacher",
    "eval_items": "held-out items evaluated",
    # data
    "vocab_size": "tokens in the vocabulary, special tokens included",
    "tokens": "tokens written to the shards",
    "train_tokens": "tokens in the train shards",
    "val_tokens": "tokens in the val shards",
    "bytes": "UTF-8 bytes of the documents encoded",
    "documents": "documents encoded",
    "tokenizer_sha256": "sha256 of tokenizer.json",
    "bad_rows": "rows skipped as malformed (each named by file and line in the log)",
    "skipped_no_assistant_turn": "conversations skipped for having no assistant turn",
    "skipped_too_long": "examples skipped for exceeding max_length",
    "skipped_identical": "preference pairs skipped for identical responses",
    "truncated": "examples truncated to max_length",
    "policy_samples": "answers sampled from the SFT model for the reward model's extra pairs",
    "policy_pairs": "pairs added from the SFT model's wrong answers",
    # curation
    "documents_in": "documents the curate stage read",
    "documents_kept": "documents the curate stage kept (what tokenize reads)",
    "bytes_in": "UTF-8 bytes of the documents the curate stage read",
    "bytes_kept": "UTF-8 bytes of the documents it kept",
}

HARNESS = "harness/"  # harness/<task>/<metric>[/<filter>]: an lm-evaluation-harness score (gptforge.model.eval.harness)
# Families of names, by prefix: the harness tasks, and one name per reward of preference.rewards (its label)
FAMILIES = {
    HARNESS: "an lm-evaluation-harness score",
    "rewards/": "rewards/<label>: mean of that reward over the step's responses, before weighing",
    "accuracy/": "accuracy/<label>: held-out mean of that reward over the policy's greedy answers (for a 0/1 check, "
                 "its accuracy)",
    "sft_accuracy/": "sft_accuracy/<label>: the same over the SFT model's greedy answers",
    "pass@": "pass@<k>/<label>: held-out share of prompts with a positive reward among k sampled answers",
    "sft_pass@": "sft_pass@<k>/<label>: the same for the SFT model",
    "start_accuracy/": "distill: start_accuracy/<label>, the same over the greedy answers of the model the student "
                       "started from",
    "teacher_accuracy/": "distill: teacher_accuracy/<label>, the same over the teacher's",
    "start_pass@": "distill: start_pass@<k>/<label>, pass@k of the model the student started from",
    "teacher_pass@": "distill: teacher_pass@<k>/<label>, pass@k of the teacher",
    "removed/": "removed/<reason>: documents the curate stage removed for that reason (exact_duplicate, "
                "near_duplicate, contaminated, language, or a quality filter's name)",
    "sft/": "sft/<name>: the curate stage's funnel over data.sft's training rows (documents_in, documents_kept, "
            "bytes_in, bytes_kept, bad_rows, removed/<reason>)",
    "preference/": "preference/<name>: the same over data.preference's training rows",
}

# What TRL's trainers log, in our names; their other keys are left out.
TRL_NAMES = {
    "loss": "loss", "learning_rate": "lr", "grad_norm": "grad_norm", "ptx_loss": "ptx_loss", "entropy": "entropy",
    "rewards/chosen": "chosen_rewards", "rewards/rejected": "rejected_rewards",
    "rewards/margins": "train_reward_margin", "rewards/accuracies": "train_reward_accuracy",
    "logps/chosen": "chosen_logps", "logps/rejected": "rejected_logps", "mean_token_accuracy": "token_accuracy",
    "reward": "reward_mean", "reward_std": "reward_std", "frac_reward_zero_std": "frac_reward_zero_std",
    "kl": "kl_per_token", "completions/mean_length": "response_length", "clip_ratio/region_mean": "clip_frac",
    "aux_loss": "aux_loss", "turns_per_episode": "turns_per_episode",
    "tool_calls_per_episode": "tool_calls_per_episode", "tool_errors": "tool_errors", "tool_wait_s": "tool_wait_s",
}
# Measures of how a run went (speed, memory) rather than of what it computed: they differ between two runs that
# computed the same thing.
MEASURED = {"tokens_per_sec", "gen_tokens_per_sec", "rollout_wait_s", "tool_wait_s", "mfu", "peak_host_memory_gib",
            "peak_device_memory_gib"}
WARMUP_STEPS = 5  # steps after each start left out of tokens_per_sec (compilation, allocator warm-up)


def check_names(metrics: dict) -> None:
    unknown = sorted(k for k in set(metrics) - set(NAMES) if not k.startswith(tuple(FAMILIES)))
    if unknown:
        raise ValueError(f"metric names outside the vocabulary (gptforge.model.train.metrics.NAMES): {unknown}")


def from_trainer(logs: dict) -> dict:
    """A TRL log record in our names: TRL's per-token KL also as `kl` per response (its mean over completion
    tokens times their mean length); each reward function's rewards/<label>/mean as rewards/<label>."""
    out = {TRL_NAMES[k]: v for k, v in logs.items() if k in TRL_NAMES}
    out |= {k.removesuffix("/mean"): v for k, v in logs.items() if k.startswith("rewards/") and k.endswith("/mean")}
    out |= {k: v for k, v in logs.items() if k.startswith(("rollout/", "mismatch/"))}  # gptforge.model.trainers.online
    if "kl_per_token" in out and "response_length" in out:
        out["kl"] = out["kl_per_token"] * out["response_length"]
    return out


class MetricsLog:
    """Rank 0 writes each record as a JSONL line and TensorBoard scalars (`logs/metrics.jsonl`, `logs/tb`), and to
    MLflow when the stage is tracked (gptforge.model.train.tracking),
    tagged by the metric's name alone, so that the curves of every stage line up. A resumed run first drops
    what a killed run logged after the checkpoint it resumes from."""

    def __init__(self, log_dir: Path, rank: int, resume_step: int = 0):
        self.rank = rank
        if rank != 0:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(log_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, **metrics) -> None:
        check_names(metrics)
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        tracking.log_step(step, metrics)
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def close(self) -> None:
        if self.rank == 0:
            self.tb.close()


class Throughput:
    """`tokens_per_sec` as every stage counts it (see NAMES). `step(seconds, tokens)` after each training step
    with this process's tokens; `reduce` sums a count over processes (identity where counts are global already).
    Every process must call `window_rate` and `rate` together: they reduce."""

    def __init__(self, reduce=lambda tokens: tokens, warmup: int = WARMUP_STEPS):
        self.reduce, self.warmup, self.steps = reduce, warmup, 0
        self._window = [0.0, 0]  # seconds, tokens since the last window_rate
        self._total = [0.0, 0]
        self._all = [0.0, 0]  # warm-up included: the rate of a start too short to have timed steps

    def step(self, seconds: float, tokens: int) -> None:
        self.steps += 1
        self._all[0] += seconds
        self._all[1] += tokens
        if self.steps > self.warmup:
            for acc in (self._window, self._total):
                acc[0] += seconds
                acc[1] += tokens

    def window_rate(self) -> float | None:
        """tokens_per_sec since the last call (None while only warm-up steps were taken)."""
        (seconds, tokens), self._window = self._window, [0.0, 0]
        tokens = self.reduce(tokens)
        return tokens / seconds if seconds else None

    def rate(self) -> float | None:
        """tokens_per_sec over every timed step of this start; over all its steps, warm-up included, where it took
        no more than the warm-up."""
        seconds, tokens = self._total if self._total[0] else self._all
        tokens = self.reduce(tokens)
        return round(tokens / seconds, 1) if seconds else None


def step_line(step: int, loss: float, lr: float, tokens_per_sec: float | None, mfu: float | None | bool = False) -> str:
    """A logged step as every training stage prints it (our loops and a TRL Trainer's logs alike); `mfu`: False
    where the stage reports none."""
    shown = "" if mfu is False else f" | mfu {'n/a' if mfu is None else format(mfu, '.1%')}"
    rate = "n/a" if tokens_per_sec is None else f"{tokens_per_sec:,.0f}"
    return f"step {step:6d} | loss {loss:.4f} | lr {lr:.2e} | {rate} tok/s{shown}"

