"""A run root that is read-only or full: one `error:` line naming the path, exit code 1, no temporary files,
nothing marked complete; after space is freed, the rerun resumes. On a real tmpfs where this machine lets the
test mount one (as root), else skipped (tests/core/test_files.py injects the same errors everywhere)."""

import json
import subprocess
import sys

import pytest

from gptforge.core.config import dump_config
from gptforge.pipeline.store import locate, read_manifest


def mount(path, *options) -> str | None:
    """Why a tmpfs cannot be mounted at `path`, or None once it is."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)],
                              capture_output=True, text=True)
    except FileNotFoundError:
        return "mount is not installed (Debian's mount)"
    return None if done.returncode == 0 else f"mount -t tmpfs failed (it needs root): {done.stderr.strip()}"


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def make(name, *options):
        path = tmp_path / name
        if why := mount(path, *options):
            pytest.skip(f"cannot mount a tmpfs here: {why}")
        mounted.append(path)
        return path

    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def stage(cfg, tmp_path, name="tokenize"):
    path = tmp_path / "pipeline.yaml"
    path.write_text(dump_config(cfg))
    return subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "stage", name, "-c", str(path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)


def one_error(proc) -> str:
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    return error


def test_a_read_only_run_root(small_cfg, tmp_path, tmpfs):
    root = tmpfs("ro", "ro", "size=1m")
    error = one_error(stage(small_cfg(f"run.root={root}"), tmp_path))
    assert error.startswith(f"error: cannot write {root}") and "read-only file system" in error, error


def test_a_full_disk_then_a_rerun_after_space_is_freed(small_cfg, tmp_path, tmpfs):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(4):  # four units of about 0.9 MB of tokens each
        (corpus / f"part-{k}.txt").write_text("".join(f"document {i} of part {k} " * 8 + "\n" for i in range(4000)))
    root = tmpfs("full", "size=2m")
    cfg = small_cfg(f"run.root={root}", f"data.pretrain={corpus}/*.txt")
    error = one_error(stage(cfg, tmp_path))
    assert "no space left" in error and "free some space and run again" in error, error
    out_dir = locate(cfg, "tokenize")[0]
    assert read_manifest(out_dir) is None and not (out_dir / "result.json").exists()
    assert not [p for p in root.rglob("*") if ".tmp" in p.name]  # no temporary file left
    # The units recorded done before the disk filled keep their shards; one whose shard was written but whose
    # record was not (the disk filled in between) is redone.
    units = out_dir / "shards" / "units"
    done = [json.loads(r.read_text()) for r in units.glob("[0-9]*.json") if r.with_suffix(".npy").is_file()]
    shards = [out_dir / "shards" / f["file"] for u in done for split in u["shards"].values() for f in split]
    kept = {p: p.stat().st_mtime_ns for p in shards}
    assert (out_dir / "tokenizer" / "tokenizer.json").is_file()  # the trained tokenizer is kept too
    subprocess.run(["mount", "-o", "remount,size=64m", str(root)], check=True)
    proc = stage(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_manifest(out_dir)["metrics"]["documents"] == 16000
    assert all(p.stat().st_mtime_ns == t for p, t in kept.items())
