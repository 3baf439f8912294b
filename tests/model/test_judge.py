"""The unit_tests reward judged where the program cannot reach (gptforge.model.agents.judge): each forgery that
scored a wrong program 1.0 under the old judge, which shared the program's interpreter, scores what the honest wrong
program scores; a right program scores 1; tests are split here into the parts the sandbox evaluates and the rest;
a row of another form is one error line naming it; a sandbox that cannot start is an error, never a 0."""

import json

import pytest

from gptforge.core.errors import DataError
from gptforge.model.agents import judge, sandbox

pytestmark = pytest.mark.skipif(sandbox.missing() is not None, reason=f"the sandbox: {sandbox.missing()}")

TESTS = ["assert f() == 7", "assert f() + 1 == 8", "assert isinstance(f(), int)"]
WRONG = "def f():\n    return 6\n"  # passes the third test alone

FORGERIES = {
    # an int whose == always holds (and + gives one): not plain data, so none of its tests holds
    "an int subclass whose __eq__ always holds": "class X(int):\n    def __eq__(self, other):\n        return True\n"
    "    def __add__(self, other):\n        return X(8)\n    __hash__ = int.__hash__\n\ndef f():\n    return X(6)\n",
    # the old harness ran each test through exec, found in builtins
    "builtins.exec patched": WRONG + "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
    "builtins.eval = lambda *a, **k: True\n",
    # the old harness printed its count on stdout: a wrapper rewrote it to "all passed"
    "sys.stdout wrapped to rewrite the count": WRONG + "import sys, re\nclass W:\n    def __init__(self, s):\n"
    "        self.s = s\n    def write(self, t):\n        return self.s.write(re.sub(r'(\\d+) (\\d+)', r'\\2 \\2', t)"
    ".replace('null', '[\"v\", true]'))\n    def flush(self):\n        self.s.flush()\n    def __getattr__(self, a):\n"
    "        return getattr(self.s, a)\nsys.stdout = W(sys.stdout)\n",
    # the old harness's frame held its key, the tests and the count: a program read and rewrote them
    "the harness's frame read and rewritten": WRONG + "import sys\nframe = sys._getframe(1)\n"
    "while frame is not None:\n    for name in ('passed', 'tests', 'parts', 'values'):\n"
    "        if name in frame.f_locals:\n            print(name, frame.f_locals[name])\n"
    "    frame = frame.f_back\nimport builtins\nbuiltins.print('forged', 3, 3)\n",
    "a settrace hook": WRONG + "import sys\ndef hook(frame, event, arg):\n    if 'passed' in frame.f_locals:\n"
    "        frame.f_locals['passed'] = 3\n    return hook\nsys.settrace(hook)\n",
    "os._exit(0) after the program": WRONG + "import os\nos._exit(0)\n",
    "SystemExit(0)": WRONG + "raise SystemExit(0)\n",
    "AssertionError overridden": WRONG + "import builtins\nclass Never(Exception):\n    pass\n"
    "builtins.AssertionError = Never\n",
}


def score(program: str, tests=TESTS) -> float:
    return judge.score(program, [judge.split(t) for t in tests], sandbox.Limits(wall_s=10.0))


def test_a_right_program_scores_1_and_a_wrong_one_what_it_passes():
    assert score("def f():\n    return 7\n") == 1.0
    assert score(WRONG) == pytest.approx(1 / 3)
    assert score("def f():\n    return 'seven'\n") == 0.0
    assert score("def f(:\n") == 0.0  # it does not run
    assert score("while True:\n    pass\n", TESTS) == 0.0  # killed at its wall time


ENDS_ITS_PROCESS = {"an int subclass whose __eq__ always holds",  # its values are not plain data
                    "os._exit(0) after the program", "SystemExit(0)"}  # no value is written: no test holds


@pytest.mark.parametrize("name", list(FORGERIES))
def test_every_forgery_scores_no_more_than_the_honest_wrong_program(name):
    got, honest = score(FORGERIES[name]), score(WRONG)
    assert got == (0.0 if name in ENDS_ITS_PROCESS else pytest.approx(honest)) and honest == pytest.approx(1 / 3)


def test_tests_are_split_into_the_programs_parts_and_the_rest_kept_here():
    t = judge.split("assert isinstance(f(3), int) and len(g('ab')[0]) == 2")
    assert t.parts == ("f(3)", "g('ab')[0]")  # the expected values and the builtins stay here
    assert judge.split("assert f(3) == 21").parts == ("f(3)",)
    assert judge.split("assert is_prime(7)").parts == ("is_prime(7)",)  # compared with True, here
    assert judge.split("assert Solution().solve([1, 2]) == [2, 1]").parts == ("Solution().solve([1, 2])",)
    assert judge.split("assert math.isclose(area(2), 12.566, rel_tol=1e-3)").parts == ("area(2)",)
    # the parts' values, as the harness writes them, judged here
    assert judge.passed(judge.split("assert f(3) == 21"), [["v", 21]])
    assert not judge.passed(judge.split("assert f(3) == 21"), [None])  # not plain data
    assert judge.passed(judge.split("assert f() == (1, [2, 3])"), [["tuple", [["v", 1], ["list", [["v", 2],
                                                                                                  ["v", 3]]]]]])
    assert not judge.passed(judge.split("assert f() == (1, 2)"), [["list", [["v", 1], ["v", 2]]]])  # a list
    for bad, why in (("f(3) == 21", "not a single `assert <expression>`"), ("assert 1 == 1", "names nothing"),
                     ("assert f(3) == 21\nassert f(1) == 7", "not a single"), ("assert f(", "not Python")):
        with pytest.raises(ValueError, match=why):
            judge.split(bad)


def test_a_row_whose_tests_are_not_judged_asserts_is_one_error_naming_it():
    rows = [("prompts.jsonl:1", TESTS), ("prompts.jsonl:2", "assert f() == 7\nassert f() > 0"),
            ("prompts.jsonl:3", ["print(f())"])]
    with pytest.raises(DataError, match=r"^prompts.jsonl:3: test 'print\(f\(\)\)': not a single `assert "
                                        r"<expression>`; the unit_tests reward takes asserts"):
        judge.check_rows(rows)
    judge.check_rows(rows[:2])


def test_a_sandbox_that_does_not_start_is_an_error_not_a_score_of_0(monkeypatch):
    """As on a host that drops CAP_SETUID: setpriv fails before the program runs. The reward raises, and the python
    tool raises too, rather than handing the model setpriv's message as its program's output."""
    real = sandbox.command
    monkeypatch.setattr(sandbox, "command", lambda uid, limits, argv, seccomp_fd: ["/bin/sh", "-c",
                                                                       "echo 'setpriv: setresuid failed' >&2; exit 1"])
    with pytest.raises(sandbox.SandboxError, match="setresuid failed"):
        score("def f():\n    return 7\n")
    with pytest.raises(sandbox.SandboxError, match="setresuid failed"):
        sandbox.python_tool(sandbox.Limits())("print(1)")
    from gptforge.core.errors import ConfigError

    with pytest.raises(ConfigError, match="a trivial program does not run in it here"):
        sandbox.require("preference.tools: python")
    monkeypatch.setattr(sandbox, "command", real)
    sandbox.require("preference.tools: python")  # this host runs it


def test_the_reward_on_a_batch_of_rows():
    reward = judge.unit_tests(sandbox.Limits(wall_s=10.0))
    responses = ["Here:\n```python\ndef f():\n    return 7\n```", WRONG, FORGERIES["builtins.exec patched"]]
    assert reward(None, responses, [None] * 3, tests=[TESTS, json.loads(json.dumps(TESTS)), "\n".join(TESTS)]) == \
        [1.0, pytest.approx(1 / 3), pytest.approx(1 / 3)]
    assert reward(None, ["def f(): return 7"], [None], tests=[[]]) == [0.0]  # a row without tests
