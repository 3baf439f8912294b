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
        deployments = docs[0]["deployments"]
        assert deployments[0]["schedules"][0]["cron"] and deployments[0]["triggers"][0]["expect"] == \
            ["gptforge.data.changed"]
        stages = {d["work_pool"]["name"] for d in deployments if d["entrypoint"].endswith(":stage_flow")}
        assert stages == {"cpu", "gpu"}
        return
    if path.name == "compose.yaml":
        services = docs[0]["services"]
        assert {"postgres", "server", "worker-cpu", "worker-gpu"} <= set(services)
        server = services["server"]["environment"]
        assert "postgresql" in server["PREFECT_API_DATABASE_CONNECTION_URL"]
        assert server["PREFECT_SERVER_API_AUTH_STRING"]  # the server is not open
        assert "api/health" in " ".join(services["server"]["healthcheck"]["test"])
        assert all(p.startswith("127.0.0.1:") for p in services["server"]["ports"])
        for pool in ("cpu", "gpu"):
            worker = services[f"worker-{pool}"]
            assert worker["depends_on"]["server"]["condition"] == "service_healthy"
            assert f"--pool {pool}" in worker["command"] and worker["environment"]["PREFECT_API_AUTH_STRING"]
            assert "shared:/shared" in worker["volumes"]  # one stage store for every worker
        return
    if "kubernetes" in path.parts:
        import kubernetes_validate

        for doc in docs:  # against the Kubernetes 1.32 API schemas, offline (no cluster here for kubectl)
            kubernetes_validate.validate(doc, "1.32", strict=True)
        pod = next(d for d in docs if d["kind"] == "Job")["spec"]["template"]["spec"]
        assert pod["containers"][0]["imagePullPolicy"] == "IfNotPresent"
        assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])  # /dev/shm for NCCL
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


def test_the_image_is_built_from_a_clean_context():
    """No Docker engine runs here to build it: the context's exclusions and the build's steps, checked as text."""
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv/", "runs/", ".git/"} <= set(ignored)
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE=" in dockerfile and "FROM ${BASE}" in dockerfile  # CPU by default, a CUDA base by build-arg
    assert "torch==2.13.0" in dockerfile and "make setup" in dockerfile


@pytest.mark.slow
def test_gpu_script_runs_shrunk_on_the_cpu(tmp_path):
    """bench/gpu.sh --cpu-smoke: the GPU readiness script's two steps, shrunk, end to end."""
    import os

    proc = subprocess.run(["bash", "bench/gpu.sh", "--cpu-smoke"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "GPU_BENCH_ROOT": str(tmp_path)}, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"gptforge \(\w+, 2 processes, ZeRO-2, eager\): +[\d,]+ tokens/s", out), out[-2000:]
    assert re.search(r"baseline \(1 process, plain PyTorch, eager\): +[\d,]+ tokens/s", out)
    table = out[out.index("== (b)"):]
    for stage in ("tokenize", "pretrain"):
        assert re.search(rf"^\| {stage} \| .*=", table, re.M), stage  # each stage's metrics
