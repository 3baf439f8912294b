"""Where rows come from: the demo generator, local files (.txt .jsonl .json .parquet, folders, globs)
or a Hugging Face hub dataset. Every row carries its origin (file and line) for error messages.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptforge.core.errors import DataError

EXTENSIONS = (".txt", ".jsonl", ".json", ".parquet")
GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Row:
    """One raw row: its value (str for .txt lines, dict otherwise) and where it came from."""

    origin: str  # file path or "hub:<name>"
    line: int  # 1-based line (jsonl/txt), item (json) or row (parquet/hub)
    value: Any = None
    error: str | None = None  # set when the row could not even be decoded/parsed

    @property
    def where(self) -> str:
        return f"{self.origin}:{self.line}"


def kind_of(spec: str) -> str:
    """'demo', 'local' or 'hub'. A spec with a known extension, a glob or an existing path is local."""
    if spec == "demo":
        return "demo"
    if any(c in spec for c in GLOB_CHARS) or spec.endswith(EXTENSIONS) or os.path.exists(spec):
        return "local"
    return "hub"


def local_files(spec: str) -> list[Path]:
    """Expand a file, folder or glob into the sorted data files it names; a missing one is a DataError."""
    if any(c in spec for c in GLOB_CHARS):
        paths = [Path(p) for p in sorted(glob.glob(spec, recursive=True))]
        files = [p for p in paths if p.is_file() and p.suffix in EXTENSIONS]
        if not files:
            raise DataError(f"no data files match {spec} (looked for {', '.join(EXTENSIONS)})")
        return files
    p = Path(spec)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in EXTENSIONS)
        if not files:
            raise DataError(f"folder {p} holds no data files ({', '.join(EXTENSIONS)})")
        return files
    if not p.is_file():
        raise DataError(f"file not found: {p}")
    if p.suffix not in EXTENSIONS:
        raise DataError(f"{p}: unsupported file type {p.suffix!r} (use {', '.join(EXTENSIONS)})")
    return [p]


def _read_lines(path: Path, as_json: bool) -> Iterator[Row]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                yield Row(str(path), n, error=f"undecodable line ({e.reason} at byte {e.start})")
                continue
            if not as_json:
                if text.strip():
                    yield Row(str(path), n, text)
                continue
            if not text.strip():
                continue
            try:
                yield Row(str(path), n, json.loads(text))
            except json.JSONDecodeError as e:
                yield Row(str(path), n, error=f"malformed JSON ({e.msg} at column {e.colno})")


def _read_json(path: Path) -> Iterator[Row]:
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a valid JSON document ({e})") from None
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        doc = doc["data"]
    if not isinstance(doc, list):
        raise DataError(f"{path}: expected a JSON list of rows (or {{\"data\": [...]}})")
    for n, item in enumerate(doc, 1):
        yield Row(str(path), n, item)


def _read_parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=8192):
        for item in batch.to_pylist():
            n += 1
            yield Row(str(path), n, item)


def read_local(spec: str) -> Iterator[Row]:
    for path in local_files(spec):
        if path.suffix == ".txt":
            yield from _read_lines(path, as_json=False)
        elif path.suffix == ".jsonl":
            yield from _read_lines(path, as_json=True)
        elif path.suffix == ".json":
            yield from _read_json(path)
        else:
            yield from _read_parquet(path)


def read_hub(name: str, split: str) -> Iterator[Row]:
    """Rows of a hub dataset via `datasets.load_dataset` (needs a network or a warm HF cache)."""
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # the hub raises many types; the user needs the name and the reason
        raise DataError(f"could not load hub dataset {name!r} (split {split!r}): {e}") from None
    for n, item in enumerate(ds, 1):
        yield Row(f"hub:{name}", n, item)


def read_rows(spec: str, split: str = "train") -> Iterator[Row]:
    """Raw rows of a non-demo source."""
    kind = kind_of(spec)
    if kind == "local":
        return read_local(spec)
    if kind == "hub":
        return read_hub(spec, split)
    raise ValueError("demo rows come from data.demo, not read_rows")


def fingerprint_source(spec: str, split: str, demo_settings: dict) -> str:
    """Content hash of a source: file bytes for local data, generator settings for demo data, name and
    split for hub data."""
    h = hashlib.sha256()
    kind = kind_of(spec)
    if kind == "local":
        for path in local_files(spec):
            h.update(str(path).encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    elif kind == "demo":
        h.update(json.dumps({"demo": demo_settings}, sort_keys=True).encode())
    else:
        h.update(json.dumps({"hub": spec, "split": split}).encode())
    return h.hexdigest()
