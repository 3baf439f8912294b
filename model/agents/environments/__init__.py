"""Environments written for other libraries, as gptforge's episodes: `preference.environment` names a factory of
environments in TRL's conventions (`package.module:Factory`, gptforge.model.agents.tools), or one of another
library's, which an adapter here turns into such a factory, so that PPO, GRPO, RLOO, distill and their evaluation
roll out through it unchanged (token-exact, concurrent, sync or async):

- `openenv:package.module:EnvClient` (openenv-core, the `environments` extra): each episode a session of the
  environment server at `preference.environment_url` (gptforge.model.agents.environments.openenv);
- `verifiers:<id>` (verifiers.v1): its harness drives each episode against the policy behind an OpenAI-compatible
  endpoint (gptforge.model.agents.environments.verifiers, gptforge.model.agents.endpoint): a `driver` of whole
  episodes rather than a factory of environments.

Procedural task libraries are sources of prompts instead (`data.prompts: reasoning_gym:<dataset>`,
gptforge.data.procedural). Each adapter's facts are declared once (gptforge.core.declarations.ADAPTERS); its
implementation is registered here by name. docs/environments.md shows each with a complete example.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from gptforge.core.declarations import adapter_of
from gptforge.model.rewards import user_function

KEY = "preference.environment"
# Each environment adapter's module here, by its declared name: a `factory(spec, url, timeout_s)` of environments,
# or, for one whose harness drives whole episodes (`drives`), a `Driver(spec, concurrency, endpoint)`.
IMPLEMENTED = {"openenv": "gptforge.model.agents.environments.openenv",
               "verifiers": "gptforge.model.agents.environments.verifiers"}


def factory(spec: str | None, url: str | None, timeout_s: float) -> Callable | None:
    """The factory of one environment an episode that `spec` names (None: no environment, or a driver's)."""
    if not spec:
        return None
    if (adapter := adapter_of(spec)) is None or not adapter.environment:  # a user's own factory
        return user_function(spec, KEY)
    if adapter.drives:
        return None
    return importlib.import_module(IMPLEMENTED[adapter.name]).factory(spec.removeprefix(adapter.prefix), url, timeout_s)


def driver(spec: str | None, concurrency: int, endpoint: tuple[str, int] = ("127.0.0.1", 0)):
    """What runs whole episodes for an environment whose own harness drives them (verifiers'), its endpoint bound to
    `endpoint` (host, port); None for others."""
    if (adapter := adapter_of(spec)) is None or not (adapter.environment and adapter.drives):
        return None
    return importlib.import_module(IMPLEMENTED[adapter.name]).Driver(spec.removeprefix(adapter.prefix), concurrency,
                                                                     endpoint)
