"""Files written so that a reader sees the old content or the whole new one, and their digests."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from gptforge.core.errors import storage_error

# the shipped configs (tiny.yaml, the DeepSpeed JSONs): the repository's configs/, which gptforge/configs links to
# in a checkout and a wheel holds as package data
CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# What a training stage's output holds: `model/` (adapters merged, where it trained any) and, for an adapter stage,
# `adapter/` (the PEFT adapter alone); see gptforge.model.export.export_model.
MODEL_OUTPUTS = {"model": "model", "adapter": "adapter"}


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON so that readers see the old file or the whole new one (write_text_atomic)."""
    write_text_atomic(path, json.dumps(obj, indent=2, default=str))


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temp name, fsync, rename, fsync the folder: readers see the old file or the whole new one.
    A failed write (a full or read-only disk) leaves no temp file behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise storage_error(e) or e from None
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
