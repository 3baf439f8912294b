"""The command line of every stage module: run the stage into a given output folder on given inputs.

    python -m gptforge.stages.sft --config CONFIG --out DIR --input pretrain=DIR [--set key=value ...]

A stage knows nothing of the stage store: the pipeline (or `gptforge stage`) decides where its output goes
and which inputs it reads, and records it as complete once every process has exited cleanly. When the
stage has finished, rank 0 writes `result.json` (its final metrics) into the output folder, last.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from gptforge.core import console
from gptforge.core.config import PipelineConfig, load_config
from gptforge.core.errors import UserError, storage_error
from gptforge.core.files import write_json_atomic
from gptforge.data.splits import curated
from gptforge.model.train.metrics import check_names
from gptforge.model.train.tracking import stage_run

RESULT = "result.json"
RunFn = Callable[[PipelineConfig, dict[str, Path], Path], dict]


def stage_args(config_path: Path, out_dir: Path, inputs: dict[str, Path]) -> list[str]:
    """The arguments that run a stage into `out_dir` on `inputs` ({input stage: its output folder})."""
    args = ["--config", str(config_path), "--out", str(out_dir)]
    for name, path in inputs.items():
        args += ["--input", f"{name}={path}"]
    return args


def run_rank(run: RunFn, cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path, name: str = "") -> dict:
    """Run a stage in this process (one rank of it under a launcher); rank 0 writes result.json last. `name`:
    the stage's, for the tracker (a stage in the store is named by its folder there)."""
    rank = int(os.environ.get("RANK", "0"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (out_dir / RESULT).unlink(missing_ok=True)  # a stale result never describes this run
    name = out_dir.parent.name if out_dir.parent.parent.name == "store" else name or out_dir.name
    with stage_run(cfg, name, out_dir, rank) as tracked:
        metrics = run(curated(cfg, inputs), inputs, out_dir)  # a curated source: curate's output
        metrics.update(peak_memory(rank))
        check_names(metrics)
        tracked(metrics)
    result = {"metrics": metrics, "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    if rank == 0:
        write_json_atomic(out_dir / RESULT, result)
    return result


def peak_memory(rank: int) -> dict:
    """This process's peak resident host memory (and accelerator memory allocated), printed for each rank; the
    largest over the ranks as the stage's `peak_host_memory_gib` (`peak_device_memory_gib`). A stage that never
    imported torch (tokenize, curate) used no accelerator and joined no group: it is not imported for this."""
    import resource

    torch = sys.modules.get("torch")
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    device = torch.cuda.max_memory_allocated() / 2**30 if torch is not None and torch.cuda.is_available() else None
    print(f"[memory] rank {rank}: peak host {host:.3f} GiB" + (f", device {device:.3f} GiB" if device else ""),
          file=sys.stderr, flush=True)
    peaks = [host, device or 0.0]
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        t = torch.tensor(peaks, dtype=torch.float64, device="cuda" if device is not None else "cpu")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        peaks = t.tolist()
    return {"peak_host_memory_gib": round(peaks[0], 3)} | (
        {"peak_device_memory_gib": round(peaks[1], 3)} if device is not None else {})


# What every stage's ranks import as they run, beyond their stage's module (`preload`): PEFT (asked of every model
# they build) and the metrics log's TensorBoard writer.
RANK_IMPORTS = ("peft", "torch.utils.tensorboard")


def preload(module, argv: list[str]) -> None:
    """Import what each rank of the stage `module` (started with `argv`) will import as it runs: RANK_IMPORTS, the
    transformers modules of the config's models, and the module's own RANK_IMPORTS (a TRL trainer's modules, which
    its stage imports once its ranks have joined their group). The warm agent (gptforge.pipeline.launch.agent) calls
    this before it forks the ranks, which then find these imported rather than importing them each on its own."""
    from gptforge.model.pretrained import modeling_modules
    from gptforge.model.train.distributed import no_integrations

    args, _ = parser(module.__name__).parse_known_args(argv)
    no_integrations()
    for name in (*RANK_IMPORTS, *modeling_modules(load_config(args.config, args.set)),
                 *getattr(module, "RANK_IMPORTS", ())):
        importlib.import_module(name)


def parser(prog: str) -> argparse.ArgumentParser:
    """A stage module's command line."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}")
    parser.add_argument("--config", "-c", required=True, help="pipeline YAML")
    parser.add_argument("--out", required=True, type=Path, help="output folder (resumes from its checkpoints)")
    parser.add_argument("--input", action="append", default=[], metavar="STAGE=DIR",
                        help="an input stage's output folder")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    # Launchers may append --local_rank; the rank is read from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return parser


def main(stage: str, run: RunFn, argv: list[str] | None = None) -> int:
    console.quiet()
    args = parser(f"gptforge.stages.{stage}").parse_args(argv)
    try:
        inputs = dict(_input(item) for item in args.input)
        cfg = load_config(args.config, args.set)
        run_rank(run, cfg, inputs, args.out, stage)
        from gptforge.model.train.distributed import end_distributed  # torch: only in a stage's processes

        end_distributed()
    except OSError as e:
        error = storage_error(e)
        if error is None:
            raise
        say_error(error)
        return error.exit_code
    except UserError as e:
        say_error(e)
        return e.exit_code
    except RuntimeError as e:  # a collective that timed out: name the rank that stopped answering
        from gptforge.model.train.distributed import hung_rank, is_timeout

        if not is_timeout(e):
            raise
        say_error(f"{stage}: {hung_rank(e, cfg.distributed.timeout_minutes)}")
        return 1
    return 0


def say_error(message) -> None:
    """The stage's one `error:` line, in one write: every rank that meets the same error says it at once, and
    print's two writes (the text, then the newline) from two ranks on one pipe ran together into one line."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def exit_process(code: int) -> NoReturn:
    """End a stage's process with `code` at once, its output flushed (`python -m gptforge.stages.<stage>`). The
    interpreter's own teardown of torch, DeepSpeed and transformers took 2 to 5 s of every rank at the end of every
    stage, and does nothing for a stage that has written its result: each stage closes what it opened (its logs,
    tracker, Ray instance and process group) itself."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _input(item: str) -> tuple[str, Path]:
    name, sep, path = item.partition("=")
    if not sep:
        raise UserError(f"--input {item!r}: expected STAGE=DIR")
    return name, Path(path)
