"""SFT stage: supervised fine-tuning of the pretrained model on chat data, under DeepSpeed ZeRO.

    gptforge stage sft -c configs/tiny.yaml      (finds its input and output in the stage store)
    deepspeed --num_gpus 2 -m gptforge.stages.sft --config CONFIG --out DIR --input pretrain=DIR

The loop is our own rather than TRL's SFTTrainer so that every training stage shares one exact-resume
mechanism (step checkpoints with loader position and RNG states, see gptforge.model.train.checkpoints) and one launcher
story; the loss is assistant-only by default (the assistant turns found through the model's own chat
template, gptforge.data.chat.assistant_mask), packing optional (conversations kept apart by their position ids).
It starts from the pretrain stage's model (`--input pretrain=DIR`) or, without that input, from
`model.pretrained`, with full weights or LoRA adapters (`sft.lora`, gptforge.model.lora). A model without a
chat template or pad token gets them here (gptforge.model.pretrained.prepare_tokenizer), its embeddings grown to
the new tokens.
Validation: the loss on held-out conversations, before training (`base_val_loss`) and after (`val_loss`).
Generation on held-out items is the evaluation step's (gptforge.stages.evaluate), over the finished output.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from gptforge.core.config import PipelineConfig
from gptforge.data import splits
from gptforge.data.chat import collate, encode_conversations, model_batch, pack
from gptforge.data.batches import DistributedOrder
from gptforge.model.lora import wrap
from gptforge.model.train.checkpoints import find_checkpoint
from gptforge.model.train.distributed import all_sum, setup_distributed
from gptforge.model.train.engine import build_config, deepspeed_config, init_engine, partitioned, uses_bf16
from gptforge.model.train.loop import TrainLoop
from gptforge.model.train.losses import router_loss
from gptforge.model.train import sequence_parallel
from gptforge.model.plan import stage_verdict
from gptforge.model.pretrained import fit_embeddings, load_causal_lm, prepare_tokenizer, start_model
from gptforge.model.train.tiling import lm_loss, logit_tiles, mlp_shards, tile_mlps
from gptforge.stages.entry import exit_process, main
from gptforge.core.registry import data_parallel



@torch.no_grad()
def val_loss(engine, examples, micro_batch: int, pad_id: int, rank: int, world: int, device,
             tiles: int = 1, sp=None) -> float:
    """Token-weighted mean loss over the val examples (each data-parallel rank a strided share; under sequence
    parallelism, each rank its slice of the share's rows)."""
    engine.eval()
    total = tokens = 0.0
    mine = examples[rank::world]
    for i in range(0, len(mine), micro_batch):
        x, a, y = collate(mine[i:i + micro_batch], pad_id)
        inputs, y = ({"input_ids": x, "attention_mask": a}, y) if sp is None else sp.shard_batch(x, y)
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        total += lm_loss(engine, inputs, y.to(device), tiles, reduction="sum")[0].item()
        tokens += (y != -100).sum().item()
    engine.train()
    total, tokens = all_sum([total, tokens], device)
    return total / tokens


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    sc, dist = cfg.sft, cfg.distributed
    rank, world, device = setup_distributed(cfg.distributed)
    base_dir = start_model(cfg, inputs)
    tokenizer = AutoTokenizer.from_pretrained(base_dir, trust_remote_code=cfg.model.trust_remote_code)
    added = prepare_tokenizer(tokenizer, sc.chat_template)
    data = splits.conversations(cfg.data)
    train = encode_conversations(tokenizer, data.train, sc.max_length, sc.assistant_only_loss, sc.on_too_long)
    val = encode_conversations(tokenizer, data.val, sc.max_length, sc.assistant_only_loss, sc.on_too_long)
    examples = pack(train.examples, sc.max_length) if sc.packing else train.examples
    dp_world = data_parallel(dist, "sft")  # sequence parallelism: groups of ranks share each row
    splits.require(len(examples), sc.micro_batch_size * dp_world, f"usable training conversations (skipped: "
                    f"{dict(train.skipped)})", "sft.micro_batch_size", "data.sft")
    splits.require(len(val.examples), 1, "usable held-out conversations", "sft.micro_batch_size", "data.sft")
    if rank == 0:
        print(f"[sft] {len(train.examples)} conversations ({len(examples)} sequences), {len(val.examples)} val; "
              f"skipped {dict(train.skipped)}, truncated {train.truncated}", flush=True)

    torch.manual_seed(cfg.run.seed)
    ds_config = deepspeed_config(dist, sc, dp_world, device, AutoConfig.from_pretrained(base_dir).hidden_size)
    with partitioned(build_config(ds_config)):  # ZeRO-3: each rank holds its partition from the start
        model = load_causal_lm(base_dir, cfg.model, uses_bf16(dist, device), lora=sc.lora)
        grown = fit_embeddings(model, tokenizer)  # the template's tokens, or ones beyond the model's rows
    if rank == 0 and (added or grown):
        print(f"[sft] added {added} to the tokenizer; embeddings grown by {len(grown)} rows (trained)", flush=True)
    if dist.activation_checkpointing:
        model.activation_checkpointing_enable()
    sp = sequence_parallel.setup(model, dist, sc.micro_batch_size, None, "sft.max_length")
    dp_rank = sp.dp_rank if sp else rank
    local_len = sc.max_length // dist.sequence_parallel  # the most tokens of a row this rank holds
    tiles = logit_tiles(dist, sc.micro_batch_size, local_len, len(tokenizer))
    tile_mlps(model, mlp_shards(dist, local_len, model.config.hidden_size))
    model = wrap(model, sc.lora, "causal-lm", "sft.lora", grown, dist.activation_checkpointing)
    ckpt, elastic = find_checkpoint(out_dir / "checkpoints", rank, world)
    verdict = partial(stage_verdict, cfg, sc, world, device, len(tokenizer), world // dp_world)  # if memory runs out
    engine, scheduler, grad_accum = init_engine(model, ds_config, sc, dist, elastic, verdict, sp and sp.mpu)
    if rank == 0 and (sp or tiles > 1):
        print(f"[sft] {f'sequence parallel {sp.size} ({dp_world} data-parallel), ' if sp else ''}"
              f"logits in {tiles} tile(s)", flush=True)
    order = DistributedOrder(len(examples), sc.micro_batch_size, dp_rank, dp_world, seed=cfg.run.seed)
    loop = TrainLoop("sft", sc, engine, scheduler, grad_accum, order, ckpt, elastic, out_dir, rank, world, device)
    base_val_loss = loop.state["base_val_loss"] if loop.state else val_loss(
        engine, val.examples, sc.micro_batch_size, tokenizer.pad_token_id, dp_rank, dp_world, device, tiles, sp)

    loss_val = float("nan")
    while loop.running():
        for ids in loop.micro_batches(order.next_ids):
            inputs, y, tokens = model_batch([examples[i] for i in ids], tokenizer.pad_token_id)
            if sp is not None:  # this rank's slice of the rows; the loss is the group's token mean
                inputs, y = sp.shard_batch(inputs["input_ids"], y)
                tokens /= sp.size
            inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
            if sp is None:
                loss, out = lm_loss(engine, inputs, y.to(device), tiles)
                scaled = loss
            else:
                summed, out = lm_loss(engine, inputs, y.to(device), tiles, reduction="sum")
                loss, scaled = sp.group_mean(summed, (y != -100).sum())
            aux = router_loss(out, engine.module.config)  # a mixture of experts' load balancing
            loop.backward(loss, scaled if aux is None else scaled + aux * (sp.backward_scale if sp else 1.0), tokens,
                          **({} if aux is None else {"aux_loss": out.aux_loss.item()}))
        if not loop.advance():
            continue
        if loop.due(sc.log_every):
            loop.log_train()
        if loop.due(sc.eval_every):
            loss_val = val_loss(engine, val.examples, sc.micro_batch_size, tokenizer.pad_token_id, dp_rank, dp_world,
                                device, tiles, sp)
            loop.log.log(loop.step, val_loss=loss_val)
        loop.save(base_val_loss=base_val_loss)

    return {**loop.finish(tokenizer, out_dir, cfg.model.shard_bytes), "val_loss": round(loss_val, 6),
            "base_val_loss": round(base_val_loss, 6), "bad_rows": data.bad_rows,
            "skipped_no_assistant_turn": train.skipped["no_assistant_turn"] + val.skipped["no_assistant_turn"],
            "skipped_too_long": train.skipped["too_long"] + val.skipped["too_long"],
            "truncated": train.truncated + val.truncated}


if __name__ == "__main__":
    exit_process(main("sft", run))
