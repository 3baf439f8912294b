"""Agents at the speed of their slowest tool: the rollout room's tool phase, one call after another against at once
(`preference.tool_concurrency`), with tools that wait as a sandbox or an HTTP call does (a sleep of `--latency`
seconds: 0.2 and 1 by default), written as plain functions (the thread pool) and as `async def` (the event loop).

    .venv/bin/python bench/agentic_latency.py [--batch 32] [--concurrency 16] [--latency 0.2 1.0] [--turns 2]

Each episode of a batch of `--batch` resets its environment, calls the waiting tool in each of its first `--turns`
turns and then answers; the policy is scripted (what it writes is known), so the time measured is the tool phase's
alone: the environments' resets, the calls and their `get_reward()`, each of which waits. Reported: the seconds of
each, the ratio one-by-one / at-once against the target 0.8 x min(batch, concurrency), and whether the trajectories
(messages, ids, masks, calls, rewards) are the same either way.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LATENCY = {"s": 0.2}
FLIGHT = {"now": 0, "peak": 0}  # waiting calls in flight, and the most seen at once
_flight = threading.Lock()


def flying(delta: int) -> None:
    with _flight:
        FLIGHT["now"] += delta
        FLIGHT["peak"] = max(FLIGHT["peak"], FLIGHT["now"])


def wait() -> None:
    flying(1)
    time.sleep(LATENCY["s"])
    flying(-1)


class Waiting:
    """An environment whose every method waits LATENCY seconds: reset, the tool, get_reward."""

    def reset(self, n: int = 0, **_) -> str:
        wait()
        self.n = n
        return f" (item {n})"

    def lookup(self, key: str) -> str:
        """Look a key up in a slow store.

        Args:
            key: what to look up
        """
        wait()
        return f"{key}={self.n}"

    def get_reward(self) -> float:
        wait()
        return float(self.n)


class AsyncWaiting(Waiting):
    """The same, its tool written as `async def` (awaited on the process's event loop)."""

    async def lookup(self, key: str) -> str:
        """Look a key up in a slow store.

        Args:
            key: what to look up
        """
        flying(1)
        await asyncio.sleep(LATENCY["s"])
        flying(-1)
        return f"{key}={self.n}"


def tokenizer():
    from transformers import AutoTokenizer

    from gptforge.data import demo
    from gptforge.data.tokenizer import save_hf, train_bpe

    out = Path(tempfile.mkdtemp())
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    corpus = list(demo.generate(pretrain_docs=300, sft_items=1, preference_pairs=1, eval_items=1).pretrain) + [
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call> <tool_response>']
    save_hf(train_bpe(corpus, 400, 2, special), out, special)
    return AutoTokenizer.from_pretrained(out)


def run(tok, factory, batch: int, turns: int, concurrency: int):
    """(seconds, the trajectories) of one batch of episodes through the rollout room."""
    from gptforge.model.agents.episode import environment_rewards, rollouts
    from gptforge.model.agents.tools import Setup

    eot = tok.convert_tokens_to_ids("<|im_end|>")
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k%d"}}\n</tool_call>'
    script = iter([call % t for t in range(turns) for _ in range(batch)] + ["Done."] * batch)

    def sample(sequences, budgets):
        return [tok(next(script), add_special_tokens=False)["input_ids"] + [eot] for _ in sequences]

    rows = [{"prompt": [{"role": "user", "content": f"Look item {n} up."}], "n": n} for n in range(batch)]
    setup = Setup(factory, [], timeout_s=60, concurrency=concurrency)
    FLIGHT["peak"] = 0
    t0 = time.perf_counter()
    episodes = rollouts(setup, sample, tok, rows, "hermes", max_turns=turns + 1, max_length=4096, stop_ids={eot})
    rewards = environment_rewards(episodes, setup.calls)
    seconds = time.perf_counter() - t0
    return seconds, [(e.messages, e.ids, e.mask, [(c.name, c.result, c.error) for c in e.calls]) for e in episodes], \
        rewards, FLIGHT["peak"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--latency", type=float, nargs="+", default=[0.2, 1.0])
    p.add_argument("--turns", type=int, default=2, help="turns that call the tool before the answer")
    args = p.parse_args()
    from gptforge.core.console import quiet

    quiet()
    tok = tokenizer()
    target = 0.8 * min(args.batch, args.concurrency)
    waits = args.batch * (args.turns + 2)  # reset, a call a turn, get_reward: each episode's waiting calls
    print(f"the tool phase of {args.batch} episodes ({waits} waiting calls: a reset, {args.turns} tool calls and "
          f"get_reward each), one by one against at once (tool_concurrency {args.concurrency})")
    print("| tool | latency (s) | one by one (s) | at once (s) | ratio | target | calls in flight at most (one by "
          "one, at once) | same trajectories |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for latency in args.latency:
        LATENCY["s"] = latency
        for name, factory in (("function", Waiting), ("async def", AsyncWaiting)):
            seq, seq_episodes, seq_rewards, seq_peak = run(tok, factory, args.batch, args.turns, 1)
            par, par_episodes, par_rewards, par_peak = run(tok, factory, args.batch, args.turns, args.concurrency)
            same = seq_episodes == par_episodes and seq_rewards == par_rewards
            print(f"| {name} | {latency:g} | {seq:.2f} | {par:.2f} | {seq / par:.1f}x | {target:.1f}x | {seq_peak}, "
                  f"{par_peak} | {same} |", flush=True)


if __name__ == "__main__":
    main()
