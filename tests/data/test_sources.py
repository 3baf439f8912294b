"""Every source format, read whole or in units; file digests cached by path, size, times and inode; hub
datasets resolved to a commit, offline from a cache made here."""

import gzip
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gptforge.core.config import SourceSection
from gptforge.core.errors import DataError
from gptforge.data import sources
from gptforge.data.formats import normalise, to_text
from gptforge.data.sources import file_digest, fingerprint_source, read_rows, read_unit, resolve_revision, units

DOCS = [f"document number {i}" for i in range(30)]


def src(path, **kw) -> SourceSection:
    return SourceSection(path=str(path), **kw)


def texts(source) -> list[str]:
    return normalise(read_rows(source), to_text, "fail", "text").items


def test_every_file_format_and_compression(tmp_path):
    rows = [{"text": d} for d in DOCS]
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "a.jsonl").write_bytes(lines)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    import zstandard

    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (tmp_path / "d.txt").write_text("\n".join(DOCS) + "\n")
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "e.parquet", row_group_size=7)
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as f, pa.ipc.new_file(f, pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": DOCS}))
    with pa.OSFile(str(tmp_path / "g.arrow"), "wb") as f, pa.ipc.new_stream(f, pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": DOCS}))  # the stream format `datasets` writes
    assert texts(src(tmp_path)) == DOCS * 7
    assert texts(src(tmp_path / "*.jsonl*")) == DOCS * 3


def test_save_to_disk_folders(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_dict({"text": DOCS}).save_to_disk(tmp_path / "ds")
    DatasetDict({"train": Dataset.from_dict({"text": DOCS[:5]}), "train_sft": Dataset.from_dict({"text": DOCS[5:]})}) \
        .save_to_disk(tmp_path / "dd")
    assert texts(src(tmp_path / "ds")) == DOCS
    assert texts(src(tmp_path / "dd", split="train_sft")) == DOCS[5:]
    with pytest.raises(DataError, match=r"no split 'test'; splits: train, train_sft"):
        texts(src(tmp_path / "dd", split="test"))


def test_text_units_cover_every_line_once(tmp_path, monkeypatch):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    monkeypatch.setattr(sources, "UNIT_BYTES", 100)  # about 3 lines a unit, boundaries mid-line
    plan = units(src(path))
    assert len(plan) > 5 and plan[0].start == 0 and plan[-1].stop == path.stat().st_size
    read = [[to_text(r.value) for r in read_unit(u, src(path))] for u in plan]  # a unit may hold no line start
    assert [d for part in read for d in part] == DOCS
    assert sum(sources.count_lines(u) for u in plan) == len(DOCS)


def test_bad_rows_in_columnar_files_are_named_by_file_and_row(tmp_path, capsys):
    pq.write_table(pa.table({"text": ["fine", "", "also fine"]}), tmp_path / "p.parquet")
    out = normalise(read_rows(src(tmp_path / "p.parquet")), to_text, "skip", "text")
    assert out.items == ["fine", "also fine"] and f"{tmp_path / 'p.parquet'}:2: skipped bad text row: empty text" \
        in capsys.readouterr().err


def test_file_digests_are_cached_until_the_file_changes(tmp_path):
    f, cache = tmp_path / "corpus.txt", tmp_path / "digests"
    f.write_text("one line\nanother line\n")
    first = file_digest(f, cache)
    (entry,) = cache.iterdir()
    entry.write_text(json.dumps({"sha256": "from the cache"}))  # an unchanged file is not read again
    assert file_digest(f, cache) == "from the cache"
    f.write_text("one line\nanother lime\n")  # one byte, the same size
    assert f.stat().st_size == len("one line\nanother line\n")
    assert file_digest(f, cache) not in (first, "from the cache")


def hub_cache(root, name: str, config: str, commit: str, rows: list[str], mtime: float):
    """What `datasets` leaves in its cache after downloading a hub dataset, made here without a network: the
    Parquet builder prepares the rows, moved to <owner>___<name>/<config>/<version>/<commit>/."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    parquet = root / f"{commit}.parquet"
    pq.write_table(pa.table({"text": rows}), parquet)
    builder = Parquet(cache_dir=str(root / "build"), dataset_name=name.split("/")[1], hash=commit,
                      config_name=config, data_files={"train": [str(parquet)]})
    builder.download_and_prepare()
    d = root / name.replace("/", "___") / config / "0.0.0"
    d.mkdir(parents=True, exist_ok=True)
    shutil.move(builder.cache_dir, d / commit)
    shutil.rmtree(root / "build")
    os.utime(d / commit, (mtime, mtime))


def test_hub_datasets_resolve_to_a_commit(tmp_path, monkeypatch):
    from datasets import config

    monkeypatch.setattr(config, "HF_DATASETS_CACHE", tmp_path)
    monkeypatch.setattr(config, "HF_HUB_OFFLINE", True)
    hub_cache(tmp_path, "team/corpus", "default", "a" * 40, DOCS, 1000)
    newest = src("team/corpus")
    assert resolve_revision(newest) == "a" * 40
    assert texts(newest) == DOCS and texts(src("team/corpus", streaming=True)) == DOCS  # read from the cache
    fp = fingerprint_source(newest, {})
    pinned = src("team/corpus", revision="a" * 40)
    hub_cache(tmp_path, "team/corpus", "default", "b" * 40, DOCS[:3], 2000)  # refreshed upstream
    assert resolve_revision(newest) == "b" * 40 and fingerprint_source(newest, {}) != fp  # recomputes
    assert texts(newest) == DOCS[:3]
    assert resolve_revision(pinned) == "a" * 40 and fingerprint_source(pinned, {}) == fp  # never does
    with pytest.raises(DataError, match=f"revision 'c+' is not in the local cache .*cached revisions: {'a' * 40}, "):
        resolve_revision(src("team/corpus", revision="c" * 40))
    with pytest.raises(DataError, match=r"subset 'fr' is not in the local cache \(offline\); cached subsets: default"):
        resolve_revision(src("team/corpus", subset="fr"))
