"""Every stage of the pipeline, declared once: what it is, what it reads, what it writes and how its processes start.
The config's lists of algorithms and sequence-parallel sections, the stage store (fingerprints, manifests), the
preflight, the launcher, the flow, the report, the planner and the CLI read this table and never a stage's name;
none of them imports a stage's module, which holds its body and is imported only by the processes that run it (a TRL
stage's module imports transformers' Trainer, PEFT and TRL: seconds that a pipeline's flow process never spends).

It lives in core, the layer every other imports, so that the config schema can take its algorithm names from it;
the functions that read a config to answer for a stage (which run in a pipeline, the models it names) are in
gptforge.core.registry. Adding a stage is a module `gptforge/stages/<name>.py` with `run(cfg, inputs, out_dir) ->
metrics`, its `Stage` here, its config section (gptforge.core.config.training) and its docs
(docs/architecture.md: "A stage"). Each stage evaluated on held-out data has an evaluation step after it
(`eval-<stage>`, computed by gptforge.stages.evaluate), declared here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gptforge.core.files import MODEL_OUTPUTS


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline.

    What it reads and writes:
    - `inputs`: the steps whose outputs it reads (before gptforge.pipeline.store.upstream drops those a config
      leaves out); `unused_inputs`: {input: cfg -> whether this config leaves that input unread}; `read_by`:
      (cfg, reading stage's declaration) -> whether a stage that lists this one among its inputs reads it (None:
      always), for a stage that a config can leave out of the pipeline;
    - `sections`: the config sections whose fields can change its result (`section` or `section.sub`; a section
      listed with its sub-sections counts without them); `seeded`: whether run.seed can, too. The store hashes
      them into its fingerprint (gptforge.pipeline.store.stage_config);
    - `data`: the `data.<name>` source it reads, if any; `reads`: what it learns from (`pairs`: preference pairs;
      `prompts`: prompts it samples, from data.prompts where set); `data_sources`: cfg -> the sources it reads
      where the config chooses them (curate's);
    - `outputs`: {name: path in its output folder}, hashed into its manifest (a `funnel` is drawn by the report
      and shown in Prefect's UI);
    - `named`: the models it reads by name where the config sets them, rather than from an upstream stage's output
      (gptforge.core.registry.named_models): `tokenizer` (tokenizer.pretrained, else model.pretrained's), `model`
      (model.pretrained), `base` (model.pretrained where the run does not pretrain it), `reward.pretrained`,
      `preference.reward_model`, `preference.reference`, `preference.ppo.critic`.

    What it is:
    - `section`: the config section of its training settings (every preference algorithm shares `preference`);
      `length`: that section's sequence length field; `dense_mask`: its field that turns on a whole (s, s)
      attention mask (the planner counts it); `ulysses_mask`: its field of a mask that DeepSpeed-Ulysses cannot
      keep (the config refuses both at once);
    - `rewarded`: preference.rewards score what it samples (an online algorithm), or the answers it evaluates;
      `async_rollouts`: preference.rollout (engines, workers, async) samples for it; `trainer`: the TRL Trainer
      that runs it (`DPO`, `GRPO`, `RLOO`; it samples with its own policy unless a rollout engine samples ahead),
      None for gptforge's own loops;
    - `loss_units`: what its logged `loss` is, where not the next-token loss (nats/token);
    - `gpus`: whether it holds the team's GPU slots (run.slots) while it runs;
    - `switch`: cfg -> whether the config runs it, for a stage outside the chain tokenize -> pretrain -> sft ->
      reward -> preference (it runs after them: distill);
    - `compared_with`: what its evaluation step compares its model with, {name: what}: a stage of the run, or the
      config key that names a stage or a model (gptforge.model.pretrained.stage_or_model); each one's figures are
      logged under its name (`sft_accuracy/<label>`, `win_rate_vs_sft`, ...).

    How it starts:
    - `launcher`: `single` (one process, no launcher), `ranks` (every rank under distributed.launcher) or
      `accelerate` (every rank, with accelerate's environment: a TRL Trainer);
    - `sequence_parallel`: whether distributed.sequence_parallel ranks share each of its sequences (DeepSpeed-
      Ulysses), its data parallelism over the rest;
    - `code_version`: raised when its code computes something else from the same config and inputs, so that
      stored outputs (and what follows them) are recomputed rather than reused.
    """

    name: str
    module: str
    inputs: tuple[str, ...] = ()
    sections: tuple[str, ...] = ()
    seeded: bool = True
    data: str | None = None
    outputs: dict[str, str] = field(default_factory=lambda: dict(MODEL_OUTPUTS))
    launcher: str = "ranks"
    code_version: int = 1
    sequence_parallel: bool = False
    section: str | None = None
    length: str = "max_length"
    dense_mask: str | None = None
    ulysses_mask: str | None = None
    reads: str | None = None
    rewarded: bool = False
    async_rollouts: bool = False
    trainer: str | None = None
    loss_units: str | None = None
    gpus: bool = True
    unused_inputs: dict[str, Callable[[Any], bool]] = field(default_factory=dict)
    named: tuple[str, ...] = ()
    data_sources: Callable[[Any], tuple[str, ...]] | None = None
    switch: Callable[[Any], bool] | None = None
    read_by: Callable[[Any, Any], bool] | None = None
    compared_with: dict[str, str] = field(default_factory=lambda: {"sft": "sft"})

    @property
    def evaluates(self) -> str | None:
        """The stage an evaluation step evaluates (eval-<stage>), else None."""
        return self.name.removeprefix("eval-") if self.module == "evaluate" else None


def _curated(cfg) -> tuple[str, ...]:
    """The sources curate reads: those it curates, and everything it decontaminates against."""
    if not cfg.curate.decontaminate.enabled:
        return tuple(cfg.curate.sources)
    return ("pretrain", "sft", "preference") + tuple(d for d in ("prompts", "eval")
                                                     if getattr(cfg.data, d).path is not None)


def _unnamed(stage: str) -> Callable[[Any], bool]:
    """Whether a config leaves `stage` out of distill's teacher and student (then distill does not read it)."""
    return lambda cfg: stage not in (cfg.distill.teacher, cfg.distill.student)


PAIRWISE = "pairwise loss (nats/pair)"  # the reward model's Bradley-Terry loss and DPO's: one number a pair
POLICY = "policy loss (per token)"  # GRPO's and RLOO's: a policy objective, not a likelihood
DIVERGENCE = "divergence to the teacher (nats/token)"  # distill's: distill.beta's KL or JSD per student token
EVAL_OUTPUTS = {"answers": "answers.jsonl", "harness": "harness"}

_TRAINED = [
    # tokenize 2: streamed in units, shards format 2 (index with counts and max id); 3: its chat template renders
    # tools (Hermes). Its own Ray workers, no GPU.
    # curate: only where curate.enabled, and an input only of the stages whose data it curates (curate.sources)
    Stage("curate", "curate", sections=("curate", "eval.harness_tasks", "eval.harness_include"), seeded=False,
          data="pretrain", data_sources=_curated,
          read_by=lambda cfg, reader: cfg.curate.enabled and reader.data in cfg.curate.sources,
          outputs={"documents": "documents", "sft": "sft", "preference": "preference", "removed": "removed",
                   "funnel": "funnel.json", "decontamination": "decontamination.json"}, launcher="single"),
    Stage("tokenize", "tokenize", ("curate",), ("tokenizer",), seeded=False, data="pretrain",
          outputs={"tokenizer": "tokenizer", "shards": "shards"}, launcher="single", code_version=3, gpus=False,
          named=("tokenizer",)),
    Stage("pretrain", "pretrain", ("tokenize",), ("model", "pretrain"), sequence_parallel=True, section="pretrain",
          length="seq_len", dense_mask="document_mask", ulysses_mask="document_mask", named=("model",),
          read_by=lambda cfg, reader: cfg.pretrain.enabled),  # a run from model.pretrained may not pretrain
    Stage("sft", "sft", ("curate", "pretrain"), ("sft",), data="sft", sequence_parallel=True, section="sft",
          ulysses_mask="packing", named=("base",)),
    # a reward model started from reward.pretrained reads SFT's output only to sample it (reward.policy_samples)
    Stage("reward", "reward", ("curate", "sft"), ("reward",), data="preference", section="reward", reads="pairs",
          loss_units=PAIRWISE, named=("reward.pretrained",),
          read_by=lambda cfg, reader: cfg.trains_reward_model(),  # none with a ready reward model, or no reward model
          unused_inputs={"sft": lambda cfg: bool(cfg.reward.pretrained) and not cfg.reward.policy_samples}),
    Stage("dpo", "dpo", ("curate", "sft"), ("preference", "preference.dpo"), data="preference",  # no reward model
          launcher="accelerate", sequence_parallel=True, section="preference", reads="pairs", trainer="DPO",
          loss_units=PAIRWISE, named=("preference.reference",)),
    Stage("ppo", "ppo", ("curate", "sft", "reward"), ("preference", "preference.ppo"), data="preference",
          section="preference", reads="prompts", rewarded=True, async_rollouts=True,
          named=("preference.reward_model", "preference.reference", "preference.ppo.critic")),
    Stage("grpo", "grpo", ("curate", "sft", "reward"), ("preference", "preference.grpo"), data="preference",
          launcher="accelerate", sequence_parallel=True, section="preference", reads="prompts", rewarded=True,
          async_rollouts=True, trainer="GRPO", loss_units=POLICY,
          named=("preference.reward_model", "preference.reference")),
    Stage("rloo", "rloo", ("curate", "sft", "reward"), ("preference", "preference.rloo"), data="preference",
          launcher="accelerate", sequence_parallel=True, section="preference", reads="prompts", rewarded=True,
          async_rollouts=True, trainer="RLOO", loss_units=POLICY,
          named=("preference.reward_model", "preference.reference")),
]
# distill: a student (distill.student: sft by default, a preference stage or a model) learns toward a teacher
# (distill.teacher: a stage of the run or a model) on its own samples of the prompts; it reads the stages they name
NAMEABLE = tuple(s.name for s in _TRAINED if s.section in ("sft", "preference"))
_DISTILL_MODELS = {"start": "distill.student", "teacher": "distill.teacher"}
_TRAINED.append(Stage(
    "distill", "distill", ("curate", *NAMEABLE), ("distill", "preference.environment", "preference.tools",
                                                   "preference.max_turns", "preference.tool_timeout_s",
                                                   "preference.sandbox",
                                                   "preference.rollout"),
    data="preference", section="distill", reads="prompts", async_rollouts=True, loss_units=DIVERGENCE,
    named=tuple(_DISTILL_MODELS.values()), unused_inputs={s: _unnamed(s) for s in NAMEABLE},
    switch=lambda cfg: cfg.distill.enabled, compared_with=_DISTILL_MODELS))
STAGE_OR_MODEL = tuple(_DISTILL_MODELS.values())  # the settings that take a stage of the run (NAMEABLE) or a model
STAGES: dict[str, Stage] = {s.name: s for s in [
    *_TRAINED,
    # evaluation steps: one process unless eval.processes (gptforge.pipeline.launch.nodes.evaluation_on_every_rank); the
    # store picks the eval fields each one reads (gptforge.pipeline.store.eval_config). A policy's answers are
    # scored by preference.rewards, with pass@k over eval.samples; SFT's by the demo's exact match.
    Stage("eval-sft", "evaluate", ("sft", "pretrain"), ("eval",), outputs=EVAL_OUTPUTS, launcher="single",
          named=("base",)),
    *[Stage(f"eval-{s.name}", "evaluate", (s.name, "sft", "reward"), ("eval",), outputs=EVAL_OUTPUTS,
            launcher="single", rewarded=True, named=("preference.reward_model",))
      for s in _TRAINED if s.section == "preference"],
    Stage("eval-distill", "evaluate", ("distill", *NAMEABLE, "reward"), ("eval",), outputs=EVAL_OUTPUTS,
          launcher="single", rewarded=True, named=("preference.reward_model", *_DISTILL_MODELS.values()),
          unused_inputs={s: _unnamed(s) for s in NAMEABLE}),
]}

# What the config schema takes from the table: preference.algorithm's names, those rewarded by preference.rewards,
# the sections of training settings, and the sections whose sequences Ulysses splits (their length and the mask it
# cannot keep).
ALGORITHMS = tuple(s.name for s in _TRAINED if s.section == "preference")
ONLINE_ALGORITHMS = tuple(a for a in ALGORITHMS if STAGES[a].rewarded)
TRAINED_SECTIONS = tuple(dict.fromkeys(s.section for s in _TRAINED if s.section))
ULYSSES_SPLITS = {s.section: (s.length, s.ulysses_mask) for s in _TRAINED if s.ulysses_mask}
DENSE_MASKS = {s.section: s.dense_mask for s in _TRAINED if s.dense_mask}
EVALUATED = tuple(s.evaluates for s in STAGES.values() if s.evaluates)


def data_parallel(dist, step: str) -> int:
    """The data-parallel world of a step (`dist`: the distributed section): the world, over
    distributed.sequence_parallel where the step takes it (the schema's batch rules and the stages both divide by
    it)."""
    return dist.world_size // (dist.sequence_parallel if STAGES[step].sequence_parallel else 1)


# --- rewards and environment adapters, each declared once ----------------------------------------------------------


@dataclass(frozen=True)
class Adapter:
    """A library whose objects gptforge adapts, named in a setting by its prefix (`openenv:...`, `verifiers:...`,
    `reasoning_gym:...`); gptforge.model.agents.environments and gptforge.data.procedural implement each.

    - `library`: the library's name, as users know it; `extra`: the module it needs, of an optional extra
      (gptforge.core.extras);
    - `environment`: `preference.environment` may name one of it; `url`: that one is a server's client, whose address
      is `preference.environment_url`; `drives`: its own harness runs whole episodes against the policy's endpoint,
      on its own taskset (data.prompts names the same);
    - `prompts`: `data.prompts` (and `data.eval`) may name a source of its prompts."""

    name: str
    library: str
    extra: str
    environment: bool = False
    url: bool = False
    drives: bool = False
    prompts: bool = False

    @property
    def prefix(self) -> str:
        return f"{self.name}:"


ADAPTERS = {a.name: a for a in (
    Adapter("openenv", "OpenEnv", "openenv", environment=True, url=True),
    Adapter("verifiers", "verifiers", "verifiers", environment=True, drives=True, prompts=True),
    Adapter("reasoning_gym", "reasoning-gym", "reasoning_gym", prompts=True),
)}


def adapter_of(spec: str | None) -> Adapter | None:
    """The adapter a setting's value names by its prefix (`openenv:pkg.mod:Client`), else None (a user's own)."""
    name, colon, _ = (spec or "").partition(":")
    return ADAPTERS.get(name) if colon else None


@dataclass(frozen=True)
class RewardKind:
    """A built-in reward (`preference.rewards: [{name: ...}]`); gptforge.model.rewards registers its scorer by name.

    - `answers`: it compares responses with reference answers (the prompts must have them);
    - `scores`: the adapter whose prompt source it scores (its rows' own column), else None;
    - `episode`: the environment's own reward of each episode (preference.environment must be set);
    - `model`: the trained reward model (the reward stage trains it; the stage scores it);
    - `sandbox`: it runs model-written code in the sandbox (the preflight runs a program there, and checks the
      prompt rows' `tests`);
    - `pattern`: it needs preference.format_pattern;
    - `passes`: pass@k means something for it (a 0/1 check), not for a model's score or a penalty."""

    name: str
    answers: bool = False
    scores: str | None = None
    episode: bool = False
    model: bool = False
    sandbox: bool = False
    pattern: bool = False
    passes: bool = True


REWARDS = {r.name: r for r in (
    RewardKind("reward_model", model=True, passes=False),
    RewardKind("exact_match", answers=True),
    RewardKind("math_equal", answers=True),
    RewardKind("format", pattern=True),
    RewardKind("length", passes=False),
    RewardKind("environment", episode=True),
    RewardKind("reasoning_gym", scores="reasoning_gym"),
    RewardKind("unit_tests", sandbox=True),
)}


def reward_kind(spec) -> RewardKind | None:
    """A reward entry's declaration: None for a reward server's or a user's function."""
    return REWARDS.get(spec.name) if spec.url is None else None
