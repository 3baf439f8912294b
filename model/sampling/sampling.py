"""A step's rollouts, sampled through an engine (gptforge.model.sampling.engine) the same way wherever it runs: in the
training process (sync) or in a rollout worker (async, gptforge.model.sampling.workers).

A prompt without tools is one turn of at most `max_new_tokens`; with tools (an `Agent`), one episode of
gptforge.model.agents.episode. Either way the step gets PPO's layout (the sequences, attention, the policy's mask,
the prompt length), the log-probability of each sampled token, the episodes where there are tools, and the weight
version that sampled them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gptforge.data.chat import prompt_ids
from gptforge.model.agents.episode import Agent, Episode, rollouts, sampled_logprobs, tensors


@dataclass
class Rollouts:
    """One process's rollouts of a step."""

    seqs: torch.Tensor  # (B, P+R): prompts left-padded to P, responses right-padded to R
    attention: torch.Tensor  # (B, P+R)
    mask: torch.Tensor  # (B, R): 1 on the policy's own tokens
    P: int
    logprobs: torch.Tensor  # (B, R): each token's log-probability when sampled, 0 off the mask
    episodes: list[Episode] | None = None  # with tools: the finished episodes
    version: int = 0  # the weights that sampled them: the number of updates behind them
    span: tuple[float, float] = (0.0, 0.0)  # when they were sampled (time.time())
    worker: int = -1  # the rollout worker that sampled them; -1: the training process
    extra: dict = field(default_factory=dict)

    def to(self, device) -> Rollouts:
        moved = {k: getattr(self, k).to(device) for k in ("seqs", "attention", "mask", "logprobs")}
        return Rollouts(**moved, P=self.P, episodes=self.episodes, version=self.version, span=self.span,
                        worker=self.worker, extra=self.extra)

    def state(self) -> dict:
        """As plain data (what torch.load(weights_only=True) reads back): a checkpoint keeps rollouts in flight."""
        episodes = None if self.episodes is None else [
            {**{k: getattr(e, k) for k in ("messages", "prompt_ids", "ids", "mask", "logprobs", "turns", "ended")},
             "calls": [vars(c) for c in e.toolbox.calls] if e.toolbox is not None else None,
             "reward": e.toolbox.reward() if e.toolbox is not None else None,
             "schemas": e.toolbox.schemas if e.toolbox is not None else None}
            for e in self.episodes]
        return {"seqs": self.seqs.cpu(), "attention": self.attention.cpu(), "mask": self.mask.cpu(), "P": self.P,
                "logprobs": self.logprobs.cpu(), "episodes": episodes, "version": self.version,
                "span": list(self.span), "worker": self.worker}

    @classmethod
    def from_state(cls, state: dict) -> Rollouts:
        from gptforge.model.agents.trajectory import Finished
        from gptforge.model.agents.tools import Call

        episodes = None
        if state["episodes"] is not None:
            episodes = []
            for e in state["episodes"]:
                box = None if e["calls"] is None else Finished([Call(**c) for c in e["calls"]], e["reward"],
                                                               e["schemas"])
                episodes.append(Episode(e["messages"], e["prompt_ids"], e["ids"], e["mask"], e["logprobs"], box,
                                        e["turns"], e["ended"]))
        return cls(state["seqs"], state["attention"], state["mask"], state["P"], state["logprobs"], episodes,
                   state["version"], tuple(state["span"]), state["worker"])


def sample(engine, tokenizer, prompts: list[list[dict]], rows: list[dict], oc, agent: Agent | None,
           stops: set[int], everyone=None, version: int = 0) -> Rollouts:
    """The rollouts of `prompts` (chat messages; `rows`, the prompt rows with their columns, for the environment's
    reset): sampled with the online section `oc`'s settings, one turn each or, with an `agent`, one episode each.
    `everyone(open)`: whether any rank still samples (a ZeRO-3 model: the ranks generate in step)."""
    t0 = time.time()
    settings = {"temperature": oc.temperature, "top_k": oc.top_k, "top_p": oc.top_p}
    pad = tokenizer.pad_token_id
    if agent is None:
        ids = [prompt_ids(tokenizer, p) for p in prompts]
        turns = engine.generate(ids, [oc.max_new_tokens] * len(ids), oc.max_new_tokens, **settings)
        episodes = [Episode(p, i, list(t), [1] * len(t), t.logprobs or [0.0] * len(t))
                    for p, i, t in zip(prompts, ids, turns, strict=True)]
        kept, extra = None, {}
    else:
        def draw(sequences, budgets):
            return engine.generate(sequences, budgets, oc.max_new_tokens, **settings)

        waited = agent.setup.calls.waited
        episodes = rollouts(agent.setup, draw, tokenizer, rows, agent.fmt, agent.max_turns, agent.max_length, stops,
                            everyone)
        kept = episodes = agent.setup.calls.map(Episode.finished, episodes)  # get_reward() of each, at once
        extra = {"tool_wait_s": agent.setup.calls.waited - waited}
    seqs, attention, mask, P = tensors(episodes, pad)
    logprobs = sampled_logprobs(episodes) * mask
    return Rollouts(seqs, attention, mask, P, logprobs, kept, version, (t0, time.time()), extra=extra)
