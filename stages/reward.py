"""Reward stage: a scalar reward model initialised from the SFT model (or from `reward.pretrained`, a model of its
own, larger say, with its own tokenizer: the policy's responses reach it as text), trained on preference pairs
with the pairwise Bradley-Terry loss (optional margin and reward centering), under DeepSpeed ZeRO.

    gptforge stage reward -c configs/tiny.yaml      (finds its input and output in the stage store)
    deepspeed --num_gpus 2 -m gptforge.stages.reward --config CONFIG --out DIR --input sft=DIR

Our own loop rather than TRL's RewardTrainer, for the same reason as SFT: one exact-resume mechanism
across stages. Full weights or LoRA adapters (`reward.lora`; the head is trained in full). Exported as a Hugging
Face sequence-classification directory (one label).
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import torch

from gptforge.core.config import PipelineConfig
from gptforge.data import splits
from gptforge.data.chat import collate, encode_pairs
from gptforge.data.batches import DistributedOrder
from gptforge.model.lora import quantization, wrap
from gptforge.model.attention import load_kwargs
from gptforge.model.train.checkpoints import find_checkpoint
from gptforge.model.train.distributed import all_sum, setup_distributed
from gptforge.model.train.engine import deepspeed_config, frozen, init_engine, partitioned, unwrap, uses_bf16
from gptforge.model.sampling.generate import generate
from gptforge.model.train.loop import TrainLoop
from gptforge.model.train.losses import pairwise_reward_loss
from gptforge.model.plan import stage_verdict
from gptforge.model.pretrained import fit_embeddings, load_dtype, model_dir, prepare_tokenizer, with_new_head
from gptforge.stages.entry import exit_process, main



def rewards(engine, pairs: list[tuple[list[int], list[int]]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the chosen and the rejected sequences, (B,) each, in one padded forward pass."""
    seqs = [(c, c) for c, _ in pairs] + [(r, r) for _, r in pairs]
    x, a, _ = collate(seqs, pad_id)
    scores = engine(input_ids=x.to(device), attention_mask=a.to(device)).logits.squeeze(-1).float()  # (2B,)
    return scores[:len(pairs)], scores[len(pairs):]


def policy_pairs(sft_dir: Path, pairs: list[dict], n: int, temperature: float, max_new_tokens: int,
                 seed: int, rank: int, world: int, device, ds_config: dict, model_cfg=None) -> tuple[list[dict], int]:
    """Comparisons of the SFT model's own answers (as InstructGPT trains its reward model on the policy's
    samples; the demo's verifier is the labeller): one answer sampled for each of n distinct training
    prompts, and each wrong one paired, as rejected, with the prompt's known answer. The pairs the demo
    ships have hand-made wrong answers; these teach the reward model the policy's own mistakes, which
    is what it judges in the preference stage. Each rank samples its share (the SFT model held as the engines
    hold theirs: partitioned under ZeRO-3); every rank gets every pair. Returns (pairs, answers sampled)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    known = splits.answered_prompts(pairs)
    n = min(n, len(known))
    mine = random.Random(seed).sample(range(len(known)), n)[rank::world]
    with partitioned(ds_config):
        policy = frozen(AutoModelForCausalLM.from_pretrained(sft_dir, **load_kwargs(sft_dir, model_cfg)), ds_config,
                        device)
    torch.manual_seed(seed + rank)  # the same samples on a rerun: resuming sees the same pairs
    answers = generate(unwrap(policy), tokenizer, [known[i][0] for i in mine], max_new_tokens, do_sample=True,
                       temperature=temperature, top_k=0, top_p=1.0, synced=ds_config["zero_optimization"]["stage"] == 3)
    del policy
    wrong = [(i, a) for i, a in zip(mine, answers) if a != known[i][1]]
    parts = [None] * world
    torch.distributed.all_gather_object(parts, wrong)
    return [{"prompt": known[i][0], "chosen": known[i][1], "rejected": a} for part in parts for i, a in part], n


@torch.no_grad()
def evaluate(engine, pairs, micro_batch: int, pad_id: int, rank: int, world: int, device) -> tuple[float, float]:
    """Held-out accuracy (chosen scored above rejected) and mean margin r_c - r_r."""
    engine.eval()
    correct = margin = 0.0
    mine = pairs[rank::world]
    for i in range(0, len(mine), micro_batch):
        c, r = rewards(engine, mine[i:i + micro_batch], pad_id, device)
        correct += (c > r).sum().item()
        margin += (c - r).sum().item()
    engine.train()
    correct, margin, n = all_sum([correct, margin, len(mine)], device)
    return correct / n, margin / n


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    rc, dist = cfg.reward, cfg.distributed
    rank, world, device = setup_distributed(cfg.distributed)
    # the reward model's start: the SFT model, or reward.pretrained (its own tokenizer and template)
    start = model_dir(rc.pretrained, None, "reward.pretrained") if rc.pretrained else inputs["sft"] / "model"
    tokenizer = AutoTokenizer.from_pretrained(start, trust_remote_code=cfg.model.trust_remote_code)
    prepare_tokenizer(tokenizer)
    data = splits.preference_pairs(cfg.data)
    train = encode_pairs(tokenizer, data.train, rc.max_length, rc.on_too_long)
    val = encode_pairs(tokenizer, data.val, rc.max_length, rc.on_too_long)
    sampled, added = 0, []
    ds_config = deepspeed_config(dist, rc, world, device, AutoConfig.from_pretrained(start).hidden_size)
    if rc.policy_samples:
        extra, sampled = policy_pairs(inputs["sft"] / "model", data.train, rc.policy_samples, rc.sample_temperature,
                                      rc.sample_max_new_tokens, cfg.run.seed, rank, world, device, ds_config,
                                      cfg.model)
        added = encode_pairs(tokenizer, extra, rc.max_length, "skip").examples
        train.examples += added
        if rank == 0:
            print(f"[reward] {len(extra)} of {sampled} answers sampled from the SFT model were wrong: "
                  f"{len(added)} pairs added", flush=True)
    splits.require(len(train.examples), rc.micro_batch_size * world, f"usable training pairs (skipped: "
                    f"{dict(train.skipped)})", "reward.micro_batch_size", "data.preference")
    splits.require(len(val.examples), 1, "usable held-out pairs", "reward.micro_batch_size", "data.preference")
    if rank == 0:
        print(f"[reward] {len(train.examples)} pairs, {len(val.examples)} held out; skipped {dict(train.skipped)}, "
              f"truncated {train.truncated}", flush=True)

    torch.manual_seed(cfg.run.seed)
    dtype = load_dtype(cfg.model.dtype, uses_bf16(dist, device))
    with partitioned(ds_config):
        model = with_new_head(AutoModelForSequenceClassification, start, "reward", rank, dtype=dtype,
                              trust_remote_code=cfg.model.trust_remote_code, **quantization(rc.lora, dtype),
                              **load_kwargs(start, cfg.model, num_labels=1))
        grown = fit_embeddings(model, tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id  # the score is read at the last non-pad token
    if dist.activation_checkpointing:
        model.activation_checkpointing_enable()
    model = wrap(model, rc.lora, "sequence-classifier", "reward.lora", grown, dist.activation_checkpointing)
    ckpt, elastic = find_checkpoint(out_dir / "checkpoints", rank, world)
    engine, scheduler, grad_accum = init_engine(model, ds_config, rc, dist, elastic,
                                                partial(stage_verdict, cfg, rc, world, device, len(tokenizer)))
    order = DistributedOrder(len(train.examples), rc.micro_batch_size, rank, world, seed=cfg.run.seed)
    loop = TrainLoop("reward", rc, engine, scheduler, grad_accum, order, ckpt, elastic, out_dir, rank, world, device)

    accuracy = margin = float("nan")
    while loop.running():
        for ids in loop.micro_batches(order.next_ids):
            batch = [train.examples[i] for i in ids]
            chosen, rejected = rewards(engine, batch, tokenizer.pad_token_id, device)
            loss = pairwise_reward_loss(chosen, rejected, rc.margin, rc.center_rewards_coefficient)
            loop.backward(loss, tokens=sum(len(c) + len(r) for c, r in batch),
                          train_reward_accuracy=(chosen > rejected).float().mean().item())
        if not loop.advance():
            continue
        if loop.due(rc.log_every):
            loop.log_train()
        if loop.due(rc.eval_every):
            accuracy, margin = evaluate(engine, val.examples, rc.micro_batch_size, tokenizer.pad_token_id,
                                        rank, world, device)
            loop.log.log(loop.step, reward_accuracy=accuracy, reward_margin=margin)
        loop.save()

    return {**loop.finish(tokenizer, out_dir, cfg.model.shard_bytes), "reward_accuracy": round(accuracy, 6),
            "reward_margin": round(margin, 6), "bad_rows": data.bad_rows,
            "policy_pairs": len(added), "policy_samples": sampled,
            "skipped_identical": train.skipped["identical_responses"] + val.skipped["identical_responses"],
            "skipped_too_long": train.skipped["too_long"] + val.skipped["too_long"],
            "truncated": train.truncated + val.truncated}


if __name__ == "__main__":
    exit_process(main("reward", run))
