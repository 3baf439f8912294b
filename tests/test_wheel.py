"""The wheel built from the repository holds every module: installed without -e into a fresh venv (its dependencies
taken from the suite's own environment as a plain path, so that the editable install's finder, which maps gptforge
onto this checkout, is not among them), every module imports from the venv's copy, and the console script answers
`--help` and `config` from a folder of its own."""

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

IMPORT_ALL = """
import importlib, pathlib, pkgutil, sys
import gptforge
here = pathlib.Path(gptforge.__file__).resolve().parent
assert str(here).startswith(sys.prefix), here  # the venv's copy, not the checkout
names = sorted(m.name for m in pkgutil.walk_packages(gptforge.__path__, "gptforge."))
for name in names:
    importlib.import_module(name)
print(len(names), "modules")
"""


def test_a_wheel_of_the_repository_installs_and_imports_every_module(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("gptforge-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # a path: its .pth files are not run
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    out = subprocess.run([str(python), "-c", IMPORT_ALL], cwd=elsewhere, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    layers = ("data", "model", "stages", "pipeline")  # gptforge/<layer> links to them
    ours = [f for layer in layers for f in (ROOT / layer).rglob("*.py")] + \
        [f for f in (ROOT / "gptforge").rglob("*.py") if f.relative_to(ROOT / "gptforge").parts[0] not in layers]
    assert int(out.stdout.split()[0]) == len(ours) - 1, out.stdout  # every module of the checkout but gptforge's own
    helped = subprocess.run([str(venv / "bin" / "gptforge"), "--help"], cwd=elsewhere, capture_output=True, text=True)
    assert helped.returncode == 0 and "run" in helped.stdout, helped.stderr[-2000:]
    reference = subprocess.run([str(venv / "bin" / "gptforge"), "config"], cwd=elsewhere, capture_output=True,
                               text=True)
    assert reference.returncode == 0 and reference.stdout == (ROOT / "docs" / "config.md").read_text()
