"""What a batch of rollouts waits on, run at once: its environments' `reset` and `get_reward`, its tool calls and its
rewards (functions and reward servers), so that a step waits about as long as its slowest call rather than their sum
(verifiers and prime-rl run episodes as asyncio tasks, SkyRL's and veRL's agent loops as coroutines, TRL's async
GRPO a thread pool).

- Plain functions run in a thread pool of `preference.tool_concurrency` threads a process: the calls of one turn of
  every open episode (each episode's own calls one after another, in the order the policy wrote them), the resets
  of a batch, its rewards.
- Functions written as `async def` (tools, an environment's methods) are awaited on one event loop a process, in a
  thread of its own, each call still under `preference.tool_timeout_s`.
- What comes back is in the batch's order and is what the calls would have returned one after another: an episode
  reads only its own environment, so its trajectory (messages, ids, masks) is the sequential one
  (tests/model/test_rollout.py).

How the bound protects training: the threads wait for what the tools wait on (a sandbox, an HTTP call) and hold no
core while they do. A CPU-bound tool written in Python holds the interpreter's lock, so in the training process it
runs no faster in parallel and no slower than alone, and in sync mode the trainer waits for the rollouts in any
case; in async mode the tools run in the rollout workers, processes pinned to the cores the training processes left
(gptforge.model.sampling.workers), so a busy tool cannot take a trainer's core. `tool_concurrency: 1` runs
everything one call after another, as before.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


class Concurrent:
    """A bounded thread pool that maps a function over a batch, results in the batch's order (the first exception
    raised, as a loop would). `limit` 1: a plain loop in the calling thread. `waited`: the seconds its callers have
    spent waiting on it (the tool phase's wall time, logged as tool_wait_s)."""

    def __init__(self, limit: int):
        self.limit, self.waited = limit, 0.0
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        items = list(items)
        t0 = time.perf_counter()
        try:
            if self.limit <= 1 or len(items) <= 1:
                return [fn(x) for x in items]
            if self._pool is None:
                with _lock:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(self.limit, thread_name_prefix="rollout-call")
            return list(self._pool.map(fn, items))
        finally:
            self.waited += time.perf_counter() - t0


SEQUENTIAL = Concurrent(1)


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for `async def` tools, running in a daemon thread of its own."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="rollout-async", daemon=True).start()
    return _loop


def settled(value, cancel: list | None = None):
    """`value`, awaited on the process's event loop where it is awaitable (a call of an `async def` function);
    `cancel` gets the future, so that a caller that stops waiting can cancel it."""
    if not inspect.isawaitable(value):
        return value

    async def wait():
        return await value

    future = asyncio.run_coroutine_threadsafe(wait(), event_loop())
    if cancel is not None:
        cancel.append(future)
    return future.result()
