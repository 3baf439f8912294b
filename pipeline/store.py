"""The stage store: content-addressed stage outputs, manifests written last and atomically, run records.

A stage output lives in `<run.root>/store/<stage>/<fingerprint[:16]>/`. Its fingerprint hashes the
config sections that define it, the fingerprints of its input stages and the fingerprint of its data,
so a changed input changes every stage downstream of it and none upstream. An output is complete
only when `manifest.json` exists, says `complete`, and every file it lists still has its sha256.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from pathlib import Path

from data.loaders import source_fingerprint
from pipeline.config import PipelineConfig, pipeline_stages

STORE_VERSION = 1
# Bumped when a stage's code changes what it computes from the same config and inputs (1 if absent),
# so that its stored outputs, and those downstream, are recomputed rather than reused.
# tokenize 2: numbers pre-tokenized apart from the space before them; 3: the newline after an
# assistant turn inside its generation span.
CODE_VERSIONS = {"tokenize": 3}
ALGORITHMS = ("dpo", "ppo", "grpo", "rloo")
UPSTREAM = {"tokenize": (), "pretrain": ("tokenize",), "sft": ("pretrain",), "reward": ("sft",),
            **{a: ("sft", "reward") for a in ALGORITHMS}}
# The data source (a `data.<name>` field) each stage reads, if any.
DATA_OF = {"tokenize": "pretrain", "sft": "sft", "reward": "preference", **{a: "preference" for a in ALGORITHMS}}
MANIFEST = "manifest.json"


def section_of(stage: str) -> str:
    return "preference" if stage in ALGORITHMS else stage


def stage_config(cfg: PipelineConfig, stage: str) -> dict:
    """The config that defines a stage's output (what its fingerprint hashes)."""
    if stage == "tokenize":
        return {"tokenizer": cfg.tokenizer.model_dump(mode="json")}
    if stage == "pretrain":
        return {"model": cfg.model.model_dump(mode="json"), "pretrain": cfg.pretrain.model_dump(mode="json"),
                "seed": cfg.run.seed}
    section = getattr(cfg, section_of(stage)).model_dump(mode="json")
    if stage in ALGORITHMS:
        section["algorithm"] = stage
    return {section_of(stage): section, "eval": cfg.eval.model_dump(mode="json"), "seed": cfg.run.seed}


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def fingerprints(cfg: PipelineConfig, stages: list[str] | None = None) -> dict[str, str]:
    """Fingerprint of every stage of the pipeline, in order (upstream ones first)."""
    out: dict[str, str] = {}
    for stage in stages or pipeline_stages(cfg):
        data = DATA_OF.get(stage)
        out[stage] = _hash({
            "stage": stage, "store_version": STORE_VERSION, "code_version": CODE_VERSIONS.get(stage, 1),
            "config": stage_config(cfg, stage),
            "inputs": {up: out[up] for up in UPSTREAM[stage]},
            "data": source_fingerprint(cfg.data, data) if data else None,
        })
    return out


def stage_dir(cfg: PipelineConfig, stage: str, fingerprint: str) -> Path:
    return Path(cfg.run.root) / "store" / stage / fingerprint[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def hash_outputs(out_dir: Path, outputs: dict[str, str]) -> dict[str, str]:
    """sha256 of every file under each output path, keyed by path relative to out_dir."""
    files = {}
    for rel in outputs.values():
        p = out_dir / rel
        for f in sorted([p] if p.is_file() else p.rglob("*")):
            if f.is_file():
                files[str(f.relative_to(out_dir))] = sha256_file(f)
    return files


def read_manifest(out_dir: Path, verify: bool = True) -> dict | None:
    """The manifest of a complete output, or None: missing, unreadable, not complete, or (with
    verify) a listed file missing or changed since the manifest was written."""
    try:
        manifest = json.loads((Path(out_dir) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if manifest.get("status") != "complete":
        return None
    if verify:
        for rel, digest in manifest.get("files", {}).items():
            f = Path(out_dir) / rel
            if not f.is_file() or sha256_file(f) != digest:
                return None
    return manifest


def write_json_atomic(path: Path, obj) -> None:
    """Write to a temp name, fsync, rename: readers see the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("gptforge", "torch", "deepspeed", "transformers", "tokenizers", "datasets", "trl", "prefect"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


class RunRecord:
    """`<run.root>/<run.name>/run.json`: the resolved config and what each stage did in this run."""

    def __init__(self, cfg: PipelineConfig):
        self.dir = Path(cfg.run.root) / cfg.run.name
        self.path = self.dir / "run.json"
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self.data = json.loads(self.path.read_text())
        else:
            self.data = {"name": cfg.run.name, "created_at": now(), "stages": {}}
        self.data["config"] = cfg.model_dump(mode="json")
        self.save()

    def update(self, stage: str, **fields) -> None:
        self.data["stages"].setdefault(stage, {}).update(fields)
        self.save()

    def save(self) -> None:
        write_json_atomic(self.path, self.data)
