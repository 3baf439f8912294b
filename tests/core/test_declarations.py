"""Rewards and environment adapters are declared once (gptforge/core/declarations.py: REWARDS, ADAPTERS), like
stages: nothing else compares a reward's name or an adapter's prefix with a string literal."""

import ast
from pathlib import Path

from gptforge.core.declarations import ADAPTERS, REWARDS

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("gptforge", "data", "model", "pipeline", "stages")


def literals(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in literals(e)]
    return []


def sources() -> list[Path]:
    """The package's modules, the declarations' own left out."""
    return sorted(p for room in ROOMS for p in (ROOT / room).rglob("*.py") if p.name != "declarations.py"
                  and not any(q.is_symlink() for q in (p, *p.parents)))


def comparisons(paths: list[Path]) -> list[str]:
    """file:line of each comparison (==, !=, in, not in) of a value with a built-in reward's name, and of each
    `startswith`/`removeprefix` of an adapter's prefix."""
    names, prefixes = set(REWARDS), {a.prefix for a in ADAPTERS.values()}
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            hit = False
            if isinstance(node, ast.Compare) and all(isinstance(o, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                     for o in node.ops):
                hit = any(v in names for side in (node.left, *node.comparators) for v in literals(side))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("startswith", "removeprefix"):
                hit = any(v in prefixes for a in node.args for v in literals(a))
            if hit:
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_reward_name_or_adapter_prefix_is_compared_outside_its_declaration():
    paths = sources()
    assert len(paths) > 100 and any(p.name == "rewards.py" for p in paths)  # (the walk reads the package)
    found = comparisons(paths)
    assert len(found) <= 2, found


def test_the_count_sees_a_comparison(tmp_path):
    """The walk finds the forms it counts: a module with three such comparisons."""
    module = tmp_path / "probe.py"
    module.write_text('def f(spec, name):\n    return name == "unit_tests" or name in ("exact_match",) or '
                      'spec.startswith("openenv:")\n')
    assert comparisons([module]) == ["probe.py:2"] * 3
