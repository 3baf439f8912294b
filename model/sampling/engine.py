"""What generates a rollout: the seam an inference engine fits.

An engine samples continuations of token ids, keeping the log-probability each sampled token had, and (where it
can) takes new weights by name. Everything above it is the engine's caller's: the chat template, the episodes and
their tools (gptforge.model.agents.episode), the batches and their versions (gptforge.model.sampling.workers), the
rewards and the loss. So an inference server plugs in by implementing three things:

    class MyEngine:
        loads_weights = True   # async rollouts push the trainer's weights after each update
        logprobs = True        # the sampled tokens' log-probabilities come back (off-policy correction needs them)

        def __init__(self, model_dir: str, **options): ...
        def generate(self, sequences: list[list[int]], budgets: list[int], max_new_tokens: int,
                     temperature: float, top_k: int, top_p: float) -> list[Turn]: ...
        def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None: ...
        def score(self, seqs, attention, P: int, top_k: int) -> Scores: ...   # a teacher (distill) only

`preference.rollout.engine: package.module:MyEngine` names it; `hf`, transformers' own `generate` over the
policy's Hugging Face model, is built in and runs on the CPU. A vLLM engine is the same three methods over
`LLM.generate(prompt_token_ids=..., SamplingParams(logprobs=0))` and `llm.collective_rpc("load_weights", ...)`
(docs/rollouts.md).

A teacher scores through the same seam (`distill.teacher_engine`): `score` takes a batch of rollouts in their
layout (gptforge.model.sampling.sampling.Rollouts: prompts left-padded to P, responses after them) and returns, for
each response token, the teacher's log-probability of it and its distribution there: whole, or its `top_k` most
likely tokens, which is what a served teacher returns (vLLM: `prompt_logprobs=top_k` on the whole sequence).

A sampled token's log-probability is log softmax of the model's raw logits (temperature 1, no top-k or top-p), as
the trainer computes it: the ratio of the two is then the mismatch of the engines alone (different kernels, a KV
cache, stale weights), not of the sampling settings.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from gptforge.core.errors import UserError
from gptforge.data.chat import positions
from gptforge.model.sampling.generate import Turn, id_sampler


@dataclass
class Scores:
    """A teacher's view of a batch of responses (B rows, R response tokens)."""

    sampled: torch.Tensor  # (B, R): log-probability of each response token
    logprobs: torch.Tensor  # (B, R, K): the distribution before each response token, over `ids` (K = the vocabulary
    ids: torch.Tensor | None = None  # where None), or over these (B, R, K) token ids (its top k)


class HFEngine:
    """transformers' `generate` with the KV cache over a causal LM (the training process's own module in sync mode,
    a rollout worker's copy in async mode). Rows are left-padded and sampled together; a row whose length budget
    is below the batch's is sampled in a call of its own (gptforge.model.sampling.generate.id_sampler), and `synced`
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
    def score(self, seqs: torch.Tensor, attention: torch.Tensor, P: int, top_k: int = 0) -> Scores:
        """The model's log-probabilities of the responses after P and its distributions there (whole, or the top_k
        most likely tokens). A forward without a KV cache, in step on every rank where the model is partitioned."""
        out = self.model(input_ids=seqs, attention_mask=attention, position_ids=positions(attention),
                         use_cache=False)
        logp = torch.log_softmax(out.logits[:, P - 1:-1].float(), -1)
        sampled = logp.gather(-1, seqs[:, P:, None])[..., 0]
        if not top_k:
            return Scores(sampled, logp)
        top = logp.topk(min(top_k, logp.size(-1)), -1)
        return Scores(sampled, top.values, top.indices)

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named:
            if name not in params:
                raise KeyError(f"the rollout engine's model has no parameter {name!r}")
            params[name].copy_(tensor)


def engine_class(spec: str, key: str = "preference.rollout.engine", needs: tuple[str, ...] = ("generate",
                                                                                                 "load_weights")):
    """The class the setting `key` names: hf, or package.module:Class with the methods `needs`."""
    if spec == "hf":
        return HFEngine
    module, _, name = spec.partition(":")
    if os.getcwd() not in sys.path:  # the user's engine imports from the working folder, as their rewards do
        sys.path.insert(0, os.getcwd())
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"{key}={spec}: cannot import it ({type(e).__name__}: {e}); give hf or "
                        "package.module:Class") from None
    for method in needs:
        if not callable(getattr(cls, method, None)):
            raise UserError(f"{key}={spec}: it has no {method}() (gptforge.model.sampling.engine says what an engine "
                            "implements)")
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
