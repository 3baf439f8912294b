"""The normalised data each stage consumes, from whichever source the `data` config section names."""

from __future__ import annotations

import hashlib
from functools import partial

from data import demo
from data.adapters import Normalised, normalise, to_messages, to_pair, to_text
from data.sources import fingerprint_source, kind_of, read_rows


def _load(spec: str, data_cfg, adapt, what: str, demo_part: str) -> Normalised:
    if kind_of(spec) == "demo":
        return Normalised(items=getattr(demo.from_settings(data_cfg.demo), demo_part), bad_rows=0)
    return normalise(read_rows(spec, data_cfg.split), adapt, data_cfg.on_bad_row, what)


def pretrain_texts(data_cfg) -> Normalised:
    """Pretraining documents (str)."""
    adapt = partial(to_text, text_field=data_cfg.text_field)
    return _load(data_cfg.pretrain, data_cfg, adapt, "text", "pretrain")


def conversations(data_cfg) -> Normalised:
    """Chat conversations ({"messages": [...]})."""
    return _load(data_cfg.sft, data_cfg, to_messages, "chat", "sft")


def preference_pairs(data_cfg) -> Normalised:
    """Preference pairs ({"prompt", "chosen", "rejected"})."""
    return _load(data_cfg.preference, data_cfg, to_pair, "preference", "preference")


def eval_items(data_cfg) -> list[dict]:
    """Held-out verifiable items ({"task", "prompt", "answer"}), from the demo generator."""
    return demo.from_settings(data_cfg.demo).eval


def source_fingerprint(data_cfg, which: str) -> str:
    """Fingerprint of the rows behind `data.<which>` (pretrain, sft or preference): the source's
    content plus the settings that decide how its rows are read."""
    spec = getattr(data_cfg, which)
    content = fingerprint_source(spec, data_cfg.split, data_cfg.demo.model_dump())
    reading = f"{data_cfg.on_bad_row}|{data_cfg.text_field}|{data_cfg.split}"
    return hashlib.sha256(f"{content}|{reading}".encode()).hexdigest()
