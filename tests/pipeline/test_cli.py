import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY


def test_config_errors_exit_2_before_anything_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(TINY).read_text() + "\nfoo: 1\n")
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c", str(bad),
                           "--set", f"run.root={tmp_path / 'runs'}"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert "unknown key foo" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("overrides,line", [
    (["model.pretrained=org/missing", "pretrain.enabled=false"],
     "error: model.pretrained='org/missing': revision main is not in the hub cache {cache} and HF_HUB_OFFLINE is set "
     "(no copy of this model at all)"),
    (["model.pretrained={model}", "pretrain.enabled=false", "sft.lora.r=8", "sft.lora.target_modules=[q_proj,c_fc]"],
     "error: sft.lora.target_modules: c_fc match no module of the model; its linear modules are down_proj, "
     "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"),
    (["model.pretrained={model}", "pretrain.enabled=false", "preference.reward_model={model}"],
     "error: preference.reward_model='{model}' is not a sequence classifier (architectures: ['LlamaForCausalLM']); "
     "a reward model scores a sequence: give an AutoModelForSequenceClassification checkpoint"),
    (["model.pretrained={model}", "pretrain.enabled=false", "model.sliding_window=1000"],
     "error: model.sliding_window=1000 is larger than the context (256 positions)"),
    (["model.pretrained={model}", "pretrain.enabled=false", "model.rope={{type: llama3, factor: 8}}"],
     "error: invalid config {tiny}: model.rope: RoPE type llama3 needs "
     "original_max_position_embeddings, low_freq_factor, high_freq_factor"),
    (["model.pretrained={model}", "pretrain.enabled=false", "distributed.nproc_per_node=3",
      "distributed.sequence_parallel=3", "sft.micro_batch_size=1", "sft.global_batch_size=3", "sft.max_length=96",
      "reward.micro_batch_size=1", "reward.global_batch_size=3", "preference.micro_batch_size=1",
      "preference.global_batch_size=3"],
     "error: distributed.sequence_parallel=3 does not divide the model's 4 attention heads"),
    pytest.param(["model.attention=flash_attention_2"],
                 "error: model.attention=flash_attention_2 needs a GPU, and there is none here; use sdpa (or auto)",
                 marks=pytest.mark.gpu),
])
def test_a_model_that_cannot_be_used_is_one_line_before_anything_starts(tmp_path, overrides, line):
    from tests import hub_models

    if "flash" in line and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    model = hub_models.save_model("llama3", tmp_path / "llama3")
    cache = tmp_path / "hub"
    overrides = [o.format(model=model) for o in overrides]
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c", str(TINY), "--set",
                           f"run.root={tmp_path / 'r'}",
                           *[a for o in overrides for a in ("--set", o)]], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode in (1, 2) and proc.stderr.strip().splitlines()[-1] == line.format(cache=cache, model=model,
                                                                                                 tiny=TINY)
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


def test_unknown_stage_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "stage", "pretrian", "-c", str(TINY)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: unknown stage 'pretrian'") and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_failed_stage_ends_the_run_with_its_own_error_line(tmp_path):
    """`gptforge run` whose pretrain stage finds too little data: no framework traceback, and the last line is the
    stage's own error, once (its two ranks' lines ran together into one when each printed the text and the newline
    apart)."""
    from tests.helpers import config

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"a short document number {i}\n" for i in range(200)))
    _, path = config(tmp_path, f"data.pretrain={corpus}", "sft.enabled=false", "reward.enabled=false",
                     "preference.enabled=false")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c", str(path)], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stage pretrain failed: the val split holds") and "pretrain.seq_len" in last, last
    assert last.count("error: ") == 1, last  # both ranks say it, each its own whole line


def test_a_stage_started_with_fewer_processes_than_its_config_asks_for(tmp_path):
    """`gptforge stage` run as one process with distributed asking for two: an error before anything starts,
    not two "nodes" training separately into one folder."""
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "stage", "pretrain", "-c", str(TINY),
                           "--set", f"run.root={tmp_path}"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: distributed asks for 2 processes (nproc_per_node=2 x nnodes=1) but this "
                                  "`gptforge stage` runs as 1")


def test_generate_stops_at_the_models_own_stop_token_and_a_chat_prints_the_reply_alone(tmp_path, capsys):
    """`gptforge generate` on a Llama 3-style model (it has a chat template) that always says end of text: asked as
    a user by default, the reply is empty (it stopped at that stop token of its generation_config, which its
    template never shows) and nothing of the templated prompt is printed; with --raw the prompt is continued as
    text and printed before the continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptforge.pipeline.cli import main
    from tests import hub_models

    d = hub_models.save_model("llama3", tmp_path / "m")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(d), AutoTokenizer.from_pretrained(d)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("<|end_of_text|>")] = 1.0
    model.save_pretrained(d)
    for chat in ([], ["--chat"]):
        assert main(["generate", str(d), "--prompt", "What is 3 plus 5?", *chat, "--max-new-tokens", "4"]) == 0
        out = capsys.readouterr().out  # (a first import of DeepSpeed may print a line of its own before)
        assert out.splitlines()[-1] == "" and "What is" not in out and "header" not in out
    assert main(["generate", str(d), "--prompt", "What is 3 plus 5?", "--raw", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "What is 3 plus 5?"


@pytest.mark.parametrize("overrides,line", [
    (["run.work_pools={pretrain: gpu}"],
     "error: run.work_pools needs a Prefect server: set PREFECT_API_URL (with the ephemeral server of a plain "
     "`gptforge run`, no worker could run a stage and nobody could approve one)"),
    (["run.approve_before=[dpo]"], "error: run.approve_before needs a Prefect server: set PREFECT_API_URL"),
    (["run.approve_before=[dop]"], "error: run.approve_before names 'dop', which is not a stage of this pipeline; "
                                   "did you mean 'dpo'?"),
    (["run.work_pools={eval-spt: gpu}"], "error: run.work_pools names 'eval-spt', which is not a stage of this "
                                         "pipeline; did you mean 'eval-sft'?"),
])
def test_team_settings_without_a_server_or_with_a_stage_misspelt_are_one_line(tmp_path, overrides, line):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c", str(TINY), "--set",
                           f"run.root={tmp_path / 'r'}", *[a for o in overrides for a in ("--set", o)]],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("overrides,line", [
    (["data.sft=/nonexistent/chat.jsonl"], "error: data.sft: file not found: /nonexistent/chat.jsonl"),
    (["preference.algorithm=grpo", "data.prompts=/nonexistent/gsm.jsonl"],
     "error: data.prompts: file not found: /nonexistent/gsm.jsonl"),
    (["preference.algorithm=grpo", "preference.rewards=[{name: 'nosuchmodule:fn', weight: 1.0}]"],
     "error: preference.rewards[0]: cannot import module 'nosuchmodule' for 'nosuchmodule:fn' (ModuleNotFoundError: "
     "No module named 'nosuchmodule'); it must be importable from the working folder ({cwd}) or an installed package"),
])
def test_a_missing_data_file_or_reward_function_of_a_later_stage_is_one_line_before_any_stage(tmp_path, overrides,
                                                                                               line):
    """Bad inputs of SFT and GRPO, found by the preflight (gptforge.pipeline.preflight) on a fresh root: before
    tokenize and pretrain, not after them."""
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c", str(TINY), "--set",
                           f"run.root={tmp_path / 'r'}", *[a for o in overrides for a in ("--set", o)]],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == line.format(cwd=tmp_path), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r" / "store" / "tokenize").exists()
    assert not list((tmp_path / "r").glob("*/run.json"))  # no run began


def test_a_reward_server_that_does_not_answer_is_a_warning_and_a_user_function_is_imported(tmp_path, monkeypatch):
    from gptforge.core.config import load_config
    from gptforge.pipeline.preflight import preflight
    from tests.helpers import free_port

    (tmp_path / "myrewards.py").write_text("def short(prompts, responses, answers, **_):\n"
                                           "    return [-float(len(r)) for r in responses]\n")
    monkeypatch.chdir(tmp_path)
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    cfg = load_config(TINY, [f"run.root={tmp_path / 'r'}", "preference.algorithm=grpo",
                             f"preference.rewards=[{{name: 'myrewards:short', weight: 1.0}}, {{url: '{url}'}}]"])
    lines = []
    preflight(cfg, log=lines.append)
    assert len(lines) == 1 and lines[0].startswith(f"warning: preference.rewards[1]: the reward server {url} does "
                                                   "not answer (") and "try it 3 time(s)" in lines[0], lines
    assert not (tmp_path / "r" / "store" / "tokenize").exists()


def test_status_reads_the_runs_under_the_configs_run_root(tmp_path, capsys, monkeypatch):
    """`gptforge status -c CONFIG` lists the runs under the config's run.root (a team's shared folder), newest last,
    then the newest in full; --root overrides it; the default `runs` of the working folder holds none here."""
    import json

    from gptforge.pipeline.cli import main

    root = tmp_path / "shared" / "runs"
    for name, status in (("nightly-1", "complete"), ("nightly-2", "failed")):
        (root / name).mkdir(parents=True)
        (root / name / "run.json").write_text(json.dumps({"name": name, "created_at": "2026-12-06", "stages": {
            "tokenize": {"status": "complete", "action": "reused", "output": "/o/t", "metrics": {"tokens": 7}},
            "pretrain": {"status": status, "action": "computed", "output": "/o/p", "metrics": {}}}}))
        time.sleep(0.01)  # (newest last: by modification time)
    monkeypatch.chdir(tmp_path)
    assert main(["status", "--set", f"run.root={root}", "-c", str(TINY)]) == 0
    out = capsys.readouterr().out
    assert out.index("nightly-1") < out.index("nightly-2") and "1 complete, 1 failed" in out
    assert f"run nightly-2 ({root / 'nightly-2' / 'run.json'})" in out
    assert main(["status", "nightly-1", "--root", str(root)]) == 0 and "run nightly-1" in capsys.readouterr().out
    assert main(["status"]) == 1 and "error: no runs under runs/" in capsys.readouterr().err
