"""Environments and tools for multi-turn rollouts, in TRL's conventions so that one environment class serves
gptforge's PPO and TRL's GRPOTrainer (`environment_factory`, `tools`):

- an environment factory (`package.module:Factory`) builds one environment per rollout; `reset(**row)` gives the
  first observation (appended to the prompt's last user turn where it returns text); its public methods, with type
  hints and docstrings, are its tools; an optional `get_reward()` scores the episode;
- stateless tools (`package.module:function`), with type hints and docstrings;
- gptforge's one addition: an environment with a `respond(text)` method answers each turn of the policy that calls
  no tool (the user turn the policy reads next; None ends the episode), as a text game or a simulated user does.

Environments of other libraries (OpenEnv) are adapted to these conventions (gptforge.model.agents.environments);
tools served over the Model Context Protocol are tools like these (gptforge.model.agents.mcp).

A call runs with a timeout. An exception, a timeout, an unknown tool or bad arguments become the tool's error
message to the model, never a crashed stage. A call that times out keeps its thread (Python cannot stop one; an
`async def` call is cancelled), and its environment answers every later call of the episode with that error.
A batch's calls run at once, up to `preference.tool_concurrency` (gptforge.model.agents.concurrency).
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gptforge.core.errors import ConfigError
from gptforge.model.rewards import user_function
from gptforge.model.agents.concurrency import Concurrent, settled


def schema(fn: Callable, key: str) -> dict:
    """The JSON schema a chat template renders for a tool (transformers' get_json_schema): a ConfigError naming the
    function where an argument has no type hint or the docstring is missing."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    if hasattr(fn, "json_schema"):  # an adapted environment's tool says its schema (an OpenEnv action's)
        return fn.json_schema
    try:
        return get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as e:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigError(f"{key}: tool {name}: {e} (a tool needs a type hint on every argument and a docstring "
                          "describing them in an Args: section)") from None


def environment_tools(env) -> dict[str, Callable]:
    """An environment's tools: its public methods but `reset`, `get_reward` and `respond`, as TRL's GRPOTrainer
    takes them (listed on the class, so that properties are not evaluated)."""
    return {name: getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward", "respond")}


BUILT_IN = ("python",)  # the tools gptforge has: model-written code run in the sandbox


def built_in(spec: str, limits) -> Callable | None:
    """A built-in tool by its name (`python`: gptforge.model.agents.sandbox, under `limits`, the preference.sandbox
    section), the host checked for the sandbox."""
    if spec not in BUILT_IN:
        return None
    from gptforge.model.agents import sandbox as room

    room.require(f"preference.tools: {spec}")
    return room.python_tool(limits)


@dataclass
class Setup:
    """What `preference.environment` and `preference.tools` name, imported and checked; `calls` runs a batch's
    calls at once, up to `concurrency` (gptforge.model.agents.concurrency)."""

    factory: Callable | None
    tools: list[Callable]
    timeout_s: float
    concurrency: int = 1
    driver: object | None = None  # runs whole episodes where the environment's own harness drives them (verifiers)

    def __post_init__(self):
        self.calls = Concurrent(self.concurrency)

    @classmethod
    def of(cls, pc) -> Setup:
        """The rollouts' environment and tools as the preference section `pc` names them."""
        return cls.load(**cls.settings(pc))

    @staticmethod
    def settings(pc) -> dict:
        """What `load` takes of the preference section `pc`, as plain data (a rollout worker loads it again)."""
        return {"environment": pc.environment, "tools": pc.tools, "timeout_s": pc.tool_timeout_s,
                "concurrency": pc.tool_concurrency, "url": pc.environment_url,
                "endpoint": (pc.endpoint_host, pc.endpoint_port), "sandbox": pc.sandbox.model_dump()}

    @classmethod
    def load(cls, environment: str | None, tools: list[str], timeout_s: float, concurrency: int = 1,
             url: str | None = None, endpoint: tuple[str, int] = ("127.0.0.1", 0),
             sandbox: dict | None = None) -> Setup:
        from gptforge.core.config.training import SandboxSection
        from gptforge.model.agents import environments, mcp

        factory = environments.factory(environment, url, timeout_s)
        functions, source = [], {}
        limits = SandboxSection(**(sandbox or {}))  # its defaults where a caller gives none
        for spec in tools:
            got = mcp.tools(spec, timeout_s, limits.output_bytes) if mcp.is_mcp(spec) else \
                [built_in(spec, limits) or user_function(spec, "preference.tools")]
            for fn in got:  # one tool a name: a server's `python` must not stand in for the sandboxed one
                name = schema(fn, "preference.tools")["function"]["name"]
                if name in source:
                    mcp.close()
                    raise ConfigError(f"preference.tools: two tools named {name!r}, from {source[name]} and from "
                                      f"{spec}; a tool's name must be unique (drop one, or rename it in its source)")
                source[name] = spec
            functions += got
        if factory is not None:
            probe = factory()
            if not callable(getattr(probe, "reset", None)):
                raise ConfigError(f"preference.environment: {environment} builds {type(probe).__name__}, which has "
                                  "no reset(**row) method")
            for fn in environment_tools(probe).values():
                schema(fn, "preference.environment")
        return cls(factory, functions, timeout_s, concurrency, environments.driver(environment, concurrency, endpoint))

    def toolbox(self, row: dict) -> Toolbox:
        """A new episode's tools: a fresh environment reset with the prompt's row, and the stateless tools."""
        env = self.factory() if self.factory else None
        box = Toolbox(env, {fn.__name__: fn for fn in self.tools}, self.timeout_s)
        if env is not None:
            box.tools.update(environment_tools(env))
            box.observation = box.run("reset", lambda: env.reset(**row))
        return box


@dataclass
class Call:
    """One tool call of an episode, as the trajectory records it."""

    name: str
    arguments: dict
    result: str | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclass
class Toolbox:
    """The tools of one episode: its environment's methods and the stateless tools, each call under a timeout."""

    env: object | None
    tools: dict[str, Callable]
    timeout_s: float
    observation: object = None
    calls: list[Call] = field(default_factory=list)
    broken: str | None = None  # why the environment answers no more calls (a call that never returned)

    @property
    def schemas(self) -> list[dict]:
        return [schema(fn, "preference.tools") for fn in self.tools.values()]

    def run(self, name: str, fn: Callable):
        """fn() under the timeout; an exception is raised as is, a timeout as TimeoutError."""
        if self.broken:
            raise RuntimeError(self.broken)
        box: dict = {}
        pending: list = []  # an async call's future on the event loop

        def target():
            try:
                box["value"] = settled(fn(), pending)
            except BaseException as e:  # noqa: BLE001 (reported to the model)
                box["error"] = e

        thread = threading.Thread(target=target, name=f"tool-{name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            for future in pending:
                future.cancel()
            self.broken = f"the environment is still running {name}, which passed preference.tool_timeout_s"
            raise TimeoutError(f"{name} did not return within {self.timeout_s:g} s (preference.tool_timeout_s)")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def call(self, name: str, arguments) -> Call:
        """Run one call; its result, or its error as the message the model reads."""
        t0 = time.perf_counter()
        record = Call(name, arguments if isinstance(arguments, dict) else {"_": arguments})
        try:
            if name not in self.tools:
                raise LookupError(f"no tool named {name!r}; tools: {', '.join(self.tools) or 'none'}")
            if not isinstance(arguments, dict):
                raise TypeError(f"arguments must be a JSON object, got {json.dumps(arguments)[:80]}")
            fn = self.tools[name]
            inspect.signature(fn).bind(**arguments)  # a missing or unknown argument, before the call
            value = self.run(name, lambda: fn(**arguments))
            record.result = value if isinstance(value, str) else json.dumps(value, default=str)
        except BaseException as e:  # noqa: BLE001 (the model reads it; the stage goes on)
            record.error = f"{type(e).__name__}: {e}"
        record.seconds = time.perf_counter() - t0
        self.calls.append(record)
        return record

    @property
    def responds(self) -> bool:
        """Whether the environment answers a turn that calls no tool (its `respond(text)`)."""
        return callable(getattr(self.env, "respond", None))

    def respond(self, text: str) -> dict | None:
        """The environment's answer to a turn that called no tool, as the user turn the policy reads next; None: the
        episode is over (the environment said so, or its call failed: the error is recorded as a call)."""
        try:
            answer = self.run("respond", lambda: self.env.respond(text))
        except BaseException as e:  # noqa: BLE001 (the trajectory names it; the stage goes on)
            self.calls.append(Call("respond", {}, error=f"{type(e).__name__}: {e}"))
            return None
        return None if answer is None else {"role": "user", "content": str(answer)}

    def reward(self) -> float | None:
        """The environment's own `get_reward()`, under the timeout (None: it has none, or it failed, its error then
        recorded as a call)."""
        get = getattr(self.env, "get_reward", None)
        if get is None:
            return None
        try:
            return float(self.run("get_reward", get))
        except BaseException as e:  # noqa: BLE001 (recorded with the calls: the trajectory names it)
            self.calls.append(Call("get_reward", {}, error=f"{type(e).__name__}: {e}"))
            return None
