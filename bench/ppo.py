"""PPO benchmark, on the SFT and reward models of a finished run (default: runs/, configs/tiny.yaml):

1. rollout generation with the KV cache against without it, same prompts, same length, same seed;
2. one PPO iteration (one process, DeepSpeed engines as the stage builds them) split into generation,
   scoring (actor/reference/critic log-probs and values, reward model) and training (PPO epochs).

    .venv/bin/python bench/ppo.py [-c configs/tiny.yaml] [--prompts 64] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from gptforge.core.config import load_config
from gptforge.data import splits
from gptforge.data.chat import left_pad, prompt_ids
from gptforge.model.train.distributed import setup_distributed
from gptforge.model.train.engine import deepspeed_config, init_engine
from gptforge.model.sampling.generate import reward_scores
from gptforge.model.train.losses import gae, ppo_policy_loss, ppo_value_loss, token_rewards, whiten
from gptforge.pipeline.store import locate, read_manifest
from gptforge.model.sampling.generate import stop_ids
from gptforge.model.sampling.engine import HFEngine
from gptforge.model.sampling.sampling import sample
from gptforge.stages.ppo import build_critic, critic_values, policy_logprobs

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    cfg = load_config(args.config, args.set)
    sft_dir, reward_dir = locate(cfg, "sft")[0], locate(cfg, "reward")[0]
    if read_manifest(sft_dir) is None or read_manifest(reward_dir) is None:
        sys.exit(f"run the pipeline first (make run): no complete sft/reward output for {args.config}")
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sft_dir / "model")
    actor = AutoModelForCausalLM.from_pretrained(sft_dir / "model").eval()
    prompts = [pp["prompt"] for pp in splits.preference_pairs(cfg.data).train[:args.prompts]]

    ids, attention = left_pad([prompt_ids(tokenizer, pr) for pr in prompts], tokenizer.pad_token_id)

    def gen(cache: bool):
        torch.manual_seed(0)
        with torch.no_grad():
            # min_new_tokens: both runs produce exactly the same number of tokens
            return actor.generate(input_ids=ids, attention_mask=attention, do_sample=True, use_cache=cache,
                                  max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                  pad_token_id=tokenizer.pad_token_id)

    gen(True)  # warm-up
    with_cache, t_cache = timed(lambda: gen(True))
    without_cache, t_nocache = timed(lambda: gen(False))
    tokens = args.prompts * args.new_tokens
    print(f"generation, {args.prompts} prompts x {args.new_tokens} new tokens:")
    print(f"  KV cache:    {t_cache:7.2f}s  {tokens / t_cache:9,.0f} tokens/s")
    print(f"  no KV cache: {t_nocache:7.2f}s  {tokens / t_nocache:9,.0f} tokens/s")
    print(f"  ratio cache/no cache: {t_nocache / t_cache:.2f}x  "
          f"(same tokens: {torch.equal(with_cache, without_cache)})")

    # One PPO iteration as the stage runs it, in a process group of one.
    pc = cfg.preference.model_copy(update={"global_batch_size": args.prompts,
                                           "micro_batch_size": min(args.prompts, cfg.preference.micro_batch_size)})
    oc = cfg.preference.ppo.model_copy(update={"max_new_tokens": args.new_tokens})
    dist = cfg.distributed.model_copy(update={"nproc_per_node": 1, "zero_stage": 0})
    rank, world, device = setup_distributed()
    section = pc.model_copy(update={"global_batch_size": pc.micro_batch_size})
    actor = AutoModelForCausalLM.from_pretrained(sft_dir / "model")
    config = deepspeed_config(dist, section, 1, device)
    actor_engine, _, _ = init_engine(actor, config, section, dist)
    critic_engine, _, _ = init_engine(build_critic(reward_dir / "model"), config, section, dist)
    ref = AutoModelForCausalLM.from_pretrained(sft_dir / "model").eval()
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_dir / "model").eval()
    engine = HFEngine(actor_engine.module, tokenizer.pad_token_id)
    drawn, t_gen = timed(lambda: sample(engine, tokenizer, prompts, [], oc, None, stop_ids(actor_engine.module)))
    seqs, attn, mask, P = drawn.seqs.to(device), drawn.attention.to(device), drawn.mask.to(device), drawn.P

    def score():
        with torch.no_grad():
            old_logp, _ = policy_logprobs(actor_engine, seqs, attn, P)
            ref_logp, _ = policy_logprobs(ref, seqs, attn, P)
            values = critic_values(critic_engine, seqs, attn, P)
            texts = [tokenizer.decode(r[m.bool()], skip_special_tokens=True) for r, m in zip(seqs[:, P:], mask)]
            s = torch.tensor(reward_scores(reward_model, tokenizer, prompts, texts))
        return old_logp, ref_logp, values, s

    (old_logp, ref_logp, values, s), t_score = timed(score)

    def train():
        m = mask.float()
        adv, ret = gae(token_rewards(s, old_logp, ref_logp, m, pc.beta), values, m, oc.gamma, oc.lam)
        adv = whiten(adv, m)
        for _ in range(oc.ppo_epochs):
            for mb in torch.arange(len(prompts)).split(pc.micro_batch_size):
                logp, _ = policy_logprobs(actor_engine, seqs[mb], attn[mb], P)
                loss, _ = ppo_policy_loss(logp, old_logp[mb], adv[mb], m[mb], oc.cliprange)
                actor_engine.backward(loss)
                actor_engine.step()
                v_loss = ppo_value_loss(critic_values(critic_engine, seqs[mb], attn[mb], P), values[mb], ret[mb],
                                        m[mb], oc.cliprange_value)
                critic_engine.backward(v_loss)
                critic_engine.step()

    _, t_train = timed(train)
    total = t_gen + t_score + t_train
    print(f"one PPO iteration ({args.prompts} prompts, {oc.ppo_epochs} epochs, minibatch {pc.micro_batch_size}): "
          f"{total:.2f}s")
    for name, t in (("generation", t_gen), ("scoring", t_score), ("training", t_train)):
        print(f"  {name:10s} {t:7.2f}s  {t / total:6.1%}")


if __name__ == "__main__":
    main()
