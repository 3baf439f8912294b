"""One check of everything a run needs that the config's schema cannot see, before any stage starts: `gptforge
run`, the pipeline flow (a run started from the UI or a schedule) and `gptforge deploy` call it, so that a bad
input is one `error:` line and nothing has trained.

- the host each stage starts on: one that loads its base through bitsandbytes (`<stage>.lora.quantize`) needs a
  GPU there, and DeepSpeed's runner over a hostfile of several hosts needs pdsh there; a stage sent to a work pool
  is checked by its worker, so a CPU head node validates a GPU config;
- the harness tasks of `eval.harness_tasks` exist;
- the curate stage's inputs: its filters' arguments, a language model available offline, the files of
  `curate.decontaminate.extra`;
- the named models load (`model.pretrained`, `reward.pretrained`, `preference.reward_model`, ...), their adapters
  match something; a setting that names a stage (`distill.teacher`) names one of the run; a distill student given
  as a model fits the layout, and its teacher shares its tokenizer;
- the team's pools, gates and slots are sound;
- a task library's prompts (`reasoning_gym:<dataset>`): the library installed, the dataset known, its options
  accepted;
- every data source of every step the run may compute is there: each local file of `data.*` read (its digest,
  which the stage store needs anyway), so a missing `data.sft` or `data.prompts` fails now, not after tokenize
  and pretrain;
- every user reward function of `preference.rewards` imports and is a function; the `unit_tests` reward's sandbox
  runs a program here, and every prompt row's tests are asserts it can judge; the rollouts' environment and tools
  import (the python tool's sandbox runs a program), each tool has type hints and a docstring, and the policy's
  chat template renders tools;
- every reward server answers; one that does not is a warning (it may be started later: the stage retries it).
"""

from __future__ import annotations

import importlib.util
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from gptforge.core.config import PipelineConfig, dump_config, tokenizer_source
from gptforge.core.errors import ConfigError
from gptforge.data.sources import kind_of
from gptforge.model.eval.harness import check_tasks
from gptforge.model.rewards import user_function
from gptforge.model.pretrained import check_models
from gptforge.pipeline.launch.nodes import deepspeed_runner, launcher_of, read_hostfile, single_process
from gptforge.pipeline.store import fingerprints, pipeline_steps
from gptforge.pipeline.team.pools import check_team, pool_of
from gptforge.core.declarations import STAGE_OR_MODEL, STAGES, reward_kind
from gptforge.core.registry import data_parallel, named_stage, pipeline_stages

CHECKED: set[tuple[str, tuple[str, ...], bool]] = set()  # checked, and not asked again since


def preflight(cfg: PipelineConfig, selected: list[str] | None = None, log: Callable[[str], None] = print,
              team: bool = True) -> None:
    """Check everything the run needs (see the module's docstring), for the steps it may compute (`selected`:
    all of the pipeline's by default); a UserError naming the key on the first problem. `team=False`: not the
    pools and slots (`gptforge deploy`, which creates them)."""
    steps = pipeline_steps(cfg)
    selected = steps if selected is None else selected
    key = (dump_config(cfg), tuple(selected), team)
    if key in CHECKED:  # `gptforge run` checks before its server starts, and its flow at once asks again (as
        CHECKED.discard(key)  # for a run from the UI): that second ask is answered; any later run checks anew
        return
    check_devices(cfg, selected)
    if cfg.eval.harness_tasks:
        check_tasks(cfg.eval)
    # curate is the one stage with files of its own to check (its language model, decontamination lists and
    # sources): a declaration field that one stage alone sets would only rename this comparison
    if "curate" in selected:
        check_curate(cfg)
    check_named_stages(cfg, steps)
    check_models(cfg)
    check_distill(cfg)
    if team:
        check_team(cfg, steps)
    check_sources(cfg)
    check_rewards(cfg, selected, log)
    fingerprints(cfg, selected)  # every step's data and its upstream's, digested: a missing file names itself
    check_rollout(cfg, selected)
    check_rollouts_apart(cfg, selected)
    CHECKED.add(key)


def check_named_stages(cfg: PipelineConfig, steps: list[str]) -> None:
    """A setting that takes a stage or a model (a declaration's `named`: distill.teacher, distill.student) and names
    a stage names one this run has."""
    for step in steps:
        for key in (k for k in STAGES[step].named if k in STAGE_OR_MODEL):
            stage = named_stage(cfg, key)
            if stage is not None and stage not in steps:
                raise ConfigError(f"{key}={stage}: this run has no {stage} stage (its stages: "
                                  f"{', '.join(pipeline_stages(cfg))}); add it to the run (preference.algorithm, or "
                                  f"{stage}.enabled) or name a model (a hub name or a local directory)")


def check_distill(cfg: PipelineConfig) -> None:
    """What the distill stage reads that can be checked before anything runs: a student it is given as a model fits
    the layout by the planner (with its teacher's frozen weights beside it) where the stage starts here, and the
    teacher's tokenizer is the student's wherever both are on disk (a stage of the run has the run's: tokenizer.
    pretrained or model.pretrained's, else the one tokenize trains, which the stage itself checks)."""
    dc = cfg.distill
    if not dc.enabled:
        return
    from gptforge.model.pretrained import check_same_tokenizer, model_dir

    student = None if named_stage(cfg, "distill.student") else model_dir(dc.student, None, "distill.student")
    teacher = None if named_stage(cfg, "distill.teacher") else model_dir(dc.teacher, None, "distill.teacher")
    if student is not None and not cfg.run.work_pools and not cfg.run.default_work_pool:
        from gptforge.model.plan import fits

        problem = fits(cfg, dc, student, teacher, "distill")
        if problem:
            raise ConfigError(f"distill.student={dc.student} is larger than the layout allows: {problem}; give it "
                              "more devices (distributed.nproc_per_node, nodes), distributed.zero_stage=3 or "
                              "offload, a smaller micro_batch_size or max_length, or a smaller student")
    name, revision = tokenizer_source(cfg)
    run = model_dir(name, revision, "tokenizer.pretrained" if cfg.tokenizer.pretrained else "model.pretrained") \
        if name else None  # the tokenizer of every stage of the run
    ours, theirs = student or run, teacher or run
    if ours is not None and theirs is not None and ours != theirs:
        check_same_tokenizer(ours, theirs, f"distill.teacher={dc.teacher}")


def check_devices(cfg: PipelineConfig, steps: list[str], here: bool = False) -> None:
    """What a stage needs of the host it starts on: a GPU where its base loads through bitsandbytes, pdsh where
    DeepSpeed's runner starts it on the hosts of its hostfile. On this host, unless a work pool takes it; `here`:
    the stage starts on this host whatever the pools (gptforge.pipeline.launch.stage asks so, on the worker that runs
    it)."""
    for step in steps:
        if pool_of(cfg, step) and not here:
            continue
        if (deepspeed_runner(cfg) and launcher_of(cfg, step) == "deepspeed" and not single_process(cfg, step)
                and len(set(read_hostfile(cfg.distributed.hostfile))) > 1 and not shutil.which("pdsh")):
            raise ConfigError(f"distributed.hostfile={cfg.distributed.hostfile} with launcher=deepspeed and "
                              "node_launcher=local: DeepSpeed's runner reaches its hosts through pdsh, which this "
                              "host does not have: install it (Debian: apt-get install pdsh), or set "
                              "distributed.node_launcher=ssh")
        section = STAGES[step].section  # None: curate, tokenize and the evaluations train no model
        if section is None:
            continue
        quantize = getattr(cfg, section).lora.quantize
        if not quantize:
            continue
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"{section}.lora.quantize={quantize} loads the base through bitsandbytes, which needs "
                              "a GPU; there is none on this host: set it to null, or send the stage to a GPU work "
                              "pool (run.work_pools)")


def check_curate(cfg: PipelineConfig) -> None:
    """What the curate stage reads besides its data: each filter built with its arguments (datatrove's own check),
    the language model (lingua, or a local fastText file: nothing is downloaded), the extra evaluation files, and
    sources it can curate."""
    cc = cfg.curate
    for name, args in cc.filters.items():
        from gptforge.data.curation.blocks import quality_filter  # datatrove: only where a run curates

        quality_filter(name, args, None)
    if cc.languages and cc.language_model != "lingua":
        if not Path(cc.language_model).is_file():
            raise ConfigError(f"curate.language_model: {cc.language_model} is neither lingua nor a fastText model "
                              "file (language identification runs offline: give the path of a local lid.176.bin)")
        if importlib.util.find_spec("fasttext") is None:
            raise ConfigError(f"curate.language_model: {cc.language_model} is a fastText model, and fastText is not "
                              "installed: pip install -e '.[fasttext]', or use lingua")
    for path in cc.decontaminate.extra if cc.decontaminate.enabled else ():
        if not Path(path).is_file():
            raise ConfigError(f"curate.decontaminate.extra: cannot read {path}: no such file")
    for which in cc.sources:  # data sources, not stages: the demo's pretraining text is not templated rows
        if which != "pretrain" and kind_of(getattr(cfg.data, which).path) == "demo":
            raise ConfigError(f"curate.sources: data.{which} is the demo, whose templated rows are near copies by "
                              f"design and whose held-out answers its rewards verify; curate a file or hub dataset")


def check_sources(cfg: PipelineConfig) -> None:
    """A task library's prompts (data.prompts, data.eval: reasoning_gym:<dataset>): the library installed, the
    dataset known and its options accepted."""
    from gptforge.data import procedural

    for key, source in (("data.prompts", cfg.data.prompts), ("data.eval", cfg.data.eval)):
        if procedural.is_procedural(source.path):
            procedural.check(source, key)


def check_rewards(cfg: PipelineConfig, steps: list[str], log: Callable[[str], None]) -> None:
    """Import each user function of preference.rewards, and call each reward server once, where a step of the run
    is rewarded or judged by them (an online algorithm, or an evaluation of a policy)."""
    if not any(STAGES[s].rewarded for s in steps):
        return
    for i, spec in enumerate(cfg.preference.rewards):
        key = f"preference.rewards[{i}]"
        if spec.url:
            if (problem := unreachable(spec.url, min(spec.timeout_s, 5.0))) is not None:
                log(f"warning: {key}: the reward server {spec.url} does not answer ({problem}); the stage will "
                    f"try it {spec.retries} time(s) when it scores its first batch")
        elif (kind := reward_kind(spec)) is None:
            user_function(spec.name, key)
        elif kind.sandbox:  # the sandbox runs here, and every row's tests are of the judged form
            from gptforge.core.config import SourceSection
            from gptforge.data.sources import kind_of, read_rows
            from gptforge.model.agents import judge, sandbox

            sandbox.require(key)
            prompts = cfg.data.prompts
            for source in (prompts, SourceSection(path=prompts.held_out) if prompts.held_out else None):
                if source is not None and source.path is not None and kind_of(source.path) in ("local", "hub"):
                    judge.check_rows((row.where, row.value.get("tests") or []) for row in read_rows(source)
                                     if row.error is None and isinstance(row.value, dict))


def check_rollout(cfg: PipelineConfig, steps: list[str]) -> None:
    """Where an online stage rolls out with tools: the environment factory and the tools import, every tool has
    type hints and a docstring, and the policy's chat template renders tools (sft.chat_template, else the pretrained
    model's own: a model without one is given gptforge's ChatML, which does)."""
    pc = cfg.preference
    if not (pc.environment or pc.tools) or not any(STAGES[s].rewarded for s in steps):
        return
    from gptforge.model.agents import mcp
    from gptforge.model.agents.calls import format_of
    from gptforge.model.agents.tools import Setup

    Setup.of(pc)
    mcp.close()  # the MCP servers it started to list their tools: each rollout process starts its own
    if cfg.sft.chat_template:
        format_of(cfg.sft.chat_template, "sft.chat_template")
    elif cfg.model.pretrained:
        from transformers import AutoTokenizer

        template = AutoTokenizer.from_pretrained(cfg.model.pretrained).chat_template
        if template:
            format_of(template, cfg.model.pretrained)


def check_rollouts_apart(cfg: PipelineConfig, steps: list[str]) -> None:
    """preference.rollout against the stages that read it: its engine imports and can do what the mode and the
    correction ask (gptforge.model.sampling.engine.check), and rollout workers fit the layout: each serves at least
    one training process's batches, and GRPO's and RLOO's (inside TRL's trainers) follow no sequence-parallel
    group."""
    rc, online = cfg.preference.rollout, [s for s in steps if STAGES[s].async_rollouts]
    if not online:
        return
    from gptforge.model.sampling.engine import check

    check(rc)
    apart = rc.mode == "async" or rc.engine != "hf"
    if not apart:
        return
    for algo in online:
        if STAGES[algo].trainer and rc.mode == "sync":
            raise ConfigError(f"preference.rollout.engine={rc.engine} in sync mode for {algo}: TRL's trainer samples "
                              "with its own policy there; give preference.rollout.mode=async to sample with the engine")
        if STAGES[algo].sequence_parallel and cfg.distributed.sequence_parallel > 1:
            raise ConfigError(f"preference.rollout.mode=async for {algo} with distributed.sequence_parallel="
                              f"{cfg.distributed.sequence_parallel}: a sequence-parallel group shares one rank's "
                              "rollouts, which the workers' batches a process do not follow; set one of them off")
    for section in dict.fromkeys(STAGES[algo].section for algo in online):  # each trains its own section's lora
        if getattr(cfg, section).lora.r:
            raise ConfigError(f"preference.rollout.mode={rc.mode} with {section}.lora.r={getattr(cfg, section).lora.r}:"
                              " the rollout workers take whole weights by name, not adapters; set "
                              "preference.rollout.mode=sync")
    world = min(data_parallel(cfg.distributed, algo) for algo in online)
    if rc.workers > world:
        raise ConfigError(f"preference.rollout.workers={rc.workers} is more than the layout allows: each worker "
                          f"serves the batches of at least one of the {world} training processes; set it to at "
                          f"most {world}")


def unreachable(url: str, timeout: float) -> str | None:
    """Why `url` cannot be reached, or None when its server answers at all (any HTTP status: a reward server
    need not serve GET)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", e))
