"""Real 2-process SFT (ZeRO-3) on a tiny pretrained model: it learns the held-out conversations, exports a model
that loads without gptforge, resumes exactly from its step checkpoints, and reads every chat format."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from gptforge.model.train.metrics import MEASURED
from gptforge.pipeline.store import locate
from tests.helpers import config, copy_store, kill_after_checkpoint, logged, run_stage

pytestmark = pytest.mark.slow
ZEROS = ["distributed.zero_stage=3"]


def test_sft_trains_and_exports(chain):
    manifest, out_dir, _ = chain["sft"]
    m = manifest["metrics"]
    curve = logged(out_dir, "loss")
    assert curve[-1] < curve[0]
    assert m["val_loss"] < m["base_val_loss"] - 0.5  # held-out conversations, before and after
    assert m["tokens_per_sec"] > 0 and manifest["world_size"] == 2
    base = load_file(chain["pretrain"][1] / "model" / "model.safetensors")
    tuned = load_file(out_dir / "model" / "model.safetensors")
    # ZeRO-3 partitions consolidated into a whole model, its tied lm_head stored once (as the embedding)
    assert set(base) == set(tuned) and "lm_head.weight" not in tuned
    assert any(not torch.equal(base[k], tuned[k]) for k in base)


def test_killed_then_rerun_matches_uninterrupted(chain, tmp_path):
    """The session's SFT, SIGKILLed (its whole process group) once its step-10 checkpoint is complete: the rerun
    resumes there and ends on the uninterrupted run."""
    cfg, path = config(tmp_path, *ZEROS)
    copy_store(chain["root"], tmp_path, "tokenize", "pretrain")
    assert locate(cfg, "sft")[0].name == chain["sft"][1].name  # the session's run, fingerprint for fingerprint
    killed = kill_after_checkpoint(cfg, path, "sft", 10)
    manifest, out_dir, out = run_stage(cfg, path, "sft")
    assert f"[sft] resumed from {killed / 'checkpoints' / 'step-00000010'}" in out
    want = chain["sft"][0]["metrics"]
    for key, value in manifest["metrics"].items():
        if key not in MEASURED:
            assert value == pytest.approx(want[key], abs=1e-6), key
    assert logged(out_dir, "loss") == pytest.approx(logged(chain["sft"][1], "loss"), abs=1e-6)


def test_sft_with_muon_and_wsd_under_zero3(chain, tmp_path):
    """sft with `optimizer: muon` and `schedule: wsd`, 2 processes under ZeRO-3 (Muon's matrices orthogonalised in
    the optimizer's sub-groups): it reports Muon on the hidden matrices and AdamW on the rest, its learning rate
    holds, then decays, and it learns: its held-out loss falls as the session's does. (reward builds its engine the
    same way; what it leaves to AdamW, its `score` head: tests/model/test_engine.py.)"""
    cfg, path = config(tmp_path, *ZEROS, "sft.optimizer=muon", "sft.schedule=wsd", "sft.decay_fraction=0.5")
    copy_store(chain["root"], tmp_path, "tokenize", "pretrain")
    manifest, out_dir, out = run_stage(cfg, path, "sft")
    assert "[sft] Muon on 8 matrices" in out, out[-3000:]
    rates = logged(out_dir, "lr")
    assert rates[2:10] == [0.02] * 8 and rates[-1] < rates[10] < 0.02  # warmup 2, stable to step 10, decay
    curve = logged(out_dir, "loss")
    assert curve[-1] < curve[0], curve
    m = manifest["metrics"]
    assert m["val_loss"] < m["base_val_loss"] - 0.5


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_every_chat_format_through_sft(chain, tmp_path):
    data = tmp_path / "chat"
    data.mkdir()
    write_jsonl(data / "alpaca.jsonl", [{"instruction": f"What is {i} plus 1?", "input": "", "output": str(i + 1)}
                                        for i in range(12)] + [{"instruction": "no output"}])
    (data / "sharegpt.json").write_text(json.dumps([
        {"conversations": [{"from": "human", "value": f"Repeat {w}"}, {"from": "gpt", "value": f"{w} {w}"}]}
        for w in ("cat", "dog", "sun", "red", "blue", "tree", "fish", "bird")]
        + [{"conversations": [{"from": "human", "value": "only a question"}]}]))
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": f"Say {i}"},
                                           {"role": "assistant", "content": str(i)}] for i in range(8)]}),
                   data / "openai.parquet")
    cfg, path = config(tmp_path, *ZEROS, f"data.sft={data}", "sft.max_steps=4", "sft.save_every=100")
    copy_store(chain["root"], tmp_path, "tokenize", "pretrain")
    manifest, _, out = run_stage(cfg, path, "sft")
    m = manifest["metrics"]
    assert m["bad_rows"] == 1 and "alpaca.jsonl:13" in out  # the alpaca row without output
    assert m["skipped_no_assistant_turn"] == 1  # the ShareGPT conversation with no answer
    assert m["global_step"] == 4
