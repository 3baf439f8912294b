"""A mixture-of-experts model through the whole CPU pipeline on 2 processes: pretraining (ZeRO-2) logs the routers'
load-balancing loss and counts active parameters apart from total ones, and SFT, the reward model and PPO (ZeRO-3,
partitioned from load to export: the actor, critic, reference and reward model) train and export Mixtral
checkpoints that the evaluation step generates from. (DPO and the other TRL stages train whatever model TRL loads.)"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import config, logged, run_stage, tokenize_from

pytestmark = pytest.mark.slow
STEPS = ["pretrain.max_steps=12", "pretrain.eval_every=12", "pretrain.save_every=100", "eval.items=8",
         "reward.policy_samples=0", "preference.ppo.max_new_tokens=6", "preference.algorithm=ppo"]
STEPS += [f"{s}.{k}" for s in ("sft", "reward", "preference") for k in ("max_steps=4", "eval_every=4",
                                                                         "save_every=100")]


def test_moe_runs_the_pipeline(tokenized, tmp_path):
    cfg, path = config(tmp_path, "model.preset=moe-tiny", "model.n_layer=2", "distributed.zero_stage=2", *STEPS)
    tokenize_from(tokenized, cfg)
    manifest, out_dir, _ = run_stage(cfg, path, "pretrain")
    m = manifest["metrics"]
    assert m["active_parameters"] < m["parameters"]  # 2 of 4 experts a token
    assert m["flops_per_token"] == pytest.approx(6 * m["active_parameters"] + 12 * 2 * 128 * 64)
    aux, loss = logged(out_dir, "aux_loss"), logged(out_dir, "loss")
    assert len(aux) == len(loss) and all(a > 0 for a in aux) and loss[-1] < loss[0]
    config_json = json.loads((out_dir / "model" / "config.json").read_text())
    assert config_json["architectures"] == ["MixtralForCausalLM"] and config_json["num_local_experts"] == 4

    cfg, path = config(tmp_path, "model.preset=moe-tiny", "model.n_layer=2", "distributed.zero_stage=3", *STEPS)
    before = load_file(out_dir / "model" / "model.safetensors")
    outs = {}
    for stage in ("sft", "reward", "ppo", "eval-ppo"):
        manifest, outs[stage], _ = run_stage(cfg, path, stage)
        if stage in ("sft", "ppo"):
            after = load_file(outs[stage] / "model" / "model.safetensors")
            assert after.keys() == before.keys()
            assert not torch.equal(after["model.layers.0.mlp.experts.gate_up_proj"],
                                   before["model.layers.0.mlp.experts.gate_up_proj"]), stage  # experts trained
            before = after if stage == "sft" else before
    assert all(a > 0 for a in logged(outs["sft"], "aux_loss")) and all(a > 0 for a in logged(outs["ppo"], "aux_loss"))
    assert 0 <= manifest["metrics"]["exact_match"] <= 1
