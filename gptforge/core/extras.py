"""The optional libraries a setting needs (pyproject.toml's extras): imported where the setting is used, and a
missing one is one error line naming the setting and the extra to install."""

from __future__ import annotations

import importlib

from gptforge.core.errors import ConfigError

EXTRAS = {"reasoning_gym": ("reasoning-gym", "environments"), "verifiers": ("verifiers", "environments"),
          "openenv": ("openenv-core", "environments"), "mcp": ("mcp", "environments")}


def require(module: str, key: str):
    """The module `module` (one of EXTRAS), imported; a ConfigError naming `key` and the extra where it is not
    installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package, extra = EXTRAS[module.split(".")[0]]
        raise ConfigError(f"{key} needs {package}, which is not installed ({e}): pip install 'gptforge[{extra}]' "
                          "(make installs it)") from None
