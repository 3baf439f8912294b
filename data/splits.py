"""The normalised conversations and preference pairs the SFT, reward and preference stages consume, from whichever
source the `data` config section names, and the fingerprints of every source. (The pretraining corpus is not
loaded here: the tokenize stage streams it, unit by unit, through gptforge.data.corpus.)"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from gptforge.data import procedural
from gptforge.core.config.inputs import SourceSection
from gptforge.core.declarations import STAGES
from gptforge.core.errors import DataError
from gptforge.data import demo
from gptforge.data.formats import Normalised, normalise, to_eval_item, to_messages, to_pair, to_prompt_item
from gptforge.data.sources import Row, fingerprint_source, kind_of, read_rows

VAL_EVERY = 20  # for files and hub data: every 20th row is held out for validation


@dataclass
class Split:
    """Normalised rows for training and held-out rows for validation."""

    train: list
    val: list
    bad_rows: int = 0


def _load(source, data_cfg, adapt, what: str) -> Normalised:
    return normalise(read_rows(source), adapt, data_cfg.on_bad_row, what)


def _split(source, data_cfg, adapt, what: str) -> Split:
    """The source's rows, every VAL_EVERY-th held out; or all of them, and the rows of its `held_out` file."""
    rows = _load(source, data_cfg, adapt, what)
    if kind_of(source.path) == "procedural":  # the held-out items are generated from a seed of their own
        held = normalise((Row(source.path, i + 1, r) for i, r in procedural.items(source, held_out=True)), adapt,
                         data_cfg.on_bad_row, what)
        seen = {str(x["prompt"]) for x in rows.items}
        return Split(rows.items, [x for x in held.items if str(x["prompt"]) not in seen], rows.bad_rows)
    if source.held_out is not None:
        held = _load(SourceSection(path=source.held_out), data_cfg, adapt, what)
        return Split(rows.items, held.items, rows.bad_rows + held.bad_rows)
    items = rows.items
    return Split([x for i, x in enumerate(items) if i % VAL_EVERY], items[::VAL_EVERY], rows.bad_rows)


def conversations(data_cfg) -> Split:
    """Chat conversations ({"messages": [...]}); demo validation uses the held-out items."""
    if kind_of(data_cfg.sft.path) == "demo":
        d = demo.from_settings(data_cfg.demo, "sft")
        val = [{"messages": it["prompt"] + [{"role": "assistant", "content": it["answer"]}]} for it in d.eval]
        return Split(d.sft, val)
    return _split(data_cfg.sft, data_cfg, to_messages, "chat")


def preference_pairs(data_cfg) -> Split:
    """Preference pairs ({"prompt", "chosen", "rejected"}); demo validation uses the held-out items."""
    if kind_of(data_cfg.preference.path) == "demo":
        d = demo.from_settings(data_cfg.demo, "preference")
        return Split(d.preference, d.preference_eval)
    return _split(data_cfg.preference, data_cfg, to_pair, "preference")


def curated(cfg, inputs: dict[str, Path]):
    """The config a stage reads its data by, where the curate stage ran before it (`inputs["curate"]`): data.pretrain
    is curate's documents; data.sft and data.preference, where curated (curate.sources), curate's training rows with
    the source's held-out rows as they were (`held_out`), so that every stage holds out the rows it would have."""
    if "curate" not in inputs:
        return cfg
    out, data = inputs["curate"], {}
    for which in cfg.curate.sources:
        if which == "pretrain":
            data.update(pretrain=SourceSection(path=str(out / "documents" / "*.jsonl.gz")), text_field="text")
        else:
            data[which] = SourceSection(path=str(out / which / "train.jsonl"),
                                        held_out=str(out / which / "held_out.jsonl"))
    return cfg.model_copy(update={"data": cfg.data.model_copy(update=data)})


def require(have: int, need: int, what: str, batch_key: str, source_key: str) -> None:
    """Too little data for one step of training is an error before anything trains, naming what to change."""
    if have < need:
        raise DataError(f"{have} {what}, fewer than the {need} that one step takes ({batch_key} over all processes); "
                        f"give more data ({source_key}), or lower {batch_key} or distributed.nproc_per_node")


def answered_prompts(pairs: list[dict]) -> list[tuple[list[dict], str]]:
    """Each distinct prompt of preference pairs once, with its chosen response: on the demo data, the
    verified answer that the verifier compares a response with."""
    return list({str(p["prompt"]): (p["prompt"], p["chosen"]) for p in pairs}.values())


def online_prompts(data_cfg) -> Split:
    """The online stages' prompts, each {"prompt": [messages], "answer": str | None, **other columns}: data.prompts'
    rows (every VAL_EVERY-th held out), else each distinct prompt of the preference pairs, with its chosen response
    as the reference where the pairs are the demo's (the known answer), none otherwise. Every row has the same
    columns (a column a row lacks is None there), as a dataset's rows do."""
    source = data_cfg.prompts
    if source.path is None or kind_of(source.path) == "demo":
        if source.path is None:
            pairs, known = preference_pairs(data_cfg), kind_of(data_cfg.preference.path) == "demo"
        else:  # the demo's preference prompts, whatever data.preference is
            d = demo.from_settings(data_cfg.demo, "preference")
            pairs, known = Split(d.preference, d.preference_eval), True
        return Split(*[[{"prompt": p, "answer": a if known else None} for p, a in answered_prompts(rows)]
                       for rows in (pairs.train, pairs.val)], pairs.bad_rows)
    split = _split(source, data_cfg, to_prompt_item, "prompts")
    columns = sorted({k for it in split.train + split.val for k in it} - {"prompt", "answer"})
    fill = [[{"prompt": it["prompt"], "answer": it["answer"], **{k: it.get(k) for k in columns}} for it in rows]
            for rows in (split.train, split.val)]
    return Split(*fill, split.bad_rows)


@dataclass
class EvalSet:
    """Held-out prompts for an evaluation step, with their reference answers where the data has them."""

    items: list  # {"prompt": [messages], "answer": str | None}
    source: str  # the config key and path they come from, for the log and for what cannot be computed
    demo: bool = False  # the demo's verifiable items: exact match is its verifier


def eval_source(data_cfg, after: str) -> tuple[str, object]:
    """The config key and source an evaluation step reads after stage `after`: data.eval when set, else the
    stage's own data (data.sft after SFT; after a preference stage data.prompts where set, else data.preference)."""
    if data_cfg.eval.path is not None:
        return "data.eval", data_cfg.eval
    if after != "sft" and data_cfg.prompts.path is not None:
        return "data.prompts", data_cfg.prompts
    which = "sft" if after == "sft" else "preference"
    return f"data.{which}", getattr(data_cfg, which)


def eval_set(data_cfg, after: str) -> EvalSet:
    """The held-out prompts evaluated after stage `after` (sft or an algorithm). The demo: its verifiable items.
    data.eval: its rows, each a conversation (the last assistant turn, if any, the reference) or a prompt with an
    optional answer. Otherwise the rows the training stage held out: after SFT each held-out conversation up to
    its last assistant turn, that turn the reference; after a preference stage the held-out rows of data.prompts, else
    the distinct prompts of the held-out pairs (no reference: the reward model judges)."""
    key, source = eval_source(data_cfg, after)
    where = f"{key}={source.path}"
    if kind_of(source.path) == "demo":
        return EvalSet(demo.from_settings(data_cfg.demo, "eval").eval, where, demo=True)
    if key == "data.eval" and kind_of(source.path) == "procedural":  # its held-out items
        return EvalSet(_split(source, data_cfg, to_prompt_item, "evaluation").val, where)
    if key == "data.eval":
        return EvalSet(_load(source, data_cfg, to_eval_item, "evaluation").items, where)
    # held-out rows: SFT's conversations; after a preference stage the online prompts' (data.prompts, else the pairs')
    items = [to_eval_item(c) for c in conversations(data_cfg).val] if after == "sft" else online_prompts(data_cfg).val
    return EvalSet(items, f"{where} (held-out rows)")


def eval_fingerprint(data_cfg, step: str, digest_cache: Path | None = None) -> str:
    """Fingerprint of the rows `eval_set` returns for evaluation step `step` (eval-sft, eval-dpo, ...)."""
    key, source = eval_source(data_cfg, STAGES[step].evaluates)
    if kind_of(source.path) == "demo":
        content = json.dumps(demo.part_settings("eval", data_cfg.demo), sort_keys=True)
    else:  # which rows a stage holds out follows from the content (every VAL_EVERY-th row, or its held_out file)
        content = f"{key}|{fingerprint_source(source, {}, digest_cache)}|{data_cfg.on_bad_row}|{VAL_EVERY}"
    return hashlib.sha256(content.encode()).hexdigest()


def source_fingerprint(data_cfg, which: str, digest_cache: Path | None = None) -> str:
    """Fingerprint of the rows behind `data.<which>` (pretrain, sft or preference): the source's content (file
    digests cached in `digest_cache`) plus the settings that decide how its rows are read."""
    part = "preference" if which == "prompts" else which  # data.prompts: demo is the preference pairs' prompts
    content = fingerprint_source(getattr(data_cfg, which), demo.part_settings(part, data_cfg.demo), digest_cache)
    reading = f"{data_cfg.on_bad_row}|{data_cfg.text_field if which == 'pretrain' else ''}"
    return hashlib.sha256(f"{content}|{reading}".encode()).hexdigest()
