"""Real 2-process pretraining under DeepSpeed on the CPU (gloo): ZeRO-0/2/3 agree, a SIGKILLed run
resumes to the same result, the export loads without gptforge."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from model import train as T
from pipeline.config import dump_config, load_config
from pipeline.entry import execute, locate
from pipeline.launch import stage_command, stage_env
from pipeline.store import read_manifest
from stages import tokenize

from tests.conftest import ROOT, SMALL, TINY

pytestmark = pytest.mark.slow

STEPS = ["pretrain.max_steps=30", "pretrain.save_every=5", "pretrain.eval_every=15", "pretrain.log_every=1",
         "pretrain.micro_batch_size=8", "pretrain.global_batch_size=16", "pretrain.warmup_steps=5",
         "pretrain.seq_len=64", "pretrain.eval_batches=2", "pretrain.keep_last=3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(root, *extra):
    cfg = load_config(TINY, [f"run.root={root}", *SMALL, *STEPS, f"distributed.master_port={free_port()}", *extra])
    execute(cfg, "tokenize", tokenize.run, tokenize.OUTPUTS)
    path = root / "pipeline.yaml"
    path.write_text(dump_config(cfg))
    return cfg, stage_command(cfg, "pretrain", path)


def launch(cmd, **kw):
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **stage_env()}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def run_pretrain(root, *extra):
    cfg, cmd = prepare(root, *extra)
    proc = launch(cmd)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    out_dir = locate(cfg, "pretrain")[0]
    return read_manifest(out_dir), out_dir, out


def losses(out_dir):
    rows = [json.loads(line) for line in (out_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    return run_pretrain(tmp_path_factory.mktemp("zero2"), "distributed.zero_stage=2")


def test_zero2_trains_and_exports(zero2, tmp_path):
    manifest, out_dir, out = zero2
    m = manifest["metrics"]
    curve = losses(out_dir)
    assert manifest["world_size"] == 2 and m["global_step"] == 30
    assert curve[-1] < curve[0] - 1.0  # the loss fell
    assert m["val_loss"] < m["unigram_entropy"]
    assert m["mfu"] is None and m["tokens_per_sec"] > 0  # no known peak on the CPU
    assert (out_dir / "logs" / "tb").is_dir()
    assert sorted(p.name for p in (out_dir / "checkpoints").glob("step-*")) == [
        "step-00000015", "step-00000020", "step-00000025"]  # keep_last=3
    # The export loads and generates with transformers alone, without gptforge on the path.
    script = ("import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer;"
              f"d={str(out_dir / 'model')!r}; m=AutoModelForCausalLM.from_pretrained(d); t=AutoTokenizer.from_pretrained(d);"
              "ids=t('What is 2 plus 3?', return_tensors='pt').input_ids;"
              "out=m.generate(ids, max_new_tokens=5, do_sample=False);"
              "assert out.shape[1] > ids.shape[1]; assert 'pipeline' not in sys.modules; print(t.decode(out[0]))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("stage", [0, 3])
def test_zero_stages_give_the_same_loss_curve(zero2, tmp_path, stage):
    manifest, out_dir, _ = run_pretrain(tmp_path, f"distributed.zero_stage={stage}")
    assert losses(out_dir) == pytest.approx(losses(zero2[1]), abs=2e-4)
    assert manifest["metrics"]["val_loss"] == pytest.approx(zero2[0]["metrics"]["val_loss"], abs=2e-4)


def test_sigkill_then_rerun_matches_uninterrupted(zero2, tmp_path):
    cfg, cmd = prepare(tmp_path, "distributed.zero_stage=2")
    ckpt_root = locate(cfg, "pretrain")[0] / "checkpoints"
    proc = launch(cmd)
    deadline = time.time() + 300
    while not (ckpt_root / "step-00000010" / "complete.json").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before its checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    out_dir = locate(cfg, "pretrain")[0]
    assert read_manifest(out_dir) is None

    again = launch(cmd)
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out[-4000:]
    assert "[pretrain] resumed from" in out
    resumed = read_manifest(out_dir)["metrics"]
    assert resumed["val_loss"] == pytest.approx(zero2[0]["metrics"]["val_loss"], abs=1e-6)
    assert losses(out_dir) == pytest.approx(losses(zero2[1]), abs=1e-6)


def test_invalid_checkpoints_are_skipped_with_a_warning(zero2, tmp_path, capsys):
    src = zero2[1] / "checkpoints"
    for name in ("step-00000015", "step-00000020", "step-00000025"):
        shutil.copytree(src / name, tmp_path / name)
    model_file = next(p for p in (tmp_path / "step-00000025").rglob("*model_states.pt"))
    model_file.write_bytes(model_file.read_bytes()[:100])  # truncated
    (tmp_path / "step-00000020" / "complete.json").unlink()  # never marked complete
    assert T.newest_valid_checkpoint(tmp_path, rank=0) == tmp_path / "step-00000015"
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "truncated" in err and "not marked complete" in err


def test_shards_from_another_tokenizer_are_a_clear_error(zero2, tmp_path):
    from pipeline.errors import DataError
    from stages.pretrain import load_data

    tok_out = next((zero2[1].parents[1] / "tokenize").iterdir())
    shards = tmp_path / "shards"
    shutil.copytree(tok_out / "shards", shards)
    index = json.loads((shards / "index.json").read_text())
    index["vocab_size"] = 50257
    (shards / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="were not made by the tokenizer"):
        load_data(tok_out / "tokenizer", shards)


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_other_launchers_run_two_processes(tmp_path, launcher):
    manifest, _, _ = run_pretrain(tmp_path, f"distributed.launcher={launcher}", "pretrain.max_steps=4")
    assert manifest["world_size"] == 2 and manifest["metrics"]["global_step"] == 4
