"""`gptforge` command line. Errors a user can cause end in one line and a non-zero exit code."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from gptforge.core import console
from gptforge.core.config import load_config
from gptforge.core.errors import ConfigError, UserError, storage_error
from gptforge.pipeline import prefect_env
from gptforge.pipeline.report import metrics_table
from gptforge.core.declarations import STAGES

DEFAULT_CONFIG = "configs/tiny.yaml"


class OneLineUserErrors(logging.Filter):
    """Prefect logs a failed task's or flow's exception with its traceback; a user's error (bad data, a failed
    stage) is one line, printed once at the end."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info, record.exc_text = None, None
        return True


def ephemeral_server():
    """Start Prefect's ephemeral server (what a run without PREFECT_API_URL talks to) here rather than on first
    use, so that a watchdog can stop it if this process is killed: a SIGKILLed run leaves no server behind."""
    from prefect.server.api.server import SubprocessASGIServer

    from gptforge.pipeline.launch.stage import watchdog

    server = SubprocessASGIServer()  # the instance Prefect's clients find
    server.start()
    watchdog(server.server_process.pid, group=False)
    return server


def drain_prefect(timeout: float = 10.0) -> None:
    """Send what Prefect's background workers still hold (flow-run logs, events) now."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=timeout)
        except Exception:  # noqa: BLE001 - a log that cannot be sent must not hide the run's own outcome
            pass


def cmd_run(args) -> int:
    overrides = args.set + ([f"run.name={args.name}"] if args.name else [])
    cfg = load_config(args.config, overrides)  # config errors end here, before anything starts
    prefect_env.apply()
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logging.getLogger(name).addFilter(OneLineUserErrors())
    from gptforge.pipeline.flow import pipeline_flow, selected_stages
    from gptforge.pipeline.preflight import preflight

    preflight(cfg, selected_stages(cfg, args.from_stage, args.only))  # before the server starts (and in the flow)
    server = None if os.environ.get("PREFECT_API_URL") else ephemeral_server()
    t0 = time.perf_counter()
    try:
        state = pipeline_flow(config=cfg, from_stage=args.from_stage, only=args.only, return_state=True)
        if state.is_cancelled():
            raise UserError(f"run {cfg.run.name} cancelled: {state.message}")
        metrics = state.result()
    finally:
        drain_prefect()  # logs and events reach the server before it stops, not at exit against a stopped one
        logging.disable(logging.CRITICAL)  # the run is over: Prefect's goodbyes would come after our last line
        if server is not None:
            server.stop()
    print(f"\nrun {cfg.run.name} finished in {time.perf_counter() - t0:.1f}s")
    print(metrics_table(metrics))
    return 0


def serve(cfg, name: str) -> None:
    """Serve the pipeline deployment (parameters: this config; schedule: run.schedule; a run whenever
    `gptforge.data.changed` is emitted about it) and its watch flow (a check every run.watch_every seconds) from
    this process, until interrupted. Stages run here, or on run.work_pools' workers."""
    from prefect import serve as serve_all

    from gptforge.pipeline.flow import pipeline_flow
    from gptforge.pipeline.team.watch import data_changed_trigger, watch_flow

    params = {"config": cfg.model_dump(mode="json")}
    serve_all(pipeline_flow.to_deployment(
        name=name, parameters=params, cron=cfg.run.schedule, triggers=[data_changed_trigger(cfg)],
        description="gptforge pipeline: tokenize -> pretrain -> sft -> reward -> preference"),
        watch_flow.to_deployment(name=name, parameters=params, interval=cfg.run.watch_every,
                                 description="checks the pipeline's data sources; emits gptforge.data.changed"))


def cmd_serve(args) -> int:
    cfg = load_config(args.config, args.set)
    prefect_env.apply()
    if not os.environ.get("PREFECT_API_URL"):
        raise UserError("PREFECT_API_URL is not set: point it at a Prefect server, or use `gptforge up`")
    serve(cfg, args.name)
    return 0


def cmd_deploy(args) -> int:
    from gptforge.pipeline.team.deploy import deploy

    cfg = load_config(args.config, args.set)
    prefect_env.apply()
    deploy(cfg, args.name, args.slots)
    return 0


def cmd_watch(args) -> int:
    """One check of the pipeline's sources, now (what the deployed watch flow does on its schedule)."""
    from gptforge.pipeline.team.watch import watch_flow

    cfg = load_config(args.config, args.set)
    prefect_env.apply()
    if not os.environ.get("PREFECT_API_URL"):
        raise UserError("PREFECT_API_URL is not set: the check compares with the last one, kept on the server")
    changed = watch_flow(config=cfg)
    drain_prefect()  # the event reaches the server before this process ends
    print(f"changed: {', '.join(changed)}" if changed else "nothing changed")
    return 0


def server_healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def cmd_up(args) -> int:
    import subprocess

    cfg = load_config(args.config, args.set)
    prefect_env.apply()
    url = f"http://{args.host}:{args.port}/api"
    server = None
    if not server_healthy(url):
        print(f"starting a Prefect server (SQLite) with its UI on http://{args.host}:{args.port}", flush=True)
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", args.host,
                                   "--port", str(args.port)], start_new_session=True,
                                  env={**os.environ, "PREFECT_UI_API_URL": url})
        deadline = time.time() + 180
        while not server_healthy(url):
            if server.poll() is not None or time.time() > deadline:
                raise UserError(f"the Prefect server did not start on {url}")
            time.sleep(1)
    os.environ["PREFECT_API_URL"] = url
    try:
        serve(cfg, args.name)
    finally:
        if server is not None:
            os.killpg(server.pid, 15)
    return 0


def cmd_stage(args) -> int:
    """One stage in this process (one rank of it under a launcher: rank 0 records it)."""
    from gptforge.pipeline.launch.nodes import single_process
    from gptforge.pipeline.store import RunRecord, execute, now

    cfg = load_config(args.config, args.set)
    if args.stage not in STAGES:
        raise UserError(f"unknown stage {args.stage!r}; stages: {', '.join(STAGES)}")
    world, want = int(os.environ.get("WORLD_SIZE", "1")), cfg.distributed.world_size
    if not single_process(cfg, args.stage) and world != want:
        raise ConfigError(f"distributed asks for {want} processes (nproc_per_node={cfg.distributed.nproc_per_node} x "
                          f"nnodes={cfg.distributed.nnodes}) but this `gptforge stage` runs as {world}: start it on "
                          "each node under a launcher with as many (torchrun --nproc_per_node ... --nnodes ...), or "
                          "use `gptforge run`, which starts them")
    rank0 = os.environ.get("RANK", "0") == "0"
    record = RunRecord(cfg) if rank0 else None
    if record:
        record.update(args.stage, started_at=now(), status="running")
    manifest = execute(cfg, args.stage)
    if record:
        record.update(args.stage, status="complete", finished_at=now(), metrics=manifest["metrics"])
        print(metrics_table({args.stage: manifest["metrics"]}))
    return 0


def cmd_status(args) -> int:
    """Without a run name: every run under the root, newest last, then the newest in full. The root: --root, else
    the config's run.root (a team's shared folder), else runs."""
    root = Path(args.root or (load_config(args.config, args.set).run.root if args.config else "runs"))
    if args.run:
        path = root / args.run / "run.json"
    else:
        runs = sorted(root.glob("*/run.json"), key=lambda p: p.stat().st_mtime)
        if not runs:
            raise UserError(f"no runs under {root}/")
        for p in runs:
            r = json.loads(p.read_text())
            states = [i.get("status", "?") for i in r["stages"].values()]
            summary = ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states)) or "no stages"
            print(f"{r['name']:40s} {r.get('created_at', ''):26s} {summary}")
        print()
        path = runs[-1]
    if not path.is_file():
        raise UserError(f"no run record at {path}")
    record = json.loads(path.read_text())
    print(f"run {record['name']} ({path})")
    for stage, info in record["stages"].items():
        print(f"  {stage:10s} {info.get('status', '?'):9s} {info.get('action', ''):9s} {info.get('output', '')}")
    print(metrics_table({s: i.get("metrics") or {} for s, i in record["stages"].items()}))
    return 0


def cmd_config(args) -> int:
    from gptforge.core.config.reference import reference

    print(reference(args.section), end="")  # what docs/config.md holds, byte for byte, for the whole schema
    return 0


def cmd_generate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        raise UserError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    from gptforge.model.attention import load_kwargs
    from gptforge.model.sampling.generate import kv_cache

    model = AutoModelForCausalLM.from_pretrained(model_dir, **load_kwargs(model_dir)).eval()
    # a model with a chat template (every gptforge model after SFT) is asked as a user; --raw continues the text
    chat = not args.raw and bool(tokenizer.chat_template)
    if chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                               add_generation_prompt=True)
    else:
        prompt = args.prompt
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    torch.manual_seed(args.seed)
    sample = args.temperature > 0
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=sample, use_cache=not args.no_cache,
                             **(kv_cache(args.kv_cache, "--kv-cache") if not args.no_cache else {}),
                             temperature=args.temperature if sample else None,
                             top_k=args.top_k if sample else None, top_p=args.top_p if sample else None,
                             num_return_sequences=args.num_samples)
    for row in out:
        reply = tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=not args.show_special)
        print(reply if chat else prompt + reply)  # a chat prints the reply alone, not the templated prompt
    return 0


def cmd_plan(args) -> int:
    from gptforge.model.plan import long_context, make_plan, render
    from gptforge.model.pretrained import architecture

    cfg = load_config(args.config, args.set)
    decl = STAGES[args.stage]
    section = getattr(cfg, decl.section)
    sp = cfg.distributed.sequence_parallel if decl.sequence_parallel else 1
    arch, config = architecture(cfg.model)  # model.pretrained: its config.json
    default_len = getattr(section, decl.length)
    seq_len = default_len if args.seq_len is None else args.seq_len
    vocab = args.vocab_size or arch.vocab_size
    plan = make_plan(arch, vocab, seq_len, section.micro_batch_size, args.gpus, args.tokens, args.peak_tflops,
                     args.mfu, args.gpus_per_node, config, section.lora,
                     long_context(cfg, decl.section, sp, seq_len, section.micro_batch_size, vocab, arch.n_embd),
                     getattr(section, "optimizer", "adamw"))
    name = cfg.model.name() + (f", {args.stage} with LoRA r={section.lora.r}" if section.lora.r else "")
    name += ", Muon" if getattr(section, "optimizer", "adamw") == "muon" else ""
    print(render(plan, name, args.gpus, args.gpu_mem, seq_len, section.micro_batch_size,
                 args.tokens is not None, args.peak_tflops, args.mfu, cfg.distributed.activation_checkpointing))
    return 0


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
    gen.add_argument("--raw", action="store_true", help="continue the prompt as text; by default a model with a "
                     "chat template is asked the prompt as a user turn")
    gen.add_argument("--chat", action="store_true", help="(the default where the model has a chat template)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--num-samples", type=int, default=1)
    gen.add_argument("--no-cache", action="store_true", help="disable the KV cache")
    gen.add_argument("--kv-cache", choices=["full", "fp8", "quanto-int4"], default="full",
                     help="KV cache precision: full, fp8, or int4 (optimum-quanto)")
    gen.add_argument("--show-special", action="store_true", help="print special tokens")
    gen.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="serve the pipeline deployment to the Prefect server at PREFECT_API_URL")
    config_args(sv)
    sv.add_argument("--name", default="gptforge", help="deployment name")
    sv.set_defaults(func=cmd_serve)

    dp = sub.add_parser("deploy", help="create the work pools, stage, pipeline and watch deployments, the slot limit "
                        "and the crashed-run automation on the Prefect server at PREFECT_API_URL")
    config_args(dp)
    dp.add_argument("--name", default="gptforge", help="pipeline deployment name")
    dp.add_argument("--slots", type=int, default=None, metavar="N",
                    help="create (or resize) the run.slots limit with N slots: the GPUs the runs share")
    dp.set_defaults(func=cmd_deploy)

    wt = sub.add_parser("watch", help="check the pipeline's data sources now; emit gptforge.data.changed if one "
                        "changed since the last check")
    config_args(wt)
    wt.set_defaults(func=cmd_watch)

    up = sub.add_parser("up", help="start a local Prefect server (UI on 127.0.0.1:4200) if none runs, and serve")
    config_args(up)
    up.add_argument("--name", default="gptforge", help="deployment name")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=4200)
    up.set_defaults(func=cmd_up)

    pl = sub.add_parser("plan", help="parameters, FLOPs, memory per GPU per ZeRO stage, token budget, time")
    config_args(pl)
    pl.add_argument("--gpus", type=int, default=8)
    pl.add_argument("--gpus-per-node", type=int, default=8, help="GPUs a node (host memory is per node)")
    pl.add_argument("--gpu-mem", type=float, default=None, help="GPU memory in GiB, to say what fits")
    pl.add_argument("--tokens", type=float, default=None, help="training tokens (default: 20 per parameter)")
    pl.add_argument("--stage", choices=[s.name for s in STAGES.values() if s.section],
                    default="pretrain", help="the training stage planned: its section's micro-batch, length and lora")
    pl.add_argument("--seq-len", type=int, default=None, help="default: the stage's seq_len or max_length")
    pl.add_argument("--vocab-size", type=int, default=None, help="default: the preset's vocabulary")
    pl.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100/H200: 989)")
    pl.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation to assume")
    pl.set_defaults(func=cmd_plan)

    cf = sub.add_parser("config", help="every config field with its type, default and help (Markdown)")
    cf.add_argument("section", nargs="?", help="a section, e.g. preference or preference.ppo (default: all)")
    cf.set_defaults(func=cmd_config)
    st = sub.add_parser("status", help="what each stage of a run did, with its metrics")
    st.add_argument("run", nargs="?", help="run name (default: the latest)")
    st.add_argument("-c", "--config", default=None, help="a pipeline YAML whose run.root holds the runs")
    st.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    st.add_argument("--root", default=None, help="the runs' root (default: the config's run.root, else runs)")
    st.set_defaults(func=cmd_status)
    return p


def main(argv: list[str] | None = None) -> int:
    console.quiet()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except OSError as e:
        error = storage_error(e)
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        if args.func is cmd_run:  # Prefect's exit handlers would print after this line; cmd_run drained them
            sys.stdout.flush()
            os._exit(e.exit_code)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
