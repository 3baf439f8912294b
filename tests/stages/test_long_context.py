"""Longer context through the stages: sequence parallelism and tiled logits in pretrain, SFT, DPO, GRPO, RLOO and PPO
against their plain runs. (YaRN's context extension: bench/yarn.py, run shrunk by tests/bench/.)"""

import shutil

import pytest

from tests.helpers import HALF_REWARD, config, copy_store, logged, prepared, run_stage, tokenize_from

SP = ["model.preset=llama-tiny", "pretrain.seq_len=128", "pretrain.max_steps=6", "pretrain.log_every=1",
      "pretrain.eval_every=6", "pretrain.save_every=100", "pretrain.micro_batch_size=4",
      "pretrain.global_batch_size=8", "pretrain.warmup_steps=2", "pretrain.grad_clip=0.5"]


def test_sequence_parallel_gives_the_data_parallel_loss_curve_and_gradients_under_zero3_and_zero2(tokenized, tmp_path):
    """2 gloo processes: sequence_parallel=2 (one data-parallel group, each rank half of every window) against
    sequence_parallel=1 (two data-parallel ranks) on the same windows; the ZeRO-3 run also tiles logits and MLPs."""
    runs = {}
    for name, extra in (("dp", ["distributed.zero_stage=3"]),
                        ("sp-zero3", ["distributed.zero_stage=3", "distributed.sequence_parallel=2",
                                      "distributed.tiling=true"]),
                        ("sp-zero2", ["distributed.zero_stage=2", "distributed.sequence_parallel=2"])):
        cfg, path = config(tmp_path / name, *SP, *extra)
        tokenize_from(tokenized, cfg)
        manifest, out_dir, out = run_stage(cfg, path, "pretrain")
        runs[name] = (manifest["metrics"], logged(out_dir, "loss"), logged(out_dir, "grad_norm"), out)
    assert "sequence parallel 2" in runs["sp-zero3"][3] and "logits in" in runs["sp-zero3"][3]
    dp_loss, dp_norm = runs["dp"][1], runs["dp"][2]
    assert dp_loss[-1] < dp_loss[0] - 0.3  # it learns
    for name in ("sp-zero3", "sp-zero2"):
        _, loss, norm, _ = runs[name]
        assert loss == pytest.approx(dp_loss, abs=2e-4), name
        assert norm == pytest.approx(dp_norm, rel=1e-3), name  # not sequence_parallel times too large
        assert runs[name][0]["val_loss"] == pytest.approx(runs["dp"][0]["val_loss"], abs=2e-4)


def test_sequence_parallel_sft_gives_the_data_parallel_loss_curve_and_gradients(chain, tmp_path):
    """SFT's rows (right-padded, different lengths, assistant-only targets) shared by 2 ranks: the group's token
    mean, under ZeRO-2 untiled and ZeRO-3 tiled, against the chain's 2-rank data-parallel SFT."""
    _, want_dir, _ = chain["sft"]
    want_loss, want_norm = logged(want_dir, "loss"), logged(want_dir, "grad_norm")
    for name, extra in (("zero2", ["distributed.zero_stage=2"]),
                        ("zero3-tiled", ["distributed.zero_stage=3", "distributed.tiling=true"])):
        cfg, path = config(tmp_path / name, "distributed.sequence_parallel=2", *extra)
        copy_store(chain["root"], tmp_path / name, "tokenize", "pretrain")  # SFT runs again: the same fingerprint
        manifest, out_dir, out = run_stage(cfg, path, "sft")
        assert "[sft] sequence parallel 2 (1 data-parallel)" in out
        assert ("logits in 1 tile(s)" in out) == (name == "zero2")
        assert logged(out_dir, "loss") == pytest.approx(want_loss, abs=2e-4), name
        assert logged(out_dir, "grad_norm") == pytest.approx(want_norm, rel=2e-3), name
        assert manifest["metrics"]["val_loss"] == pytest.approx(chain["sft"][0]["metrics"]["val_loss"], abs=2e-4)
        assert manifest["metrics"]["base_val_loss"] == pytest.approx(
            chain["sft"][0]["metrics"]["base_val_loss"], abs=2e-4)


def test_sequence_parallel_dpo_gives_the_data_parallel_loss_and_weights(chain, dpo, tmp_path):
    """TRL's DPO with each pair's rows shared by 2 ranks (its fused forward sharded, the slices' log-probabilities
    joined) against the 2-rank data-parallel DPO of the same pairs: under ZeRO-3 from the start, the same loss,
    gradient norms (not 2x) and exported weights; under ZeRO-2 resumed from the data-parallel run's step-4
    checkpoint, the same last two steps and weights (the batches it skips are the ones that run took)."""

    from safetensors.torch import load_file

    from gptforge.pipeline.store import locate
    from tests.conftest import DPO

    want = load_file(dpo[1] / "model" / "model.safetensors")
    for stage in (3, 2):
        cfg, path = prepared(chain, tmp_path / f"zero{stage}", *DPO, f"distributed.zero_stage={stage}",
                             "distributed.sequence_parallel=2", "run.tracker=none")
        if stage == 2:  # the same fingerprint: sequence parallelism and ZeRO do not change a stage's result
            shutil.copytree(dpo[1], locate(cfg, "dpo")[0], ignore=shutil.ignore_patterns(
                "manifest.json", "result.json", "model", "checkpoint-6"))
        manifest, out_dir, out = run_stage(cfg, path, "dpo")
        assert "[dpo] sequence parallel 2 (1 data-parallel)" in out
        assert ("resumed from" in out and "checkpoint-4" in out) == (stage == 2)
        norms, want_norms = logged(out_dir, "grad_norm"), logged(dpo[1], "grad_norm")
        assert len(norms) == 6 and norms == pytest.approx(want_norms, rel=2e-3), stage
        if stage == 3:
            assert manifest["metrics"]["train_loss"] == pytest.approx(dpo[0]["metrics"]["train_loss"], abs=2e-4)
        got = load_file(out_dir / "model" / "model.safetensors")
        assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-4, stage


DYNAMIC = [  # a user's reward that is 0 for every response to half the prompts: groups to replace (test_grpo.py)
    "preference.rewards=[{name: 'my_rewards:half'}]", "preference.grpo.dynamic_sampling=true",
    "preference.grpo.max_draws=4"]


@pytest.mark.parametrize("algorithm,zero", [("grpo", 2), ("rloo", 3)])
def test_sequence_parallel_grpo_and_rloo_give_the_data_parallel_updates(chain, tmp_path, monkeypatch, algorithm,
                                                                         zero):
    """GRPO (ZeRO-2) and RLOO (ZeRO-3) on 2 ranks that share every rollout (sequence parallel 2: one data-parallel
    group) against the same stage on 1 rank: the same prompts, completions (sampled once a group), rewards,
    advantages, loss and gradient norm at every update. GRPO's with dynamic sampling: the ranks of the group draw
    the same new prompts and replace the same groups (RLOO's rewards are the reward model's, on whole sequences)."""
    (tmp_path / "my_rewards.py").write_text(HALF_REWARD)
    monkeypatch.chdir(tmp_path)  # the launched stages import the reward from the user's working folder
    settings = [f"preference.algorithm={algorithm}", "distributed.zero_stage=2", "preference.max_steps=2",
                "preference.log_every=1", "preference.save_every=100", "preference.global_batch_size=8",
                "preference.micro_batch_size=2", f"preference.{algorithm}.ptx_coef=0",
                *(DYNAMIC if algorithm == "grpo" else [])]
    runs = {}
    for name, extra in (("one", ["distributed.nproc_per_node=1"]),
                        ("sp", ["distributed.sequence_parallel=2", f"distributed.zero_stage={zero}"])):
        cfg, path = prepared(chain, tmp_path / name, *settings, *extra)
        manifest, out_dir, out = run_stage(cfg, path, algorithm)
        runs[name] = out_dir
    assert f"[{algorithm}] sequence parallel 2 (1 data-parallel)" in out
    keys = ["reward_mean", "loss", "grad_norm", "response_length", "entropy"]
    if algorithm == "grpo":  # a step drew again (measured: 1 then 4 draws), and both runs replaced the same groups
        assert max(logged(runs["one"], "rollout/draws")) > 1
        keys += ["rollout/draws", "rollout/zero_advantage_groups", "rollout/zero_advantage_trained"]
    for key in keys:
        want, got = logged(runs["one"], key), logged(runs["sp"], key)
        assert len(got) == 2 and got == pytest.approx(want, rel=2e-3, abs=1e-5), key


def test_ppo_with_tiled_log_probabilities_matches_its_first_update(chain, ppo, tmp_path):
    """PPO scoring and training its response tokens a tile of logits at a time: the first step (same rollouts)
    logs what the untiled run logged."""
    from tests.conftest import PPO

    cfg, path = prepared(chain, tmp_path / "tiled", *PPO, "distributed.tiling=true", "preference.max_steps=2",
                         "preference.save_every=100")
    manifest, out_dir, _ = run_stage(cfg, path, "ppo")
    for key in ("policy_loss", "value_loss", "kl", "entropy"):
        want, got = logged(ppo[1], key), logged(out_dir, key)
        assert got[0] == pytest.approx(want[0], abs=1e-4), key
