"""What the pipeline evaluates on, as an n-gram index that the curate stage removes documents by
(gptforge.data.curation.blocks.Decontaminate).

The items: the held-out rows of data.sft, data.preference and data.prompts, data.eval, the demo's held-out items
where a source is the demo, the files of `curate.decontaminate.extra`, and (given by the stage, which reads them
through lm-evaluation-harness) the documents of `eval.harness_tasks`. Each item's text (its prompt, answer or
conversation) is normalised and split into words as datatrove's decontamination filter does, and every n-gram of
`curate.decontaminate.ngram` words is hashed with datatrove's hash; an item shorter than that, of at least
`min_words` words, is indexed whole as an n-gram of its own length. The index is datatrove's format
(`index/n<L>/<source>.index.hashes`: uint64 hashes), one folder for each length L.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from gptforge.core.errors import DataError
from gptforge.data import demo, splits
from gptforge.data.sources import kind_of


TEXT_FIELDS = ("messages", "prompt", "question", "answer", "chosen", "rejected", "text")


def item_text(value) -> str:
    """The words of an item: a string, a message list, or a row's TEXT_FIELDS, joined."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return " ".join(item_text(m.get("content") if isinstance(m, dict) else m) for m in value)
    if isinstance(value, dict):
        return " ".join(item_text(value.get(k)) for k in TEXT_FIELDS if k in value)
    return str(value)


def evaluation_items(cfg) -> dict[str, list[str]]:
    """{source: item texts} of everything the pipeline evaluates on but the harness tasks (see the module's doc)."""
    data, out = cfg.data, {}
    out["data.sft held-out"] = [item_text(c) for c in splits.conversations(data).val]
    out["data.preference held-out"] = [item_text(p) for p in splits.preference_pairs(data).val]
    if data.prompts.path is not None:
        out["data.prompts held-out"] = [item_text(p) for p in splits.online_prompts(data).val]
    if data.eval.path is not None:
        out["data.eval"] = [item_text(it) for it in splits.eval_set(data, "sft").items]
    if "demo" in {kind_of(s.path) for s in (data.sft, data.preference, data.eval, data.prompts) if s.path}:
        out["demo held-out items"] = [item_text(it) for it in demo.from_settings(data.demo, "eval").eval]
    for path in cfg.curate.decontaminate.extra:
        out[f"extra {Path(path).name}"] = list(_extra_items(Path(path)))
    return out


def _extra_items(path: Path):
    if not path.is_file():
        raise DataError(f"curate.decontaminate.extra: cannot read {path}: no such file")
    with open(path, encoding="utf-8", errors="strict") as f:
        for line in f:
            line = line.strip()
            if line:
                yield item_text(json.loads(line)) if line.startswith("{") else line


def build_index(items: dict[str, list[str]], folder: Path, ngram: int, min_words: int) -> dict[str, dict]:
    """Write the index of `items` into `folder` (see the module's doc); {source: {items, indexed, too_short,
    ngrams}}: what was checked, for the stage's record."""
    from datatrove.utils.hashing import HashConfig, create_hash_func
    from datatrove.utils.text import TextNormConfig, ngrams, simplify_text
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    hash_config, norm = HashConfig(), TextNormConfig()
    tokenizer, hash_fn = load_word_tokenizer("en"), create_hash_func(hash_config)
    record = {}
    for source, texts in items.items():
        by_length: dict[int, set[int]] = defaultdict(set)
        indexed = too_short = 0
        for text in texts:
            words = tokenizer.word_tokenize(simplify_text(text, norm))
            if len(words) < min_words:
                too_short += 1
                continue
            n = min(ngram, len(words))
            by_length[n].update(hash_fn(" ".join(g)) for g in ngrams(words, n))
            indexed += 1
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", source)
        for n, hashes in by_length.items():
            (folder / f"n{n}").mkdir(parents=True, exist_ok=True)
            np.array(sorted(hashes), dtype=hash_config.np_descr).tofile(folder / f"n{n}" / f"{name}.index.hashes")
        record[source] = {"items": len(texts), "indexed": indexed, "too_short": too_short,
                          "ngrams": sum(len(h) for h in by_length.values())}
    return record
