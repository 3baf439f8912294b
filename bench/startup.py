"""Start-up benchmark: how long a 2-process stage of the default pipeline spends before its first training step and
after its last one, against the floor, a plain 2-process `torch.distributed` script that imports torch and
transformers, builds the same model, takes one step and saves it. Both are timed side by side in one run, in two
spans each: from launch to the first step, and from the last step to exit.

    .venv/bin/python bench/startup.py [-c configs/tiny.yaml] [--repeats 3] [--set k=v ...]

The stage is `pretrain`, started as `gptforge run` starts it (gptforge.pipeline.launch.stage.run_stage, under the
configured launcher), on the tokenize output this script makes first (not timed). A step's end is the moment its
log line reaches this process; the stage logs every step here. Each span's median over the rounds is compared.

On a CPU host each round starts the stage twice: as a pipeline's later stage does, its agent forked from the fork
server that this process started for its first stage (gptforge.pipeline.launch.fork_server), and as a process that
imports everything itself (GPTFORGE_FORK_SERVER=0). The CPU the whole machine spent on each (/proc/stat, so run it
on a quiet machine) is compared too; the first stage of the process, which starts the server, is printed apart.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
STEPS = 5

# The floor: what any 2-process training script pays. Rank 0 prints a line after its step, then saves.
FLOOR = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, os.cpu_count() // world))
    cfg = GPT2Config(vocab_size=int(sys.argv[1]), n_positions=int(sys.argv[2]), n_embd=int(sys.argv[3]),
                     n_layer=int(sys.argv[4]), n_head=int(sys.argv[5]))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (int(sys.argv[6]), int(sys.argv[7])))
    model(input_ids=x, labels=x).loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    if rank == 0:
        print("step 1 done", flush=True)
        model.save_pretrained(sys.argv[8])
    dist.barrier()
    dist.destroy_process_group()
""")


def floor(cfg, out: Path) -> tuple[float, float]:
    """(launch to step, step to exit) of the plain script, in seconds."""
    from gptforge.pipeline.launch.agent import rank_env

    arch, pc = cfg.model.arch(), cfg.pretrain
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [str(cfg.tokenizer.vocab_size), str(arch.n_positions), str(arch.n_embd), str(arch.n_layer),
            str(arch.n_head), str(pc.micro_batch_size), str(pc.seq_len), str(out)]
    nproc = cfg.distributed.nproc_per_node
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", FLOOR, *args], stdout=subprocess.PIPE, text=True,
                              env={**rank_env(os.environ, nproc, 1, 0, r, "127.0.0.1", port),
                                   "TORCHELASTIC_USE_AGENT_STORE": ""}) for r in range(nproc)]
    procs[0].stdout.readline()
    stepped = time.perf_counter()
    for p in procs:
        p.communicate()
        assert p.returncode == 0, "the floor script failed"
    return stepped - t0, time.perf_counter() - stepped


def busy() -> float:
    """Seconds of CPU the whole machine has spent busy, all cores together (/proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # but idle and iowait


def stage(cfg, path: Path, forked: bool = True) -> tuple[float, float, float]:
    """(launch to first step, last step to exit, the machine's CPU seconds) of the pretrain stage, in seconds;
    `forked`: its agent forked from the fork server (on a CPU host), else started as a process of its own."""
    from gptforge.pipeline.launch.stage import run_stage
    from gptforge.pipeline.store import RunRecord

    steps: list[float] = []

    def log(line: str) -> None:
        if line.lstrip().startswith("step ") and " | loss " in line:
            steps.append(time.perf_counter())

    os.environ["GPTFORGE_FORK_SERVER"] = "1" if forked else "0"
    cpu, t0 = busy(), time.perf_counter()
    run_stage(cfg, "pretrain", path, RunRecord(cfg), log, recompute=True)
    end = time.perf_counter()
    assert len(steps) == STEPS, f"expected a log line for each of {STEPS} steps, saw {len(steps)}"
    return steps[0] - t0, end - steps[-1], busy() - cpu


def main() -> None:
    from gptforge.core.config import dump_config, load_config
    from gptforge.pipeline.store import execute

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds of stage and floor (default 3)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    cfg = load_config(args.config, [f"run.root={root}", f"pretrain.max_steps={STEPS}", "pretrain.log_every=1",
                                    f"pretrain.eval_every={STEPS}", f"pretrain.save_every={STEPS}", *args.set])
    path = root / "pipeline.yaml"
    path.write_text(dump_config(cfg))
    execute(cfg, "tokenize")
    first = stage(cfg, path)  # the process's first stage: it starts the fork server, which imports the stage
    spans: dict[str, list[tuple[float, ...]]] = {"forked": [], "own": [], "floor": []}
    for _ in range(args.repeats):  # interleaved: the machine's drift falls on every side
        spans["forked"].append(stage(cfg, path))
        spans["own"].append(stage(cfg, path, forked=False))
        cpu = busy()
        spans["floor"].append((*floor(cfg, root / "floor-model"), busy() - cpu))
    d = cfg.distributed
    print(f"pretrain, {cfg.model.name()}, {d.world_size} processes, launcher {d.launcher}, ZeRO-{d.zero_stage}; "
          f"medians of {args.repeats} interleaved round(s)")

    def median(side: str, i: int) -> float:
        return statistics.median(x[i] for x in spans[side])

    for i, span in enumerate(("launch to first step", "last step to exit")):
        f = median("floor", i)
        for side, name in (("forked", "stage"), ("own", "stage, no fork server")):
            s = median(side, i)
            print(f"{span}: {name} {s:6.2f} s, floor {f:6.2f} s, ratio {s / f:.2f}x (target <= 1.5x; rounds: "
                  f"{', '.join(f'{a[i]:.2f}/{b[i]:.2f}' for a, b in zip(spans[side], spans['floor']))})")
    forked, own, f = median("forked", 2), median("own", 2), median("floor", 2)
    print(f"CPU a stage (the machine's): stage {forked:.1f} s, no fork server {own:.1f} s, floor {f:.1f} s; "
          f"ratio {forked / own:.2f}x of no fork server")
    print(f"the process's first stage (the fork server starts): launch to first step {first[0]:.2f} s, "
          f"CPU {first[2]:.1f} s")


if __name__ == "__main__":
    main()
