import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gptforge.core.config import dump_config
from gptforge.pipeline.flow import pipeline_flow

ONLY_TOKENIZE = ["pretrain.enabled=false", "sft.enabled=false", "reward.enabled=false", "preference.enabled=false"]


def write_cfg(cfg, tmp_path):
    path = tmp_path / "pipeline.yaml"
    path.write_text(dump_config(cfg))
    return str(path)


async def artifacts():
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return await client.read_artifacts()


def test_flow_runs_then_reuses_and_reports(prefect_server, small_cfg, tmp_path):
    """The flow computes, then reuses, and reports in the UI; `--from` recomputes, removing a stage's output under
    the stage's lock only: a run refused by the lock (another run is writing it) has deleted nothing."""
    import fcntl

    from gptforge.core.errors import UserError
    from gptforge.pipeline.store import locate, read_manifest

    cfg = small_cfg(*ONLY_TOKENIZE)
    first = pipeline_flow(config=cfg)
    run_dir = tmp_path / "runs" / "tiny"
    record = json.loads((run_dir / "run.json").read_text())
    assert record["stages"]["tokenize"]["action"] == "computed"
    assert record["stages"]["tokenize"]["status"] == "complete"
    second = pipeline_flow(config=cfg)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["stages"]["tokenize"]["action"] == "reused"
    assert first == second and first["tokenize"]["tokens"] > 0
    report = json.loads((run_dir / "report.json").read_text())
    assert report["stages"]["tokenize"]["metrics"]["tokens"] == first["tokenize"]["tokens"]
    out_dir = record["stages"]["tokenize"]["output"]
    assert f"| [tokenize]({Path(out_dir).as_uri()}) | reused |" in (run_dir / "report.md").read_text()
    uri = Path(out_dir).as_uri()  # (the session's Prefect server holds other tests' artifacts too)
    shown = [(a.key, str(a.data)) for a in asyncio.run(artifacts())]
    assert ("run-report", True) in [(k, f"| [tokenize]({uri}) |" in d) for k, d in shown]  # the report in the UI
    assert ("tokenize-output", True) in [(k, f"]({uri})" in d) for k, d in shown]  # a link to the stage's output
    pipeline_flow(config=cfg, from_stage="tokenize")  # --from recomputes
    record = json.loads((run_dir / "run.json").read_text())
    assert record["stages"]["tokenize"]["action"] == "computed"
    out_dir = locate(cfg, "tokenize")[0]
    with open(out_dir.with_name(out_dir.name + ".lock"), "w") as lock:  # another run is writing it
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(UserError, match="another run is writing"):
            pipeline_flow(config=cfg, from_stage="tokenize")
    assert read_manifest(out_dir) is not None  # nothing was removed


def test_missing_data_file_is_one_line(small_cfg, tmp_path):
    path = write_cfg(small_cfg(f"data.pretrain={tmp_path / 'missing.txt'}"), tmp_path)
    proc = subprocess.run([sys.executable, "-m", "gptforge.stages.tokenize", "--config", path, "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: file not found: {tmp_path / 'missing.txt'}"
