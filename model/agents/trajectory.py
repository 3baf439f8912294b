"""An episode's trajectory, as the rollout room and the policy's endpoint build it: the ids after the prompt (each
turn as sampled, the template's tokens between turns), the policy's mask and log-probabilities, the messages; and
the template's rendering of what comes between turns (gptforge.model.agents.episode explains why)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gptforge.core.errors import DataError

# sample(sequences, budgets) -> each sequence's next turn: the ids sampled, ending with a stop id unless the budget
# (new tokens at most) ran out first
Sampler = Callable[[list[list[int]], list[int]], list[list[int]]]


@dataclass
class Episode:
    messages: list[dict]  # the trajectory: the prompt, each turn of the policy and each tool result
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # after the prompt: the turns and the tokens between them
    mask: list[int] = field(default_factory=list)  # 1 on the tokens the policy sampled
    logprobs: list[float] = field(default_factory=list)  # each token's log-probability when sampled (0 off the mask)
    toolbox: object = None  # the episode's Toolbox (gptforge.model.agents.tools), or Finished
    turns: int = 0
    ended: str = ""  # answer (a turn without calls), environment (it is done), max_turns, max_length, or truncated

    @property
    def response(self) -> str:
        """The last turn's text: what the rewards of the answer read."""
        last = next((m for m in reversed(self.messages) if m["role"] == "assistant"), None)
        return "" if last is None else last["content"]

    @property
    def calls(self) -> list:  # the Calls of gptforge.model.agents.tools
        return [] if self.toolbox is None else [c for c in self.toolbox.calls if c.name != "get_reward"]

    @property
    def tool_errors(self) -> int:
        return sum(1 for c in self.calls if c.error)

    def finished(self) -> Episode:
        """The episode without its live environment, to travel between processes: its calls and its environment's
        `get_reward()`, taken now, kept (gptforge.model.sampling.workers)."""
        box = self.toolbox
        kept = None if box is None else Finished(list(box.calls), box.reward(), box.schemas)
        return Episode(self.messages, self.prompt_ids, self.ids, self.mask, self.logprobs, kept, self.turns, self.ended)

    def record(self) -> dict:
        """The episode as a trajectory file row."""
        return {"messages": self.messages, "turns": self.turns, "ended": self.ended,
                "tool_calls": [vars(c) for c in self.calls], "tool_errors": self.tool_errors,
                "prompt_tokens": len(self.prompt_ids), "policy_tokens": sum(self.mask),
                "tool_tokens": len(self.mask) - sum(self.mask)}


@dataclass
class Finished:
    """A finished episode's environment, as a worker returns it: what its toolbox recorded, `reward()` as computed
    when the episode ended."""

    calls: list  # its toolbox's Calls
    value: float | None
    schemas: list[dict]

    def reward(self) -> float | None:
        return self.value


def render(tokenizer, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation)


def between_turns(tokenizer, episode: Episode, results: list[dict], end_of_turn: str,
                  tools: list[dict] | None = None) -> list[int]:
    """The ids the template puts after the policy's turn (whose end-of-turn token was sampled): the tool turn of
    `results` and the next generation prompt (`tools`: the schemas rendered, else the episode's toolbox's)."""
    if tools is None and episode.toolbox is not None:
        tools = episode.toolbox.schemas
    before = render(tokenizer, episode.messages, tools, False)
    after = render(tokenizer, episode.messages + results, tools, True)
    if not after.startswith(before):
        raise DataError("the chat template renders a conversation's earlier turns differently once a tool turn "
                        "follows, so the tokens between turns cannot be added to the sampled ones; conversation "
                        f"starts {before[:80]!r}")
    behind = before[before.rfind(end_of_turn) + len(end_of_turn):]  # e.g. ChatML's newline after <|im_end|>
    return list(tokenizer(behind + after[len(before):], add_special_tokens=False)["input_ids"])
