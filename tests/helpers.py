"""Running real stages (real launchers, real processes) from tests."""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from gptforge.core.config import dump_config, load_config
from gptforge.core.errors import StageFailed
from gptforge.pipeline.launch.stage import run_stage as run_step
from gptforge.pipeline.launch.nodes import node_commands, node_env, rendezvous
from gptforge.pipeline.store import RunRecord, execute, locate, read_manifest
from tests.conftest import ROOT, SMALL, TINY

# Short, fast training for every stage; each test adds what it needs.
FAST = [
    "model.n_layer=2", "pretrain.max_steps=30", "pretrain.save_every=5", "pretrain.eval_every=15",
    "pretrain.log_every=1", "pretrain.micro_batch_size=8", "pretrain.global_batch_size=16",
    "pretrain.warmup_steps=5", "pretrain.seq_len=64", "pretrain.eval_batches=2", "pretrain.keep_last=3",
    "eval.items=24", "eval.batch_size=8", "reward.policy_samples=48",
]
for _s in ("sft", "reward", "preference"):
    FAST += [f"{_s}.max_steps=20", f"{_s}.save_every=5", f"{_s}.log_every=1",
             f"{_s}.micro_batch_size=4", f"{_s}.global_batch_size=8", f"{_s}.warmup_steps=2", f"{_s}.keep_last=3"]
FAST += ["sft.eval_every=10", "reward.eval_every=10"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(root: Path, *overrides):
    """A fast config rooted at `root`, written to root/pipeline.yaml; returns (cfg, path)."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config(TINY, [f"run.root={root}", *SMALL, *FAST, *overrides])
    path = root / "pipeline.yaml"
    path.write_text(dump_config(cfg))
    return cfg, path


def tokenize_in_process(cfg):
    execute(cfg, "tokenize")


def tokenize_from(shared: Path, cfg) -> None:
    """`cfg`'s tokenize output: the shared root's (the session's `tokenized`) where the fingerprints agree, else
    computed here."""
    copy_store(shared, Path(cfg.run.root), "tokenize")
    tokenize_in_process(cfg)


class launch:
    """Start a single-node stage under its launcher, as the pipeline does, its rendezvous hosted here (a context
    manager: the store lives until the block ends); `.proc` is the launcher's process."""

    def __init__(self, cfg, path, stage, stdout=subprocess.PIPE):
        self.cfg, self.path, self.stage, self.stdout = cfg, path, stage, stdout

    def __enter__(self) -> subprocess.Popen:
        out_dir, _, inputs = locate(self.cfg, self.stage)
        self.rendezvous = rendezvous(self.cfg, self.stage)
        port = self.rendezvous.__enter__()
        env = node_env(self.cfg, self.stage)
        (cmd,) = node_commands(self.cfg, self.stage, self.path, out_dir, {up: d for up, (d, _) in inputs.items()},
                               port, env)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=self.stdout,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        return self.proc

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.rendezvous.__exit__(*exc)


def run_stage(cfg, path, stage):
    """Run a stage to completion under its launcher, as the pipeline does without Prefect; return
    (manifest, out_dir, output)."""
    lines = []
    try:
        manifest = run_step(cfg, stage, path, RunRecord(cfg), lines.append)
    except StageFailed as e:
        pytest.fail(f"{e}\n" + "\n".join(lines[-150:]))
    return manifest, locate(cfg, stage)[0], "\n".join(lines)


def kill_after_checkpoint(cfg, path, stage, step: int, sessions: list | None = None, trainer: bool = False) -> Path:
    """Start the stage, SIGKILL its whole process group once step `step` is checkpointed (`trainer`: a TRL
    Trainer's checkpoint-N; its session id, the launcher's pid, appended to `sessions`)."""
    out_dir = locate(cfg, stage)[0]
    marker = out_dir / "checkpoints" / (f"checkpoint-{step}" if trainer else f"step-{step:08d}") / "complete.json"
    log = Path(path).with_name(f"{stage}-killed.log")
    with open(log, "w") as out, launch(cfg, path, stage, stdout=out) as proc:  # a file: nobody reads the output
        deadline = time.time() + 600
        while not marker.exists():
            assert proc.poll() is None, f"{stage} ended before its step-{step} checkpoint:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if sessions is not None:
            sessions.append(proc.pid)
    assert read_manifest(out_dir) is None
    return out_dir


# A sitecustomize every rank runs where it starts as a Python of its own (PYTHONPATH, forwarded to every node): what
# started it (its command line and its parent's) and its launcher's variables, for a test to show which launcher ran.
WITNESS = """
import json, os
def _cmd(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\\0")[:-1]]
if "RANK" in os.environ:
    seen = {"rank": os.environ["RANK"], "argv": _cmd(os.getpid()), "parent": _cmd(os.getppid()),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "TORCHELASTIC_"))}}
    with open(os.path.join(os.path.dirname(__file__), "seen", f"{os.getpid()}.json"), "w") as f:
        json.dump(seen, f)
"""


def rank_witness(root: Path) -> tuple[str, Path]:
    """(the override that puts WITNESS on every rank's path, the folder its records go to)."""
    site = root / "site"
    (site / "seen").mkdir(parents=True)
    (site / "sitecustomize.py").write_text(WITNESS)
    return f"distributed.env={{PYTHONPATH: {site}}}", site / "seen"


def witnessed(seen: Path, module: str) -> dict[str, dict]:
    """{RANK: its record} of the processes that ran `module` (a stage's ranks, not their helpers)."""
    records = (json.loads(f.read_text()) for f in seen.glob("*.json"))
    return {r["rank"]: r for r in records if module in r["argv"]}


def copy_store(src_root: Path, dst_root: Path, *stages):
    """Reuse finished upstream stages in another root (fingerprints do not depend on run.root)."""
    for stage in stages:
        shutil.copytree(src_root / "store" / stage, dst_root / "store" / stage, dirs_exist_ok=True)


def logged(out_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (out_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


UPSTREAM = ("tokenize", "pretrain", "sft", "reward")


def prepared(chain, root: Path, *overrides):
    """A config rooted at `root` whose tokenize, pretrain, sft and reward outputs are the chain's."""
    cfg, path = config(root, *overrides)
    copy_store(chain["root"], root, *UPSTREAM)
    return cfg, path


def changed_from_sft(chain, out_dir) -> bool:
    import torch
    from safetensors.torch import load_file

    sft = load_file(chain["sft"][1] / "model" / "model.safetensors")
    tuned = load_file(out_dir / "model" / "model.safetensors")
    assert sft.keys() == tuned.keys() and "lm_head.weight" not in tuned  # the tied weight stored once
    return any(not torch.equal(sft[k], tuned[k]) for k in sft)


def logged_names(out_dir: Path) -> set[str]:
    rows = [json.loads(line) for line in (out_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {k for r in rows for k in r} - {"step"}


# A user's reward (my_rewards.py in the working folder) that is 0 for every response to half the prompts, by the
# parity of the prompt's CRC, and the response's length for the others: groups with no advantage, and groups with.
HALF_REWARD = (
    "import zlib\n"
    "def half(prompts, responses, answers, **_):\n"
    "    return [0.0 if zlib.crc32(str(p).encode()) % 2 else float(len(r)) for p, r in zip(prompts, responses)]\n")
