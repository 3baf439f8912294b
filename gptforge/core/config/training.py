"""The stages' own sections: pretraining, SFT, the reward model, the preference algorithms and their rewards, the
evaluation of finished outputs, and curation."""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import field_validator, model_validator

from gptforge.core.config.base import Algorithm, Section, Setting
from gptforge.core.declarations import EVALUATED, REWARDS, adapter_of, reward_kind
from gptforge.core.config.model_layout import LoraSection


class TrainSection(Section):
    enabled: bool = Setting(True, same_result=True, description="Run this stage.")
    lr: float = Setting(1e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr: float = Setting(1e-4, ge=0, description="Learning rate at the end of cosine decay.")
    warmup_steps: int = Setting(20, ge=0, description="Linear warmup steps.")
    max_steps: int = Setting(200, ge=1, description="Optimizer steps.")
    optimizer: Literal["adamw", "muon"] = Setting("adamw", description="adamw; or muon: DeepSpeed's Muon on the 2-D "
                                                  "hidden matrices, AdamW (lr) on embeddings, head, norms and biases.")
    muon_lr: float = Setting(0.02, gt=0, description="Peak learning rate of Muon's matrices (optimizer: muon).")
    muon_momentum: float = Setting(0.95, gt=0, lt=1, description="Muon's momentum (Nesterov), optimizer: muon.")
    schedule: Literal["cosine", "wsd"] = Setting("cosine", description="After warmup: cosine decay to min_lr; or wsd: "
                                                 "constant at lr, then a linear decay to min_lr over decay_fraction.")
    decay_fraction: float = Setting(0.2, gt=0, le=1, description="Share of max_steps the wsd schedule decays over, "
                                    "at the end (schedule: wsd).")
    micro_batch_size: int = Setting(16, ge=1, description="Sequences per process per forward pass.")
    global_batch_size: int = Setting(32, ge=1, description="Sequences per optimizer step over all processes.")
    weight_decay: float = Setting(0.1, ge=0, description="AdamW weight decay.")
    grad_clip: float = Setting(1.0, ge=0, description="Gradient norm clip (0 disables).")
    log_every: int = Setting(10, ge=1, same_result=True, description="Steps between log lines.")
    save_every: int = Setting(100, ge=1, same_result=True, description="Steps between step checkpoints.")
    keep_last: int = Setting(2, ge=1, same_result=True, description="Step checkpoints kept.")
    lora: LoraSection = Setting(default_factory=LoraSection, description="LoRA/QLoRA adapters (r=0: full weights).")
    spike_factor: float | None = Setting(None, gt=1, description="Skip a step whose loss is over this factor times "
                                         "the median of the last spike_window steps (None: off); model/train/guard.py.")
    spike_window: int = Setting(32, ge=1, description="Good steps whose median loss spike_factor is taken against.")
    max_bad_steps: int = Setting(3, ge=1, description="Bad steps (NaN/Inf loss or gradient norm, spikes) in a row "
                                 "after which the stage rolls back to its newest valid checkpoint.")
    max_rollbacks: int = Setting(2, ge=0, description="Rollbacks after which more bad steps fail the stage.")


class PretrainSection(TrainSection):
    eval_every: int = Setting(100, ge=1, same_result=True, description="Steps between evaluations of the held-out "
                              "loss (the stage's own; the preference stages' and distill's are their eval- steps).")
    seq_len: int = Setting(96, ge=8, description="Training sequence length in tokens.")
    eval_batches: int = Setting(8, ge=1, same_result=True, description="Val batches per evaluation.")
    document_mask: bool = Setting(False, description="Inside a window, attention and positions restart after each "
                                  "end-of-text token (Llama 3, OLMo); false: windows attend across documents (GPT-2).")
    compile: bool = Setting(False, same_result=True, description="torch.compile the model (DeepSpeed engine.compile): "
                            "a slower first step, faster ones after; needs a C++ compiler on the CPU.")


class SFTSection(TrainSection):
    eval_every: int = Setting(100, ge=1, same_result=True, description="Steps between evaluations of the held-out "
                              "loss (the stage's own; the preference stages' and distill's are their eval- steps).")
    lr: float = Setting(5e-4, gt=0, description="Peak learning rate (AdamW).")
    max_length: int = Setting(96, ge=8, description="Maximum tokens per conversation.")
    assistant_only_loss: bool = Setting(True, description="Loss on assistant tokens only (else the full sequence).")
    packing: bool = Setting(False, description="Pack several conversations into each sequence; positions restart and "
                            "attention stays within each conversation.")
    chat_template: str | None = Setting(None, description="Jinja chat template the SFT model is trained and saved "
                                        "with, in place of its own (None: its own; ChatML for a model without one).")
    on_too_long: Literal["skip", "truncate"] = Setting("skip", description="What to do with examples over max_length.")


class RewardSection(TrainSection):
    eval_every: int = Setting(100, ge=1, same_result=True, description="Steps between evaluations of the held-out "
                              "loss (the stage's own; the preference stages' and distill's are their eval- steps).")
    pretrained: str | None = Setting(None, description="Start the reward model from this model (hub name or local "
                                     "directory; a causal LM gets a new head) instead of the SFT output.")
    lr: float = Setting(5e-4, gt=0, description="Peak learning rate (AdamW).")
    max_length: int = Setting(96, ge=8, description="Maximum tokens per prompt+response.")
    on_too_long: Literal["skip", "truncate"] = Setting("skip", description="What to do with pairs over max_length.")
    margin: float = Setting(0.0, ge=0, description="Margin term of the pairwise loss.")
    center_rewards_coefficient: float = Setting(0.0, ge=0, description="Weight of the reward-centering term.")
    policy_samples: int = Setting(0, ge=0, description="Sample the SFT model on this many prompts and pair each wrong "
                                  "answer, as rejected, with the known one (demo data only).")
    sample_temperature: float = Setting(1.0, gt=0, description="Sampling temperature of policy_samples.")
    sample_max_new_tokens: int = Setting(8, ge=1, description="Longest answer sampled for policy_samples, in tokens.")


class DPOSection(Section):
    loss_type: str | list[str] = Setting("sigmoid", description="TRL DPO loss (sigmoid, ipo, hinge, robust, ...), or a "
                                         "list combined with equal weights ([sigmoid, sft] is RPO).")


class SamplingSection(Section):
    """How a stage that learns on its own samples draws them (gptforge.model.sampling.sampling)."""

    max_new_tokens: int = Setting(8, ge=1, description="Response length of on-policy sampling, in tokens.")
    temperature: float = Setting(1.0, gt=0, description="Sampling temperature of rollouts.")
    top_k: int = Setting(0, ge=0, description="Top-k of rollouts (0 disables).")
    top_p: float = Setting(1.0, gt=0, le=1, description="Top-p of rollouts.")


class OnlineSection(SamplingSection):
    """What each online algorithm (ppo, grpo, rloo) sets for itself: rollouts and the supervised ptx term (their
    rewards are preference.rewards, shared)."""

    ptx_coef: float = Setting(0.0, ge=0, description="Weight of the chosen responses' loss added at every update "
                              "(InstructGPT's PPO-ptx); 0 disables.")
    ptx_batch_size: int | None = Setting(None, ge=1, description="Rows of chosen responses in each update's ptx loss "
                                         "over all processes; None: as many as the update's responses.")
    overlong: Literal["none", "mask", "penalty"] = Setting("none", description="Responses cut at max_new_tokens: mask "
                                                           "(out of the loss, DAPO's) or penalty (overlong_buffer).")
    overlong_buffer: int = Setting(0, ge=0, description="penalty: the last tokens before max_new_tokens over which the "
                                   "reward falls linearly by up to overlong_penalty (DAPO's soft overlong shaping).")
    overlong_penalty: float = Setting(1.0, gt=0, description="penalty: what a response of max_new_tokens loses.")

    @model_validator(mode="after")
    def _overlong(self):
        if self.overlong_buffer > self.max_new_tokens:
            raise ValueError(f"overlong_buffer={self.overlong_buffer} is longer than max_new_tokens="
                             f"{self.max_new_tokens}: the penalty would start before the response does")
        if self.overlong == "penalty" and not self.overlong_buffer:
            raise ValueError("overlong=penalty needs overlong_buffer: the tokens before max_new_tokens over which "
                             "the penalty grows")
        return self

    def ptx_rows(self, micro_batch_size: int, world: int, micro_steps_per_update: int) -> int:
        """Rows of chosen responses on each process in each micro-batch of the ptx loss, when a policy update
        takes `micro_steps_per_update` micro-batches of `micro_batch_size` on each process."""
        per_update = self.ptx_batch_size or micro_batch_size * world * micro_steps_per_update
        return per_update // (world * micro_steps_per_update)


REWARD_BUILT_IN = tuple(REWARDS)  # gptforge.core.declarations: each declared once


class RewardSpec(Section):
    """One reward of the online stages: a built-in or the user's function by `name`, or a reward server at `url`."""

    name: str | None = Setting(None, description="A built-in (reward_model, exact_match, math_equal, format, length, "
                               "environment, reasoning_gym, unit_tests) or package.module:function; with url, its "
                               "metric's name.")
    url: str | None = Setting(None, description="A reward server: each batch as one JSON POST {prompts, responses, "
                              "answers, ...}, answered by {rewards: [...]}.")
    weight: float = Setting(1.0, description="Weight of this reward in the total.")
    timeout_s: float = Setting(30.0, gt=0, description="Seconds a reward server has to answer one try.")
    retries: int = Setting(3, ge=1, description="Tries of a reward server before the stage fails.")

    @model_validator(mode="after")
    def _known(self):
        if self.url is None and not self.name:
            raise ValueError("a reward needs a name (a built-in or package.module:function) or a url")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward url {self.url!r} is not an http:// or https:// address")
        if self.url is None and self.name not in REWARD_BUILT_IN:
            module, colon, attr = self.name.partition(":")
            if not (colon and module and attr.isidentifier()):
                close = difflib.get_close_matches(self.name, REWARD_BUILT_IN, n=1)
                raise ValueError(f"reward name {self.name!r} is neither a built-in ({', '.join(REWARD_BUILT_IN)}) "
                                 "nor package.module:function" + (f"; did you mean {close[0]!r}?" if close else ""))
        return self

    def label(self) -> str:
        """The name its mean is logged under: rewards/<label>."""
        if self.url is not None:
            return self.name or "remote"
        return self.name.partition(":")[2] or self.name


class PPOSection(OnlineSection):
    ppo_epochs: int = Setting(2, ge=1, description="Passes over each rollout batch.")
    gamma: float = Setting(1.0, ge=0, le=1, description="Discount factor.")
    lam: float = Setting(0.95, ge=0, le=1, description="GAE lambda.")
    cliprange: float = Setting(0.2, gt=0, description="Policy ratio clip.")
    cliprange_value: float = Setting(0.2, gt=0, description="Value clip.")
    critic_lr: float = Setting(1e-4, gt=0, description="Critic learning rate.")
    critic: str | None = Setting(None, description="The critic's start (hub name or local directory); None: the "
                                 "reward model (if it shares the policy's tokenizer), else the SFT model with a new "
                                 "value head.")
    kl_target: float | None = Setting(None, gt=0, description="Adaptive KL controller target (None: fixed beta).")
    kl_horizon: int = Setting(10000, ge=1, description="Adaptive KL controller horizon, in samples.")


class GroupSection(OnlineSection):
    """The online stages that sample a group of completions a prompt and take each one's advantage within it."""

    num_generations: int = Setting(4, ge=2, description="Completions per prompt.")
    dynamic_sampling: bool = Setting(False, description="Replace a group whose rewards are all equal (no advantage) "
                                     "by a group of a new draw, up to max_draws (DAPO's dynamic sampling).")
    max_draws: int = Setting(3, ge=1, description="dynamic_sampling: generation batches drawn for one step at most, "
                             "the first included; groups still equal then are trained as drawn.")


class GRPOSection(GroupSection):
    scale_rewards: Literal["group", "batch", "none"] = Setting(
        "group", description="Divide rewards less their group mean by the group's std, the batch's, or nothing "
        "(none, as Dr. GRPO).")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo"] = Setting(
        "dapo", description="TRL's GRPO loss: grpo (per-sequence mean), dr_grpo (a constant length), dapo (tokens of "
        "the batch), bnpo, cispo (clipped weights), sapo.")
    importance_sampling_level: Literal["token", "sequence"] = Setting(
        "token", description="The policy ratio per token, or per sequence (GSPO: the mean of its tokens' log-ratios).")
    epsilon_high: float | None = Setting(None, gt=0, description="The ratio's upper clip, 1 + epsilon_high (DAPO: "
                                         "0.28); cispo's bound on its weight itself. None: 0.2 (cispo: 5.0).")


class RLOOSection(GroupSection):
    pass


class RolloutSection(Section):
    """Where the online stages' rollouts are generated, and how the loss corrects for the policy they were sampled
    with (gptforge.model.sampling.engine, workers, offpolicy; docs/rollouts.md)."""

    mode: Literal["sync", "async"] = Setting("sync", description="sync: the training processes generate between "
                                             "updates; async: rollout workers generate the next batches meanwhile.")
    max_staleness: int = Setting(1, ge=0, description="async: updates the weights a batch was sampled with may be "
                                 "behind the trainer's when it trains on it (0: none; the same samples as sync).")
    workers: int = Setting(1, ge=1, same_result=True, description="async: rollout worker processes (Ray actors, one "
                           "engine each); each serves the batches of every workers-th training process.")
    engine: str = Setting("hf", description="What generates: hf (transformers' generate) or a package.module:Class "
                          "on the seam of gptforge.model.sampling.engine (docs/rollouts.md).")
    correction: Literal["none", "tis", "icepop"] = Setting("none", description="Off-policy correction of the policy "
                                                           "loss: truncated importance sampling, IcePop's band, none.")
    tis_cap: float = Setting(2.0, gt=0, description="tis: the cap of each token's ratio pi_train / pi_sampling.")
    icepop_band: tuple[float, float] = Setting((0.5, 5.0), description="icepop: a token's weight is its ratio "
                                               "pi_train / pi_sampling inside [low, high], 0 outside (Ring-1T's band).")
    max_mismatch: float | None = Setting(None, gt=0, description="A step whose KL from the sampling policy to the "
                                         "trainer's, per token, is over this is a bad step (None: logged only).")

    @model_validator(mode="after")
    def _band(self):
        low, high = self.icepop_band
        if not 0 <= low < 1 < high:
            raise ValueError(f"preference.rollout.icepop_band {list(self.icepop_band)}: give [low, high] with "
                             "0 <= low < 1 < high")
        return self


class SandboxSection(Section):
    """The limits of the sandbox model-written code runs in (gptforge.model.agents.sandbox): the `python` tool and
    the `unit_tests` reward."""

    wall_s: float = Setting(10.0, gt=0, description="Seconds a run may take, then everything in it is killed.")
    cpu_s: int = Setting(10, gt=0, description="CPU seconds a process of it may use (RLIMIT_CPU).")
    memory_mb: int = Setting(512, gt=0, description="Address space of a process of it, MiB (RLIMIT_AS), and the "
                             "memory of all its processes together where the host lets it have a cgroup.")
    processes: int = Setting(32, gt=0, description="Processes it may run at once (RLIMIT_NPROC of its own uid, and "
                             "its cgroup's pids.max).")
    open_files: int = Setting(64, gt=0, description="Files a process of it may hold open (RLIMIT_NOFILE).")
    output_bytes: int = Setting(16384, gt=0, description="Bytes of stdout (and of stderr) kept; past it the run is "
                                "killed and the output cut.")
    disk_mb: int = Setting(16, gt=0, description="Size of its scratch file system, MiB (and of any file it writes).")


class PreferenceSection(TrainSection):
    """What every preference algorithm shares; each algorithm's own fields are in its sub-section."""

    algorithm: Algorithm | list[Algorithm] = Setting("dpo", same_result=True,
                                                     description="Alignment algorithm(s); each runs as its own stage.")
    lr: float = Setting(5e-5, gt=0, description="Peak learning rate (AdamW).")
    min_lr: float = Setting(0.0, ge=0, description="Learning rate at the end of cosine decay.")
    beta: float = Setting(0.1, gt=0, description="KL strength (DPO beta, the initial KL coefficient of the others).")
    max_length: int = Setting(96, ge=8, description="Maximum tokens per prompt+response.")
    reward_model: str | None = Setting(None, description="A ready reward model (sequence classifier: hub name or local "
                                       "directory) that judges the policy; the pipeline then trains none.")
    rewards: list[RewardSpec] = Setting(default_factory=lambda: [RewardSpec(name="reward_model")],
                                        description="The online stages' rewards, weighed and summed: [{name, weight}] "
                                        "or [{url, weight}]; without reward_model there is no reward stage.")
    format_pattern: str | None = Setting(None, description="Regex the whole response must match for the format "
                                         "reward, e.g. '<think>.*</think>\\s*<answer>.*</answer>'.")
    length_target: int = Setting(64, ge=0, description="Tokens a response may have before the length reward "
                                 "subtracts one per token over.")
    reference: str | None = Setting(None, description="The reference policy (hub name or local directory); None: the "
                                    "SFT model (with adapters: the policy with its adapters disabled).")
    environment: str | None = Setting(None, description="package.module:Factory (TRL's conventions: reset(**row), "
                                      "methods as tools, get_reward()), openenv:module:Client or verifiers:<id> "
                                      "(docs/environments.md).")
    environment_url: str | None = Setting(None, description="openenv: the environment server's address (its "
                                          "websocket, http://host:port); one session an episode.")
    endpoint_host: str = Setting("127.0.0.1", same_result=True, description="verifiers: the address the policy's "
                                 "OpenAI-compatible endpoint binds to (its harnesses' model), in each rollout "
                                 "process.")
    endpoint_port: int = Setting(0, ge=0, le=65535, same_result=True, description="verifiers: its port (0: a free "
                                 "one, as every rollout process serves its own).")
    tools: list[str] = Setting([], description="Tools of the rollouts: package.module:function (type hints, a "
                               "docstring), python (the sandbox), mcp:<command> or an MCP server's URL.")
    max_turns: int = Setting(4, ge=1, description="Turns of the policy in one rollout with tools; a turn that calls "
                             "no tool ends it.")
    tool_timeout_s: float = Setting(15.0, gt=0, description="Seconds a tool call (and reset, get_reward) may take; "
                                    "past it, the model reads a timeout error (python: sandbox.wall_s + 5 at least).")
    tool_concurrency: int = Setting(16, ge=1, same_result=True, description="Tool calls, environment resets and "
                                    "rewards, and rewards a batch's episodes wait on at once, a process (1: in turn).")
    dpo: DPOSection = Setting(default_factory=DPOSection, description="DPO's own settings.")
    ppo: PPOSection = Setting(default_factory=PPOSection, description="PPO's own settings.")
    grpo: GRPOSection = Setting(default_factory=GRPOSection, description="GRPO's own settings.")
    rloo: RLOOSection = Setting(default_factory=RLOOSection, description="RLOO's own settings.")
    sandbox: SandboxSection = Setting(default_factory=SandboxSection, description="Limits of the sandbox the python "
                                      "tool and the unit_tests reward run model-written code in.")
    rollout: RolloutSection = Setting(default_factory=RolloutSection, description="Where PPO's, GRPO's and RLOO's "
                                      "rollouts are generated (sync or async), and their off-policy correction.")

    def algorithms(self) -> list[str]:
        return [self.algorithm] if isinstance(self.algorithm, str) else list(self.algorithm)

    def uses_reward_model(self) -> bool:
        """Whether a reward model is among the rewards (then it also judges the evaluation's win rate)."""
        return any((kind := reward_kind(r)) and kind.model for r in self.rewards)

    def reward_weight(self) -> float:
        """The reward model's weight in the total (0 where it has none): the scale of PPO's first values."""
        return sum(r.weight for r in self.rewards if (kind := reward_kind(r)) and kind.model)

    @model_validator(mode="after")
    def _rewards(self):
        if not self.rewards:
            raise ValueError("preference.rewards is empty: name at least one reward, e.g. [{name: reward_model}] or "
                             "[{name: math_equal}]")
        labels = [r.label() for r in self.rewards]
        for i, label in enumerate(labels):
            if label in labels[:i]:
                raise ValueError(f"preference.rewards[{i}]: a second reward logged as {label!r}; give it its own name")
        kinds = [k for k in map(reward_kind, self.rewards) if k is not None]
        if (episode := next((k for k in kinds if k.episode), None)) and not self.environment:
            raise ValueError(f"preference.rewards names {episode.name} but preference.environment is not set; set the "
                             "factory of the environment whose get_reward() it is")
        served = adapter_of(self.environment)
        if bool(served and served.url) != bool(self.environment_url):
            raise ValueError("preference.environment_url is the address of an openenv: environment's server: set "
                             "both or neither")
        if any(k.pattern for k in kinds):
            if not self.format_pattern:
                raise ValueError("preference.rewards names format but preference.format_pattern is not set; set the "
                                 "regex a response must match")
            import re

            try:
                re.compile(self.format_pattern)
            except re.error as e:
                raise ValueError(f"preference.format_pattern {self.format_pattern!r} is not a regex: {e}") from None
        if "python" in self.tools and self.tool_timeout_s < self.sandbox.wall_s + TOOL_MARGIN_S:
            raise ValueError(f"preference.tool_timeout_s ({self.tool_timeout_s:g}) must be at least "
                             f"preference.sandbox.wall_s ({self.sandbox.wall_s:g}) + {TOOL_MARGIN_S:g} with the python "
                             "tool: the sandbox ends a program at its wall time, and the tool must outlast that")
        return self


TOOL_MARGIN_S = 5.0  # the python tool's call over its sandbox's wall time: start-up, the kill, the reaping


class DistillSection(SamplingSection, TrainSection):
    """On-policy distillation (gptforge.stages.distill, docs/distill.md): the student samples the run's prompts
    (data.prompts, with preference.environment and preference.tools where set, through preference.rollout) and
    learns toward the teacher's next-token distribution at each of its own tokens."""

    enabled: bool = Setting(False, same_result=True, description="Run the distill stage.")
    teacher: str | None = Setting(None, description="The teacher: a stage of this run (sft, dpo, ppo, grpo, rloo) "
                                  "or a model (hub name or local directory) sharing the student's tokenizer.")
    student: str = Setting("sft", description="Where the student starts: a stage of this run (sft by default, or a "
                           "preference stage) or a model (hub name or local directory).")
    beta: float = Setting(1.0, ge=0, le=1, description="The divergence, in TRL's convention: 1 reverse KL(student "
                          "|| teacher), 0 forward KL(teacher || student), between: the generalised JSD.")
    teacher_top_k: int = Setting(0, ge=0, description="The divergence over the teacher's k most likely tokens a "
                                 "position, both renormalised there (a served teacher's); 0: the whole vocabulary.")
    teacher_engine: str = Setting("hf", description="What scores the samples under the teacher: hf (in the training "
                                  "processes) or package.module:Class on gptforge.model.sampling.engine's seam.")
    lr: float = Setting(5e-5, gt=0, description="Peak learning rate (AdamW).")
    min_lr: float = Setting(0.0, ge=0, description="Learning rate at the end of cosine decay.")
    max_length: int = Setting(96, ge=8, description="Maximum tokens per prompt+response (an episode with tools).")

    @model_validator(mode="after")
    def _teacher(self):
        if self.enabled and not self.teacher:
            raise ValueError("distill.enabled is true but distill.teacher is not set: name a stage of this run "
                             "(e.g. grpo) or a model (hub name or local directory)")
        if self.teacher and self.teacher == self.student:
            raise ValueError(f"distill.teacher and distill.student are both {self.teacher!r}: the student would "
                             "learn toward itself")
        return self


class EvalSection(Section):
    max_new_tokens: int = Setting(8, ge=1, description="Tokens generated per held-out item.")
    items: int = Setting(200, ge=1, description="Held-out items evaluated.")
    batch_size: int = Setting(64, ge=1, description="Items generated and scored together; the batches are fixed, "
                              "whatever the number of processes.")
    processes: Literal["auto", "one", "all"] = Setting(
        "auto", same_result=True, description="one process, or all of the distributed layout's (a share of the "
        "batches each); auto: all with a GPU here or nodes over ssh/slurm.")
    samples: int = Setting(0, ge=0, description="Answers sampled per held-out prompt after a preference stage for "
                           "pass@k of each reward but the reward model (k = samples; 0: none).")
    kv_cache: Literal["full", "fp8", "quanto-int4"] = Setting("full", description="KV cache of generation: full "
                                                             "precision, fp8 (per tensor), or int4 (optimum-quanto).")
    harness_tasks: list[str] = Setting([], description="lm-evaluation-harness tasks run on the exported model of "
                                       "each of harness_stages, e.g. [arc_easy]; gptforge_demo: the demo's held-out "
                                       "items.")
    harness_stages: list[Literal[EVALUATED]] = Setting(list(EVALUATED), description="The evaluated "
                                                              "stages whose evaluation step runs harness_tasks.")
    harness_include: list[str] = Setting([], description="Folders of the user's own task YAMLs for harness_tasks.")
    harness_limit: int | None = Setting(None, ge=1, description="Examples per harness task (None: all).")
    harness_num_fewshot: int | None = Setting(None, ge=0, description="Few-shot examples (None: each task's own).")


CURATE_FILTERS = ("gopher_quality", "gopher_repetition", "c4", "fineweb")  # datatrove's quality filters


class NearDedupSection(Section):
    """MinHash near-deduplication (datatrove's MinhashDedup* blocks): documents whose word n-gram sets overlap by
    `threshold` (Jaccard) or more are near duplicates; one of each cluster is kept."""

    enabled: bool = Setting(True, description="Remove near duplicates.")
    threshold: float = Setting(0.8, gt=0, le=1, description="Jaccard similarity of two documents' n-gram sets from "
                               "which they are near duplicates (each candidate pair is verified against it).")
    bands: int = Setting(14, ge=1, description="LSH bands (buckets): candidates share all the hashes of one band.")
    rows: int = Setting(8, ge=1, description="Hashes a band; bands x rows hashes a document.")
    ngram: int = Setting(5, ge=1, description="Words an n-gram (shingle).")


class DecontaminateSection(Section):
    """Documents sharing a word n-gram with anything the pipeline evaluates on are removed."""

    enabled: bool = Setting(True, description="Remove documents that hold evaluation items.")
    ngram: int = Setting(13, ge=1, description="Words an n-gram; an evaluation item shorter than this is matched "
                         "whole.")
    min_words: int = Setting(8, ge=1, description="Shortest evaluation item matched (shorter ones would match "
                             "everyday phrases).")
    extra: list[str] = Setting([], description="More files of evaluation items (text lines, or JSON rows with "
                               "prompt/answer, question/answer or text) to decontaminate against.")


class CurateSection(Section):
    """The curate stage (before tokenize): datatrove's blocks on Ray, on the local instance or tokenizer.cluster."""

    enabled: bool = Setting(False, description="Curate curate.sources before the stages that read them (they read "
                            "its output).")
    sources: list[Literal["pretrain", "sft", "preference"]] = Setting(["pretrain"], description="The data sources "
                                                                       "curated: pretrain by every pass; sft and "
                                                                       "preference by PII, decontamination and dedup "
                                                                       "of their training rows (held-out rows stay).")
    exact_dedup: bool = Setting(True, description="Remove exact duplicates (the text's hash), keeping one.")
    near_dedup: NearDedupSection = Setting(default_factory=NearDedupSection, description="MinHash near-dedup.")
    filters: dict[str, dict] = Setting({}, description="Quality filters in order, each with its arguments: "
                                       "gopher_repetition, gopher_quality, c4, fineweb, e.g. {c4: {}}.")
    pii: bool = Setting(True, description="Replace email and IP addresses (datatrove's PIIFormatter).")
    languages: list[str] = Setting([], description="Keep documents in these languages (ISO 639-1, e.g. [en]); "
                                   "empty: no language filter.")
    language_model: str = Setting("lingua", description="Language identification: lingua (its models ship with "
                                  "it, offline) or the path of a local fastText model (lid.176.bin).")
    language_threshold: float = Setting(0.65, gt=0, le=1, description="Smallest confidence of a kept language.")
    decontaminate: DecontaminateSection = Setting(default_factory=DecontaminateSection,
                                                  description="n-gram decontamination against the evaluation data.")
    tasks: int = Setting(0, ge=0, same_result=True, description="datatrove tasks a pass (0: one a unit of the "
                         "source, at most 256); the output is the same for any number.")
    examples: int = Setting(3, ge=0, same_result=True, description="Removed documents shown for each reason in the "
                            "report.")

    @field_validator("filters")
    @classmethod
    def _known_filters(cls, filters: dict) -> dict:
        for name in filters:
            if name not in CURATE_FILTERS:
                close = difflib.get_close_matches(name, CURATE_FILTERS, n=1)
                raise ValueError(f"unknown filter {name!r}; filters: {', '.join(CURATE_FILTERS)}"
                                 + (f"; did you mean {close[0]!r}?" if close else ""))
        return filters

    @field_validator("languages")
    @classmethod
    def _iso_codes(cls, languages: list[str]) -> list[str]:
        for lang in languages:
            if not (len(lang) == 2 and lang.isalpha() and lang.islower()):
                raise ValueError(f"{lang!r} is not an ISO 639-1 code (two letters, e.g. en)")
        return languages
