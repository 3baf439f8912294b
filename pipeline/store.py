"""The stage store: content-addressed stage outputs, manifests written last and atomically, run records.

A stage output lives in `<run.root>/store/<stage>/<fingerprint[:16]>/`. Its fingerprint hashes the config
fields that can change what the stage computes (`gptforge.core.config.result_fields`: not how often it logs,
evaluates or saves, not `compile`), the fingerprints of its input stages and the fingerprint of its data, so a
changed input changes every stage downstream of it and none upstream. The sft stage and each preference stage
are followed by an evaluation step (`eval-sft`, `eval-dpo`, ...) over the finished output, with a fingerprint
of its own: changing the `eval` section reruns the evaluation, never the training. An output is complete only
when `manifest.json` exists, says `complete`, and every file it lists still has its sha256.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import importlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

from gptforge.core.config import ALGORITHMS, PipelineConfig, Section, result_fields
from gptforge.core.errors import DataError, InputError
from gptforge.core.files import sha256_file, write_json_atomic
from gptforge.data.splits import eval_fingerprint, source_fingerprint
from gptforge.model import pretrained
from gptforge.stages.entry import RESULT, run_rank
from gptforge.core.declarations import EVALUATED, STAGES
from gptforge.core.registry import named_models, pipeline_stages

STORE_VERSION = 2  # 2: fingerprints hash only the fields that can change a result; evaluation is its own step


def data_of(cfg: PipelineConfig, step: str) -> tuple[str, ...]:
    """The data sources (`data.<name>` fields) a step reads: its declaration's, where an online stage reads
    data.prompts instead when it is set (and the preference pairs too for the ptx term's chosen responses)."""
    decl = STAGES[step]
    if decl.data is None:
        return ()
    if decl.data_sources is not None:  # chosen by the config (curate's)
        return decl.data_sources(cfg)
    if decl.reads == "prompts" and cfg.data.prompts.path is not None:
        ptx = getattr(getattr(cfg.preference, step, None), "ptx_coef", 0)  # an online algorithm's ptx term
        return ("prompts", "preference") if ptx else ("prompts",)
    return (decl.data,)
MANIFEST = "manifest.json"


def eval_step(stage: str) -> str:
    return f"eval-{stage}"


def stage_run(step: str):
    """The run function of a step's stage module (imported: for running it in this process)."""
    return importlib.import_module(f"gptforge.stages.{STAGES[step].module}").run


def pipeline_steps(cfg: PipelineConfig) -> list[str]:
    """The pipeline's stages in order, each evaluated stage followed by its evaluation step."""
    return [s for stage in pipeline_stages(cfg) for s in ([stage, eval_step(stage)] if stage in EVALUATED else [stage])]


def stage_config(cfg: PipelineConfig, step: str) -> dict:
    """The config that defines a step's output (what its fingerprint hashes): the fields of the sections its
    declaration names (gptforge.core.registry.Stage.sections) that can change a result, and the seed."""
    if STAGES[step].evaluates:
        return eval_config(cfg, step)
    declared = STAGES[step].sections
    out = {}
    for path in declared:
        *parents, leaf = path.split(".")
        owner = cfg
        for part in parents:
            owner = getattr(owner, part)
        section = getattr(owner, leaf)
        if not isinstance(section, Section):  # a field of a section (eval.harness_tasks)
            out[path] = owner.model_dump(mode="json", include={leaf})[leaf]
            continue
        subs = tuple(p.rsplit(".", 1)[1] for p in declared if p.startswith(path + "."))
        decl = STAGES[step]  # what of its section a stage does not read (DPO: neither the rewards nor the rollouts)
        unread = (() if decl.rewarded else REWARD_FIELDS) + (() if decl.async_rollouts else ("rollout",))
        leave_out = (ALGORITHMS if subs else ()) + (unread if path == "preference" else ())
        out[path.rsplit(".", 1)[-1]] = result_fields(section, leave_out=leave_out)
    return {**out, "seed": cfg.run.seed} if STAGES[step].seeded else out


def eval_config(cfg: PipelineConfig, step: str) -> dict:
    """An evaluation step's: the eval fields it reads (the harness settings only where this stage runs the
    harness, pass@k after a preference stage), the seed, and the rewards that score a policy's answers."""
    harness = STAGES[step].evaluates in cfg.eval.harness_stages and cfg.eval.harness_tasks
    rewarded = STAGES[step].rewarded  # the rewards score a policy's held-out answers, with pass@k over eval.samples
    fields = {k: v for k, v in result_fields(cfg.eval, leave_out=("harness_stages",) + (
        () if rewarded else ("samples",))).items() if harness or not k.startswith("harness_")}
    if rewarded:
        return {"eval": fields, "seed": cfg.run.seed, "rewards": reward_fields(cfg)}
    return {"eval": fields, "seed": cfg.run.seed}


REWARD_FIELDS = ("rewards", "format_pattern", "length_target")  # preference.*: what the online stages are rewarded by


def reward_fields(cfg: PipelineConfig) -> dict:
    pc = cfg.preference
    return {name: pc.model_dump(mode="json", include={name})[name] for name in REWARD_FIELDS}


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def upstream(cfg: PipelineConfig, step: str) -> tuple[str, ...]:
    """The steps whose outputs `step` reads: its declaration's inputs, less those the config leaves out of the
    pipeline for it (each input's `read_by`: a pipeline that starts from model.pretrained without pretraining it
    has no pretrain step; curate is read only where curate.enabled and curate.sources holds the reader's data; with
    preference.reward_model, or no reward model among preference.rewards, there is no reward stage) and those it
    leaves unread (`unused_inputs`: a reward model started from reward.pretrained reads SFT's output only to sample
    it)."""
    reader = STAGES[step]
    drop = {u for u in reader.inputs if STAGES[u].read_by is not None and not STAGES[u].read_by(cfg, reader)}
    drop |= {u for u, unread in STAGES[step].unused_inputs.items() if unread(cfg)}
    return tuple(u for u in STAGES[step].inputs if u not in drop)


def lineage(cfg: PipelineConfig, step: str) -> list[str]:
    """The step and everything upstream of it, upstream first."""
    order: list[str] = []
    for up in upstream(cfg, step):
        order += [s for s in lineage(cfg, up) if s not in order]
    return order + [step]


def base_model(cfg: PipelineConfig, step: str) -> dict | None:
    """What identifies the models a step reads by name (gptforge.core.registry.named_models): their settings and
    their content (a hub name's resolved commit, a local directory's files)."""
    named = named_models(cfg, step)
    if not named:
        return None
    content = {key: pretrained.fingerprint(name, revision, digest_cache(cfg), key)
               for key, (name, revision) in named.items()}
    return {"model": result_fields(cfg.model), "content": content} if "model.pretrained" in named else \
        {"content": content}


def fingerprints(cfg: PipelineConfig, steps: list[str] | None = None) -> dict[str, str]:
    """Fingerprint of each step (default: the pipeline's), its inputs' computed first."""
    out: dict[str, str] = {}
    for step in steps or pipeline_steps(cfg):
        for s in lineage(cfg, step):
            if s not in out:
                sources = [data_fingerprint(cfg, d) for d in data_of(cfg, s)]
                data = eval_fingerprint(cfg.data, s, digest_cache(cfg)) if STAGES[s].evaluates else (
                    "|".join(sources) if sources else None)
                identity = {"stage": s, "store_version": STORE_VERSION, "code_version": STAGES[s].code_version,
                            "config": stage_config(cfg, s), "inputs": {up: out[up] for up in upstream(cfg, s)},
                            "data": data}
                base = base_model(cfg, s)
                out[s] = _hash(identity if base is None else {**identity, "base_model": base})
    return {s: out[s] for s in steps} if steps else out


def data_fingerprint(cfg: PipelineConfig, which: str) -> str:
    """source_fingerprint of `data.<which>`; a source that cannot be read is a DataError naming its key."""
    try:
        return source_fingerprint(cfg.data, which, digest_cache(cfg))
    except DataError as e:
        raise DataError(f"data.{which}: {e}") from None


def digest_cache(cfg: PipelineConfig) -> Path:
    """Where the digests of local data files are cached (gptforge.data.sources.file_digest)."""
    return Path(cfg.run.root) / "store" / "digests"


def stage_dir(cfg: PipelineConfig, step: str, fingerprint: str) -> Path:
    return Path(cfg.run.root) / "store" / step / fingerprint[:16]


def locate(cfg: PipelineConfig, step: str) -> tuple[Path, str, dict[str, tuple[Path, str]]]:
    """(output dir, fingerprint, {input step: (dir, fingerprint)}) of a step under this config."""
    fps = fingerprints(cfg, lineage(cfg, step))
    inputs = {up: (stage_dir(cfg, up, fps[up]), fps[up]) for up in upstream(cfg, step)}
    return stage_dir(cfg, step, fps[step]), fps[step], inputs


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


def read_result(out_dir: Path) -> dict | None:
    """What a stage that finished wrote last (gptforge.stages.entry), or None."""
    try:
        return json.loads((out_dir / RESULT).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def check_inputs(step: str, inputs: dict[str, tuple[Path, str]]) -> None:
    for up, (up_dir, _) in inputs.items():
        if read_manifest(up_dir) is None:
            raise InputError(f"stage {step} needs a complete {up} output at {up_dir}; "
                             f"run `gptforge run --only {up}` (or the whole pipeline) first")


def complete(cfg: PipelineConfig, step: str, out_dir: Path, fingerprint: str, inputs: dict[str, tuple[Path, str]],
             outputs: dict[str, str], result: dict, started: str) -> dict:
    """Record a finished step's output as complete: its manifest, written last and atomically. Outputs a run does
    not write (`adapter/` of a stage that trained full weights) are left out."""
    outputs = {k: v for k, v in outputs.items() if (out_dir / v).exists()}
    manifest = {
        "stage": step, "fingerprint": fingerprint, "status": "complete", "config": cfg.model_dump(mode="json"),
        "inputs": {up: {"path": str(d), "fingerprint": fp} for up, (d, fp) in inputs.items()},
        "outputs": outputs, "metrics": result["metrics"], "files": hash_outputs(out_dir, outputs),
        "started_at": started, "finished_at": now(), "world_size": result["world_size"], "versions": versions(),
    }
    write_json_atomic(out_dir / MANIFEST, manifest)
    return manifest


def reuse(step: str, out_dir: Path, log=print) -> dict | None:
    """The manifest of a step's complete output, said to `log` as reused; None where there is none to reuse. The
    one way a finished output is taken instead of computed: in a pipeline (gptforge.pipeline.launch.stage) and in one
    process (`execute`)."""
    manifest = read_manifest(out_dir)
    if manifest is not None:
        log(f"{step}: reused complete output {out_dir} (fingerprint {manifest['fingerprint'][:16]})")
    return manifest


def execute(cfg: PipelineConfig, step: str, run=None, outputs: dict[str, str] | None = None) -> dict:
    """Reuse a step's complete output, or run the step in this process (one rank of it under a launcher)
    and record it complete (rank 0); return its manifest. `run` and `outputs` default to the stage's."""
    run, outputs = run or stage_run(step), outputs or STAGES[step].outputs
    out_dir, fingerprint, inputs = locate(cfg, step)
    if (manifest := reuse(step, out_dir)) is not None:
        return manifest
    check_inputs(step, inputs)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / MANIFEST).unlink(missing_ok=True)  # a stale or corrupted output is recomputed
    started = now()
    result = run_rank(run, cfg, {up: d for up, (d, _) in inputs.items()}, out_dir, step)
    if rank != 0:
        return {"stage": step, "status": "complete", **result}
    manifest = complete(cfg, step, out_dir, fingerprint, inputs, outputs, result, started)
    print(f"[{step}] complete: {out_dir}", flush=True)
    return manifest


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
    """`<run.root>/<run.name>/run.json`: the resolved config and what each stage did in this run. Stages running at
    once (parallel branches, in threads or on workers sharing run.root) each update it under a file lock, reading
    it afresh, so that none overwrites another's entry."""

    def __init__(self, cfg: PipelineConfig):
        self.dir = Path(cfg.run.root) / cfg.run.name
        self.path = self.dir / "run.json"
        self.dir.mkdir(parents=True, exist_ok=True)
        with self._locked():
            self.data = self._read() or {"name": cfg.run.name, "created_at": now(), "stages": {}}
            self.data["config"] = cfg.model_dump(mode="json")
            write_json_atomic(self.path, self.data)

    @contextmanager
    def _locked(self):
        with open(self.dir / "run.json.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def update(self, stage: str | None = None, **fields) -> None:
        """Merge `fields` into a stage's entry (or, with no stage, into the record itself)."""
        with self._locked():
            self.data = self._read() or self.data
            (self.data["stages"].setdefault(stage, {}) if stage else self.data).update(fields)
            write_json_atomic(self.path, self.data)
