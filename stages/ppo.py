"""PPO stage: RLHF with proximal policy optimisation, written in this project because TRL removed its
PPO trainer. Actor initialised from SFT, critic from the reward model (its scalar head on every token),
frozen reference (SFT) and reward models; actor and critic are DeepSpeed engines (ZeRO 0-3).

    deepspeed --num_gpus 2 -m stages.ppo --config configs/tiny.yaml --set preference.algorithm=ppo

Each step: sample responses with the KV cache; score them with the reward model (plus, with
preference.verifier_reward, verifier_weight when the response is the demo item's answer); per-token reward is
the score at the last token minus kl_coef * (log pi - log pi_ref) at every token (fixed or adaptive
kl_coef); GAE advantages (whitened) and returns; then ppo_epochs passes of the clipped policy and value
losses over minibatches. The losses, GAE and the KL estimate are in model/losses.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from data import loaders
from data.chat import ChosenRows, left_pad, positions, prompt_ids
from data.loader import DistributedOrder
from model import train as T
from model.evaluate import policy_and_judge, preference_metrics, reward_scores, stop_ids
from model.losses import (AdaptiveKLController, gae, kl_per_token, masked_mean, ppo_policy_loss, ppo_value_loss,
                          token_rewards, whiten)
from pipeline.config import PipelineConfig
from pipeline.entry import stage_main
from pipeline.errors import DataError, UserError

OUTPUTS = {"model": "model"}


@torch.no_grad()
def rollout(actor, tokenizer, prompts, pc, device, synced: bool):
    """Sample one response per prompt. Returns sequences (B, P+R), attention (B, P+R), the response mask
    (B, R: 1 up to and including the first stop token) and the prompt length P."""
    ids, attention = left_pad([prompt_ids(tokenizer, p) for p in prompts], tokenizer.pad_token_id)
    stops = stop_ids(actor)
    out = actor.generate(input_ids=ids.to(device), attention_mask=attention.to(device), do_sample=True,
                         temperature=pc.temperature, top_k=pc.top_k, top_p=pc.top_p,
                         max_new_tokens=pc.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=list(stops), use_cache=True, synced_gpus=synced)
    P = ids.shape[1]
    response = out[:, P:]
    is_stop = torch.isin(response, torch.tensor(list(stops), device=device))
    after_stop = (is_stop.cumsum(1) - is_stop.long()) > 0  # strictly after the first stop token
    resp_mask = (~after_stop).long()
    return out, torch.cat([attention.to(device), resp_mask], 1), resp_mask, P


def policy_logprobs(model, seqs, attention, P: int):
    """log pi of each response token and the policy entropy there, (B, R) each."""
    logits = model(input_ids=seqs, attention_mask=attention, position_ids=positions(attention)).logits
    logits = logits[:, P - 1:-1].float()  # the logits that predicted each response token
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, seqs[:, P:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def critic_values(critic, seqs, attention, P: int):
    """V(s_t) before each response token, (B, R)."""
    out = critic(input_ids=seqs, attention_mask=attention, position_ids=positions(attention)).logits
    return out[:, P - 1:-1, 0].float()


def build_critic(reward_dir: Path, scale: float = 1.0):
    """The reward model as a token-level value model: same backbone, its scalar head applied to every token,
    scaled by the reward model's weight in the reward, so that the first values are on the reward's scale."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(reward_dir, num_labels=1)
    config.classifier_dropout = 0.0  # transformers' token classifiers default to 0.1: the values would be noisy
    critic = AutoModelForTokenClassification.from_pretrained(reward_dir, config=config)
    score = AutoModelForSequenceClassification.from_pretrained(reward_dir).score
    head = critic.classifier if critic.config.model_type == "gpt2" else critic.score  # transformers' naming
    with torch.no_grad():
        head.weight.copy_(score.weight * scale)
        if head.bias is not None:
            head.bias.zero_()
    return critic


def all_finite(device, *tensors) -> bool:
    """True on every rank only if every rank's tensors are finite."""
    bad = torch.tensor([float(not all(torch.isfinite(t).all() for t in tensors))], device=device)
    torch.distributed.all_reduce(bad)
    return bad.item() == 0


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    pc, dist = cfg.preference, cfg.distributed
    rank, world, device = T.setup_distributed()
    sft_dir, reward_dir, tokenizer, _ = policy_and_judge(inputs)
    pairs = loaders.preference_pairs(cfg.data).train
    prompts, answers = map(list, zip(*loaders.answered_prompts(pairs)))
    per_rank = pc.global_batch_size // world  # prompts each rank rolls out per step
    minibatches = per_rank // pc.micro_batch_size
    if len(prompts) < per_rank * world:
        raise DataError(f"too few prompts for PPO: {len(prompts)}")
    ptx_rows = (ChosenRows(tokenizer, pairs, pc.max_length, pc.ptx_rows(world, 1), rank, world, cfg.run.seed)
                if pc.ptx_coef else None)  # an update: one minibatch
    stat_names = ["policy_loss", "value_loss", "clip_frac", "entropy"] + (["ptx_loss"] if ptx_rows is not None else [])

    torch.manual_seed(cfg.run.seed)
    actor = AutoModelForCausalLM.from_pretrained(sft_dir)
    critic = build_critic(reward_dir, pc.reward_model_weight)
    ref = AutoModelForCausalLM.from_pretrained(sft_dir).to(device).eval().requires_grad_(False)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_dir).to(device).eval()
    # The engines step once per minibatch: the schedule counts optimizer steps, not PPO steps.
    updates = pc.ppo_epochs * minibatches
    section = pc.model_copy(update={"global_batch_size": pc.micro_batch_size * world,
                                    "max_steps": pc.max_steps * updates, "warmup_steps": pc.warmup_steps * updates})
    actor_engine, actor_sched, _ = T.init_engine(actor, section, dist, world, device)
    critic_engine, _, _ = T.init_engine(critic, section.model_copy(update={"lr": pc.critic_lr}), dist, world, device)
    engines = {"actor": actor_engine, "critic": critic_engine}
    order = DistributedOrder(len(prompts), per_rank, rank, world, seed=cfg.run.seed)
    kl_ctl = AdaptiveKLController(pc.beta, pc.kl_target, pc.kl_horizon)
    step = bad_steps = 0
    state = T.resume(engines, out_dir / "checkpoints", rank, "ppo")
    if state:
        step, bad_steps, kl_ctl.value = state["step"], state["bad_steps"], state["kl_coef"]
        order.load_state_dict(state["loader"])
    log = T.MetricsLog(out_dir / "logs", rank, resume_step=step)

    bar = tqdm(total=pc.max_steps, initial=step, desc="ppo", file=sys.stderr, disable=rank != 0, mininterval=2.0)
    while step < pc.max_steps:
        step += 1
        ids = order.next_ids()
        batch = [prompts[i] for i in ids]
        t0 = time.perf_counter()
        seqs, attention, mask, P = rollout(actor_engine.module, tokenizer, batch, pc, device, dist.zero_stage == 3)
        gen_seconds = time.perf_counter() - t0
        with torch.no_grad():
            old_logp, _ = policy_logprobs(actor_engine, seqs, attention, P)
            ref_logp, _ = policy_logprobs(ref, seqs, attention, P)
            old_values = critic_values(critic_engine, seqs, attention, P)
            texts = [tokenizer.decode(r[m.bool()], skip_special_tokens=True).strip() for r, m in zip(seqs[:, P:], mask)]
            score = pc.reward_model_weight * torch.tensor(reward_scores(reward_model, tokenizer, batch, texts),
                                                          device=device)
            if pc.verifier_reward:
                score += pc.verifier_weight * torch.tensor([float(t == answers[i]) for t, i in zip(texts, ids)],
                                                           device=device)
            rewards = token_rewards(score, old_logp, ref_logp, mask.float(), kl_ctl.value)
            advantages, returns = gae(rewards, old_values, mask.float(), pc.gamma, pc.lam)
            advantages = whiten(advantages, mask.float())
        stats = dict.fromkeys(stat_names, 0.0)
        finite = all_finite(device, score, advantages)
        for epoch in range(pc.ppo_epochs if finite else 0):
            for k, mb in enumerate(torch.arange(per_rank).split(pc.micro_batch_size)):
                m = mask[mb].float()
                logp, entropy = policy_logprobs(actor_engine, seqs[mb], attention[mb], P)
                pg_loss, clip_frac = ppo_policy_loss(logp, old_logp[mb], advantages[mb], m, pc.cliprange)
                values = critic_values(critic_engine, seqs[mb], attention[mb], P)
                v_loss = ppo_value_loss(values, old_values[mb], returns[mb], m, pc.cliprange_value)
                ptx_loss = torch.zeros((), device=device)
                if ptx_rows is not None:  # PPO-ptx: the update's own rows of the chosen responses
                    ptx_loss = ptx_rows.loss(actor_engine, (step - 1) * updates + epoch * minibatches + k, device)
                if not all_finite(device, pg_loss, v_loss, ptx_loss):
                    finite = False
                    break
                actor_engine.backward(pg_loss + pc.ptx_coef * ptx_loss)
                actor_engine.step()
                critic_engine.backward(v_loss)
                critic_engine.step()
                for name, v in zip(stat_names, (pg_loss, v_loss, clip_frac, masked_mean(entropy, m), ptx_loss)):
                    stats[name] += v.item() / updates
            if not finite:
                break
        if not finite:
            bad_steps += 1
            if rank == 0:
                print(f"warning: [ppo] step {step}: NaN/Inf in reward or loss, step skipped ({bad_steps} so far)",
                      file=sys.stderr, flush=True)
            if bad_steps > pc.max_bad_steps:
                raise UserError(f"ppo: {bad_steps} steps with NaN/Inf rewards or losses (preference.max_bad_steps="
                                f"{pc.max_bad_steps}); stopped, the last good checkpoint is kept in {out_dir / 'checkpoints'}")
        kl = masked_mean(kl_per_token(old_logp, ref_logp), mask.float()).item() * mask.sum(1).float().mean().item()
        kl = T.all_mean(kl, device)
        kl_ctl.update(kl, per_rank * world)
        bar.update(1)
        if step % pc.log_every == 0 or step == pc.max_steps:
            reward_mean = T.all_mean(score.mean().item(), device)
            log.log(step, reward_mean=reward_mean, reward_std=T.all_mean(score.std().item(), device), kl=kl,
                    kl_coef=kl_ctl.value, response_length=T.all_mean(mask.sum(1).float().mean().item(), device),
                    gen_tokens_per_sec=T.all_mean(mask.sum().item() / gen_seconds, device) * world,
                    lr=actor_sched.get_last_lr()[0], bad_steps=bad_steps,
                    **{k: T.all_mean(v, device) for k, v in stats.items()})
        if step % pc.save_every == 0 and step < pc.max_steps:
            T.save_step(engines, out_dir / "checkpoints", step, {"step": step, "loader": order.state_dict(),
                        "kl_coef": kl_ctl.value, "bad_steps": bad_steps}, rank, pc.keep_last)
    bar.close()
    log.close()

    state_dict = T.full_state_dict(actor_engine.module, dist.zero_stage, rank)
    metrics = {"global_step": step, "bad_steps": bad_steps, "kl_coef": kl_ctl.value}
    if rank == 0:
        T.export_hf(actor_engine.module, state_dict, tokenizer, out_dir / "model", list(stop_ids(ref)))
        metrics.update(preference_metrics(cfg, "ppo", out_dir / "model", sft_dir, reward_dir))
    T.barrier()
    return metrics


if __name__ == "__main__":
    sys.exit(stage_main("ppo", run, OUTPUTS))
