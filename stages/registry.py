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

from gptforge.core.config import ALGORITHMS
from gptforge.core.files import MODEL_OUTPUTS


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline.

    - `inputs`: the steps whose outputs it reads (before gptforge.pipeline.store.upstream drops those a config
      leaves out);
    - `data`: the `data.<name>` source it reads, if any (data.prompts for the online stages where it is set);
    - `outputs`: {name: path in its output folder}, hashed into its manifest;
    - `launcher`: `single` (one process, no launcher), `ranks` (every rank under distributed.launcher) or
      `accelerate` (every rank, with accelerate's environment: a TRL Trainer);
    - `code_version`: raised when its code computes something else from the same config and inputs, so that
      stored outputs (and what follows them) are recomputed rather than reused.
    """

    name: str
    module: str
    inputs: tuple[str, ...] = ()
    data: str | None = None
    outputs: dict[str, str] = field(default_factory=lambda: dict(MODEL_OUTPUTS))
    launcher: str = "ranks"
    code_version: int = 1


EVAL_OUTPUTS = {"answers": "answers.jsonl", "harness": "harness"}
STAGES: dict[str, Stage] = {s.name: s for s in [
    # tokenize 2: streamed in units, shards format 2 (index with counts and max id). Its own Ray workers.
    Stage("tokenize", "tokenize", data="pretrain", outputs={"tokenizer": "tokenizer", "shards": "shards"},
          launcher="single", code_version=2),
    Stage("pretrain", "pretrain", ("tokenize",)),
    Stage("sft", "sft", ("pretrain",), data="sft"),
    Stage("reward", "reward", ("sft",), data="preference"),
    Stage("dpo", "dpo", ("sft",), data="preference", launcher="accelerate"),  # DPO needs no reward model
    Stage("ppo", "ppo", ("sft", "reward"), data="preference"),
    Stage("grpo", "grpo", ("sft", "reward"), data="preference", launcher="accelerate"),
    Stage("rloo", "rloo", ("sft", "reward"), data="preference", launcher="accelerate"),
    # evaluation steps: one process unless eval.processes (gptforge.core.config.EvalSection.distributed)
    Stage("eval-sft", "evaluate", ("sft", "pretrain"), outputs=EVAL_OUTPUTS, launcher="single"),
    *[Stage(f"eval-{a}", "evaluate", (a, "sft", "reward"), outputs=EVAL_OUTPUTS, launcher="single")
      for a in ALGORITHMS],
]}
EVALUATED = tuple(s.name.removeprefix("eval-") for s in STAGES.values() if s.name.startswith("eval-"))


def stage(step: str) -> Stage:
    """The declaration of a step."""
    return STAGES[step]
