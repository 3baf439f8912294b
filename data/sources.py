"""Where rows come from, read in pieces that one task can handle: local files (.txt .jsonl .json .parquet .arrow,
.gz or .zst compressed text, folders and globs of them), a `save_to_disk` folder (Dataset or DatasetDict), a
Hugging Face hub dataset (subset, split, revision, streamed when asked), or the built-in demo generator.

A source is split into `Unit`s: a byte range of an uncompressed text file (the lines that start in it), a whole
compressed file, a row range of a Parquet/Arrow file or of a Dataset, a shard of a streamed hub dataset. Every row
carries its origin (file and line, or row) for error messages. Reading a unit holds one batch in memory at a
time, so nothing here grows with the corpus.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptforge.data import procedural
from gptforge.core.errors import DataError

TEXT = (".txt", ".jsonl")
COMPRESSED = (".gz", ".zst")
EXTENSIONS = (*TEXT, ".json", ".parquet", ".arrow", *(t + c for t in TEXT for c in COMPRESSED))
GLOB_CHARS = "*?["
UNIT_BYTES = 64 << 20  # uncompressed text files are split into ranges of about this many bytes
UNIT_ROWS = 100_000  # Parquet, Arrow and Dataset rows per unit
BATCH_ROWS = 4096  # rows read at a time from columnar files


@dataclass(frozen=True)
class Row:
    """One raw row: its value (str for .txt lines, dict otherwise) and where it came from."""

    origin: str  # file path, or "hub:<name>[/shard]"
    line: int  # 1-based line (text files), item (json) or row (columnar files, datasets)
    value: Any = None
    error: str | None = None  # set when the row could not even be decoded/parsed

    @property
    def where(self) -> str:
        return f"{self.origin}:{self.line}"


@dataclass(frozen=True)
class Unit:
    """A piece of a source that one task reads. `start`/`stop` are byte offsets (text), rows (columnar files,
    datasets) or the shard index (streamed hub datasets); `first` numbers the unit's first row or line (None:
    count from 1 at `start`, the default until a scan has counted the lines before it)."""

    kind: str  # text | json | parquet | arrow | dataset | hub | demo
    path: str
    start: int = 0
    stop: int | None = None
    first: int = 1


def kind_of(path: str) -> str:
    """'demo', 'procedural' (reasoning_gym:<dataset>), 'tasks' (verifiers:<id>), 'local' or 'hub'. A path with a
    known extension, a glob or an existing path is local."""
    if path == "demo":
        return "demo"
    if procedural.is_procedural(path):
        return "procedural"
    if procedural.is_taskset(path):
        return "tasks"
    if any(c in path for c in GLOB_CHARS) or path.endswith(EXTENSIONS) or os.path.exists(path):
        return "local"
    return "hub"


def is_dataset_folder(p: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return (p / "dataset_dict.json").is_file() or (p / "state.json").is_file()


def local_files(spec: str) -> list[Path]:
    """Expand a file, folder or glob into the sorted data files it names; a missing one is a DataError."""
    if any(c in spec for c in GLOB_CHARS):
        paths = sorted(glob.glob(spec, recursive=True))
        files = [Path(p) for p in paths if Path(p).is_file() and p.endswith(EXTENSIONS)]
        if not files:
            raise DataError(f"no data files match {spec} (looked for {', '.join(EXTENSIONS)})")
        return files
    p = Path(spec)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(EXTENSIONS))
        if not files:
            raise DataError(f"folder {p} holds no data files ({', '.join(EXTENSIONS)})")
        return files
    if not p.is_file():
        raise DataError(f"file not found: {p}")
    if not p.name.endswith(EXTENSIONS):
        raise DataError(f"{p}: unsupported file type {''.join(p.suffixes)!r} (use {', '.join(EXTENSIONS)})")
    return [p]


# --- planning units --------------------------------------------------------------------------------


def units(source, demo_docs: int = 0, split_files: bool = True) -> list[Unit]:
    """The units of a source (a `data.<name>` config section); `demo_docs` sizes the demo corpus. Without
    `split_files`, an uncompressed text file is one unit (read in order, its lines numbered from 1)."""
    kind = kind_of(source.path)
    if kind == "demo":
        return [Unit("demo", "demo", 0, demo_docs)]
    if kind == "procedural":
        return [Unit("procedural", source.path, 0, source.size)]
    if kind == "tasks":
        return [Unit("tasks", source.path)]
    if kind == "hub":
        return _hub_units(source)
    if Path(source.path).is_dir() and is_dataset_folder(Path(source.path)):
        n = len(load_saved(source))
        return [Unit("dataset", source.path, a, min(a + UNIT_ROWS, n)) for a in range(0, n, UNIT_ROWS)]
    return [u for f in local_files(source.path) for u in _file_units(f, split_files)]


def _file_units(f: Path, split: bool) -> list[Unit]:
    name = f.name
    if name.endswith(TEXT) and split:  # byte ranges; a range holds the lines that start in it
        size = f.stat().st_size
        return [Unit("text", str(f), a, min(a + UNIT_BYTES, size)) for a in range(0, max(size, 1), UNIT_BYTES)]
    if name.endswith(TEXT) or name.endswith(COMPRESSED):
        return [Unit("text", str(f))]  # no seeking into a compressed stream: one unit a file
    if name.endswith(".json"):
        return [Unit("json", str(f))]
    if name.endswith(".parquet"):  # whole row groups, about UNIT_ROWS rows a unit
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(f).metadata
        out, lo, row, rows = [], 0, 0, 0
        for g in range(meta.num_row_groups):
            rows += meta.row_group(g).num_rows
            if rows >= UNIT_ROWS or g == meta.num_row_groups - 1:
                out.append(Unit("parquet", str(f), lo, g + 1, row + 1))
                lo, row, rows = g + 1, row + rows, 0
        return out
    n = _arrow_table(f).num_rows
    return [Unit("arrow", str(f), a, min(a + UNIT_ROWS, n)) for a in range(0, max(n, 1), UNIT_ROWS)]


def _hub_units(source) -> list[Unit]:
    if source.streaming:
        ds = load_hub(source)
        return [Unit("hub", source.path, i, i + 1) for i in range(ds.num_shards)]
    n = len(load_hub(source))
    return [Unit("hub", source.path, a, min(a + UNIT_ROWS, n)) for a in range(0, max(n, 1), UNIT_ROWS)]


# --- reading units -----------------------------------------------------------------------------------


def unit_bytes(unit: Unit) -> int | None:
    """The size a unit reads (its byte range, or its file), or None where it is not known (datasets, demo)."""
    if unit.kind == "text" and unit.stop is not None:
        return unit.stop - unit.start
    if unit.kind in ("text", "json", "parquet", "arrow"):
        return os.path.getsize(unit.path) if unit.kind in ("text", "json") else _file_share(unit)
    return None


def _file_share(unit: Unit) -> int:
    """A columnar unit's share of its file's bytes (rows or row groups of all)."""
    import pyarrow.parquet as pq

    size = os.path.getsize(unit.path)
    if unit.kind == "parquet":
        groups = pq.ParquetFile(unit.path).metadata.num_row_groups
        return size * (unit.stop - unit.start) // max(groups, 1)
    return size * (unit.stop - unit.start) // max(_arrow_table(Path(unit.path)).num_rows, 1)


def read_unit(unit: Unit, source, demo_settings=None) -> Iterator[Row]:
    """The raw rows of a unit, one batch in memory at a time."""
    if unit.kind == "text":
        return _read_text(unit)
    if unit.kind == "json":
        return _read_json(Path(unit.path))
    if unit.kind == "parquet":
        return _read_parquet(unit)
    if unit.kind == "arrow":
        return _read_table(unit, _arrow_table(Path(unit.path)), unit.path)
    if unit.kind == "dataset":
        return _read_table(unit, load_saved(source).data.table, unit.path)
    if unit.kind == "hub":
        return _read_hub(unit, source)
    if unit.kind == "procedural":
        return (Row(source.path, i + 1, row) for i, row in procedural.items(source))
    if unit.kind == "tasks":
        return (Row(source.path, i + 1, row) for i, row in procedural.tasks(source))
    from gptforge.data import demo

    docs = demo.from_settings(demo_settings, "pretrain").pretrain
    return (Row("demo", i + 1, doc) for i, doc in enumerate(docs))


def read_rows(source) -> Iterator[Row]:
    """Every raw row of a (non-demo) source, in order."""
    for unit in units(source, split_files=False):
        yield from read_unit(unit, source)


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.name.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _lines(unit: Unit) -> Iterator[bytes]:
    """The raw lines that start in the unit's byte range (all of a compressed file)."""
    with _open_text(Path(unit.path)) as f:
        if unit.stop is None:
            yield from f
            return
        if unit.start:
            f.seek(unit.start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line that started before the range is the previous unit's
        while f.tell() < unit.stop:
            line = f.readline()
            if not line:
                return
            yield line


def count_lines(unit: Unit) -> int:
    """Lines that start in a text unit."""
    return sum(1 for _ in _lines(unit))


def _read_text(unit: Unit) -> Iterator[Row]:
    as_json = ".jsonl" in Path(unit.path).name
    for n, raw in enumerate(_lines(unit), unit.first):
        try:
            text = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            yield Row(unit.path, n, error=f"undecodable line ({e.reason} at byte {e.start})")
            continue
        if not text.strip():
            continue
        if not as_json:
            yield Row(unit.path, n, text)
            continue
        try:
            yield Row(unit.path, n, json.loads(text))
        except json.JSONDecodeError as e:
            yield Row(unit.path, n, error=f"malformed JSON ({e.msg} at column {e.colno})")


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


def _read_parquet(unit: Unit) -> Iterator[Row]:
    import pyarrow.parquet as pq

    n = unit.first
    for batch in pq.ParquetFile(unit.path).iter_batches(BATCH_ROWS, row_groups=range(unit.start, unit.stop)):
        for item in batch.to_pylist():
            yield Row(unit.path, n, item)
            n += 1


def _arrow_table(path: Path):
    """An Arrow IPC file (Feather v2) or stream (what `datasets` writes), memory-mapped."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source = pa.memory_map(str(path))
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid as e:
            raise DataError(f"{path}: not an Arrow IPC file or stream ({e})") from None


def _read_table(unit: Unit, table, origin: str) -> Iterator[Row]:
    for lo in range(unit.start, unit.stop, BATCH_ROWS):
        hi = min(lo + BATCH_ROWS, unit.stop)
        for n, item in enumerate(table.slice(lo, hi - lo).to_pylist(), lo + 1):
            yield Row(origin, n, item)


def load_saved(source):
    """The Dataset of a save_to_disk folder, the source's split of a DatasetDict (memory-mapped)."""
    import datasets

    ds = datasets.load_from_disk(source.path)
    if isinstance(ds, datasets.DatasetDict):
        if source.split not in ds:
            raise DataError(f"{source.path}: no split {source.split!r}; splits: {', '.join(ds)}")
        ds = ds[source.split]
    return ds


# --- hub datasets ----------------------------------------------------------------------------------


def load_hub(source):
    """A hub dataset (streamed when the source says so), at the source's subset, split and revision."""
    import datasets

    try:
        return datasets.load_dataset(source.path, source.subset, split=source.split, revision=source.revision,
                                     streaming=source.streaming)
    except Exception as e:  # the hub raises many types; the user needs the name and the reason
        raise DataError(f"could not load hub dataset {source.path!r} (subset {source.subset!r}, split "
                        f"{source.split!r}, revision {source.revision!r}): {e}") from None


def _read_hub(unit: Unit, source) -> Iterator[Row]:
    ds = load_hub(source)
    if source.streaming:
        origin = f"hub:{source.path}/shard-{unit.start}"
        for n, item in enumerate(ds.shard(num_shards=ds.num_shards, index=unit.start), 1):
            yield Row(origin, n, item)
        return
    yield from _read_table(unit, ds.data.table, f"hub:{source.path}")


def resolve_revision(source) -> str:
    """The commit a hub source reads: the newest one of its revision (default: main) on the hub, or, offline
    (HF_HUB_OFFLINE), the one in the local datasets cache. A refreshed dataset resolves to a new commit."""
    from datasets import config

    if not config.HF_HUB_OFFLINE:
        from huggingface_hub import HfApi

        try:
            return HfApi().dataset_info(source.path, revision=source.revision).sha
        except Exception as e:
            raise DataError(f"hub dataset {source.path!r} at revision {source.revision!r}: {e}") from None
    root = Path(config.HF_DATASETS_CACHE) / "___".join(source.path.split("/"))
    subset = source.subset or "*"
    found = sorted(Path(p) for p in glob.glob(str(root / subset / "*" / "*")) if Path(p).is_dir())
    if not found:
        cached = sorted({p.name for p in root.glob("*") if p.is_dir()})
        raise DataError(f"hub dataset {source.path!r} subset {source.subset!r} is not in the local cache (offline)"
                        + (f"; cached subsets: {', '.join(cached)}" if cached else ""))
    commits = [p.name for p in sorted(found, key=lambda p: p.stat().st_mtime)]
    if source.revision is None:
        return commits[-1]
    if source.revision not in commits:
        raise DataError(f"hub dataset {source.path!r}: revision {source.revision!r} is not in the local cache "
                        f"(offline); cached revisions: {', '.join(commits)}")
    return source.revision


# --- fingerprints ----------------------------------------------------------------------------------------


def file_digest(path: Path, cache_dir: Path | None) -> str:
    """sha256 of a file's bytes, cached by (path, size, modification and change times, inode): a rerun over an
    unchanged multi-gigabyte corpus stats its files instead of reading them."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}".encode())
    entry = cache_dir / f"{key.hexdigest()}.json" if cache_dir else None
    if entry is not None and entry.is_file():
        return json.loads(entry.read_text())["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if entry is not None:
        from gptforge.core.files import write_json_atomic

        entry.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(entry, {"path": str(path), "sha256": h.hexdigest()})
    return h.hexdigest()


def fingerprint_source(source, demo_settings: dict, cache_dir: Path | None = None) -> str:
    """Content hash of a source: its files' bytes for local data (save_to_disk folders included), the generator
    settings for the demo, the name, subset, split and resolved commit for hub data; and the held_out file's bytes."""
    h = hashlib.sha256()
    kind = kind_of(source.path)
    if kind == "local":
        p = Path(source.path)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() and is_dataset_folder(p) else \
            local_files(source.path)
        for f in files:
            h.update(f"{f}|{file_digest(f, cache_dir)}".encode())
        if p.is_dir() and (p / "dataset_dict.json").is_file():
            h.update(source.split.encode())
    elif kind == "demo":
        h.update(json.dumps({"demo": demo_settings}, sort_keys=True).encode())
    elif kind == "procedural":
        h.update(json.dumps(procedural.fingerprint(source), sort_keys=True).encode())
    elif kind == "tasks":
        h.update(json.dumps(procedural.tasks_fingerprint(source), sort_keys=True).encode())
    else:
        h.update(json.dumps({"hub": source.path, "subset": source.subset, "split": source.split,
                             "commit": resolve_revision(source)}).encode())
    held_out = getattr(source, "held_out", None)  # rows held out from a file of their own
    if held_out is not None:
        try:
            held = local_files(held_out)
        except DataError as e:
            raise DataError(f"held_out: {e}") from None
        for f in held:
            h.update(f"held_out|{f}|{file_digest(f, cache_dir)}".encode())
    return h.hexdigest()
