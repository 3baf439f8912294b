"""Every scale-out template parses, and every gptforge command or module it runs exists."""

import importlib
import re
import subprocess

import pytest
import yaml

from gptforge.pipeline.cli import build_parser
from tests.conftest import ROOT

INFRA = ROOT / "infra"


def commands_in(text: str) -> list[str]:
    return re.findall(r"-m (gptforge\.stages\.\w+|gptforge\.pipeline\.\w+)|gptforge (\w+)", text)


def check_references(text: str) -> None:
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    found = commands_in(text)
    assert found, "template runs no gptforge command"
    for module, sub in found:
        if module:
            importlib.util.find_spec(module) or pytest.fail(f"no module {module}")
        if sub:
            assert sub in subcommands, f"gptforge has no command {sub!r}"


@pytest.mark.parametrize("path", sorted(INFRA.rglob("*.yaml")), ids=lambda p: p.name)
def test_yaml_templates_parse_and_reference_real_commands(path):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert all(d is not None for d in docs)
    if path.name == "prefect.yaml":
        for dep in docs[0]["deployments"]:
            module, func = dep["entrypoint"].split(":")
            mod = importlib.import_module("gptforge." + module.removesuffix(".py").replace("/", "."))
            assert callable(getattr(mod, func))
        assert docs[0]["deployments"][0]["schedules"][0]["cron"]
        return
    if path.name == "compose.yaml":
        services = docs[0]["services"]
        assert {"postgres", "server", "worker"} <= set(services)
        assert "postgresql" in services["server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
        return
    check_references(path.read_text())


@pytest.mark.parametrize("path", sorted(INFRA.rglob("*.sh")) + sorted(INFRA.rglob("*.sbatch")), ids=lambda p: p.name)
def test_shell_templates_parse_and_reference_real_commands(path):
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    check_references(path.read_text())


def test_multi_node_overrides_in_templates_are_valid_config():
    from gptforge.core.config import load_config

    text = "\n".join(p.read_text() for p in INFRA.rglob("*") if p.is_file())
    keys = set(re.findall(r"--set ([\w.]+)=", text))
    assert keys
    for key in keys:
        section, field = key.split(".", 1)
        model = type(getattr(load_config(ROOT / "configs" / "tiny.yaml"), section))
        assert field in model.model_fields, key
