"""DPO with TRL under ZeRO-2 on 2 processes: the policy moves toward the chosen responses, its logs are in our
metric names, and a run SIGKILLed mid-stage reruns to the uninterrupted run, each step logged once."""

import json

import pytest
import torch

from gptforge.data import splits
from gptforge.model.sampling.generate import response_logprobs
from gptforge.model.train.metrics import NAMES
from gptforge.pipeline.store import locate
from tests.conftest import DPO
from tests.helpers import changed_from_sft, kill_after_checkpoint, logged_names, prepared, run_stage

pytestmark = pytest.mark.slow


def implicit_margin(policy_dir, sft_dir, pairs) -> float:
    """Mean over pairs of DPO's implicit reward margin, [log pi(c) - log ref(c)] - [log pi(r) - log ref(r)]."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_dir)
    prompts = [p["prompt"] for p in pairs]
    answer = {k: [tok(p[k] + "<|im_end|>\n", add_special_tokens=False)["input_ids"] for p in pairs]
              for k in ("chosen", "rejected")}
    logp = {(d, k): torch.tensor(response_logprobs(AutoModelForCausalLM.from_pretrained(d), tok, prompts, answer[k]))
            for d in (policy_dir, sft_dir) for k in answer}
    chosen = logp[policy_dir, "chosen"] - logp[sft_dir, "chosen"]
    margin = chosen - (logp[policy_dir, "rejected"] - logp[sft_dir, "rejected"])
    return margin.mean().item()


def test_dpo_raises_the_chosen_over_the_rejected(chain, dpo):
    manifest, out_dir, _, cfg, _ = dpo
    assert manifest["metrics"]["global_step"] == 6 and manifest["world_size"] == 2
    assert changed_from_sft(chain, out_dir)
    pairs = splits.preference_pairs(cfg.data).train[:48]
    assert implicit_margin(out_dir / "model", chain["sft"][1] / "model", pairs) > 0.05
    names = logged_names(out_dir)
    assert {"loss", "lr", "grad_norm", "train_reward_margin", "chosen_rewards"} <= names <= set(NAMES)
    assert not (out_dir / "model" / "training_args.bin").exists()  # no pickle in the model directory
    # tracked in MLflow (run.tracker): TRL's logs in our names, each step, and the final metrics
    from mlflow.tracking import MlflowClient

    from gptforge.model.train.tracking import tracking_uri

    client = MlflowClient(tracking_uri(cfg))
    run = client.search_runs([client.get_experiment_by_name(cfg.run.name).experiment_id],
                             filter_string="attributes.run_name = 'dpo'")[0]
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]
    assert history == [(r["step"], r["loss"]) for r in rows(out_dir) if "loss" in r]
    assert run.data.metrics["global_step"] == 6 and run.data.params["preference.algorithm"] == "dpo"


def test_a_sigkilled_dpo_skips_a_corrupt_checkpoint_and_reruns_to_the_uninterrupted_run(chain, dpo, tmp_path):
    """A DPO SIGKILLed (its whole process group) once its step-4 Trainer checkpoint is complete, with a file of that
    checkpoint then truncated: the rerun warns, resumes from the one before (step 2), finishes, and its log holds
    each step once, each loss that of the uninterrupted run."""
    cfg, path = prepared(chain, tmp_path, *DPO)
    assert locate(cfg, "dpo")[0].name == dpo[1].name  # the same fingerprint in another root
    killed = kill_after_checkpoint(cfg, path, "dpo", 4, trainer=True)
    assert {"checkpoint-2", "checkpoint-4"} <= {p.name for p in (killed / "checkpoints").glob("checkpoint-*")}
    optim = next((killed / "checkpoints" / "checkpoint-4").rglob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[:1000])
    manifest, out_dir, out = run_stage(cfg, path, "dpo")
    assert f"warning: skipping checkpoint {killed / 'checkpoints' / 'checkpoint-4'}: truncated" in out
    assert f"[dpo] resumed from {killed / 'checkpoints' / 'checkpoint-2'}" in out
    assert manifest["metrics"]["global_step"] == 6
    ours, theirs = ([r for r in rows(d) if "loss" in r] for d in (out_dir, dpo[1]))
    assert [r["step"] for r in ours] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in theirs], abs=1e-5)


def rows(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_two_local_nodes_train_dpo_as_one_node_with_two_processes(chain, dpo, tmp_path):
    """The TRL stage as 2 "nodes" x 1 process (an accelerate launch per node, machine ranks 0 and 1): each of its six
    steps' losses is that of 1 node x 2 processes. (No checkpoint: save_every past the run.)"""
    cfg, path = prepared(chain, tmp_path, *DPO, "distributed.launcher=torchrun", "distributed.nnodes=2",
                         "distributed.nproc_per_node=1", "preference.log_every=1", "preference.save_every=10")
    manifest, out_dir, out = run_stage(cfg, path, "dpo")
    assert manifest["world_size"] == 2 and "[node 1]" in out and manifest["metrics"]["global_step"] == 6
    ours, theirs = ([r for r in rows(d) if "loss" in r] for d in (out_dir, dpo[1]))
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in theirs], abs=1e-3)


def test_dpo_skips_bad_steps_and_rolls_back_through_its_callback(chain, tmp_path, monkeypatch):
    """Drills (model/train/guard.py) in a TRL stage: micro-batch 3's loss NaN on rank 1, 5th a spike (x10), 7th and 8th
    NaN. Steps 3 and 5 are skipped (no update, the schedule held), 7 and 8 roll back to checkpoint-6; the run
    ends at max_steps with finite weights."""
    from safetensors.torch import load_file

    cfg, path = prepared(chain, tmp_path, *DPO, "preference.max_steps=10", "preference.spike_factor=3",
                         "preference.spike_window=2", "preference.max_bad_steps=2")
    monkeypatch.setenv("GPTFORGE_FAULTS", "nan@3:1,spike@5:1,nan@7:1,nan@8:1")
    manifest, out_dir, out = run_stage(cfg, path, "dpo")
    m = manifest["metrics"]
    assert m["bad_steps"] == 4 and m["rollbacks"] == 1 and m["global_step"] == 10, "\n".join(
        line for line in out.splitlines() if "warning" in line or "step" in line)
    assert "[dpo] step 3: loss NaN/Inf on 1 of 2 rank(s); step skipped" in out
    assert "[dpo] step 5: loss " in out and "over spike_factor 3 x the median" in out
    assert "rolling back to" in out and "checkpoint-6" in out
    lr = {r["step"]: r["lr"] for r in rows(out_dir) if "lr" in r}
    assert lr[2] != lr[3] and lr[4] == lr[3]  # no scheduler step for the skipped step 3
    assert all(t.isfinite().all() for t in load_file(out_dir / "model" / "model.safetensors").values())
