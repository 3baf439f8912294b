import contextlib
import io
from dataclasses import replace

import pytest
import torch

from gptforge.core.config import load_config
from gptforge.core.presets import PRESETS
from gptforge.model.build import build_model
from gptforge.model.plan import GiB, LongContext, activation_bytes, make_plan
from tests.conftest import TINY


def gptforge_plan(*args: str) -> str:
    """What `gptforge plan -c configs/tiny.yaml ARGS` prints (the command, in this process: it only loads the
    config, plans and prints)."""
    from gptforge.pipeline.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "-c", str(TINY), *args]) == 0
    return out.getvalue()


def test_gpt3_175b_against_the_paper():
    arch = PRESETS["gpt3-175b"]
    p = make_plan(arch, arch.vocab_size, seq_len=2048, micro_batch=1, gpus=1024, tokens=300e9)
    assert p.n_params == pytest.approx(175e9, rel=0.01)
    # The paper's 3.14e23 training FLOPs is 6*N*D for 300B tokens; the attention term adds ~2%: its dense layers
    # attend over 2048 tokens, its locally banded ones (every other layer) over their 256-token band.
    assert p.train_flops == pytest.approx(3.14e23, rel=0.05)
    assert p.flops_per_token == pytest.approx(6 * p.n_params + 12 * 12288 * (48 * 2048 + 48 * 256))
    dense = make_plan(replace(arch, attention_pattern="dense"), arch.vocab_size, 2048, 1, 1024, 300e9)
    assert dense.flops_per_token == pytest.approx(6 * p.n_params + 12 * 96 * 12288 * 2048)
    assert p.optimal_tokens == pytest.approx(20 * p.n_params)
    assert p.largest_layer == 50257 * 12288  # the embedding
    # ZeRO-0 holds 20 bytes per parameter on every GPU; ZeRO-3 partitions 18 of them and gathers the largest layer.
    assert p.memory[(0, False)][0] == pytest.approx(20 * p.n_params)
    assert p.memory[(3, False)][0] == pytest.approx(4 * p.largest_layer + 18 * p.n_params / 1024)


def test_muon_holds_one_moment_for_the_hidden_matrices():
    """Muon's momentum takes the place of Adam's two moments on the 2-D weights other than the embedding tables and
    the head: 4 bytes a parameter less where the optimizer's states are (partitioned, or on the host with offload)."""
    arch = PRESETS["llama-7b"]
    adam, muon = (make_plan(arch, arch.vocab_size, 2048, 1, 8, optimizer=o) for o in ("adamw", "muon"))
    matrices = adam.n_params - 2 * arch.vocab_size * arch.n_embd - sum(  # untied embedding and head; the norms
        arch.n_embd for _ in range(2 * arch.n_layer + 1))
    for stage, offload in ((0, False), (1, False), (2, False), (3, False)):
        saved = adam.memory[(stage, offload)][0] - muon.memory[(stage, offload)][0]
        assert saved == pytest.approx(4 * matrices / (1 if stage == 0 else 8)), (stage, offload)
    assert adam.memory[(3, True)][1] - muon.memory[(3, True)][1] == pytest.approx(4 * matrices * 1.5)
    assert "llama-7b, Muon:" in gptforge_plan("--set", "model.preset=llama-7b", "--set", "pretrain.optimizer=muon")


def _count(arch):
    with torch.device("meta"):
        model = build_model(arch, arch.vocab_size)
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


@pytest.mark.parametrize("preset", ["gpt2-1.5b", "llama-7b", "gpt3-13b", "mixtral-8x7b"])
@pytest.mark.parametrize("gpus_per_node,nodes", [(8, 1), (8, 4), (4, 1)])
def test_model_states_match_deepspeeds_estimators(preset, gpus_per_node, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    arch = PRESETS[preset]
    total, largest = _count(arch)
    p = make_plan(arch, arch.vocab_size, 2048, 1, gpus_per_node * nodes, gpus_per_node=gpus_per_node)
    assert p.n_params == total and p.largest_layer == largest
    for offload in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total, gpus_per_node, nodes, cpu_offload=offload)
        ours_gpu, ours_cpu = p.memory[(2, offload)]
        assert ours_gpu == pytest.approx(gpu, rel=0.05), ("ZeRO-2", offload)
        if nodes == 1 or not offload:  # several nodes, offload: we count a node's share (see gptforge.model.plan)
            assert ours_cpu == pytest.approx(cpu, rel=0.05), ("ZeRO-2 host", offload)
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, gpus_per_node, nodes, cpu_offload=offload,
                                                            cpu_offload_params=False, zero_init=True)
        ours_gpu, ours_cpu = p.memory[(3, offload)]
        assert ours_gpu == pytest.approx(gpu, rel=0.05), ("ZeRO-3", offload)
        assert ours_cpu == pytest.approx(cpu, rel=0.05), ("ZeRO-3 host", offload)


def test_activations_count_one_layers_recompute_and_the_logits():
    arch = PRESETS["gpt2-124m"]
    s, b, V = 1024, 4, 50257
    full = activation_bytes(arch, V, s, b, checkpointing=False)
    ckpt = activation_bytes(arch, V, s, b, checkpointing=True)
    logits = 10 * s * b * V
    layer = (full - logits) / arch.n_layer
    assert layer == pytest.approx(34 * s * b * 768 + 5 * 12 * s * s * b)  # Korthikanti et al. for a 4h MLP
    assert ckpt == pytest.approx(arch.n_layer * 2 * s * b * 768 + layer + logits)


def test_a_mixture_of_experts_computes_with_its_active_parameters():
    arch = PRESETS["mixtral-8x7b"]
    p = make_plan(arch, arch.vocab_size, 4096, 1, 64)
    assert p.n_params == pytest.approx(46.7e9, rel=0.01)  # Mixtral 8x7B as published: 46.7B, 12.9B active
    assert p.active_params == pytest.approx(12.9e9, rel=0.01)
    assert p.flops_per_token == pytest.approx(6 * p.active_params + 12 * 32 * 4096 * 4096)
    assert p.memory[(3, False)][0] == pytest.approx(4 * p.largest_layer + 18 * p.n_params / 64)  # memory: all


def test_a_llama2_70b_shape_from_overrides():
    cfg = load_config(None, ["model.preset=llama-7b", "model.n_layer=80", "model.n_embd=8192", "model.n_head=64",
                             "model.n_kv_head=8", "model.intermediate_size=28672"])
    p = make_plan(cfg.model.arch(), 32000, 4096, 1, 64)
    assert p.n_params == pytest.approx(69e9, rel=0.02)
    assert cfg.model.name() == ("llama-7b (n_layer=80, n_head=64, n_embd=8192, n_kv_head=8, "
                                "intermediate_size=28672)")


def test_plan_command_states_its_verdict_and_assumptions():
    def plan(gpus):
        out = gptforge_plan("--set", "model.preset=gpt3-175b", "--set", "model.n_positions=2048", "--set",
                            "pretrain.seq_len=2048", "--set", "pretrain.micro_batch_size=1", "--set",
                            "pretrain.global_batch_size=1024", "--set", "distributed.activation_checkpointing=true",
                            "--gpus", str(gpus), "--gpu-mem", "80", "--tokens", "300e9")
        return {line.split()[0] + (" offload" if "offload" in line else ""): line
                for line in out.splitlines() if line.startswith("  ZeRO")}, out

    rows, out = plan(1024)
    assert "174.6" in out and "days" in out and "(n_positions=2048)" in out.splitlines()[0]
    assert "does not fit" in rows["ZeRO-0"] and " fits" in rows["ZeRO-3"]
    assert "one layer recomputed" in out and "live parameters" in out and "assumed:" in out
    rows, _ = plan(8)  # 8 GPUs of 80 GB: ZeRO-3 holds 18*175e9/8 = 367 GiB of model states each
    assert all("does not fit" in row for stage, row in rows.items() if stage != "ZeRO-3 offload")
    # Offloaded, the GPUs hold 2 bytes a parameter over 8, but the node needs 16 bytes a parameter of host memory.
    host = float(rows["ZeRO-3 offload"].split("host ")[1].split()[0])
    assert " fits" in rows["ZeRO-3 offload"] and host == pytest.approx(16 * 174.6e9 * 1.5 / GiB, rel=1e-3)


def test_out_of_memory_message_quotes_the_planner(tmp_path):
    from gptforge.core.errors import UserError
    from gptforge.model.train.engine import startup_oom
    from gptforge.model.plan import stage_verdict

    cfg = load_config(None, ["model.preset=gpt2-1.5b", "distributed.zero_stage=2"])
    verdict = stage_verdict(cfg, cfg.pretrain, 2, torch.device("cpu"), 50257)
    with pytest.raises(UserError) as e, startup_oom(cfg.distributed, cfg.pretrain, verdict=lambda: verdict):
        raise torch.OutOfMemoryError("CUDA out of memory")
    message = str(e.value)
    assert "distributed.zero_stage=2" in message and "the planner (gpt2-1.5b): ZeRO-2 on 2 devices needs" in message
    assert f"{make_plan(PRESETS['gpt2-1.5b'], 50257, cfg.pretrain.seq_len, cfg.pretrain.micro_batch_size, 2, gpus_per_node=2, lc=LongContext(scores=False)).gpu_bytes(2, False, False) / GiB:.1f} GiB" in message  # noqa: E501


def test_a_pretrained_models_lora_run_is_planned_from_its_config_json(tmp_path):
    """`gptforge plan --set model.pretrained=DIR --set sft.lora.r=16 --stage sft` reads DIR/config.json (a Llama 2
    7B shape here, no weights needed) and counts a LoRA run: the frozen base in 16 bits, whole on every GPU under
    ZeRO-2, plus the adapters' own weights, gradients and Adam states (r * (in + out) a targeted linear layer)."""
    from transformers import LlamaConfig

    from gptforge.core.config import LoraSection

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         vocab_size=32000)
    config.save_pretrained(tmp_path / "llama-2-7b")
    from gptforge.model.build import arch_of

    lora = LoraSection(r=16)
    p = make_plan(arch_of(config), 32000, 1024, 1, 8, config=config, lora=lora)
    full = make_plan(arch_of(config), 32000, 1024, 1, 8, config=config)
    adapters = 32 * 16 * (4 * (4096 + 4096) + 2 * (4096 + 11008) + (11008 + 4096))
    assert p.n_params == full.n_params == pytest.approx(6.74e9, rel=0.01)
    assert p.memory[(2, False)][0] == pytest.approx(2 * p.n_params + 2 * adapters + 18 * adapters / 8)
    assert p.memory[(3, False)][0] < p.memory[(2, False)][0] < 0.5 * full.memory[(2, False)][0]
    four_bit = make_plan(arch_of(config), 32000, 1024, 1, 8, config=config, lora=LoraSection(r=16, quantize=4))
    assert four_bit.memory[(2, False)][0] == pytest.approx(0.5 * p.n_params + 2 * adapters + 18 * adapters / 8)
    out = gptforge_plan("--set", f"model.pretrained={tmp_path / 'llama-2-7b'}", "--set", "sft.lora.r=16", "--stage",
                        "sft", "--gpus", "8")
    assert "llama-2-7b, sft with LoRA r=16: 6.738B parameters" in out
    assert f"ZeRO-2{'':15s} {p.memory[(2, False)][0] / GiB:10.1f}" in out


LONG = ["model.preset=llama-7b", "pretrain.seq_len=131072", "model.rope={type: yarn, factor: 32}",
        "distributed.nproc_per_node=8", "pretrain.micro_batch_size=1", "pretrain.global_batch_size=8",
        *[f"{s}.{k}" for s in ("sft", "reward", "preference") for k in ("micro_batch_size=1", "global_batch_size=8")]]


def plan_of(*overrides):
    return gptforge_plan("--gpus", "8", *[a for o in (*LONG, *overrides) for a in ("--set", o)])


def test_the_planner_divides_activations_by_the_sequence_parallel_ranks_and_counts_tiled_logits():
    from gptforge.model.plan import logits_bytes

    one = plan_of("distributed.tiling=false")
    eight = plan_of("distributed.tiling=false", "distributed.sequence_parallel=8")

    def activations(text):
        line = next(x for x in text.splitlines() if x.startswith("activations per GPU"))
        return float(line.split("): ")[1].split(" GiB")[0])

    assert activations(eight) == pytest.approx(activations(one) / 8, rel=0.01)
    assert "16384 tokens a rank" in eight and "sequence parallel 8" in eight
    assert "logits of the loss per GPU: 39.06 GiB (untiled)" in one  # 10 bytes x 131072 x 32000
    # tiling auto: the logits in tiles of at most logits_tile_mb (1 GiB of fp32), the MLPs in slices
    tiled = plan_of()
    tiles = 131072 * 32000 * 4 // 2**30 + 1
    assert f"(a tile of {tiles}); MLPs in 32 slices" in tiled
    assert logits_bytes(32000, 131072, 1, LongContext(logit_tiles=tiles)) / GiB == pytest.approx(39.06 / tiles,
                                                                                                 rel=0.01)
    assert activations(tiled) < activations(one) - 39.06 + 39.06 / tiles
