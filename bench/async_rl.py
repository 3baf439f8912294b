"""Rollouts apart from training: PPO and GRPO on the demo, sync (the training process samples between updates)
against async (one rollout worker samples the next batch while the trainer trains, max_staleness 1), in one run,
with the same settings and samples per step, over several seeds.

    .venv/bin/python bench/async_rl.py [-c configs/tiny.yaml] [--seeds 0 1 2] [--algorithms ppo grpo]
                                       [--root runs/async_rl] [--new-tokens 8] [--steps 200] [--set k=v ...]

With `--tool-latency S`, the workload async exists for: bench/agentic.py's task, its tool waiting S seconds a call
(a sandbox, an HTTP call), run sync with the tools in turn (preference.tool_concurrency 1), sync with them at once,
and async; the tool phase of each step (tool_wait_s) is reported beside the step time. `--reward-latency S` adds
a reward server (a judge standing in: exact match, answered after S seconds, on 127.0.0.1) in place of the built-in
exact match; `--modes` picks the modes (the tools in turn cost a minute a step at a 1 s tool).

Reported: the step time of each (the mean time between the ends of consecutive updates, the first step left
out), their ratio sync / async, the held-out exact match of each policy (mean ± standard error over the seeds),
and a timeline of seed 0's last steps (`timeline.png` in the root): when the trainer samples, waits and trains,
and when the worker samples. Both use the whole machine: sync's one training process takes every core, async's
takes all but one, which its worker takes (gptforge.model.train.distributed's `reserve`). GRPO's async run draws
its prompts from gptforge's own seeded order (gptforge.model.sampling.workers.GenerationOrder), not TRL's sampler.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import mean_se, run_seed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": ["preference.rollout.mode=sync"],
         "async": ["preference.rollout.mode=async", "preference.rollout.max_staleness=1",
                   "preference.rollout.workers=1"]}
IN_TURN = {"sync, tools in turn": ["preference.rollout.mode=sync", "preference.tool_concurrency=1"]}
WAITING_TOOL = '''
import time


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    time.sleep({latency})  # a sandbox's or an HTTP call's wait
    return a + b
'''


def waiting_task(root: Path, latency: float, algorithms: list[str], steps_data: dict) -> list[str]:
    """bench/agentic.py's task (a sum only its tool gets right), its tool waiting `latency` seconds a call: the
    overrides, its data and tool module written into `root` (the working folder the stages import it from)."""
    from agentic import overrides

    settings = overrides(root, argparse.Namespace(algorithms=algorithms, **steps_data))
    (root / "agentic_tools.py").write_text(WAITING_TOOL.replace("{latency}", repr(latency)))
    return [s for s in settings if not s.startswith("preference.algorithm=")]


def judge(latency: float) -> str:
    """A reward server in this process on 127.0.0.1 that answers each batch after `latency` seconds with exact
    match (gptforge's built-in): a slow judge. Its URL."""

    class Judge(BaseHTTPRequestHandler):
        def do_POST(self):
            batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(latency)
            body = json.dumps({"rewards": [float(str(r).strip() == str(a).strip())
                                           for r, a in zip(batch["responses"], batch["answers"])]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/score"


def step_time(timeline: list[dict]) -> float:
    """Mean seconds between the ends of consecutive updates, the first step (start-up) left out."""
    ends = sorted(s["end"] for s in timeline if s["who"] == "trainer" and s["what"] == "train")
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def split(timeline: list[dict]) -> str:
    """Seconds a step (the first left out) the trainer spent generating, waiting and training, and the worker
    generating."""
    steps = {s["step"] for s in timeline} - {1}
    spent: dict[str, float] = {}
    for s in timeline:
        if s["step"] in steps:
            key = f"{s['who']} {s['what']}"
            spent[key] = spent.get(key, 0.0) + (s["end"] - s["start"]) / len(steps)
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(spent.items()))


def plot(timelines: dict[str, list[dict]], path: Path, last: int = 4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"generate": "tab:orange", "wait": "tab:gray", "train": "tab:blue"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.4 + 1.1 * len(timelines)), squeeze=False)
    for ax, (mode, timeline) in zip(axes[:, 0], timelines.items()):
        steps = sorted({s["step"] for s in timeline})[-last:]
        shown = [s for s in timeline if s["step"] in steps]
        t0 = min(s["start"] for s in shown)
        rows = sorted({s["who"] for s in shown}, key=lambda w: (w != "trainer", w))
        for s in shown:
            y = rows.index(s["who"])
            ax.barh(y, s["end"] - s["start"], left=s["start"] - t0, color=colors[s["what"]], edgecolor="black",
                    linewidth=0.3)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_title(f"{mode}: steps {steps[0]}-{steps[-1]}", fontsize=9)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--algorithms", nargs="+", default=["ppo", "grpo"], choices=["ppo", "grpo", "rloo"])
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "async_rl")
    parser.add_argument("--new-tokens", type=int, default=None, help="preference.<algorithm>.max_new_tokens")
    parser.add_argument("--steps", type=int, default=None, help="preference.max_steps")
    parser.add_argument("--sync-cores", type=int, default=None,
                        help="pin the sync runs to this many cores (default: all), so that async's worker has cores "
                             "of its own beside a trainer of the same size, as rollout engines have their GPUs")
    parser.add_argument("--tool-latency", type=float, default=None,
                        help="the workload async exists for: bench/agentic.py's task with a tool that waits this many "
                             "seconds a call, run sync with its tools in turn, sync with them at once, and async")
    parser.add_argument("--reward-latency", type=float, default=None,
                        help="--tool-latency: score with a reward server that answers after this many seconds")
    parser.add_argument("--modes", nargs="+", default=None, choices=[*MODES, "in-turn"],
                        help="the modes to run (default: all; with --tool-latency the tools in turn too)")
    parser.add_argument("--agentic-data", type=int, nargs=4, default=[20000, 4000, 4000, 8000],
                        metavar=("DOCUMENTS", "CALLS", "PROBLEMS", "DEMONSTRATIONS"),
                        help="--tool-latency: bench/agentic.py's data sizes")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    modes = MODES
    if args.tool_latency is not None:
        args.root = args.root.resolve()
        args.root.mkdir(parents=True, exist_ok=True)
        documents, calls, problems, demonstrations = args.agentic_data
        args.set = waiting_task(args.root, args.tool_latency, args.algorithms, {
            "documents": documents, "calls": calls, "problems": problems, "demonstrations": demonstrations,
            "flaws": 0.6}) + args.set
        os.chdir(args.root)  # the stages import the tool from their working folder
        modes = {**MODES, **IN_TURN}
        if args.reward_latency is not None:
            args.set.append(f"preference.rewards=[{{name: judge, url: '{judge(args.reward_latency)}'}}]")
    if args.modes:
        modes = {mode: extra for mode, extra in modes.items() if (mode in IN_TURN and "in-turn" in args.modes)
                 or mode in args.modes}
    from gptforge.core.config import load_config
    from gptforge.pipeline.store import locate

    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    timelines = {}
    for seed in args.seeds:
        for algorithm in args.algorithms:
            common = [*args.set, f"preference.algorithm={algorithm}", "distributed.nproc_per_node=1"]
            common += [f"preference.{algorithm}.max_new_tokens={args.new_tokens}"] if args.new_tokens else []
            common += [f"preference.max_steps={args.steps}"] if args.steps else []
            for mode, extra in modes.items():  # one store: the stages before the algorithm computed once a seed
                every = os.sched_getaffinity(0)
                if mode == "sync" and args.sync_cores:
                    os.sched_setaffinity(0, sorted(every)[:args.sync_cores])
                root = args.root
                if mode in IN_TURN:  # tool_concurrency leaves the fingerprint (the same result): a store of its own
                    root = args.root / "in-turn"
                    for done in (args.root / "store").glob("*"):
                        if done.name not in (algorithm, f"eval-{algorithm}"):
                            shutil.copytree(done, root / "store" / done.name, dirs_exist_ok=True)
                try:
                    metrics = run_seed(args.config, root, seed, [*common, *extra])
                finally:
                    os.sched_setaffinity(0, every)
                cfg = load_config(str(root / f"seed{seed}.yaml"))
                folder = locate(cfg, algorithm)[0]
                timeline = [json.loads(line) for line in (folder / "logs" / "timeline.jsonl").read_text().splitlines()]
                got = results.setdefault((algorithm, mode), {"step_s": [], "exact_match": [], "steps": [],
                                                             "updates": [], "tool_wait_s": []})
                got["step_s"].append(step_time(timeline))
                got["steps"].append(metrics[algorithm]["global_step"])
                got["updates"].append(len({s["step"] for s in timeline if s["who"] == "trainer"
                                           and s["what"] == "train"}))
                evaluated = metrics[f"eval-{algorithm}"]
                accuracy = [v for k, v in evaluated.items() if k.startswith("accuracy/")]  # the reward's (a judge's)
                got["exact_match"].append(evaluated.get("exact_match", evaluated.get("accuracy/exact_match",
                                                                                    accuracy[0] if accuracy else None)))
                waits = [json.loads(line).get("tool_wait_s") for line in
                         (folder / "logs" / "metrics.jsonl").read_text().splitlines()]
                waits = [w for w in waits if w is not None]
                if waits:
                    got["tool_wait_s"].append(statistics.mean(waits))
                if seed == args.seeds[0]:
                    timelines[f"{algorithm} {mode}"] = timeline
    plot(timelines, args.root / "timeline.png")
    n = len(os.sched_getaffinity(0))
    cores = f"sync on {args.sync_cores} of {n} cores" if args.sync_cores else "both on every core"
    print(f"sync against async (max_staleness 1, one worker) on the demo, seeds {args.seeds}, {cores}, "
          f"{' '.join(args.set)}")
    tools = args.tool_latency is not None  # the tool phase beside the step time
    print(f"| algorithm | mode | step time (s) |{' tool phase (s a step) |' if tools else ''} held-out exact match |")
    print(f"|---|---|---|{'---|' if tools else ''}---|")
    ratios = {}
    for (algorithm, mode), got in results.items():
        waits = f" {mean_se(got['tool_wait_s']) if got['tool_wait_s'] else '-'} |" if tools else ""
        print(f"| {algorithm} | {mode} | {mean_se(got['step_s'])} |{waits} {mean_se(got['exact_match'])} |")
    for (algorithm, mode), got in results.items():  # both modes did the same work: the same steps and updates
        print(f"work: {algorithm} {mode}: {got['steps']} steps, {got['updates']} updates")
    for algorithm in args.algorithms:
        if (algorithm, "sync, tools in turn") in results and (algorithm, "sync") in results:
            turn, once = results[algorithm, "sync, tools in turn"], results[algorithm, "sync"]
            if turn["tool_wait_s"] and once["tool_wait_s"]:
                each = [a / b for a, b in zip(turn["tool_wait_s"], once["tool_wait_s"])]
                print(f"{algorithm} tool phase in turn / at once: {statistics.mean(each):.2f}x (per seed: "
                      f"{', '.join(f'{r:.2f}' for r in each)})")
        if (algorithm, "sync") not in results or (algorithm, "async") not in results:
            continue
        once = results[algorithm, "sync"]
        waited = [w + (args.reward_latency or 0) for w in once["tool_wait_s"]]  # the judge answers once a step
        if waited:
            share = [w / s for w, s in zip(waited, once["step_s"])]
            print(f"{algorithm} waiting on tools{' and the judge' if args.reward_latency else ''}, share of a sync "
                  f"step: {statistics.mean(share):.0%}")
        each = [s / a for s, a in zip(results[algorithm, "sync"]["step_s"], results[algorithm, "async"]["step_s"])]
        ratios[algorithm] = statistics.mean(each)
        print(f"{algorithm} step time sync / async: {ratios[algorithm]:.2f}x (per seed: "
              f"{', '.join(f'{r:.2f}' for r in each)})")
    for name, timeline in timelines.items():
        print(f"seconds a step, seed {args.seeds[0]}, {name}: {split(timeline)}")
    print(f"timeline: {args.root / 'timeline.png'}")
    return ratios


if __name__ == "__main__":
    main()
