"""Real 2-process pretraining under DeepSpeed on the CPU (gloo): ZeRO-0/2/3 agree, a SIGKILLed run
resumes to the same result, the export loads without gptforge."""

import json
import re
import shutil
from pathlib import Path
import subprocess
import sys

import pytest

from gptforge.core.errors import DataError
from gptforge.core.files import sha256_file
from gptforge.model.train.checkpoints import newest_valid_checkpoint
from gptforge.pipeline.store import locate
from gptforge.stages.pretrain import load_data
from tests.helpers import (config, copy_store, kill_after_checkpoint, launch, logged, rank_witness, run_stage,
                           tokenize_from, tokenize_in_process, witnessed)

pytestmark = pytest.mark.slow


def pretrain(tokenized, root, *overrides):
    cfg, path = config(root, *overrides)
    tokenize_from(tokenized, cfg)
    return run_stage(cfg, path, "pretrain")


@pytest.fixture(scope="module")
def zero2(pretrained):
    """The session's 2-process ZeRO-2 pretraining, which the variants below are compared with."""
    return pretrained


def test_zero2_trains_and_exports(zero2, tmp_path):
    manifest, out_dir, out = zero2
    m = manifest["metrics"]
    curve = logged(out_dir, "loss")
    assert manifest["world_size"] == 2 and m["global_step"] == 30
    assert curve[-1] < curve[0] - 1.0  # the loss fell
    assert m["val_loss"] < m["unigram_entropy"]
    assert m["mfu"] is None and m["tokens_per_sec"] > 0  # no known peak on the CPU
    rates = logged(out_dir, "tokens_per_sec")  # log_every=1: the first 5 steps of the start are not timed
    assert rates[:5] == [None] * 5 and all(r > 0 for r in rates[5:])
    assert (out_dir / "logs" / "tb").is_dir()
    assert sorted(p.name for p in (out_dir / "checkpoints").glob("step-*")) == [
        "step-00000015", "step-00000020", "step-00000025"]  # keep_last=3
    # The export loads and generates with transformers alone, without gptforge on the path.
    script = ("import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer;"
              f"d={str(out_dir / 'model')!r}; m=AutoModelForCausalLM.from_pretrained(d);"
              "t=AutoTokenizer.from_pretrained(d);"
              "ids=t('What is 2 plus 3?', return_tensors='pt').input_ids;"
              "out=m.generate(ids, max_new_tokens=5, do_sample=False);"
              "assert out.shape[1] > ids.shape[1]; assert 'gptforge' not in sys.modules;"
              "assert m.generation_config.eos_token_id == [t.convert_tokens_to_ids('<|im_end|>'), t.eos_token_id];"
              "assert t.model_max_length == m.config.n_positions; print(t.decode(out[0]))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_zero3_under_the_deepspeed_launcher_gives_the_loss_curve_of_zero2(zero2, tokenized, tmp_path):
    """Built partitioned, trained partitioned: the curve of ZeRO-2 (ZeRO-0 against ZeRO-3: bench/zero3.py); its two
    processes started by the deepspeed launcher (its own log lines: the world it was given, each rank it spawned
    with DeepSpeed's --local_rank), the engine reporting ZeRO-3."""
    manifest, out_dir, out = pretrain(tokenized, tmp_path, "distributed.zero_stage=3",
                                      "distributed.launcher=deepspeed", "pretrain.save_every=100")
    assert manifest["world_size"] == 2 and manifest["metrics"]["global_step"] == 30
    assert re.search(r"\[launch\.py:\d+:main\] WORLD INFO DICT: \{'localhost': \[0, 1\]\}", out), out[-3000:]
    assert sorted(re.findall(r"\[launch\.py:\d+:main\] process \d+ spawned with command: \[.*'gptforge\.stages\."
                             r"pretrain', '--local_rank=(\d)'", out)) == ["0", "1"], out[-3000:]
    assert re.search(r"^\[pretrain\] .*, world 2, ZeRO-3, ", out, re.M), out[-3000:]  # the engine's own stage
    assert logged(out_dir, "loss") == pytest.approx(logged(zero2[1], "loss"), abs=2e-4)
    assert manifest["metrics"]["val_loss"] == pytest.approx(zero2[0]["metrics"]["val_loss"], abs=2e-4)


def test_compiled_model_under_accelerate_gives_the_same_loss_curve_and_export(zero2, tokenized, tmp_path):
    """torch.compile through DeepSpeed's engine, its two processes started by `accelerate launch`."""
    from safetensors import safe_open

    witness, seen = rank_witness(tmp_path)
    manifest, out_dir, out = pretrain(tokenized, tmp_path, "distributed.zero_stage=2", "pretrain.compile=true",
                                      "distributed.launcher=accelerate", "pretrain.save_every=100", witness)
    assert manifest["world_size"] == 2
    assert re.search(r"^\[pretrain\] .*, ZeRO-2, .*, torch\.compile", out, re.M), out[-3000:]  # the engine compiled
    ranks = witnessed(seen, "gptforge.stages.pretrain")
    assert sorted(ranks) == ["0", "1"], ranks
    for r in ranks.values():  # each rank started by torch elastic under accelerate's launch, told to use DeepSpeed
        assert r["parent"][1:3] == ["-m", "accelerate.commands.launch"], r
        assert r["env"]["ACCELERATE_USE_DEEPSPEED"] == "true" and r["env"]["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert logged(out_dir, "loss") == pytest.approx(logged(zero2[1], "loss"), abs=1e-3)
    assert manifest["metrics"]["val_loss"] == pytest.approx(zero2[0]["metrics"]["val_loss"], abs=1e-3)
    keys = [sorted(safe_open(d / "model" / "model.safetensors", "pt").keys()) for d in (out_dir, zero2[1])]
    assert keys[0] == keys[1]  # compiled in place: no "_orig_mod." in the exported names


@pytest.fixture(scope="module")
def killed(tokenized, tmp_path_factory) -> Path:
    """A root whose 2-process pretraining was SIGKILLed after its step-10 checkpoint (copied by each test below)."""
    root = tmp_path_factory.mktemp("killed")
    cfg, path = config(root, "distributed.zero_stage=2")
    tokenize_from(tokenized, cfg)
    kill_after_checkpoint(cfg, path, "pretrain", step=10)
    return root


def test_sigkill_then_rerun_matches_uninterrupted(zero2, killed, tmp_path):
    copy_store(killed, tmp_path, "tokenize", "pretrain")
    cfg, path = config(tmp_path, "distributed.zero_stage=2")
    manifest, out_dir, out = run_stage(cfg, path, "pretrain")
    assert "[pretrain] resumed from" in out
    assert manifest["metrics"]["val_loss"] == pytest.approx(zero2[0]["metrics"]["val_loss"], abs=1e-6)
    assert logged(out_dir, "loss") == pytest.approx(logged(zero2[1], "loss"), abs=1e-6)


def test_killed_at_two_processes_resumed_at_one(zero2, killed, tmp_path):
    """Elastic resume: a 2-process run killed after its step-10 checkpoint, resumed with 1 process through
    DeepSpeed's universal checkpoint, ends on the uninterrupted 2-process run's loss curve (within 1e-3: the
    same data a step, only summed over micro-batches instead of processes)."""
    copy_store(killed, tmp_path, "tokenize", "pretrain")
    cfg, path = config(tmp_path, "distributed.zero_stage=2", "distributed.nproc_per_node=1")
    manifest, out_dir, out = run_stage(cfg, path, "pretrain")
    assert "(written by 2 processes, now 1)" in out and manifest["world_size"] == 1
    assert logged(out_dir, "loss") == pytest.approx(logged(zero2[1], "loss"), abs=1e-3)
    assert manifest["metrics"]["val_loss"] == pytest.approx(zero2[0]["metrics"]["val_loss"], abs=1e-3)


MUON = ["distributed.zero_stage=2", "pretrain.optimizer=muon", "pretrain.schedule=wsd", "pretrain.decay_fraction=0.4"]


def test_muon_with_wsd_killed_then_rerun_matches_uninterrupted(zero2, tokenized, tmp_path):
    """DeepSpeed's Muon on the hidden matrices (AdamW on GPT-2's embedding tables and its tied head, which
    DeepSpeed's own names would give to Muon) with warmup-stable-decay, 2 processes under ZeRO-2: the learning rate
    holds at muon_lr until the last 40% of the steps, then falls linearly to min_lr; SIGKILLed after its step-10
    checkpoint, the rerun ends on the uninterrupted run's loss curve (the momentum and the schedule restored); and
    Muon ends below AdamW's cosine run on the same data and steps."""
    from gptforge.model.train.engine import lr_factor

    manifest, out_dir, out = pretrain(tokenized, tmp_path / "full", *MUON)
    line = re.search(r"^\[pretrain\] Muon on (\d+) matrices \(([\d.]+)M parameters, lr 0.02\), AdamW on the rest "
                     r"\(([\d.]+)M, lr 0.002\)", out, re.M)
    assert line and int(line[1]) == 2 * 4, out[-3000:]  # each of the 2 layers' qkv, proj, fc and mlp proj
    assert float(line[3]) > 0.05  # wte (with the head tied to it), wpe, the norms and biases
    rate = 1e-4 / 2e-3  # min_lr / lr
    assert logged(out_dir, "lr") == pytest.approx([0.02 * lr_factor(s, 5, 30, rate, 0.4) for s in range(1, 31)])
    assert logged(out_dir, "lr")[17] == pytest.approx(0.02)  # step 18, the last of the stable phase
    assert manifest["metrics"]["val_loss"] < zero2[0]["metrics"]["val_loss"] - 0.1

    root = tmp_path / "killed"
    cfg, path = config(root, *MUON)
    tokenize_from(tokenized, cfg)
    kill_after_checkpoint(cfg, path, "pretrain", step=10)
    resumed, resumed_dir, out = run_stage(cfg, path, "pretrain")
    assert "[pretrain] resumed from" in out
    assert logged(resumed_dir, "loss") == pytest.approx(logged(out_dir, "loss"), abs=1e-6)
    assert resumed["metrics"]["val_loss"] == pytest.approx(manifest["metrics"]["val_loss"], abs=1e-6)


def test_invalid_checkpoints_are_skipped_with_a_warning(zero2, tmp_path, capsys):
    src = zero2[1] / "checkpoints"
    for name in ("step-00000015", "step-00000020", "step-00000025"):
        shutil.copytree(src / name, tmp_path / name)
    model_file = next(p for p in (tmp_path / "step-00000025").rglob("*model_states.pt"))
    model_file.write_bytes(model_file.read_bytes()[:100])  # truncated
    (tmp_path / "step-00000020" / "complete.json").unlink()  # never marked complete
    assert newest_valid_checkpoint(tmp_path) == tmp_path / "step-00000015"
    rng = tmp_path / "step-00000015" / "rng-rank0.pt"
    rng.write_bytes(rng.read_bytes()[:-1] + bytes([rng.read_bytes()[-1] ^ 1]))  # one bit, the same size
    assert newest_valid_checkpoint(tmp_path) is None
    err = capsys.readouterr().err
    for why in ("truncated", "not marked complete", "rng-rank0.pt changed since it was written (sha256 mismatch)"):
        assert why in err


class Payload:
    """What a pickle can do on load: here, create a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_a_pickle_planted_in_a_checkpoint_does_not_run(zero2, tmp_path):
    """A pickle payload in the newest checkpoint, its record forged to match: the resumed stage refuses the file
    with one error naming it, and the payload never runs (DeepSpeed itself asks torch.load for weights_only=False)."""
    import torch

    cfg, path = config(tmp_path, "distributed.zero_stage=2")
    copy_store(zero2[1].parents[2], tmp_path, "tokenize", "pretrain")  # zero2's output, its checkpoints ...
    out_dir = locate(cfg, "pretrain")[0]
    for done in ("manifest.json", "result.json"):  # ... as a run killed after its last checkpoint left them
        (out_dir / done).unlink()
    ckpt = newest_valid_checkpoint(out_dir / "checkpoints")
    target = next(ckpt.rglob("*optim_states.pt"))
    marker = tmp_path / "payload-ran"
    state = torch.load(target, weights_only=False)
    state["planted"] = Payload(marker)
    torch.save(state, target)
    record = json.loads((ckpt / "complete.json").read_text())
    record["files"][str(target.relative_to(ckpt))] = {"size": target.stat().st_size, "sha256": sha256_file(target)}
    (ckpt / "complete.json").write_text(json.dumps(record))
    with launch(cfg, path, "pretrain") as proc:
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0 and not marker.exists()
    assert f"error: {target}: refused to load, it holds more than tensors and plain data" in out, out[-3000:]


def test_shards_from_another_tokenizer_are_a_clear_error(zero2, tmp_path):
    tok_out = next((zero2[1].parents[1] / "tokenize").iterdir())
    shards = tmp_path / "shards"
    shutil.copytree(tok_out / "shards", shards)
    index = json.loads((shards / "index.json").read_text())
    index["vocab_size"] = 50257
    (shards / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="were not made by the tokenizer"):
        load_data(tok_out / "tokenizer", shards)


def test_two_local_nodes_give_the_output_of_one_node_with_two_processes(zero2, tokenized, tmp_path):
    """2 "nodes" x 1 process on this host (torchrun agents meeting through the c10d rendezvous, as across real
    nodes): one output, the same loss curve as 1 node x 2 processes; each rank started by torch's elastic agent."""
    witness, seen = rank_witness(tmp_path)
    manifest, out_dir, out = pretrain(tokenized, tmp_path, "distributed.zero_stage=2", "distributed.launcher=torchrun",
                                      "distributed.nnodes=2", "distributed.nproc_per_node=1", "pretrain.save_every=100",
                                      witness)
    assert manifest["world_size"] == 2 and "[node 0]" in out and "[node 1]" in out
    ranks = witnessed(seen, "gptforge.stages.pretrain")
    assert sorted(ranks) == ["0", "1"], ranks
    for r in ranks.values():  # torchrun's agent, one a node, both in the stage's rendezvous
        assert r["parent"][1:3] == ["-m", "torch.distributed.run"] and "--nnodes=2" in r["parent"], r
        assert r["env"]["TORCHELASTIC_RUN_ID"].startswith("pretrain-"), r
    assert logged(out_dir, "loss") == pytest.approx(logged(zero2[1], "loss"), abs=2e-4)
    assert manifest["metrics"]["val_loss"] == pytest.approx(zero2[0]["metrics"]["val_loss"], abs=2e-4)


def test_out_of_memory_at_start_up_names_the_settings_to_change(tokenized, tmp_path):
    """The allocator failing in the first step (simulated: the CPU allocator's error from the model's
    forward) ends the stage with one message naming the ZeRO stage, offload and micro-batch settings."""
    from gptforge.pipeline.store import locate, read_manifest
    from gptforge.stages.entry import stage_args

    cfg, path = config(tmp_path, "distributed.nproc_per_node=1", "pretrain.global_batch_size=16")
    tokenize_from(tokenized, cfg)
    out_dir, _, inputs = locate(cfg, "pretrain")
    script = tmp_path / "oom.py"
    script.write_text(
        "import sys, runpy\n"
        "from transformers import GPT2LMHeadModel\n"
        "def forward(self, *a, **k):\n"
        "    raise RuntimeError('[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can\\'t allocate memory: '\n"
        "                       'you tried to allocate 68719476736 bytes')\n"
        "GPT2LMHeadModel.forward = forward\n"
        "runpy.run_module('gptforge.stages.pretrain', run_name='__main__')\n")
    args = stage_args(path, out_dir, {"tokenize": inputs["tokenize"][0]})
    proc = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    error = [line.split("error: ", 1)[1] for line in proc.stderr.splitlines() if "error: " in line]  # after tqdm's \r
    assert len(error) == 1, proc.stderr[-3000:]
    for key in ("out of memory at start-up", "distributed.zero_stage=2", "distributed.offload_optimizer=False",
                "pretrain.micro_batch_size=", "distributed.activation_checkpointing"):
        assert key in error[0], error[0]
    assert "Traceback" not in proc.stderr
    assert read_manifest(out_dir) is None and not (out_dir / "result.json").exists()  # nothing marked complete


def test_too_little_data_is_an_error_before_training(tmp_path):
    """A corpus whose val split holds fewer windows than one micro-step: one error line naming the numbers and
    the keys to change, exit code 1, before any engine starts."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"a short document number {i}\n" for i in range(200)))
    cfg, path = config(tmp_path, f"data.pretrain={corpus}", "distributed.nproc_per_node=1")
    tokenize_in_process(cfg)
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "stage", "pretrain", "-c", str(path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert re.match(r"error: the val split holds \d+ tokens: \d+ windows of pretrain.seq_len=64, fewer than one "
                    r"micro-step of pretrain.micro_batch_size=8 x 1 processes", error), error
    keys = ("tokenizer.val_fraction", "pretrain.seq_len", "pretrain.micro_batch_size", "distributed.nproc_per_node")
    assert all(key in error for key in keys), error
    assert "Traceback" not in proc.stderr and "deepspeed.initialize" not in proc.stderr
