"""The `unit_tests` reward, judged where the program cannot reach it.

A row's tests are asserts of one expression each, with or without a comparison: `assert f(3) == 21`,
`assert is_prime(7)`, `assert len(f("ab")) == 2`, `assert isinstance(f(), int)`. Each is split here, in gptforge's
process, before anything runs (`split`): the parts that need the program go to the sandbox as source text, the rest
of the expression, with every expected value in it, stays here.

- A part is a maximal subexpression that names the program: a call of one of its functions, a name it defines, an
  attribute or an item of one (every name that is not one of `SAFE`'s). Around it, comparisons, arithmetic, boolean
  logic, literals, displays and calls of `SAFE`'s builtins stay here: in `isinstance(f(), int)` only `f()` leaves.
- In the sandbox a harness runs the program, evaluates each part in the program's namespace and writes its value as
  plain data: None, bool, int, float, str, and lists, tuples, dicts and sets of them, of exactly those types (an
  `int` subclass whose `__eq__` always holds is not plain data; it scores that test 0).
- Here each value is parsed back into real builtins, put in place of its part, and the expression is evaluated
  with `SAFE`'s builtins alone: its truth is the test's. The comparison and the count happen in this process.

So nothing the program does in its own interpreter (patching `exec` or `builtins`, rewriting `sys.stdout`, reading
the harness's frame, a trace hook, exiting early) reaches the judgement: the most it can do is choose the values its
parts return, which is what an honest program does, and the values they are compared with never enter its process.

A test of another form (several statements, not an assert, a syntax error) is one error line naming the row, where
the data is read (`check_rows`), before anything runs. A sandbox that cannot start is a
`gptforge.model.agents.sandbox.SandboxError`, never a score of 0.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import re
from dataclasses import dataclass

from gptforge.core.errors import DataError
from gptforge.model.agents import sandbox

# the names a test may use around the program's parts, evaluated here (never the program's own)
SAFE = {name: getattr(builtins, name) for name in (
    "abs", "all", "any", "bool", "dict", "divmod", "enumerate", "filter", "float", "frozenset", "int", "isinstance",
    "len", "list", "map", "max", "min", "pow", "range", "repr", "reversed", "round", "set", "sorted", "str", "sum",
    "tuple", "type", "zip")} | {"math": math}
PART = "_part"  # the name a part takes here: _part0, _part1, ...
MARK = "\x1egptforge-judge "  # the harness's line of values (the program may print anything around it)

HARNESS = '''
import json, sys

sys.stdout.write(''' + repr(sandbox.START) + ''')
sys.stdout.flush()


def plain(value, depth=0):
    """The value as tagged JSON, where it is plain data of exactly these types; else None."""
    kind = type(value)
    if depth > 20:
        return None
    if value is None or kind in (bool, int, str) or (kind is float and value == value and abs(value) != float("inf")):
        return ["v", value]
    if kind is float:
        return ["f", repr(value)]
    if kind in (list, tuple, set, frozenset):
        items = [plain(v, depth + 1) for v in value]
        return None if None in items else [kind.__name__, items]
    if kind is dict:
        items = [[plain(k, depth + 1), plain(v, depth + 1)] for k, v in value.items()]
        return None if any(None in kv for kv in items) else ["dict", items]
    return None


def main():
    parts = json.loads(sys.stdin.readline())
    space = {"__name__": "__main__"}
    try:
        exec(compile(sys.stdin.read(), "<program>", "exec"), space)
        values = []
        for source in parts:
            try:
                values.append(plain(eval(compile(source, "<test>", "eval"), space)))
            except BaseException:
                values.append(None)
    except BaseException:
        values = [None] * len(parts)
    sys.stdout.write("\\n" + ''' + repr(MARK) + ''' + json.dumps(values) + "\\n")
    sys.stdout.flush()


main()
'''


@dataclass(frozen=True)
class Test:
    """A test split for judging: `parts`, the sources the sandbox evaluates; `here`, the rest, with each part a
    name `_part<i>`, evaluated in this process."""

    source: str
    parts: tuple[str, ...]
    here: ast.Expression


class _Split(ast.NodeTransformer):
    """Replace each maximal subexpression that needs the program with a name of its own."""

    def __init__(self, source: str):
        self.source, self.parts = source, []

    def visit(self, node):
        if not isinstance(node, ast.expr) or not needs_program(node):
            return node
        if isinstance(node, (ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.IfExp, ast.List, ast.Tuple,
                             ast.Set, ast.Dict)) or (isinstance(node, ast.Call) and safe_callee(node.func)):
            return self.generic_visit(node)
        self.parts.append(ast.get_source_segment(self.source, node) or ast.unparse(node))
        return ast.copy_location(ast.Name(f"{PART}{len(self.parts) - 1}", ast.Load()), node)


def needs_program(node: ast.AST) -> bool:
    """Whether the expression names anything that is not one of SAFE's."""
    return any(isinstance(n, ast.Name) and n.id not in SAFE for n in ast.walk(node))


def safe_callee(func: ast.expr) -> bool:
    """A call evaluated here: one of SAFE's builtins, or a function of a SAFE module (math.isclose)."""
    if isinstance(func, ast.Name):
        return func.id in SAFE
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math"


def split(source: str) -> Test:
    """The test `source` (`assert <expression>`) split into its parts and the rest; a ValueError saying why where
    it is not of that form."""
    try:
        tree = ast.parse(source.strip())
    except SyntaxError as e:
        raise ValueError(f"not Python ({e.msg})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise ValueError("not a single `assert <expression>`")
    expression = tree.body[0].test
    if not needs_program(expression):
        raise ValueError("it names nothing of the program")
    splitter = _Split(source.strip())
    here = ast.fix_missing_locations(ast.Expression(splitter.visit(expression)))
    return Test(source, tuple(splitter.parts), here)


def tests_of(value) -> list[str]:
    """A row's `tests` column as a list of tests (a list, or one string of them a line)."""
    if isinstance(value, str):
        return [t for t in value.splitlines() if t.strip()]
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return value
    raise ValueError(f"tests must be a list of strings or a string, not {type(value).__name__}")


def check_rows(rows) -> None:
    """Each row's tests (`rows`: (where, tests column) pairs, where a file:line) are of the judged form, else one
    error naming the row and the test."""
    for where, tests in rows:
        try:
            for test in tests_of(tests):
                try:
                    split(test)
                except ValueError as e:
                    raise ValueError(f"test {test!r}: {e}") from None
        except ValueError as e:
            raise DataError(f"{where}: {e}; the unit_tests reward takes asserts of one expression each, such as "
                            "`assert f(3) == 21`") from None


def decode(tagged):
    """A value the harness wrote, as real builtins (None where it was not plain data)."""
    if tagged is None:
        return None
    kind, value = tagged
    if kind == "v":
        return value
    if kind == "f":
        return float(value)
    if kind == "dict":
        return {_hashable(decode(k)): decode(v) for k, v in value}
    items = [decode(v) for v in value]
    return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](
        items if kind in ("list", "tuple") else map(_hashable, items))


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def passed(test: Test, values: list) -> bool:
    """Whether the test holds with its parts' values (a part that was not plain data fails it)."""
    if any(v is None for v in values):
        return False
    scope = {"__builtins__": {}, **SAFE, **{f"{PART}{i}": decode(v) for i, v in enumerate(values)}}
    try:
        return bool(eval(compile(test.here, "<test>", "eval"), scope))
    except Exception:
        return False


CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def code_of(response: str) -> str:
    """The program a response writes: its last ```python block, else the whole response."""
    blocks = CODE_BLOCK.findall(response)
    return blocks[-1] if blocks else response


def score(program: str, tests: list[Test], limits: sandbox.Limits) -> float:
    """The share of `tests` the program passes, judged here from the values its parts took in the sandbox."""
    parts = [p for t in tests for p in t.parts]
    result = sandbox.started(sandbox.run([sandbox.PYTHON, "-I", "-c", HARNESS], stdin=json.dumps(parts) + "\n" +
                                         program, limits=limits), limits)
    lines = [line for line in result.stdout.split("\n") if line.startswith(MARK)]  # (splitlines splits at \x1e)
    try:
        values = json.loads(lines[-1][len(MARK):]) if lines else None
    except ValueError:
        values = None
    if not isinstance(values, list) or len(values) != len(parts):
        return 0.0  # the program ended the process, or a limit did, before the values were written
    n, wins = 0, 0
    for t in tests:
        wins += passed(t, values[n:n + len(t.parts)])
        n += len(t.parts)
    return wins / len(tests)


def unit_tests(limits: sandbox.Limits, calls=None):
    """The built-in reward `unit_tests`: each response's program judged against its row's `tests` (the share
    that hold), 0 where a row has none."""

    def one(response: str, tests) -> float:
        try:
            split_tests = [split(t) for t in tests_of(tests or [])]
        except ValueError as e:  # the preflight checked every row: a row of another source, named by its test
            raise DataError(f"a row's tests: {e}; the unit_tests reward takes asserts of one expression each") from None
        return score(code_of(response), split_tests, limits) if split_tests else 0.0

    def unit_tests(prompts, responses, answers, tests=None, **_) -> list[float]:
        rows = tests if tests is not None else [None] * len(responses)
        return list((calls.map if calls else map)(lambda rt: one(*rt), zip(responses, rows)))

    return unit_tests
