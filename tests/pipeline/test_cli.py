import subprocess
import sys
from pathlib import Path

from tests.conftest import TINY


def test_config_errors_exit_2_before_anything_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(TINY).read_text() + "\nfoo: 1\n")
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c", str(bad),
                           "--set", f"run.root={tmp_path / 'runs'}"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert "unknown key foo" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_unknown_stage_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "stage", "pretrian", "-c", str(TINY)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: unknown stage 'pretrian'") and "Traceback" not in proc.stderr
