"""The package's layers point down only (docs/architecture.md: core -> data -> model -> stages -> pipeline), no two
modules import each other (through any chain, function-level imports counted), every first-party import goes
through `gptforge`, a static reader finds each module at its path in the checkout, and nothing in a user's working
folder can shadow the package."""

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


def modules() -> dict[str, object]:
    """Every first-party module: {dotted name: its file}."""
    out = {}
    for layer, folder in LAYERS.items():
        for f in folder.rglob("*.py"):
            name = ".".join(["gptforge", layer, *f.relative_to(folder).with_suffix("").parts])
            out[name.removesuffix(".__init__")] = f
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def test_no_import_cycles_counting_imports_inside_functions():
    assert cycles(import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the walk sees one


def test_a_static_resolver_finds_every_module_at_its_path_in_the_checkout():
    """jedi (an editor's go-to-definition) reads imports without running the install's import hooks: each module
    resolves to its file through the links gptforge/<layer> -> <layer>."""
    import jedi

    project = jedi.Project(ROOT)
    for name, f in modules().items():
        source = f"import {name}\n{name}"
        (found,) = jedi.Script(source, project=project).goto(2, len(name), follow_imports=True)
        assert found.module_path is not None and found.module_path.resolve() == f.resolve(), (name, found)


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
    assert again.returncode == 0 and "reused complete output" in again.stdout, again.stderr[-3000:]
