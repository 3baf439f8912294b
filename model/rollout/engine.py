"""What generates a rollout: the seam an inference engine fits.

An engine samples continuations of token ids, keeping the log-probability each sampled token had, and (where it
can) takes new weights by name. Everything above it is the engine's caller's: the chat template, the episodes and
their tools (gptforge.model.rollout.episode), the batches and their versions (gptforge.model.rollout.workers), the
rewards and the loss. So an inference server plugs in by implementing three things:

    class MyEngine:
        loads_weights = True   # async rollouts push the trainer's weights after each update
        logprobs = True        # the sampled tokens' log-probabilities come back (off-policy correction needs them)

        def __init__(self, model_dir: str, **options): ...
        def generate(self, sequences: list[list[int]], budgets: list[int], max_new_tokens: int,
                     temperature: float, top_k: int, top_p: float) -> list[Turn]: ...
        def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None: ...

`preference.rollout.engine: package.module:MyEngine` names it; `hf`, transformers' own `generate` over the
policy's Hugging Face model, is built in and runs on the CPU. A vLLM engine is the same three methods over
`LLM.generate(prompt_token_ids=..., SamplingParams(logprobs=0))` and `llm.collective_rpc("load_weights", ...)`
(docs/rollouts.md).

A sampled token's log-probability is log softmax of the model's raw logits (temperature 1, no top-k or top-p), as
the trainer computes it: the ratio of the two is then the mismatch of the engines alone (different kernels, a KV
cache, stale weights), not of the sampling settings.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable

import torch

from gptforge.core.errors import UserError
from gptforge.model.rollout.generate import Turn, id_sampler


class HFEngine:
    """transformers' `generate` with the KV cache over a causal LM (the training process's own module in sync mode,
    a rollout worker's copy in async mode). Rows are left-padded and sampled together; a row whose length budget
    is below the batch's is sampled in a call of its own (gptforge.model.rollout.generate.id_sampler), and `synced`
    keeps the ranks of a ZeRO-3 model in step."""

    loads_weights = True
    logprobs = True

    def __init__(self, model, pad_id: int, synced: bool = False):
        self.model, self.pad_id, self.synced = model, pad_id, synced

    @classmethod
    def load(cls, model_dir: str, pad_id: int) -> HFEngine:
        """The policy from `model_dir` on this process's device (a GPU Ray gave it, in bf16; else the CPU, fp32)."""
        from transformers import AutoModelForCausalLM

        cuda = torch.cuda.is_available()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32)
        return cls(model.to("cuda" if cuda else "cpu").eval(), pad_id)

    @torch.no_grad()
    def generate(self, sequences: list[list[int]], budgets: list[int], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0) -> list[Turn]:
        sample = id_sampler(self.model, self.pad_id, max_new_tokens, self.synced, logprobs=True, do_sample=True,
                            temperature=temperature, top_k=top_k, top_p=top_p)
        return sample(sequences, budgets)

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named:
            if name not in params:
                raise KeyError(f"the rollout engine's model has no parameter {name!r}")
            params[name].copy_(tensor)


def engine_class(spec: str):
    """The class `preference.rollout.engine` names: hf, or package.module:Class."""
    if spec == "hf":
        return HFEngine
    module, _, name = spec.partition(":")
    if os.getcwd() not in sys.path:  # the user's engine imports from the working folder, as their rewards do
        sys.path.insert(0, os.getcwd())
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"preference.rollout.engine={spec}: cannot import it ({type(e).__name__}: {e}); give hf or "
                        "package.module:Class") from None
    for method in ("generate", "load_weights"):
        if not callable(getattr(cls, method, None)):
            raise UserError(f"preference.rollout.engine={spec}: it has no {method}() (gptforge.model.rollout.engine "
                            "says what an engine implements)")
    return cls


def check(rollout) -> None:
    """What a rollout section asks of its engine, checked before anything runs: async rollouts need one that loads
    weights, an off-policy correction one that returns the sampled log-probabilities."""
    cls = engine_class(rollout.engine)
    if rollout.mode == "async" and not getattr(cls, "loads_weights", False):
        raise UserError(f"preference.rollout.engine={rollout.engine} cannot load weights (its loads_weights is not "
                        "true), so async rollouts could never sample the trainer's newer policy; use hf or an engine "
                        "that loads them, or preference.rollout.mode=sync")
    if rollout.correction != "none" and not getattr(cls, "logprobs", False):
        raise UserError(f"preference.rollout.correction={rollout.correction} needs the sampled tokens' "
                        f"log-probabilities, and preference.rollout.engine={rollout.engine} returns none (its logprobs "
                        "is not true); set preference.rollout.correction=none or use an engine that returns them")
