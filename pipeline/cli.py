"""`gptforge` command line. Errors a user can cause end in one line and a non-zero exit code."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

from pipeline.config import load_config
from pipeline.errors import UserError

DEFAULT_CONFIG = "configs/tiny.yaml"


def _quiet_prefect_env() -> None:
    # No internet: no telemetry. With no PREFECT_API_URL Prefect starts an ephemeral local server.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    # The first start of the ephemeral server migrates its SQLite database: slow on 2 cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def cmd_run(args) -> int:
    cfg = load_config(args.config, args.set)  # config errors end here, before anything starts
    if args.name:
        args.set.append(f"run.name={args.name}")
        cfg = load_config(args.config, args.set)
    _quiet_prefect_env()
    from pipeline.flow import pipeline_flow, selected_stages

    selected_stages(cfg, args.from_stage, args.only)
    t0 = time.perf_counter()
    metrics = pipeline_flow(config_path=args.config, overrides=args.set, from_stage=args.from_stage, only=args.only)
    print(f"\nrun {cfg.run.name} finished in {time.perf_counter() - t0:.1f}s")
    print(metrics_table(metrics))
    return 0


def cmd_stage(args) -> int:
    from pipeline.entry import execute
    from pipeline.launch import stage_module
    from pipeline.store import RunRecord, now

    cfg = load_config(args.config, args.set)
    module = importlib.import_module(stage_module(args.stage))
    record = RunRecord(cfg)
    record.update(args.stage, started_at=now(), status="running")
    manifest = execute(cfg, args.stage, module.run, module.OUTPUTS)
    record.update(args.stage, status="complete", finished_at=now(), metrics=manifest["metrics"])
    print(metrics_table({args.stage: manifest["metrics"]}))
    return 0


def cmd_status(args) -> int:
    root = Path(args.root)
    if args.run:
        path = root / args.run / "run.json"
    else:
        runs = sorted(root.glob("*/run.json"), key=lambda p: p.stat().st_mtime)
        if not runs:
            raise UserError(f"no runs under {root}/")
        path = runs[-1]
    if not path.is_file():
        raise UserError(f"no run record at {path}")
    record = json.loads(path.read_text())
    print(f"run {record['name']} ({path})")
    for stage, info in record["stages"].items():
        print(f"  {stage:10s} {info.get('status', '?'):9s} {info.get('action', ''):9s} {info.get('output', '')}")
    print(metrics_table({s: i.get("metrics") or {} for s, i in record["stages"].items()}))
    return 0


def cmd_generate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        raise UserError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if args.chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                               add_generation_prompt=True)
    else:
        prompt = args.prompt
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    torch.manual_seed(args.seed)
    sample = args.temperature > 0
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=sample, use_cache=not args.no_cache,
                             temperature=args.temperature if sample else None,
                             top_k=args.top_k if sample else None, top_p=args.top_p if sample else None,
                             num_return_sequences=args.num_samples)
    for row in out:
        print(prompt + tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=not args.show_special))
    return 0


def metrics_table(metrics: dict[str, dict]) -> str:
    """Markdown table: one row per stage, its final metrics as key=value."""
    rows = ["| stage | metrics |", "| --- | --- |"]
    for stage, m in metrics.items():
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in m.items() if not k.endswith("sha256"))
        rows.append(f"| {stage} | {shown} |")
    return "\n".join(rows)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gptforge", description="End-to-end GPT training pipeline.")
    sub = p.add_subparsers(dest="command", required=True)

    def config_args(sp, required=False):
        sp.add_argument("-c", "--config", default=None if required else DEFAULT_CONFIG, required=required,
                        help="pipeline YAML")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set pretrain.lr=3e-4")

    r = sub.add_parser("run", help="run the pipeline as a Prefect flow")
    config_args(r)
    g = r.add_mutually_exclusive_group()
    g.add_argument("--from", dest="from_stage", metavar="STAGE", help="recompute from this stage on")
    g.add_argument("--only", metavar="STAGE", help="run only this stage, on existing inputs")
    r.add_argument("--name", help="run name (run.name)")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("stage", help="run one stage in this process, without Prefect")
    s.add_argument("stage")
    config_args(s, required=True)
    s.set_defaults(func=cmd_stage)

    gen = sub.add_parser("generate", help="sample from any stage's model directory")
    gen.add_argument("model_dir")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user turn")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--num-samples", type=int, default=1)
    gen.add_argument("--no-cache", action="store_true", help="disable the KV cache")
    gen.add_argument("--show-special", action="store_true", help="print special tokens")
    gen.set_defaults(func=cmd_generate)

    st = sub.add_parser("status", help="what each stage of a run did, with its metrics")
    st.add_argument("run", nargs="?", help="run name (default: the latest)")
    st.add_argument("--root", default="runs", help="run.root")
    st.set_defaults(func=cmd_status)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
