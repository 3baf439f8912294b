"""OpenEnv environments (openenv-core's `EnvClient` against an environment server) in TRL's environment
conventions, so that gptforge's episodes roll out in them: `preference.environment: openenv:package.module:Client`
with `preference.environment_url`.

Each episode is a session of its own: a client connects (the server's websocket, one `Environment` instance a
connection), `reset`s with the prompt row's columns (the server takes those its `reset` names), and `step`s:
- an action of one text field (a message, a command): each turn of the policy that calls no tool is the action,
  and the observation is the next user turn the policy reads (`respond`), until the environment says `done`;
- any other action: a tool named after it (`MoveAction` -> `move`), whose arguments are the action's fields (its
  JSON schema, as the chat template renders tools), whose result is the observation.
The episode's reward (`get_reward()`, the reward `{name: environment}`) is the sum of the rewards of its steps. The
client's calls are `async def`, awaited on the rollout process's event loop under `preference.tool_timeout_s`
(gptforge.model.agents.concurrency), one session an episode, as many at once as `preference.tool_concurrency` and
the server's `max_concurrent_envs` allow. The session ends when the environment is done, else when the episode's
environment is released.

The server is asked for its health as the factory is built (the preflight, each stage and each rollout worker), so
that one that does not answer is one error line before anything runs.
"""

from __future__ import annotations

import asyncio
import json
import re
import typing
import urllib.error
import urllib.request

from gptforge.core.errors import ConfigError, UserError
from gptforge.core.extras import require
from gptforge.model.rewards import user_function
from gptforge.model.agents.concurrency import event_loop

KEY = "preference.environment"
OBSERVATION_SET = {"done", "reward", "metadata"}  # what every observation has beside its own fields


def factory(spec: str, url: str, timeout_s: float):
    """A factory of one session an episode with the OpenEnv environment that client class `spec` reaches at `url`."""
    require("openenv.core", f"{KEY}: openenv:{spec}")
    from openenv.core import EnvClient

    client = user_function(spec, KEY)
    if not (isinstance(client, type) and issubclass(client, EnvClient)):
        raise ConfigError(f"{KEY}: openenv:{spec} is {client!r}, not a subclass of openenv's EnvClient")
    action = action_class(client, spec)
    check_server(url)
    fields = [n for n, f in action.model_fields.items() if n != "metadata" and f.is_required()]
    if len(fields) == 1 and action.model_fields[fields[0]].annotation is str:
        kind = type(f"{action.__name__}Episode", (TextEpisode,), {})
    else:
        kind = type(f"{action.__name__}Episode", (Episode,), {tool_name(action): action_tool(action)})
    return lambda: kind(client, action, fields[0] if len(fields) == 1 else None, url, timeout_s)


def action_class(client: type, spec: str) -> type:
    """The Action type a client class is generic in (`EnvClient[Action, Observation, State]`)."""
    from openenv.core import EnvClient

    for klass in client.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            if isinstance(origin, type) and issubclass(origin, EnvClient) and typing.get_args(base):
                return typing.get_args(base)[0]
    raise ConfigError(f"{KEY}: openenv:{spec} does not say its action type: declare it as "
                      f"class {client.__name__}(EnvClient[MyAction, MyObservation, MyState])")


def check_server(url: str) -> None:
    """The environment server's /health answers, within 10 s: else one error line naming the address."""
    health = re.sub(r"^ws(s?)://", r"http\1://", url.rstrip("/")).removesuffix("/ws") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=10) as response:
            response.read()
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        raise UserError(f"{KEY}_url: the OpenEnv environment server at {url} does not answer ({health}: "
                        f"{getattr(e, 'reason', e)}); start it, or correct the address") from None


def tool_name(action: type) -> str:
    """MoveAction -> move: the tool an action of several fields is called as."""
    name = action.__name__.removesuffix("Action") or "act"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def action_tool(action: type):
    """The tool that steps the environment with an action of these arguments (the action's fields)."""
    parameters = action.model_json_schema()
    parameters["properties"] = {k: v for k, v in parameters.get("properties", {}).items() if k != "metadata"}
    parameters.pop("title", None)

    async def tool(self, **arguments) -> str:
        return await self._step(action(**arguments))

    tool.json_schema = {"type": "function", "function": {
        "name": tool_name(action), "description": (action.__doc__ or f"Act: {action.__name__}.").strip(),
        "parameters": parameters}}
    return tool


def observation_text(observation) -> str:
    """What the policy reads of an observation: its one text field, else its fields as JSON."""
    fields = {k: v for k, v in observation.model_dump().items() if k not in OBSERVATION_SET}
    texts = [v for v in fields.values() if isinstance(v, str)]
    return texts[0] if len(fields) == 1 and texts else json.dumps(fields, default=str)


class Episode:
    """One session of the environment, in TRL's environment conventions."""

    def __init__(self, client: type, action: type, field: str | None, url: str, timeout_s: float):
        self._client = client(base_url=url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s)
        self._action, self._field = action, field
        self._total, self.done, self._open = 0.0, False, False

    async def reset(self, prompt=None, **row) -> str:
        await self._client.connect()
        self._open = True
        result = await self._client.reset(**row)
        return observation_text(result.observation)

    async def _step(self, action) -> str:
        if self.done:
            raise RuntimeError("the environment's episode is over")
        result = await self._client.step(action)
        self._total += float(result.reward or 0.0)
        if result.done:
            self.done = True
            await self._close()
        return observation_text(result.observation)

    def get_reward(self) -> float:
        """The sum of the rewards of the episode's steps."""
        return self._total

    async def _close(self) -> None:
        if self._open:
            self._open = False
            await self._client.close()

    def __del__(self):
        if getattr(self, "_open", False):  # the episode ended before the environment did: end its session
            asyncio.run_coroutine_threadsafe(self._close(), event_loop())


class TextEpisode(Episode):
    """An environment whose action is one text field: each turn of the policy that calls no tool is an action."""

    async def respond(self, text: str) -> str | None:
        """The observation after the turn `text`, the policy's next user turn; None once the environment is done."""
        observation = await self._step(self._action(**{self._field: text}))
        return None if self.done else observation
