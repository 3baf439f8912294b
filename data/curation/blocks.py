"""The curate stage's blocks that datatrove does not have, each a datatrove PipelineStep, so that the stage is a list
of blocks run by datatrove's executor (gptforge.stages.curate). Every other block is datatrove's own: its quality
filters, PII formatter, exact and MinHash deduplication, n-gram decontamination filter and JSONL writer.

- `UnitReader`: the documents of a gptforge source, its units shared out over the tasks. datatrove's readers
  cover JSONL, Parquet, IPC, CSV, WARC and hub datasets, but not byte ranges of one large text file, `.json`
  arrays, `save_to_disk` folders or the demo; this reader is tokenize's own (gptforge.data.sources and .corpus),
  so a curated corpus is read exactly as tokenize reads it, bad rows counted and named by file and line.
- `RowsReader`: the training rows of data.sft or data.preference, as documents of their texts.
- `RankShardReader`: a pass reads back the documents the pass before wrote for the same task. datatrove's dedup
  filters find a document by its position within its task, so each task must read its own file; JsonlReader shares
  the files out by their position in the folder, which shifts when a task kept no document and wrote none.
- `Tally`: documents and bytes at a point of the pipeline (datatrove's stats count documents a step forwarded,
  not the bytes in and out of the whole funnel).
- `FullSignatures` and `VerifiedPairs`: datatrove's MinHash takes every pair of documents that share one band of
  their signatures as duplicates; which pairs those are follows from the bands and rows alone. The verification
  keeps a pair only where the share of equal hashes over the whole signature, MinHash's estimate of the Jaccard
  similarity, reaches `curate.near_dedup.threshold`, so that the threshold is what decides.
- `LinguaFilter`: language identification offline. datatrove's LanguageFilter downloads a fastText model; lingua
  ships its models in its wheel. `LocalFastTextLID` gives datatrove's own filter a local fastText model instead.
- `Decontaminate`: datatrove's NGramsDecontFilter for each n-gram length of the index that
  gptforge.data.curation.decontamination builds (datatrove's indexer reads lighteval's task registry, which
  downloads); an item shorter than n is matched whole, as its own length.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.decont.n_grams import NGramsDecontConfig, NGramsDecontFilter
from datatrove.pipeline.dedup.minhash import MinhashDedupSignature
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.readers import JsonlReader
from datatrove.utils.binaryio import read_tuples_from_file
from datatrove.utils.lid import FastTextLID

from gptforge.core.errors import DataError, UserError
from gptforge.data.corpus import Reading, documents
from gptforge.data.curation.decontamination import item_text
from gptforge.data.sources import Unit

SHARD = "{rank:05d}.jsonl.gz"  # a task's documents in the stage's output
WORK_SHARD = "{rank:05d}.jsonl"  # between passes: written once, read once, on local disk (gzip cost more than it saved)


def text_of(doc: Document) -> str:
    """What exact deduplication compares: the document's text."""
    return doc.text


def quality_filter(name: str, args: dict, exclusion_writer):
    """datatrove's quality filter `name` (curate.filters) with its arguments."""
    from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter, GopherQualityFilter,
                                            GopherRepetitionFilter)

    cls = {"gopher_quality": GopherQualityFilter, "gopher_repetition": GopherRepetitionFilter,
           "c4": C4QualityFilter, "fineweb": FineWebQualityFilter}[name]
    try:
        return cls(**args, exclusion_writer=exclusion_writer)
    except TypeError as e:
        raise UserError(f"curate.filters.{name}: {e}") from None


class UnitReader(PipelineStep):
    """The documents of `units` of a source (units[rank::world_size] for each task), read as tokenize reads them."""

    type = "📖 - READER"
    name = "gptforge source"

    def __init__(self, units: list[Unit], reading: Reading, on_bad_row: str):
        super().__init__()
        self.units, self.reading, self.on_bad_row = units, reading, on_bad_row

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for unit in self.units[rank::world_size]:
            bad: list = []
            for line, text in documents(unit, self.reading, bad):
                yield Document(text=text, id=f"{unit.path}:{line}")
            self.stat_update("bad_rows", value=len(bad))
            if bad and self.on_bad_row == "fail":
                line, reason = bad[0]
                raise DataError(f"{unit.path}:{line}: {reason} (data.on_bad_row=fail)")


class RowsReader(PipelineStep):
    """The training rows of data.sft or data.preference (their held-out rows settled before: gptforge.data.splits),
    rows[rank::world_size], each a document of its texts whose id is the row's index: the stage writes the rows it
    kept back by their ids, as rows."""

    type = "📖 - READER"
    name = "gptforge rows"

    def __init__(self, rows: list[dict], bad_rows: int):
        super().__init__()
        self.rows, self.bad_rows = rows, bad_rows

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for i in range(rank, len(self.rows), world_size):
            yield Document(text=item_text(self.rows[i]), id=str(i))
        self.stat_update("bad_rows", value=self.bad_rows if rank == 0 else 0)


class RankShardReader(JsonlReader):
    """The documents the previous pass wrote for this task (`WORK_SHARD`), none where it wrote none."""

    name = "gptforge task shard"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        path = WORK_SHARD.format(rank=rank)
        if self.data_folder.exists(path):
            yield from self.read_file(path)


class Tally(PipelineStep):
    """Counts `<label>_documents` and `<label>_bytes` (UTF-8) of the documents passing."""

    type = "📊 - STATS"
    name = "gptforge tally"

    def __init__(self, label: str):
        super().__init__()
        self.label = label

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for doc in data:
            self.stat_update(f"{self.label}_documents")
            self.stat_update(f"{self.label}_bytes", value=len(doc.text.encode()))
            yield doc


class SpanMemo:
    """datatrove's spaCy word tokenizer, run once per distinct space-separated span. spaCy tokenizes each span of a
    text between spaces on its own (its tokenizer caches spans the same way), and MinHash tokenizes simplified text,
    whose whitespace is single spaces: so the tokens are spaCy's own, without building a spaCy Doc (and running its
    sentencizer) for every document, which took 70% of the MinHash signature pass."""

    LIMIT = 200_000  # spans remembered (cleared when full: memory flat in the corpus)

    def __init__(self, tokenizer):
        self.tokenizer, self.memo = tokenizer, {}

    def word_tokenize(self, text: str) -> list[str]:
        out, memo = [], self.memo
        for span in text.split(" "):
            if not span:
                continue
            tokens = memo.get(span)
            if tokens is None:
                if len(memo) >= self.LIMIT:
                    memo.clear()
                tokens = memo[span] = tuple(self.tokenizer.word_tokenize(span))
            out.extend(tokens)
        return out

    def __getstate__(self):  # shipped to the tasks empty
        return {"tokenizer": self.tokenizer, "memo": {}}


class FullSignatures(MinhashDedupSignature):
    """datatrove's MinHash signature step, which also writes each document's whole signature in document order, for
    `VerifiedPairs`: `<full_dir>/<rank>.docs` (the indices of the documents signed, uint32) and `<rank>.sig` (their
    bands x rows hashes, uint64); its English words through `SpanMemo`."""

    def __init__(self, output_folder: Path, config, full_dir: Path):
        super().__init__(str(output_folder), config)
        self.full_dir = full_dir
        self.word_tokenizer = SpanMemo(self.word_tokenizer)

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1):
        docs, sigs = (self.full_dir / f"{rank:05d}{ext}" for ext in (".docs", ".sig"))
        if self.check_can_skip_sig_writing(rank)[0] and docs.is_file() and sigs.is_file():  # written, then killed
            return super().run(data, rank, world_size)
        self.full_dir.mkdir(parents=True, exist_ok=True)
        parts = [path.with_suffix(path.suffix + ".part") for path in (docs, sigs)]
        self._docs, self._sigs, self._doc = open(parts[0], "wb"), open(parts[1], "wb"), -1
        try:
            super().run(data, rank, world_size)
        finally:
            self._docs.close()
            self._sigs.close()
        for part, path in zip(parts, (docs, sigs)):
            part.replace(path)

    def get_shingles(self, text: str) -> np.ndarray:
        self._doc += 1  # the base step asks for every document's shingles, in order, once
        return super().get_shingles(text)

    def get_signature(self, shingles: np.ndarray) -> list[list[int]]:
        sig = super().get_signature(shingles)
        self._docs.write(struct.pack("<I", self._doc))
        self._sigs.write(np.asarray(sig, dtype="<u8").tobytes())
        return sig


class SignatureRows:
    """A task's signatures for `VerifiedPairs`: the indices of the documents signed, in memory (4 bytes a
    document), and each pair's two rows read from the file with pread. Neither is mapped into the process: a memory
    map of the signatures kept every page a pair touched (and the kernel's fault-around, 64 KiB a touch) resident in
    the worker, 0.18 GiB more at 1 GB than at 0.1 GB; read this way, the pages stay in the page cache, outside every
    process."""

    def __init__(self, folder: Path, rank: int, hashes: int):
        self.docs = np.fromfile(folder / f"{rank:05d}.docs", dtype="<u4")
        self.row = hashes * 8
        self.fd = os.open(folder / f"{rank:05d}.sig", os.O_RDONLY)

    def __getitem__(self, doc: int) -> np.ndarray:
        offset = int(np.searchsorted(self.docs, doc)) * self.row
        return np.frombuffer(os.pread(self.fd, self.row, offset), dtype="<u8")

    def close(self) -> None:
        os.close(self.fd)


class VerifiedPairs(PipelineStep):
    """Between datatrove's MinhashDedupBuckets and MinhashDedupCluster: keeps the candidate pairs (each `.dups`
    file of `input_folder`, written as the same file into `output_folder`) whose signatures agree on at least
    `threshold` of their hashes. One task a `.dups` file; memory: each task's document indices (`SignatureRows`)."""

    type = "🫂 - DEDUP"
    name = "gptforge MinHash pairs verified"

    def __init__(self, signatures: Path, input_folder: Path, output_folder: Path, hashes: int, threshold: float):
        super().__init__()
        self.signatures, self.input_folder, self.output_folder = signatures, input_folder, output_folder
        self.hashes, self.threshold = hashes, threshold

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        files = sorted(self.input_folder.glob("*.dups"))[rank::world_size]
        self.output_folder.mkdir(parents=True, exist_ok=True)
        tasks: dict[int, SignatureRows] = {}

        def signature(task: int, doc: int) -> np.ndarray:
            if task not in tasks:
                tasks[task] = SignatureRows(self.signatures, task, self.hashes)
            return tasks[task][doc]

        try:
            for file in files:
                with open(file, "rb") as f, open(self.output_folder / file.name, "wb") as out:
                    for f1, d1, f2, d2 in read_tuples_from_file(f, "4I"):
                        self.stat_update("candidates")
                        if np.mean(signature(f1, d1) == signature(f2, d2)) >= self.threshold:
                            out.write(struct.pack("<4I", f1, d1, f2, d2))
                            self.stat_update("verified")
        finally:
            for rows in tasks.values():
                rows.close()
        return
        yield


class LinguaFilter(BaseFilter):
    """Keeps documents that lingua finds in one of `languages` (ISO 639-1) with at least `threshold` confidence;
    the language found goes into the document's metadata."""

    name = "🌍 Language ID (lingua)"

    def __init__(self, languages: list[str], threshold: float, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.languages, self.threshold = languages, threshold
        self._detector = None

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if self._detector is None:
            from lingua import LanguageDetectorBuilder

            self._detector = LanguageDetectorBuilder.from_all_languages().build()  # models loaded as needed
        best = self._detector.compute_language_confidence_values(doc.text[:2000])[:1]
        if best:
            code = best[0].language.iso_code_639_1.name.lower()
            doc.metadata["language"], doc.metadata["language_score"] = code, round(best[0].value, 4)
            if code in self.languages and best[0].value >= self.threshold:
                return True
        return False, "language"


class LocalFastTextLID(FastTextLID):
    """datatrove's fastText language identification over a local model file (`curate.language_model`): its own
    FT176LID downloads lid.176.bin."""

    def __init__(self, path: str, languages: list[str]):
        super().__init__(languages)
        self.path = str(Path(path).resolve())

    @property
    def model(self):
        if self._model is None:
            from fasttext.FastText import _FastText

            self._model = _FastText(self.path)
        return self._model


class Decontaminate(BaseFilter):
    """datatrove's n-gram decontamination filter, one for each n-gram length of the index (`index/n<L>/`): a
    document sharing an n-gram with an evaluation item is removed, the item's source and the n-gram in its
    metadata."""

    name = "🦠 Decontaminate"

    def __init__(self, index: Path, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.filters = [NGramsDecontFilter(str(folder), NGramsDecontConfig(n_grams=int(folder.name[1:])))
                        for folder in sorted(index.glob("n*")) if any(folder.iterdir())]

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        for f in self.filters:
            kept = f.filter(doc)
            if kept is not True:
                return False, "contaminated"
        return True
