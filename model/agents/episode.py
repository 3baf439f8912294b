"""Multi-turn episodes, token-exact.

The policy samples a turn; its tool calls are parsed in the model's format (gptforge.model.agents.calls) and run
(gptforge.model.agents.tools); the results are appended as the chat template renders a tool turn, with the next
generation prompt; and the policy samples again, until a turn calls no tool, or `max_turns` turns, or the length
budget. The sequence trained is the prompt's ids, then each turn's ids exactly as sampled, then the template's
tokens between turns: nothing the policy sampled is decoded and tokenized again (the bug the peers' users report
most, TRL #5224, veRL #6501). `mask` is 1 on the policy's own tokens and 0 on the tokens between turns, so that the
loss and the KL see the policy's tokens alone.

The tokens between turns: the conversation rendered through the policy's turn, and rendered with the tool results
and the generation prompt after it; the second extends the first (a template that renders earlier turns otherwise,
as one that drops their reasoning, is an error), and what it adds, after what the template puts behind the turn's
end-of-turn token (ChatML's newline), is tokenized on its own. The turn's end-of-turn token was sampled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gptforge.core.errors import UserError
from gptforge.model.agents.calls import parse
from gptforge.model.agents.concurrency import SEQUENTIAL, Concurrent
from gptforge.model.agents.tools import Call, Setup, Toolbox
from gptforge.model.agents.trajectory import Episode, Finished, Sampler, between_turns, render  # noqa: F401

@dataclass
class Agent:
    """What an online stage and its evaluation roll out with: the environment and tools, the policy's call format
    (gptforge.model.agents.calls.format_of), and the turn and length budgets of an episode."""

    setup: Setup
    fmt: str
    max_turns: int
    max_length: int


def agent_spec(pc, fmt: str, max_length: int) -> dict:
    """What a rollout worker builds an `Agent` from (plain data, `spec_agent`): the preference section `pc`'s
    environment, tools and their settings, the policy's call format and an episode's length budget."""
    return {"setup": Setup.settings(pc), "fmt": fmt, "max_turns": pc.max_turns, "max_length": max_length}


def spec_agent(spec: dict) -> Agent:
    """The `Agent` of an `agent_spec`, its environment and tools imported and checked."""
    return Agent(Setup.load(**spec["setup"]), spec["fmt"], spec["max_turns"], spec["max_length"])


def start(tokenizer, prompt: list[dict], box: Toolbox | None) -> Episode:
    """An episode at its prompt: the environment's first observation appended to the last user turn (as TRL's
    GRPOTrainer does), the tools' schemas rendered by the template."""
    messages = [dict(m) for m in prompt]
    if box is not None and isinstance(box.observation, str):
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + box.observation}
    tools = box.schemas if box is not None else None
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    return Episode(messages, list(ids), toolbox=box)


def rollouts(setup: Setup, sample: Sampler, tokenizer, rows: list[dict], fmt: str, max_turns: int, max_length: int,
             stop_ids: set[int], everyone: Callable[[bool], bool] | None = None) -> list[Episode]:
    """One episode a prompt row ({"prompt": messages, "answer", **columns}): a fresh environment reset with the row,
    then `run_episodes`; or, where the environment's own harness drives its episodes (verifiers), its driver's."""
    if setup.driver is not None:
        if everyone is not None:
            raise UserError("preference.environment: a verifiers environment's episodes are sampled by one process "
                            "at a time; with a model partitioned by ZeRO-3 use async rollouts "
                            "(preference.rollout.mode: async) or distributed.zero_stage below 3")
        return setup.driver.rollouts(sample, tokenizer, rows, fmt, max_turns, max_length, stop_ids)
    boxes = setup.calls.map(setup.toolbox, rows)  # the environments reset at once
    episodes = [start(tokenizer, row["prompt"], box) for row, box in zip(rows, boxes, strict=True)]
    longest = max(len(e.prompt_ids) for e in episodes)
    if longest >= max_length:
        raise UserError(f"a prompt with the tools' schemas and the environment's first observation is {longest} "
                        f"tokens, with no room left under preference.max_length ({max_length}); raise it, or give "
                        "fewer tools or shorter docstrings")
    return run_episodes(sample, tokenizer, episodes, fmt, max_turns, max_length, stop_ids, everyone, setup.calls)


def environment_rewards(episodes: list[Episode], calls: Concurrent = SEQUENTIAL) -> list[float | None]:
    """Each episode's environment's `get_reward()` (None without one), the batch's at once through `calls`."""
    return calls.map(lambda e: None if e.toolbox is None else e.toolbox.reward(), episodes)


def run_episodes(sample: Sampler, tokenizer, episodes: list[Episode], fmt: str, max_turns: int, max_length: int,
                 stop_ids: set[int], everyone: Callable[[bool], bool] | None = None,
                 calls: Concurrent = SEQUENTIAL) -> list[Episode]:
    """Every episode to its end, the policy sampling the next turn of all open episodes at once, then the tool
    calls of that turn of every episode at once through `calls` (each episode's own in the order written).
    `everyone(open)`: whether any rank still has an open episode, where the ranks sample in step (a model partitioned
    by ZeRO-3): a rank whose episodes have all ended samples a dummy turn meanwhile."""
    for e in episodes:
        e.ended = "max_length" if len(e.prompt_ids) >= max_length else ""
    open_ = [e for e in episodes if not e.ended]
    while open_ if everyone is None else everyone(bool(open_)):
        if not open_:
            sample([episodes[0].prompt_ids], [1])
            continue
        budgets = [max_length - len(e.prompt_ids) - len(e.ids) for e in open_]
        turns = sample([e.prompt_ids + e.ids for e in open_], budgets)
        calling = []  # (episode, its turn, the calls it wrote): those whose tools run before their next turn
        for e, turn in zip(open_, turns, strict=True):
            e.ids += turn
            e.mask += [1] * len(turn)
            e.logprobs += getattr(turn, "logprobs", None) or [0.0] * len(turn)
            e.turns += 1
            stopped = bool(turn) and turn[-1] in stop_ids
            parsed = parse(tokenizer.decode(turn, skip_special_tokens=True), fmt)
            e.messages.append(parsed.message())
            if not stopped:
                e.ended = "truncated"
            elif e.toolbox is None or not (parsed.calls or e.toolbox.responds):
                e.ended = "answer"
            elif e.turns >= max_turns:
                e.ended = "max_turns"
            else:  # its calls run, or (none written) its environment responds, before its next turn
                calling.append((e, turn, parsed.calls or parsed.message()["content"]))
        answered = calls.map(lambda c: answer(c[0].toolbox, c[2]), calling)
        still = []
        for (e, turn, _), results in zip(calling, answered, strict=True):
            if results is None:
                e.ended = "environment"  # the environment is done
                continue
            between = between_turns(tokenizer, e, results, tokenizer.decode(turn[-1:]))
            if len(e.prompt_ids) + len(e.ids) + len(between) >= max_length:
                e.ended = "max_length"  # the results would leave no room for another turn
                continue
            e.messages += results
            e.ids += between
            e.mask += [0] * len(between)
            e.logprobs += [0.0] * len(between)
            still.append(e)
        open_ = still
    return episodes


def answer(box: Toolbox, calls: list | str) -> list[dict] | None:
    """What follows a turn: its calls' results (each episode's in the order written), or, where it wrote none, its
    environment's response to its text; None: the environment is done."""
    if isinstance(calls, str):
        response = box.respond(calls)
        return None if response is None else [response]
    return [tool_message(box, name, args) for name, args in calls]


def tool_message(box: Toolbox, name: str | None, arguments) -> dict:
    """A call run (or refused, where it did not parse) as the tool turn the model reads."""
    if name is None:
        call = Call("malformed", {}, error=f"ValueError: {arguments}")
        box.calls.append(call)
    else:
        call = box.call(name, arguments)
    content = call.result if call.error is None else f"error: {call.error}"
    return {"role": "tool", "name": call.name, "content": content}


def tensors(episodes: list[Episode], pad_id: int):
    """A batch of episodes in PPO's layout: the sequences (B, P+R), prompts left-padded to P and the episodes' ids
    right-padded to R; the attention mask (B, P+R); the policy's mask (B, R: 1 on its own tokens); and P."""
    import torch

    P = max(len(e.prompt_ids) for e in episodes)
    R = max(1, max(len(e.ids) for e in episodes))
    seqs = torch.full((len(episodes), P + R), pad_id, dtype=torch.long)
    attention = torch.zeros_like(seqs)
    mask = torch.zeros((len(episodes), R), dtype=torch.long)
    for b, e in enumerate(episodes):
        p, n = len(e.prompt_ids), len(e.ids)
        seqs[b, P - p:P], seqs[b, P:P + n] = torch.tensor(e.prompt_ids), torch.tensor(e.ids, dtype=torch.long)
        attention[b, P - p:P + n] = 1
        mask[b, :n] = torch.tensor(e.mask, dtype=torch.long)
    return seqs, attention, mask, P


def sampled_logprobs(episodes: list[Episode]):
    """The log-probabilities the episodes' tokens were sampled with, in `tensors`' layout (B, R), 0 off the mask."""
    import torch

    R = max(1, max(len(e.ids) for e in episodes))
    out = torch.zeros((len(episodes), R))
    for b, e in enumerate(episodes):
        out[b, :len(e.logprobs)] = torch.tensor(e.logprobs, dtype=torch.float)
    return out


def write_trajectories(folder: Path, step: int, episodes, total: list[float], each: dict) -> None:
    """A logged step's episodes (rank 0's): messages, calls, results, errors, each reward and the token counts."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{**e.record(), "reward": total[j], "rewards": {k: v[j] for k, v in each.items()}}
            for j, e in enumerate(episodes)]
    tmp = folder / f"step-{step:08d}.jsonl.part"
    tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    tmp.replace(folder / f"step-{step:08d}.jsonl")


def episode_metrics(episodes: list[Episode] | None, device, tool_wait_s: float | None = None) -> dict:
    """turns_per_episode and tool_calls_per_episode (means over every rank's episodes), tool_errors (their sum), and
    tool_wait_s (the mean over the ranks of the seconds their rollouts waited on tools, where measured)."""
    if episodes is None:
        return {}
    from gptforge.model.train.distributed import all_mean, all_sum

    turns, calls, errors, n = all_sum([sum(e.turns for e in episodes), sum(len(e.calls) for e in episodes),
                                       sum(e.tool_errors for e in episodes), len(episodes)], device)
    waited = {} if tool_wait_s is None else {"tool_wait_s": all_mean(tool_wait_s, device)}
    return {"turns_per_episode": turns / n, "tool_calls_per_episode": calls / n, "tool_errors": errors, **waited}
