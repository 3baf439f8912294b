"""The package's layers point down only (DESIGN.md: core -> data -> model -> stages -> pipeline), every
first-party import goes through `gptforge`, and nothing in a user's working folder can shadow the package."""

import ast
import subprocess
import sys

from gptforge.core.config import dump_config
from tests.conftest import ROOT

LAYERS = {"core": ROOT / "gptforge" / "core", "data": ROOT / "data", "model": ROOT / "model",
          "stages": ROOT / "stages", "pipeline": ROOT / "pipeline"}
ORDER = list(LAYERS)


def imports(path):
    """Absolute module names imported anywhere in a file (function-level imports included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_no_module_imports_from_a_layer_above_its_own():
    upward, bare = [], []
    for layer, folder in LAYERS.items():
        for f in sorted(folder.rglob("*.py")):
            for name in imports(f):
                parts = name.split(".")
                if parts[0] in ("data", "model", "stages", "pipeline"):
                    bare.append(f"{f.relative_to(ROOT)} imports {name}")
                if parts[0] == "gptforge" and len(parts) > 1 and ORDER.index(parts[1]) > ORDER.index(layer):
                    upward.append(f"{f.relative_to(ROOT)} imports {name}")
    assert not bare, "first-party imports go through gptforge:\n" + "\n".join(bare)
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_the_walk_sees_an_upward_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from gptforge.pipeline.store import locate\n")
    assert list(imports(f)) == ["gptforge.pipeline.store"]


def test_a_stage_runs_from_a_folder_with_its_own_model_and_data(small_cfg, tmp_path):
    """`gptforge stage tokenize` (no Prefect) from a folder whose model.py and data/ would shadow gptforge's if its
    layers were importable by those names; run again, it reuses its complete output."""
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    for shadow in (work / "model.py", work / "pipeline.py", work / "stages.py", work / "data" / "__init__.py"):
        shadow.write_text("raise SystemExit('imported the user\\'s module instead of gptforge')\n")
    cfg = small_cfg("pretrain.enabled=false", "sft.enabled=false", "reward.enabled=false", "preference.enabled=false")
    (work / "pipeline.yaml").write_text(dump_config(cfg))
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "stage", "tokenize", "-c", "pipeline.yaml"],
                          cwd=work, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokenize" in proc.stdout and "imported the user" not in proc.stderr
    again = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "stage", "tokenize", "-c", "pipeline.yaml"],
                           cwd=work, capture_output=True, text=True)
    assert again.returncode == 0 and "reusing complete output" in again.stdout, again.stderr[-3000:]
