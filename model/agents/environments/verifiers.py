"""verifiers environments (`verifiers.v1`: a taskset, its rewards, harnesses and the environment that runs them) as
gptforge's episodes: `preference.environment: verifiers:<id>` with `data.prompts: verifiers:<id>` (its tasks the
prompts, every 20th held out; gptforge.core.procedural).

The environment's own harness drives each episode, as verifiers runs it anywhere: it reaches the model through an
OpenAI-compatible client, here the policy behind gptforge's endpoint (gptforge.model.agents.endpoint), one session
an episode, so that the ids trained are the ids sampled across its turns. A batch's episodes run at once on the
rollout process's event loop (up to `preference.tool_concurrency`), while the process samples the turns they ask for
in batches. The episode's reward is verifiers' total (`trace.reward`: its rubric's rewards and judges, weighed), the
reward `{name: environment}`.
"""

from __future__ import annotations

import asyncio
import atexit
import os

from gptforge.core.errors import ConfigError, UserError
from gptforge.data.procedural import load_verifiers
from gptforge.model.agents.concurrency import event_loop
from gptforge.model.agents.endpoint import Endpoint

KEY = "preference.environment"
KEY_VAR = "GPTFORGE_ENDPOINT_KEY"  # verifiers reads the endpoint's key from a variable


class Driver:
    """Episodes of a verifiers environment, driven by its harness against the policy behind the endpoint."""

    def __init__(self, spec: str, concurrency: int, bind: tuple[str, int] = ("127.0.0.1", 0)):
        self.spec, self.concurrency, self.bind = spec, concurrency, bind
        self.env = load_verifiers(spec, KEY)
        self.tasks = {task.data.idx: task for task in self.env.taskset}
        self.endpoint: Endpoint | None = None
        self.shape: tuple = ()  # what the endpoint was made for

    def serving(self, tokenizer, fmt: str, max_turns: int, max_length: int, stop_ids: set[int]) -> Endpoint:
        """The endpoint, one for the process's stage (a new one where the episodes' budgets or model change: an
        evaluation's after training's)."""
        shape = (id(tokenizer), fmt, max_turns, max_length, frozenset(stop_ids))
        if self.endpoint is None or self.shape != shape:
            if self.endpoint is not None:
                self.endpoint.close()
            host, port = self.bind
            self.endpoint, self.shape = Endpoint(tokenizer, fmt, max_turns, max_length, stop_ids, host, port), shape
            atexit.register(self.endpoint.close)
        return self.endpoint

    def rollouts(self, sample, tokenizer, rows: list[dict], fmt: str, max_turns: int, max_length: int,
                 stop_ids: set[int]):
        """One episode a prompt row (its `verifiers_task`), its Episode token-exact, its toolbox the trace's."""
        import verifiers.v1 as vf

        from gptforge.model.agents.trajectory import Finished

        endpoint = self.serving(tokenizer, fmt, max_turns, max_length, stop_ids)
        os.environ[KEY_VAR] = endpoint.key  # the run's key: the harness's client sends it with every request
        urls = [endpoint.open() for _ in rows]
        limit = asyncio.Semaphore(self.concurrency)

        async def one(row, url):
            ctx = vf.ModelContext(model=endpoint.model, client=vf.EvalClientConfig(base_url=url, api_key_var=KEY_VAR),
                                  sampling=vf.SamplingConfig())
            try:
                async with limit:
                    return await self.env.run_episode(self.tasks[row["verifiers_task"]], ctx)
            finally:
                endpoint.session(url).open = False

        async def every():
            async with self.env.serving():
                return await asyncio.gather(*(one(r, u) for r, u in zip(rows, urls)), return_exceptions=True)

        running = asyncio.run_coroutine_threadsafe(every(), event_loop())
        endpoint.serve(sample, running.done)
        results = running.result()
        episodes = []
        for row, url, result in zip(rows, urls, results, strict=True):
            session = endpoint.sessions.pop(endpoint.session_id(url))
            e = session.episode
            if e is None:
                raise ConfigError(f"{KEY}: verifiers:{self.spec}'s harness never asked the model for task "
                                  f"{row['verifiers_task']} ({describe(result)}); its harness must call the "
                                  "endpoint it is given")
            trace = result.traces[0] if not isinstance(result, BaseException) and result.traces else None
            e.toolbox = Finished([], None if trace is None else float(trace.reward or 0.0), session.tools or [])
            episodes.append(e)
        longest = max(len(e.prompt_ids) for e in episodes)
        if longest >= max_length:
            raise UserError(f"{KEY}: verifiers:{self.spec}'s harness asks with a conversation of {longest} tokens "
                            f"(its system prompt and tools' schemas with the task), with no room left under "
                            f"preference.max_length ({max_length}); raise it, or give the harness fewer tools")
        return episodes


def describe(result) -> str:
    if isinstance(result, BaseException):
        return f"{type(result).__name__}: {result}"
    errors = [f"{e.type}: {e.message}" for t in result.traces for e in t.errors] + \
        [e.message for e in result.errors]
    return "; ".join(errors) or "no error recorded"
