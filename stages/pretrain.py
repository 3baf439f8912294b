"""Pretrain stage: a GPT trained from scratch on the token shards under DeepSpeed ZeRO, or, with
`model.pretrained`, that model's pretraining continued on them (its own tokenizer made the shards; full weights
or `pretrain.lora` adapters).

    gptforge stage pretrain -c configs/tiny.yaml      (finds its input and output in the stage store)
    deepspeed --num_gpus 2 -m gptforge.stages.pretrain --config CONFIG --out DIR --input tokenize=DIR

Resumes from its newest valid step checkpoint; exports a Hugging Face model directory `model/`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from gptforge.core.config import PipelineConfig
from gptforge.core.errors import DataError
from gptforge.data.batches import TokenWindows, document_positions, eval_batches
from gptforge.data.shards import TokenStream, read_index
from gptforge.model.lora import wrap
from gptforge.model.build import build_model, flops_per_token, parameter_counts, peak_flops
from gptforge.model.train.checkpoints import find_checkpoint
from gptforge.model.train.distributed import all_mean, setup_distributed
from gptforge.model.train.engine import (build_config, deepspeed_config, init_engine, partitioned, startup_oom,
                                         uses_bf16)
from gptforge.model.train.loop import TrainLoop
from gptforge.model.train.losses import router_loss
from gptforge.model.train import sequence_parallel
from gptforge.model.plan import stage_verdict
from gptforge.model.pretrained import architecture, load_causal_lm, model_dir
from gptforge.model.train.tiling import lm_loss, logit_tiles, mlp_shards, tile_mlps
from gptforge.stages.entry import exit_process, main
from gptforge.core.registry import data_parallel



def load_data(tok_dir: Path, shard_dir: Path):
    """Tokenizer, the shard index and the train/val token streams (memory-mapped), checked to belong together."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    index = read_index(shard_dir)
    if index["vocab_size"] != len(tokenizer) or index["max_token_id"] >= len(tokenizer):
        raise DataError(f"token shards in {shard_dir} (vocab {index['vocab_size']}, max id {index['max_token_id']}) "
                        f"were not made by the tokenizer in {tok_dir} (vocab {len(tokenizer)})")
    return tokenizer, index, TokenStream(shard_dir, "train"), TokenStream(shard_dir, "val")


def check_enough(train, val, pc, world: int) -> None:
    """Too little data for one micro-step on every process is an error before anything trains."""
    need = pc.micro_batch_size * world
    for split, tokens in (("train", train), ("val", val)):
        windows = (len(tokens) - 1) // pc.seq_len
        if windows < need:
            raise DataError(
                f"the {split} split holds {len(tokens)} tokens: {windows} windows of pretrain.seq_len={pc.seq_len}, "
                f"fewer than one micro-step of pretrain.micro_batch_size={pc.micro_batch_size} x {world} processes "
                f"(distributed.nproc_per_node x nnodes); give more data, or change tokenizer.val_fraction, "
                "pretrain.seq_len, pretrain.micro_batch_size or distributed.nproc_per_node")


def model_inputs(x: torch.Tensor, y: torch.Tensor, pc, eos_id: int, device, sp=None) -> tuple[dict, torch.Tensor]:
    """A window's model inputs and targets: with pretrain.document_mask, position ids that restart after each
    end-of-text token, and no cache built, so that attention stays within each document (transformers reads packed
    sequences from the position ids: a block-diagonal mask for sdpa and eager, varlen for FlashAttention). Under
    sequence parallelism (`sp`), this rank's slice of the tokens, with the whole window's positions."""
    if sp is not None:
        positions = torch.arange(x.size(1)).expand_as(x)
        return ({"input_ids": sp.shard(x).to(device), "position_ids": sp.shard(positions).to(device),
                 "use_cache": False}, sp.shard(y).to(device))
    if not pc.document_mask:
        return {"input_ids": x.to(device)}, y.to(device)
    return ({"input_ids": x.to(device), "position_ids": document_positions(x, eos_id).to(device), "use_cache": False},
            y.to(device))


@torch.no_grad()
def evaluate(engine, val, pc, rank, world, device, eos_id: int, tiles: int, sp=None) -> float:
    """Mean val loss over all ranks (`rank`, `world`: the data-parallel ones)."""
    engine.eval()
    losses = [lm_loss(engine, *model_inputs(x, y, pc, eos_id, device, sp), tiles)[0].item()
              for x, y in eval_batches(val, pc.seq_len, pc.micro_batch_size, pc.eval_batches, rank, world)]
    engine.train()
    return all_mean(sum(losses) / len(losses), device)


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    pc, dist = cfg.pretrain, cfg.distributed
    rank, world, device = setup_distributed(cfg.distributed)
    tokenizer, index, train_tokens, val_tokens = load_data(inputs["tokenize"] / "tokenizer",
                                                           inputs["tokenize"] / "shards")
    dp_world = data_parallel(dist, "pretrain")  # sequence parallelism: groups of ranks share each window
    check_enough(train_tokens, val_tokens, pc, dp_world)
    torch.manual_seed(cfg.run.seed)
    arch, _ = architecture(cfg.model)
    ds_config = deepspeed_config(dist, pc, dp_world, device, arch.n_embd)
    build = build_config(ds_config)
    if cfg.model.pretrained:  # continued pretraining
        if pc.seq_len > arch.n_positions:
            raise DataError(f"pretrain.seq_len={pc.seq_len} exceeds the context of model.pretrained="
                            f"{cfg.model.pretrained} ({arch.n_positions} positions)")
        with partitioned(build):  # ZeRO-3: loaded partitioned
            model = load_causal_lm(model_dir(cfg.model.pretrained, cfg.model.revision), cfg.model,
                                   uses_bf16(dist, device), pc.lora)
    else:
        model = build_model(arch, len(tokenizer), cfg.model.dropout, tokens={  # ZeRO-3: each rank its partition
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}, zero3=build if dist.zero_stage == 3 else None,
            model_cfg=cfg.model)
    if dist.activation_checkpointing:
        model.activation_checkpointing_enable()
    sp = sequence_parallel.setup(model, dist, pc.micro_batch_size, pc.seq_len, "pretrain.seq_len")
    dp_rank = sp.dp_rank if sp else rank
    local_len = pc.seq_len // dist.sequence_parallel  # the tokens of a window this rank holds
    tiles = logit_tiles(dist, pc.micro_batch_size, local_len, len(tokenizer))
    tiled_mlps = tile_mlps(model, mlp_shards(dist, local_len, arch.n_embd))
    model = wrap(model, pc.lora, "causal-lm", "pretrain.lora", checkpointing=dist.activation_checkpointing)
    n_params, n_active = parameter_counts(model)
    ckpt, elastic = find_checkpoint(out_dir / "checkpoints", rank, world)
    verdict = partial(stage_verdict, cfg, pc, world, device, len(tokenizer), world // dp_world)  # if memory runs out
    engine, scheduler, grad_accum = init_engine(model, ds_config, pc, dist, elastic, verdict, sp and sp.mpu)
    if pc.compile:
        engine.compile()  # compiles in place: parameter names and checkpoints are unchanged
    loader = TokenWindows(train_tokens, pc.seq_len, pc.micro_batch_size, dp_rank, dp_world, seed=cfg.run.seed)
    tokens_per_step = pc.global_batch_size * pc.seq_len  # over all processes
    flops_tok, peak = flops_per_token(n_active, arch, pc.seq_len), peak_flops(device)

    def mfu_of(tps: float | None) -> float | None:  # model FLOPs utilisation over all ranks
        return flops_tok * tps / (peak * world) if peak and tps else None

    loop = TrainLoop("pretrain", pc, engine, scheduler, grad_accum, loader, ckpt, elastic, out_dir, rank, world,
                     device, tokens_per_step=tokens_per_step, mfu=mfu_of)
    if rank == 0:
        active = f" ({n_active / 1e6:.2f}M active)" if n_active != n_params else ""
        print(f"[pretrain] {cfg.model.name()}: {n_params / 1e6:.2f}M parameters{active}, world {world}, "
              f"ZeRO-{engine.zero_optimization_stage()}, {f'sequence parallel {sp.size}, ' if sp else ''}"
              f"grad accum {grad_accum}, {tokens_per_step} tokens/step, {pc.max_steps} steps"
              f"{', torch.compile' if engine.is_compiled else ''}"
              f"{f', logits in {tiles} tiles' if tiles > 1 else ''}"
              f"{f', {tiled_mlps} MLPs tiled' if tiled_mlps else ''}",
              flush=True)

    val_loss = float("nan")
    while loop.running():
        for x, y in loop.micro_batches(loader.next):  # (B, T), (B, T)
            with startup_oom(dist, pc, active=loop.step == loop.first_step, verdict=verdict):
                loss, out = lm_loss(engine, *model_inputs(x, y, pc, index["eos_id"], device, sp), tiles)
                aux = router_loss(out, engine.module.config)  # a mixture of experts' load balancing
                loop.backward(loss, (loss if aux is None else loss + aux) * (sp.backward_scale if sp else 1.0),
                              **({} if aux is None else {"aux_loss": out.aux_loss.item()}))
        if not loop.advance():
            continue
        if loop.due(pc.log_every):
            loop.log_train()
        if loop.due(pc.eval_every):
            val_loss = evaluate(engine, val_tokens, pc, dp_rank, dp_world, device, index["eos_id"], tiles, sp)
            loop.log.log(loop.step, val_loss=val_loss, val_ppl=float(torch.tensor(val_loss).exp()))
        loop.save()

    metrics = loop.finish(tokenizer, out_dir, cfg.model.shard_bytes)
    mfu = mfu_of(metrics["tokens_per_sec"])
    return {**metrics, "val_loss": round(val_loss, 6), "val_ppl": round(float(torch.tensor(val_loss).exp()), 4),
            "unigram_entropy": round(index["unigram_entropy"], 6), "mfu": round(mfu, 4) if mfu else None,
            "parameters": n_params, "active_parameters": n_active, "flops_per_token": flops_tok}


if __name__ == "__main__":
    exit_process(main("pretrain", run))
