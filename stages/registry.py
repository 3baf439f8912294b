"""Every stage of the pipeline, declared once: what it reads, what it writes and how its processes start. The stage
store (fingerprints, manifests), the launcher, the flow and the CLI read this table; none of them imports a stage's
module, which holds its body and is imported only by the processes that run it (a TRL stage's module imports
transformers' Trainer, PEFT and TRL: seconds that a pipeline's flow process never needs to spend).

Adding a stage is a module `gptforge/stages/<name>.py` with `run(cfg, inputs, out_dir) -> metrics`, and its
`Stage` here. Each stage trained on held-out data has an evaluation step after it (`eval-<stage>`, computed by
gptforge.stages.evaluate), declared here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gptforge.core.config import ALGORITHMS, DistributedSection, PipelineConfig, tokenizer_source
from gptforge.core.files import MODEL_OUTPUTS


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline.

    - `inputs`: the steps whose outputs it reads (before gptforge.pipeline.store.upstream drops those a config
      leaves out);
    - `sections`: the config sections whose fields can change its result (`section` or `section.sub`; a section
      listed with its sub-sections counts without them); `seeded`: whether run.seed can, too. The store hashes
      them into its fingerprint (gptforge.pipeline.store.stage_config);
    - `data`: the `data.<name>` source it reads, if any (data.prompts for the online stages where it is set);
    - `outputs`: {name: path in its output folder}, hashed into its manifest;
    - `launcher`: `single` (one process, no launcher), `ranks` (every rank under distributed.launcher) or
      `accelerate` (every rank, with accelerate's environment: a TRL Trainer);
    - `code_version`: raised when its code computes something else from the same config and inputs, so that
      stored outputs (and what follows them) are recomputed rather than reused;
    - `sequence_parallel`: whether distributed.sequence_parallel ranks share each of its sequences (DeepSpeed-
      Ulysses), its data parallelism over the rest (`data_parallel`).
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


EVAL_OUTPUTS = {"answers": "answers.jsonl", "harness": "harness"}
STAGES: dict[str, Stage] = {s.name: s for s in [
    # tokenize 2: streamed in units, shards format 2 (index with counts and max id); 3: its chat template renders
    # tools (Hermes). Its own Ray workers.
    # curate: only where curate.enabled, and an input only of the stages whose data it curates (curate.sources:
    # gptforge.pipeline.store.upstream); its data: those sources, and what it decontaminates against
    # (gptforge.pipeline.store.data_of)
    Stage("curate", "curate", sections=("curate", "eval.harness_tasks", "eval.harness_include"), seeded=False,
          data="pretrain", outputs={"documents": "documents", "sft": "sft", "preference": "preference",
                                    "removed": "removed", "funnel": "funnel.json",
                                    "decontamination": "decontamination.json"}, launcher="single"),
    Stage("tokenize", "tokenize", ("curate",), ("tokenizer",), seeded=False, data="pretrain",
          outputs={"tokenizer": "tokenizer", "shards": "shards"}, launcher="single", code_version=3),
    Stage("pretrain", "pretrain", ("tokenize",), ("model", "pretrain"), sequence_parallel=True),
    Stage("sft", "sft", ("curate", "pretrain"), ("sft",), data="sft", sequence_parallel=True),
    Stage("reward", "reward", ("curate", "sft"), ("reward",), data="preference"),
    Stage("dpo", "dpo", ("curate", "sft"), ("preference", "preference.dpo"), data="preference",  # needs no reward model
          launcher="accelerate", sequence_parallel=True),
    Stage("ppo", "ppo", ("curate", "sft", "reward"), ("preference", "preference.ppo"), data="preference"),
    Stage("grpo", "grpo", ("curate", "sft", "reward"), ("preference", "preference.grpo"), data="preference",
          launcher="accelerate", sequence_parallel=True),
    Stage("rloo", "rloo", ("curate", "sft", "reward"), ("preference", "preference.rloo"), data="preference",
          launcher="accelerate", sequence_parallel=True),
    # evaluation steps: one process unless eval.processes (gptforge.pipeline.nodes.evaluation_on_every_rank); the
    # store picks the eval fields each one reads (gptforge.pipeline.store.stage_config)
    Stage("eval-sft", "evaluate", ("sft", "pretrain"), ("eval",), outputs=EVAL_OUTPUTS, launcher="single"),
    *[Stage(f"eval-{a}", "evaluate", (a, "sft", "reward"), ("eval",), outputs=EVAL_OUTPUTS, launcher="single")
      for a in ALGORITHMS],
]}
EVALUATED = tuple(s.name.removeprefix("eval-") for s in STAGES.values() if s.name.startswith("eval-"))


def stage(step: str) -> Stage:
    """The declaration of a step."""
    return STAGES[step]


def data_parallel(dist: DistributedSection, step: str) -> int:
    """The data-parallel world of a step: the world, over distributed.sequence_parallel where the step takes it."""
    return dist.world_size // (dist.sequence_parallel if STAGES[step].sequence_parallel else 1)


def pipeline_stages(cfg: PipelineConfig) -> list[str]:
    """Stage names in order, the preference stage named after each algorithm; disabled stages left out (tokenize
    too when the pipeline starts from model.pretrained without pretraining it, and reward when
    preference.reward_model names a ready one or preference.rewards has no reward model)."""
    names = ["tokenize"] if cfg.pretrain.enabled or not cfg.model.pretrained else []
    if names and cfg.curate.enabled:
        names.insert(0, "curate")
    for name in ("pretrain", "sft"):
        if getattr(cfg, name).enabled:
            names.append(name)
    if cfg.trains_reward_model():
        names.append("reward")
    if cfg.preference.enabled:
        names.extend(cfg.preference.algorithms())
    return names


def named_models(cfg: PipelineConfig, step: str) -> dict[str, tuple[str, str | None]]:
    """The models a step reads by name rather than from an upstream stage's output: {config key: (hub name or
    directory, revision)}."""
    out = {}
    if step == "tokenize":
        name, revision = tokenizer_source(cfg)
        if name:
            out["tokenizer.pretrained" if cfg.tokenizer.pretrained else "model.pretrained"] = (name, revision)
    if cfg.model.pretrained and (step == "pretrain" or (step in ("sft", "eval-sft") and not cfg.pretrain.enabled)):
        out["model.pretrained"] = (cfg.model.pretrained, cfg.model.revision)
    if step == "reward" and cfg.reward.pretrained:
        out["reward.pretrained"] = (cfg.reward.pretrained, None)
    pc, algorithm = cfg.preference, step.removeprefix("eval-")
    if algorithm in ALGORITHMS:
        judged = algorithm != "dpo" or step != algorithm  # DPO needs no reward model; its evaluation does
        if pc.reward_model and judged and pc.uses_reward_model():
            out["preference.reward_model"] = (pc.reward_model, None)
        if pc.reference and step == algorithm:
            out["preference.reference"] = (pc.reference, None)
        if pc.ppo.critic and step == "ppo":
            out["preference.ppo.critic"] = (pc.ppo.critic, None)
    return out
