"""Environments written for other libraries, as gptforge's episodes: `preference.environment` names a factory of
environments in TRL's conventions (`package.module:Factory`, gptforge.model.rollout.tools), or one of another
library's, which an adapter here turns into such a factory, so that PPO, GRPO, RLOO, distill and their evaluation
roll out through it unchanged (token-exact, concurrent, sync or async):

- `openenv:package.module:EnvClient` (openenv-core, the `environments` extra): each episode a session of the
  environment server at `preference.environment_url` (gptforge.model.rollout.environments.openenv);
- `verifiers:<id>` (verifiers.v1): its harness drives each episode against the policy behind an OpenAI-compatible
  endpoint (gptforge.model.rollout.environments.verifiers, gptforge.model.rollout.endpoint): a `driver` of whole
  episodes rather than a factory of environments.

Procedural task libraries are sources of prompts instead (`data.prompts: reasoning_gym:<dataset>`,
gptforge.core.procedural). docs/environments.md shows each with a complete example.
"""

from __future__ import annotations

from collections.abc import Callable

from gptforge.model.rewards import user_function

KEY = "preference.environment"


def factory(spec: str | None, url: str | None, timeout_s: float) -> Callable | None:
    """The factory of one environment an episode that `spec` names (None: no environment, or a driver's)."""
    if not spec or spec.startswith("verifiers:"):
        return None
    if spec.startswith("openenv:"):
        from gptforge.model.rollout.environments import openenv

        return openenv.factory(spec.removeprefix("openenv:"), url, timeout_s)
    return user_function(spec, KEY)


def driver(spec: str | None, concurrency: int, endpoint: tuple[str, int] = ("127.0.0.1", 0)):
    """What runs whole episodes for an environment whose own harness drives them (verifiers'), its endpoint bound to
    `endpoint` (host, port); None for others."""
    if spec and spec.startswith("verifiers:"):
        from gptforge.model.rollout.environments.verifiers import Driver

        return Driver(spec.removeprefix("verifiers:"), concurrency, endpoint)
    return None
