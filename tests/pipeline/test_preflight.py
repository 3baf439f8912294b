"""What the preflight (gptforge.pipeline.preflight) checks beyond the schema: the devices where each stage would
start, and the rollouts' engines and workers. (Missing files, reward functions and servers:
tests/pipeline/test_cli.py, through `gptforge run` on a fresh root.)"""

import subprocess
import sys

import pytest
import torch

from gptforge.core.config import load_config
from gptforge.core.errors import ConfigError
from gptforge.pipeline.preflight import check_devices
from gptforge.pipeline.store import pipeline_steps
from tests.conftest import TINY


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_a_qlora_config_validates_on_a_cpu_head_node_and_fails_only_where_it_would_start():
    qlora = ["sft.lora.r=8", "sft.lora.quantize=4"]
    here = load_config(TINY, qlora)  # the schema does not ask this host for a GPU
    with pytest.raises(ConfigError, match=r"^sft.lora.quantize=4 loads the base through bitsandbytes, which needs a "
                                          r"GPU; there is none on this host"):
        check_devices(here, pipeline_steps(here))
    sent = load_config(TINY, [*qlora, "run.work_pools={sft: gpu}", "run.default_work_pool=cpu"])
    check_devices(sent, pipeline_steps(sent))  # the GPU pool's worker checks it, where the stage starts
    with pytest.raises(ConfigError, match=r"^sft.lora.quantize=4"):
        check_devices(sent, ["sft"], here=True)  # as gptforge.pipeline.launch.stage asks on the worker that runs it


class SamplesOnly:
    """An engine on the seam of gptforge.model.sampling.engine that generates and can neither load weights nor give
    the sampled log-probabilities (a frozen inference server)."""

    loads_weights = False
    logprobs = False

    def generate(self, sequences, budgets, max_new_tokens, **sampling):
        return [[0] for _ in sequences]

    def load_weights(self, named):
        raise NotImplementedError


class Engine(SamplesOnly):
    loads_weights = logprobs = True


ONLINE = ["preference.algorithm=ppo"]


@pytest.mark.parametrize("overrides, says", [
    (["preference.rollout.max_staleness=-1"], "preference.rollout.max_staleness"),
    (["preference.rollout.icepop_band=[1.5, 2]"], "preference.rollout.icepop_band [1.5, 2.0]: give [low, high]"),
    (["preference.rollout.mode=async", "preference.rollout.engine=tests.pipeline.test_preflight:SamplesOnly"],
     "preference.rollout.engine=tests.pipeline.test_preflight:SamplesOnly cannot load weights"),
    (["preference.rollout.correction=tis", "preference.rollout.engine=tests.pipeline.test_preflight:SamplesOnly"],
     "preference.rollout.correction=tis needs the sampled tokens' log-probabilities"),
    (["preference.rollout.engine=tests.pipeline.test_preflight:Nowhere"],
     "preference.rollout.engine=tests.pipeline.test_preflight:Nowhere: cannot import it"),
    (["preference.rollout.mode=async", "preference.rollout.workers=3"],
     "preference.rollout.workers=3 is more than the layout allows: each worker serves the batches of at least one "
     "of the 2 training processes"),
    (["preference.rollout.mode=async", "preference.algorithm=grpo", "distributed.sequence_parallel=2",
      "preference.grpo.ptx_coef=0"],
     "preference.rollout.mode=async for grpo with distributed.sequence_parallel=2"),
    (["preference.algorithm=rloo", "preference.rollout.engine=tests.pipeline.test_preflight:Engine"],
     "preference.rollout.engine=tests.pipeline.test_preflight:Engine in sync mode for rloo"),
    (["preference.enabled=false", "distill.enabled=true", "distill.teacher=/tmp/teacher",
      "preference.rollout.mode=async", "distill.lora.r=8"],
     "preference.rollout.mode=async with distill.lora.r=8: the rollout workers take whole"),
])
def test_bad_rollout_settings_are_one_error_naming_the_key_before_anything_runs(overrides, says):
    from gptforge.core.errors import UserError
    from gptforge.pipeline.preflight import check_rollouts_apart

    with pytest.raises(UserError) as e:
        cfg = load_config(TINY, [*ONLINE, *overrides])
        check_rollouts_apart(cfg, pipeline_steps(cfg))
    assert says in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)


def test_the_lora_that_rollout_workers_refuse_is_the_one_its_stage_trains():
    """Distill trains distill.lora: a LoRA of the preference stage, which is not in the pipeline, is no reason to
    refuse distill's workers."""
    from gptforge.pipeline.preflight import check_rollouts_apart

    cfg = load_config(TINY, ["preference.enabled=false", "distill.enabled=true", "distill.teacher=/tmp/teacher",
                             "preference.rollout.mode=async", "preference.lora.r=8"])
    check_rollouts_apart(cfg, pipeline_steps(cfg))


def test_the_whole_preflight_of_the_default_pipeline_imports_no_torch(tmp_path):
    """`gptforge run` checks the config before its server starts: for a preset model with no LoRA targets to match
    and no FlashAttention to look for, that needs neither torch nor the modelling code (about 3 s of a core)."""
    code = ("import sys; from gptforge.core.config import load_config; from gptforge.pipeline.preflight import "
            f"preflight; preflight(load_config({str(TINY)!r}, ['run.root={tmp_path}']), log=lambda m: None); "
            "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_deepspeeds_runner_over_several_hosts_without_pdsh_is_one_error_before_anything_runs(tmp_path, monkeypatch):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    cfg = load_config(TINY, ["distributed.launcher=deepspeed", "distributed.nnodes=2", "distributed.nproc_per_node=1",
                             f"distributed.hostfile={hostfile}"])
    monkeypatch.setenv("PATH", str(tmp_path))  # a host without pdsh
    with pytest.raises(ConfigError, match=rf"^distributed.hostfile={hostfile} with launcher=deepspeed and "
                                          r"node_launcher=local: DeepSpeed's runner reaches its hosts through pdsh"):
        check_devices(cfg, pipeline_steps(cfg))
    check_devices(cfg, ["tokenize", "eval-sft"])  # one process each: no runner
    over_ssh = load_config(TINY, ["distributed.launcher=deepspeed", "distributed.nnodes=2",
                                  "distributed.nproc_per_node=1", "distributed.node_launcher=ssh",
                                  "distributed.master_addr=10.0.0.1", f"distributed.hostfile={hostfile}"])
    check_devices(over_ssh, pipeline_steps(over_ssh))  # gptforge starts each node's launcher itself
    (tmp_path / "pdsh").write_text("#!/bin/sh\n")
    (tmp_path / "pdsh").chmod(0o755)
    check_devices(cfg, pipeline_steps(cfg))
