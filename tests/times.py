"""The suite's time, from the JUnit report that `make test` writes (.pytest/junit.xml): the seconds of each test file
(setup, call and teardown of its tests, as the worker that ran it measured them) and the slowest tests, written into
tests/README.md between its markers. Run it after a fresh-clone run (`CI=true bash .ci/run`):

    .venv/bin/python tests/times.py [.pytest/junit.xml] [--wall SECONDS] [--commit SHA]

`--wall`: the run's own wall time, which the report does not hold (two workers share the two cores, so the files'
seconds add up to about twice it). Nothing here is asserted: these are figures for a reader, never a test.
"""

from __future__ import annotations

import argparse
import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "tests" / "README.md"
BEGIN, END = "<!-- times: begin (tests/times.py writes this) -->", "<!-- times: end -->"


def read(report: Path) -> tuple[Counter, Counter, int, int]:
    """(seconds by file, seconds by test, tests run, tests skipped) of a JUnit report."""
    files: Counter = Counter()
    tests: Counter = Counter()
    run = skipped = 0
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # the module's dotted path, then a class's name where one holds it
        cut = next((k for k in range(len(parts), 0, -1) if (ROOT / "/".join(parts[:k])).with_suffix(".py").exists()),
                   len(parts))
        path = "/".join(parts[:cut]) + ".py"
        name = "::".join([path, *parts[cut:], case.get("name", "")])
        seconds = float(case.get("time") or 0)
        files[path] += seconds
        tests[name] += seconds
        run += 1
        skipped += case.find("skipped") is not None
    return files, tests, run, skipped


def table(files: Counter, tests: Counter, run: int, skipped: int, wall: float | None, commit: str | None) -> str:
    total = sum(files.values())
    head = (f"{run} tests, {skipped} skipped; {total:.0f} s of tests over both workers"
            + (f", {wall / 60:.1f} minutes of wall time" if wall else "") + (f", at `{commit}`" if commit else ""))
    lines = [head, "", "| test file | seconds | share |", "| --- | ---: | ---: |"]
    lines += [f"| `{f}` | {s:.0f} | {s / total:.1%} |" for f, s in files.most_common()]
    lines += ["", "The 20 slowest tests:", "", "| test | seconds |", "| --- | ---: |"]
    lines += [f"| `{t}` | {s:.0f} |" for t, s in tests.most_common(20)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", nargs="?", default=str(ROOT / ".pytest" / "junit.xml"))
    p.add_argument("--wall", type=float, help="the run's wall time in seconds")
    p.add_argument("--commit", help="the commit that ran")
    args = p.parse_args()
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"error: {README} has no {BEGIN} ... {END} markers")
    body = table(*read(Path(args.report)), args.wall, args.commit)
    README.write_text(re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: f"{BEGIN}\n{body}\n{END}", text,
                             flags=re.S))
    print(body.splitlines()[0])


if __name__ == "__main__":
    main()
