"""The distill stage end to end on the session's chain: the SFT model (the student) learns toward the session's PPO
policy (the teacher, named by its directory) on its own samples of the demo's prompts, in 2 processes under ZeRO-2;
a SIGKILL after its step-2 checkpoint, then a rerun, ends where the uninterrupted run ended; its evaluation compares
the student with where it started and with its teacher. Learning (the direction, over seeds in bench/distill.py):
tests/stages/test_rlvr.py."""

import json
from pathlib import Path

import pytest

from gptforge.core.registry import named_models
from gptforge.model.train.metrics import MEASURED, check_names
from gptforge.pipeline.store import locate, upstream
from tests.helpers import changed_from_sft, kill_after_checkpoint, logged, logged_names, prepared, run_stage

pytestmark = pytest.mark.slow


def distill(ppo) -> list[str]:
    return ["distill.enabled=true", f"distill.teacher={ppo[1] / 'model'}", "distributed.zero_stage=2",
            "distill.max_steps=4", "distill.save_every=2", "distill.global_batch_size=8", "distill.micro_batch_size=2",
            "distill.lr=1e-4", "distill.warmup_steps=0", "distill.log_every=1", "eval.items=16"]


def test_distill_resumes_after_sigkill_and_is_evaluated_against_its_start_and_its_teacher(chain, ppo, tmp_path):
    cfg, path = prepared(chain, tmp_path / "whole", *distill(ppo))
    assert upstream(cfg, "distill") == ("sft",)  # the teacher is a directory: named, fingerprinted by its files
    assert named_models(cfg, "distill") == {"distill.teacher": (str(ppo[1] / "model"), None)}
    manifest, out_dir, _ = run_stage(cfg, path, "distill")
    m = manifest["metrics"]
    assert m["global_step"] == 4 and m["bad_steps"] == 0
    for key in ("loss", "distill_kl", "teacher_logp", "student_logp", "tokens_per_sec", "response_length",
                "gen_tokens_per_sec", "lr", "grad_norm"):
        assert len(logged(out_dir, key)) == 4, key
    check_names(dict.fromkeys(logged_names(out_dir)))
    # beta 1: the loss is the reverse KL itself (the student learning toward its teacher: test_rlvr, bench/distill.py)
    assert logged(out_dir, "loss") == pytest.approx(logged(out_dir, "distill_kl"), rel=1e-5)
    # the first step's samples: each token's teacher log-probability is the teacher's (the PPO model's) of the
    # student's sampled token, and the student's is the SFT model's, whose samples they are (nothing updated yet)
    import torch
    from transformers import AutoModelForCausalLM

    rows = [json.loads(line) for line in (out_dir / "rollouts" / "step-00000001.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["ids"] for r in rows)  # rank 0's 4 of the step's 8 prompts
    for key, model_dir in (("teacher_logprobs", ppo[1] / "model"), ("student_logprobs", chain["sft"][1] / "model"),
                           ("logprobs", chain["sft"][1] / "model")):
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        for r in rows:
            seq = torch.tensor([r["prompt_ids"] + r["ids"]])
            with torch.no_grad():
                logp = torch.log_softmax(model(seq).logits[0, len(r["prompt_ids"]) - 1:-1].float(), -1)
            want = logp.gather(-1, torch.tensor(r["ids"])[:, None])[:, 0]
            assert r[key] == pytest.approx(want.tolist(), abs=2e-4), key
    assert any(r["teacher_logprobs"] != pytest.approx(r["student_logprobs"], abs=1e-3) for r in rows)
    assert changed_from_sft(chain, out_dir)
    from gptforge.pipeline.report import read_log, stage_panels

    panels = {title: unit for title, _, unit in stage_panels(read_log(out_dir), "distill")}  # the report's plot
    assert panels["loss"] == "divergence to the teacher (nats/token)"
    assert {"KL to the teacher", "log-probability of the samples"} <= panels.keys()

    # SIGKILLed once its step-2 checkpoint is complete, then rerun: the uninterrupted run's metrics and weights
    cfg2, path2 = prepared(chain, tmp_path / "killed", *distill(ppo))
    assert locate(cfg2, "distill")[0].name == out_dir.name
    killed = kill_after_checkpoint(cfg2, path2, "distill", 2)
    resumed, resumed_dir, out = run_stage(cfg2, path2, "distill")
    assert f"[distill] resumed from {killed / 'checkpoints' / 'step-00000002'}" in out
    for key, value in resumed["metrics"].items():
        if key not in MEASURED:
            assert value == pytest.approx(m[key], abs=1e-6), key
    assert logged(resumed_dir, "distill_kl") == pytest.approx(logged(out_dir, "distill_kl"), abs=1e-6)
    from safetensors.torch import load_file

    whole, again = load_file(out_dir / "model" / "model.safetensors"), load_file(resumed_dir / "model" /
                                                                                "model.safetensors")
    assert all(whole[k].allclose(again[k], atol=1e-6) for k in whole)

    # eval-distill: the student against where it started (the SFT model) and against its teacher
    report, eval_dir, _ = run_stage(cfg, path, "eval-distill")
    e = report["metrics"]
    for prefix in ("start_", "teacher_"):
        assert {f"{prefix}reward_mean", f"{prefix}exact_match"} <= e.keys()
    assert {"win_rate_vs_start", "win_rate_vs_teacher", "kl", "kl_teacher", "reward_mean"} <= e.keys()
    rows = [json.loads(line) for line in (eval_dir / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {"response", "start_response", "teacher_response"} <= rows[0].keys()
    assert e["teacher_reward_mean"] == pytest.approx(sum(r["teacher_score"] for r in rows) / 16, abs=1e-5)
    assert e["start_reward_mean"] == pytest.approx(sum(r["start_score"] for r in rows) / 16, abs=1e-5)


def big_student(model: Path, out: Path) -> Path:
    """A student of 7B parameters by its config (Llama-2-7B's shape) with `model`'s tokenizer: what the planner
    reads; its weights are never loaded."""
    import shutil

    config = json.loads((model / "config.json").read_text())
    config |= {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 32, "head_dim": 128}
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").write_bytes(b"")
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation")):
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("overrides,line", [
    (["distill.teacher={tmp}/nowhere"], "error: distill.teacher='{tmp}/nowhere': no such directory"),
    (["distill.teacher=grpo"],
     "error: distill.teacher=grpo: this run has no grpo stage (its stages: sft, dpo, distill); add it to the run "
     "(preference.algorithm, or grpo.enabled) or name a model (a hub name or a local directory)"),
    (["distill.teacher={model}", "distill.student={big}"], "error: distill.student={big} is larger than the layout "
     "allows: the planner (6.48B parameters): ZeRO-2 on 2 devices needs 71.6 GiB per device"),
    (["distill.teacher={qwen}"], "error: distill.teacher={qwen}: the teacher's tokenizer ({qwen}, 400 tokens) is not "
     "the student's ({model}, 400 tokens); on-policy distillation here compares their next-token distributions token "
     "for token, so they must share one vocabulary: give a teacher with the student's tokenizer (docs/distill.md)"),
    (["distill.teacher={model}", "distill.beta=1.5"],
     "error: invalid config {tiny}: distill.beta: Input should be less than or equal to 1 (got 1.5)"),
])
def test_bad_distill_inputs_are_one_line_before_anything_runs(tmp_path, overrides, line):
    """A teacher that does not exist, a teacher stage the run lacks, a student the planner says the layout cannot
    hold, a teacher with another tokenizer, beta outside [0, 1]: one error line naming the key, nothing run."""
    import os
    import subprocess
    import sys

    from tests import hub_models
    from tests.conftest import TINY

    model = hub_models.save_model("llama3", tmp_path / "llama3")
    names = {"tmp": tmp_path, "model": model, "tiny": TINY, "qwen": hub_models.save_model("qwen2", tmp_path / "qwen2"),
             "big": big_student(model, tmp_path / "big") if "{big}" in " ".join(overrides) else None}
    sets = ["model.pretrained={model}", "pretrain.enabled=false", "preference.rewards=[{{name: exact_match}}]",
            "distill.enabled=true", *overrides]
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c", str(TINY), "--set",
                           f"run.root={tmp_path / 'r'}", *[a for o in sets for a in ("--set", o.format(**names))]],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode in (1, 2) and last.startswith(line.format(**names)), last
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()
