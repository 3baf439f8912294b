"""Rollouts apart from training (preference.rollout, gptforge.model.sampling.workers): our PPO on 2 processes with a
rollout worker, a Ray actor, sampling while the trainer trains. At max_staleness 0 it samples and trains exactly
what the in-process (sync) run does; at 1 each batch is one update old, and a run killed after a checkpoint
resumes to the uninterrupted result."""

import json
import math
import os
import subprocess
import time

import pytest
from safetensors.torch import load_file

from gptforge.model.train.metrics import MEASURED
from tests.conftest import PPO, once, shared_dir
from tests.helpers import kill_after_checkpoint, launch, logged, prepared, run_stage

pytestmark = pytest.mark.slow

ASYNC = [*PPO, "preference.rollout.mode=async"]


@pytest.fixture(scope="module")
def stale(chain, tmp_path_factory):
    """PPO with one rollout worker at max_staleness 1: (manifest, out_dir, output, cfg, path)."""
    def build():
        cfg, path = prepared(chain, shared_dir(tmp_path_factory, "ppo-async"), *ASYNC,
                             "preference.rollout.max_staleness=1")
        return (*run_stage(cfg, path, "ppo"), cfg, path)

    return once(tmp_path_factory, "ppo-async", build)


def weights(out_dir):
    return load_file(out_dir / "model" / "model.safetensors")


def spans(out_dir):
    return [json.loads(line) for line in (out_dir / "logs" / "timeline.jsonl").read_text().splitlines()]


def test_async_at_staleness_0_samples_and_trains_exactly_what_sync_does(chain, ppo, tmp_path):
    cfg, path = prepared(chain, tmp_path, *ASYNC, "preference.rollout.max_staleness=0")
    _, out_dir, _ = run_stage(cfg, path, "ppo")
    for key in ("reward_mean", "reward_std", "policy_loss", "value_loss", "kl", "response_length"):
        assert logged(out_dir, key) == logged(ppo[1], key), key  # the same samples, the same updates: bit for bit
    sync, moved = weights(ppo[1]), weights(out_dir)
    assert all((sync[k] == moved[k]).all() for k in sync)
    assert logged(out_dir, "rollout/staleness") == [0] * 6
    assert logged(out_dir, "rollout/version") == [0, 1, 2, 3, 4, 5]
    generated = [s for s in spans(out_dir) if s["what"] == "generate"]
    assert {s["who"] for s in generated} == {"worker-0"} and len(generated) == 6  # sampled by the worker alone
    assert {s["who"] for s in spans(ppo[1]) if s["what"] == "generate"} == {"trainer"}


def test_async_at_staleness_1_trains_each_batch_one_update_old_and_measures_the_mismatch(stale, ppo):
    _, out_dir, _, _, _ = stale
    assert logged(out_dir, "rollout/staleness") == [0, 1, 1, 1, 1, 1]  # the first batch: the SFT weights, fresh
    assert logged(out_dir, "rollout/version") == [0, 0, 1, 2, 3, 4]
    kl = logged(out_dir, "mismatch/kl")
    assert kl[0] == 0 and all(k > 0 for k in kl[1:])  # stale samples: the trainer's policy moved since
    assert all(k == 0 for k in logged(ppo[1], "mismatch/kl"))  # sync: the same module sampled and scored
    # batch n+1 was sampled while step n trained: the worker's span starts before the trainer's train span ends
    s = spans(out_dir)
    train = {x["step"]: x for x in s if x["what"] == "train"}
    ahead = [x for x in s if x["what"] == "generate" and x["step"] > 1]
    assert ahead and all(x["start"] < train[x["step"] - 1]["end"] for x in ahead)


def test_an_async_run_killed_after_its_checkpoint_resumes_to_the_uninterrupted_result(chain, stale, tmp_path):
    """SIGKILL after step 4's checkpoint, which kept the batch in flight (step 5's, sampled with version 3):
    the rerun trains on it and ends on the uninterrupted run's metrics and weights. The Ray actor, in a process
    group of its own, ends with the raylet: nothing of the killed stage's session is left."""
    manifest, done, _, _, _ = stale
    cfg, path = prepared(chain, tmp_path, *ASYNC, "preference.rollout.max_staleness=1")
    sessions = []
    killed = kill_after_checkpoint(cfg, path, "ppo", 4, sessions)
    deadline = time.time() + 30
    while session_alive(sessions[0]) and time.time() < deadline:
        time.sleep(0.5)
    assert not session_alive(sessions[0])
    assert (killed / "checkpoints" / "step-00000004" / "state-rank1.pt").is_file()
    again, out_dir, out = run_stage(cfg, path, "ppo")
    assert f"[ppo] resumed from {killed / 'checkpoints' / 'step-00000004'}" in out
    for key, value in manifest["metrics"].items():
        if key not in MEASURED:
            assert again["metrics"][key] == pytest.approx(value, abs=1e-6), key
    for key in ("reward_mean", "policy_loss", "rollout/staleness", "rollout/version"):
        assert logged(out_dir, key) == pytest.approx(logged(done, key)[-len(logged(out_dir, key)):], abs=1e-6), key
    a, b = weights(done), weights(out_dir)
    assert all((a[k] - b[k]).abs().max() < 1e-6 for k in a)


def session_alive(sid: int) -> bool:
    out = subprocess.run(["ps", "-eo", "sid="], capture_output=True, text=True).stdout.split()
    return str(sid) in out


def test_async_rollouts_run_the_users_environment_in_the_worker(chain, tmp_path, monkeypatch):
    """The user's environment (from the working folder) is reset and rewarded inside the rollout worker; its
    episodes, stale by one update, come back with its get_reward()."""
    from tests.stages.test_agents import episodes_of, ledger_reward, run_with_ledger

    _, _, out_dir = run_with_ledger(chain, tmp_path, monkeypatch, "ppo", *ASYNC, "preference.rollout.max_staleness=1")
    assert logged(out_dir, "rollout/staleness") == [0, 1]
    for e in episodes_of(out_dir, 2):
        asked = e["messages"][0]["content"]
        assert asked.endswith(" (ledger open)") and e["rewards"]["environment"] == pytest.approx(ledger_reward(asked))


NOISY = '''
from transformers import AutoTokenizer

from gptforge.model.sampling.engine import HFEngine


class Noisy(HFEngine):
    """transformers' generate, each sampled token's log-probability reported 0.3 nats under the model's (as another
    kernel's would differ)."""

    def __init__(self, model_dir):
        loaded = HFEngine.load(model_dir, AutoTokenizer.from_pretrained(model_dir).pad_token_id)
        super().__init__(loaded.model, loaded.pad_id)

    def generate(self, *args, **kwargs):
        turns = super().generate(*args, **kwargs)
        for t in turns:
            t.logprobs = [x - self.offset() for x in t.logprobs]
        return turns

    def offset(self):
        return 0.3


class NoisyLater(Noisy):
    """Noisy from the third weights it is sent on (the weights after the second update)."""

    loads = 0

    def load_weights(self, named):
        self.loads += 1
        super().load_weights(named)

    def offset(self):
        return 0.3 if self.loads >= 3 else 0.0
'''


def with_noisy_engine(chain, tmp_path, monkeypatch, *overrides):
    """The engine from the working folder (run_stage's), or from PYTHONPATH (a `launch`ed stage runs in the
    repository)."""
    (tmp_path / "noisy_engine.py").write_text(NOISY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    return prepared(chain, tmp_path / "run", *PPO, "preference.rollout.engine=noisy_engine:Noisy", *overrides)


def test_a_users_engine_samples_in_a_worker_and_tis_caps_its_mismatch(chain, ppo, tmp_path, monkeypatch):
    """Sync mode with an engine on the seam: it runs in a rollout worker at staleness 0, samples what hf does, and
    its log-probabilities, 0.3 nats off the trainer's on every token, are measured and capped."""
    cfg, path = with_noisy_engine(chain, tmp_path, monkeypatch, "preference.rollout.correction=tis",
                                  "preference.rollout.tis_cap=1.2", "preference.max_steps=2")
    _, out_dir, _ = run_stage(cfg, path, "ppo")
    assert logged(out_dir, "reward_mean")[0] == logged(ppo[1], "reward_mean")[0]  # hf's samples, in the worker
    assert logged(out_dir, "mismatch/logp_abs_diff") == pytest.approx([0.3, 0.3], abs=1e-5)
    assert logged(out_dir, "mismatch/kl") == pytest.approx([math.exp(0.3) - 1.3] * 2, abs=1e-5)
    assert logged(out_dir, "mismatch/capped") == [1.0, 1.0]  # e^0.3 = 1.35 > 1.2 on every token
    assert logged(out_dir, "rollout/staleness") == [0, 0]


def test_a_mismatch_past_max_mismatch_is_a_bad_step_skipped_then_rolled_back(chain, tmp_path, monkeypatch):
    """Steps 1-2 sample with no mismatch and step 2 is checkpointed; from the third weights on the engine is 0.05
    nats of KL a token off: step 3 is skipped twice, the stage rolls back to step 2, and then stops."""
    cfg, path = with_noisy_engine(chain, tmp_path, monkeypatch, "preference.rollout.engine=noisy_engine:NoisyLater",
                                  "preference.rollout.max_mismatch=0.04", "preference.max_bad_steps=2",
                                  "preference.max_rollbacks=1")
    with launch(cfg, path, "ppo") as proc:
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    said = "the rollouts' mismatch, KL 0.04986 a token, is over preference.rollout.max_mismatch (0.04)"
    assert f"[ppo] step 3: {said}; step skipped (1 bad, 1 in a row)" in out, out[-3000:]
    assert "step 1:" not in out and "step 2:" not in out
    assert "rolling back to" in out and "step-00000002" in out
    assert f"error: ppo: step 3: {said}, 2 bad steps in a row (preference.max_bad_steps=2) after 1 rollback(s)" in out


def test_under_zero3_the_weights_reach_the_worker_gathered_and_exact(chain, tmp_path):
    """ZeRO-3 partitions the policy over both processes; each update's weights reach the worker one gathered
    parameter at a time, so that at staleness 0 the worker samples with exactly the trainer's policy: the
    log-probabilities it kept equal the trainer's at every step."""
    cfg, path = prepared(chain, tmp_path, *ASYNC, "distributed.zero_stage=3", "preference.rollout.max_staleness=0",
                         "preference.max_steps=4")
    _, out_dir, _ = run_stage(cfg, path, "ppo")
    assert logged(out_dir, "rollout/version") == [0, 1, 2, 3]
    assert logged(out_dir, "mismatch/logp_abs_diff") == pytest.approx([0.0] * 4, abs=1e-6)
