"""PPO stage: RLHF with proximal policy optimisation, written in this project because TRL removed its
PPO trainer. Actor initialised from SFT, critic from the reward model (its scalar head on every token; without
one, preference.ppo.critic or the SFT model with a new value head), frozen reference (SFT) and reward models;
actor and critic are DeepSpeed engines (ZeRO 0-3), with full weights or LoRA adapters (`preference.lora`: then
the reference is the actor with its adapters disabled).

    gptforge stage ppo -c configs/tiny.yaml --set preference.algorithm=ppo
    deepspeed --num_gpus 2 -m gptforge.stages.ppo --config CONFIG --out DIR --input sft=DIR [--input reward=DIR]

Each step: sample responses to the online prompts (data.prompts) with the KV cache; score them with
preference.rewards (gptforge.model.rewards: the reward model, checkers, the user's functions, a reward server,
weighed and summed, each logged as rewards/<label>); per-token reward is
the score at the last token minus kl_coef * (log pi - log pi_ref) at every token (fixed or adaptive
kl_coef); GAE advantages (whitened) and returns; then ppo_epochs passes of the clipped policy and value
losses over minibatches. The losses, GAE and the KL estimate are in gptforge.model.train.losses; log-probabilities and
entropies are TRL's helpers. The held-out report is the evaluation step's (gptforge.stages.evaluate).

With tools (preference.environment, preference.tools) each rollout is an episode of up to preference.max_turns turns
(gptforge.model.agents): the policy's own tokens alone are trained and enter the KL, the tool turns between them
are masked; the rewards read the last turn and the whole trajectory (`messages`); `rollouts/step-N.jsonl` keeps
each logged step's episodes.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from gptforge.core.config import PipelineConfig
from gptforge.data import splits
from gptforge.data.chat import ChosenRows, positions
from gptforge.data.batches import DistributedOrder
from gptforge.model.lora import as_reference, quantization, wrap
from gptforge.model.train.checkpoints import find_checkpoint, resume, save_step
from gptforge.model.train.distributed import all_mean, all_sum, barrier, setup_distributed
from gptforge.model.train.engine import deepspeed_config, frozen, grad_norm, init_engine, partitioned, unwrap, uses_bf16
from gptforge.model import rewards
from gptforge.model.trainers import overlong
from gptforge.model.sampling.generate import (check_same_vocabulary, policy_and_judge, reward_scores,
                                             same_vocabulary, stop_ids)
from gptforge.model.agents.calls import format_of
from gptforge.model.agents.concurrency import Concurrent
from gptforge.model.agents.episode import agent_spec as make_spec
from gptforge.model.agents.episode import environment_rewards, episode_metrics, spec_agent, write_trajectories
from gptforge.model.sampling.offpolicy import mismatch, token_weights
from gptforge.model.sampling.workers import rollout_source
from gptforge.model.export import export_model, hf_tensor
from gptforge.model.train.guard import StepGuard
from gptforge.model.train.losses import (AdaptiveKLController, causal_lm_loss, gae, kl_per_token, masked_mean,
                                         ppo_policy_loss, ppo_value_loss, router_loss, token_rewards, whiten)
from gptforge.model.train.metrics import MetricsLog, Throughput
from gptforge.model.plan import stage_verdict
from gptforge.model.attention import load_kwargs
from gptforge.model.train.tiling import logit_tiles, token_logprobs
from gptforge.model.pretrained import load_dtype, load_policy, model_dir, reference_dir, reference_is_policy
from gptforge.stages.entry import exit_process, main

# its log-probabilities' kernels (gptforge.model.train.tiling), which import TRL's utilities as they are first used;
# imported by the warm agent before it forks the ranks (gptforge.stages.entry.preload)
RANK_IMPORTS = ("trl.trainer.utils",)


def policy_logprobs(model, seqs, attention, P: int, aux: bool = False, tiles: int = 1):
    """log pi of each response token and the policy entropy there, (B, R) each (from the logits that predicted
    each response token; `tiles` > 1: a tile of them at a time, gptforge.model.train.tiling); with `aux`, also a mixture
    of experts' weighed load-balancing loss (None for a dense model)."""
    inputs = {"input_ids": seqs, "attention_mask": attention, "position_ids": positions(attention)}
    logp, entropy, out = token_logprobs(model, inputs, P - 1, seqs[:, P:], tiles)
    return (logp, entropy, router_loss(out, unwrap(model).config)) if aux else (logp, entropy)


def critic_values(critic, seqs, attention, P: int):
    """V(s_t) before each response token, (B, R)."""
    out = critic(input_ids=seqs, attention_mask=attention, position_ids=positions(attention)).logits
    return out[:, P - 1:-1, 0].float()


def build_critic(start: Path, scale: float = 1.0, model_cfg=None, **kwargs):
    """A token-level value model from `start`: a reward model's backbone with its scalar head applied to every
    token, scaled by the reward model's weight in the reward, so that the first values are on the reward's scale;
    a model without a reward head (a causal LM) gets a zero one. Inside `partitioned` (ZeRO-3) the critic loads
    partitioned and only its head is gathered to be set."""
    import deepspeed
    from transformers import AutoModelForTokenClassification

    attention = load_kwargs(start, model_cfg, num_labels=1)
    attention["config"].classifier_dropout = 0.0  # transformers' token classifiers default to 0.1: noisy values
    critic = AutoModelForTokenClassification.from_pretrained(start, **attention, **kwargs)
    config = critic.config
    head = critic.classifier if critic.config.model_type == "gpt2" else critic.score  # transformers' naming
    params = [p for p in (head.weight, head.bias) if p is not None]
    reward_head = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=hasattr(head.weight, "ds_id")), \
            torch.no_grad():
        head.weight.copy_(hf_tensor(start, "score.weight") * scale if reward_head else torch.zeros_like(head.weight))
        if head.bias is not None:
            head.bias.zero_()
    return critic


def all_finite(device, *tensors) -> bool:
    """True on every rank only if every rank's tensors are finite."""
    bad = torch.tensor([float(not all(torch.isfinite(t).all() for t in tensors))], device=device)
    torch.distributed.all_reduce(bad)
    return bad.item() == 0


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    pc, oc, rc, dist = cfg.preference, cfg.preference.ppo, cfg.preference.rollout, cfg.distributed
    rank, world, device = setup_distributed(cfg.distributed, reserve=rc.workers if rc.mode == "async" else 0)
    sft_dir, reward_dir, tokenizer, reward_tokenizer = policy_and_judge(cfg, inputs)
    # the critic reads the policy's tokens: the reward model where it shares their vocabulary, else a new head
    critic_dir = model_dir(oc.critic, None, "preference.ppo.critic") if oc.critic else \
        reward_dir if reward_dir and same_vocabulary(tokenizer, reward_tokenizer) else sft_dir
    for key, d in (("preference.ppo.critic", critic_dir), ("preference.reference", reference_dir(cfg, inputs))):
        check_same_vocabulary(tokenizer, AutoTokenizer.from_pretrained(d), f"{key} {d}")
    per_rank = pc.global_batch_size // world  # prompts each rank rolls out per step
    minibatches = per_rank // pc.micro_batch_size
    scoring, items = rewards.for_stage(cfg, tokenizer, per_rank * world, sampling=oc)
    prompts, answers = [it["prompt"] for it in items], [it["answer"] for it in items]
    columns = rewards.columns_of(items)
    calls = Concurrent(pc.tool_concurrency)  # the rewards' functions and servers, at once
    agent = agent_spec = None
    if pc.environment or pc.tools:
        agent_spec = make_spec(pc, format_of(tokenizer.chat_template, str(sft_dir)), pc.max_length)
        agent = spec_agent(agent_spec)
    ptx_rows = (ChosenRows(tokenizer, splits.preference_pairs(cfg.data).train, pc.max_length,
                           oc.ptx_rows(pc.micro_batch_size, world, 1), rank, world, cfg.run.seed)
                if oc.ptx_coef else None)  # an update: one minibatch
    stat_names = ["policy_loss", "value_loss", "clip_frac", "entropy"] + (["ptx_loss"] if ptx_rows is not None else [])

    # The engines step once per minibatch: the schedule counts optimizer steps, not PPO steps.
    updates = oc.ppo_epochs * minibatches
    section = pc.model_copy(update={"global_batch_size": pc.micro_batch_size * world,
                                    "max_steps": pc.max_steps * updates, "warmup_steps": pc.warmup_steps * updates})
    critic_section = section.model_copy(update={"lr": oc.critic_lr})
    hidden = AutoConfig.from_pretrained(sft_dir).hidden_size
    actor_config = deepspeed_config(dist, section, world, device, hidden)
    critic_config = deepspeed_config(dist, critic_section, world, device, hidden)
    torch.manual_seed(cfg.run.seed)
    bf16, lora = uses_bf16(dist, device), pc.lora
    dtype = load_dtype(cfg.model.dtype, bf16)
    ref_dir = reference_dir(cfg, inputs)
    with partitioned(actor_config):  # ZeRO-3: all models partitioned as they load
        actor = load_policy(sft_dir, cfg, bf16)
        critic = wrap(build_critic(critic_dir, pc.reward_weight(), cfg.model, dtype=dtype,
                                   **quantization(lora, dtype)),
                      lora, "token-classifier", "preference.lora", checkpointing=dist.activation_checkpointing)
        ref = None if reference_is_policy(cfg) else frozen(
            AutoModelForCausalLM.from_pretrained(ref_dir, **load_kwargs(ref_dir, cfg.model)), actor_config, device)
        reward_model = None if reward_dir is None else frozen(AutoModelForSequenceClassification.from_pretrained(
            reward_dir, **load_kwargs(reward_dir, cfg.model)), actor_config, device)
    judge = None if reward_model is None else partial(reward_scores, reward_model, reward_tokenizer)
    ckpt, elastic = find_checkpoint(out_dir / "checkpoints", rank, world)
    verdict = partial(stage_verdict, cfg, pc, world, device, len(tokenizer))
    actor_engine, actor_sched, _ = init_engine(actor, actor_config, section, dist, elastic, verdict)
    moe = getattr(actor.config, "router_aux_loss_coef", None)  # a mixture of experts: its aux loss is logged
    stat_names += ["aux_loss"] if moe else []
    critic_engine, _, _ = init_engine(critic, critic_config, critic_section, dist, elastic, verdict)
    engines = {"actor": actor_engine, "critic": critic_engine}
    order = DistributedOrder(len(prompts), per_rank, rank, world, seed=cfg.run.seed)
    kl_ctl = AdaptiveKLController(pc.beta, oc.kl_target, oc.kl_horizon)
    step = 0
    state = resume(engines, ckpt, elastic, rank, world, "ppo")
    guard = StepGuard(pc, "ppo", actor_engine, device, rank, world, key="preference")
    if state:
        step, kl_ctl.value = state["step"], state["kl_coef"]
        order.load_state_dict(state["loader"])
        guard.load_state_dict(state.get("guard"))
    log = MetricsLog(out_dir / "logs", rank, resume_step=step)
    synced, stops = dist.zero_stage == 3, stop_ids(actor)
    everyone = (lambda any_open: all_sum([float(any_open)], device)[0] > 0) if synced else None
    source = rollout_source(cfg, oc, actor_engine.module, sft_dir, tokenizer, agent, agent_spec,
                            lambda ids: ([prompts[i] for i in ids], [items[i] for i in ids]), rank, world, synced,
                            everyone, stops, out_dir / "logs")
    try:
        # the checkpoint's batches in flight (none where another number of processes wrote it: then fresh ones,
        # the weights' version the steps taken)
        kept = (state or {}).get("rank_state", {}).get("rollouts") or {"version": step}
        source.load_state(kept, actor_engine.module)

        bar = tqdm(total=pc.max_steps, initial=step, desc="ppo", file=sys.stderr, disable=rank != 0, mininterval=2.0)
        throughput = Throughput(reduce=lambda tokens: all_sum([tokens], device)[0])
        rows = max(pc.micro_batch_size, per_rank)  # scoring takes a rank's rollouts at once, training a micro-batch
        tiles = logit_tiles(dist, rows, pc.max_length if agent else oc.max_new_tokens, len(tokenizer))  # responses
        while step < pc.max_steps:
            step += 1
            t0 = time.perf_counter()
            ids, sampled = source.next(lambda: guard.next(order.next_ids), step)
            batch = [prompts[i] for i in ids]
            sampled = sampled.to(device)
            seqs, attention, mask, P, episodes = sampled.seqs, sampled.attention, sampled.mask, sampled.P, \
                sampled.episodes
            gen_seconds, trained_from = time.perf_counter() - t0, time.time()
            staleness = source.version - sampled.version
            with torch.no_grad():
                old_logp, _ = policy_logprobs(actor_engine, seqs, attention, P, tiles=tiles)
                weights = token_weights(old_logp, sampled.logprobs, rc)
                drift = {k: all_mean(v, device) for k, v in mismatch(old_logp, sampled.logprobs, mask, rc).items()}
                with as_reference(actor_engine, ref) as reference:
                    ref_logp, _ = policy_logprobs(reference, seqs, attention, P, tiles=tiles)
                old_values = critic_values(critic_engine, seqs, attention, P)
                cols = {k: [v[i] for i in ids] for k, v in columns.items()}
                if episodes is None:
                    texts = [tokenizer.decode(r[m.bool()], skip_special_tokens=True).strip()
                             for r, m in zip(seqs[:, P:], mask)]
                else:  # the last turn; the whole trajectory and the environment's own reward beside it
                    texts = [e.response.strip() for e in episodes]
                    cols |= {"messages": [e.messages for e in episodes],
                             "environment_reward": environment_rewards(episodes, agent.setup.calls)}
                total, each = rewards.score(scoring, batch, texts, [answers[i] for i in ids], cols, judge, calls)
                score = torch.tensor(total, device=device) * guard.scale  # a drill's NaN (model/train/guard.py)
                cut = overlong.cut(seqs, mask, P, stops, episodes)
                if oc.overlong == "mask":  # cut responses leave the loss (gptforge.model.trainers.overlong)
                    mask = mask * ~cut[:, None]
                per_token = token_rewards(score, old_logp, ref_logp, mask.float(), kl_ctl.value)
                advantages, returns = gae(per_token, old_values, mask.float(), oc.gamma, oc.lam)
                advantages = whiten(advantages, mask.float())
            stats = dict.fromkeys(stat_names, 0.0)
            finite = all_finite(device, score, advantages)
            drifted = rc.max_mismatch is not None and drift["mismatch/kl"] > rc.max_mismatch
            for epoch in range(oc.ppo_epochs if finite and not drifted else 0):
                for k, mb in enumerate(torch.arange(per_rank).split(pc.micro_batch_size)):
                    m = mask[mb].float()
                    logp, entropy, aux = policy_logprobs(actor_engine, seqs[mb], attention[mb], P, aux=True,
                                                         tiles=tiles)
                    pg_loss, clip_frac = ppo_policy_loss(logp, old_logp[mb], advantages[mb], m, oc.cliprange,
                                                         None if weights is None else weights[mb])
                    values = critic_values(critic_engine, seqs[mb], attention[mb], P)
                    v_loss = ppo_value_loss(values, old_values[mb], returns[mb], m, oc.cliprange_value)
                    ptx_loss = torch.zeros((), device=device)
                    if ptx_rows is not None:  # PPO-ptx: the update's own rows of the chosen responses
                        x, a, y = ptx_rows.batch((step - 1) * updates + epoch * minibatches + k)
                        ptx_loss = causal_lm_loss(actor_engine(input_ids=x.to(device),
                                                               attention_mask=a.to(device)).logits, y.to(device))
                    if not all_finite(device, pg_loss, v_loss, ptx_loss):
                        finite = False
                        break
                    actor_engine.backward(pg_loss + oc.ptx_coef * ptx_loss + (0 if aux is None else aux))
                    guard.step(actor_engine)  # a non-finite gradient norm: DeepSpeed drops that update
                    critic_engine.backward(v_loss)
                    guard.step(critic_engine)
                    values_of = [pg_loss, v_loss, clip_frac, masked_mean(entropy, m)] + (
                        [ptx_loss] if ptx_rows is not None else []) + ([aux / moe] if moe else [])
                    for name, v in zip(stat_names, values_of):
                        stats[name] += v.item() / updates
                if not finite:
                    break
            guard.verdict = None if finite and not drifted else "reward, advantage or loss NaN/Inf" if not finite \
                else (f"the rollouts' mismatch, KL {drift['mismatch/kl']:.4g} a token, is over "
                      f"preference.rollout.max_mismatch ({rc.max_mismatch:g})")
            outcome = guard.settle(step)
            if outcome == "rollback":  # actor, critic and KL coefficient from the newest checkpoint; prompts go on
                state = guard.rollback(engines, out_dir / "checkpoints", step)
                step, kl_ctl.value = state["step"], state["kl_coef"]
                source.load_state(state.get("rank_state", {}).get("rollouts") or {"version": step},
                                  actor_engine.module)
            else:  # the weights the next rollouts are sampled with (a skipped step may have taken some updates)
                source.updated(actor_engine.module)
            source.timeline.span("trainer", "train", trained_from, time.time(), step)
            if outcome == "skip":
                step -= 1  # the step is taken again on the prompts that follow
            if outcome != "ok":
                bar.n = step
                continue
            throughput.step(time.perf_counter() - t0, int(attention.sum()))
            kl_token = masked_mean(kl_per_token(old_logp, ref_logp), mask.float()).item()
            kl = all_mean(kl_token * mask.sum(1).float().mean().item(), device)  # nats per response
            kl_ctl.update(kl, per_rank * world)
            bar.update(1)
            if step % pc.log_every == 0 or step == pc.max_steps:
                each_mean = {f"rewards/{k}": all_mean(sum(v) / len(v), device) for k, v in each.items()}
                log.log(step, reward_mean=all_mean(score.mean().item(), device), **each_mean,
                        reward_std=all_mean(score.std().item(), device), kl=kl,
                        kl_per_token=all_mean(kl_token, device),
                        kl_coef=kl_ctl.value, **drift, **{"rollout/staleness": staleness,
                                                          "rollout/version": sampled.version,
                                                          "rollout/truncated": all_mean(cut.float().mean().item(),
                                                                                        device)},
                        response_length=all_mean(mask.sum(1).float().mean().item(), device),
                        gen_tokens_per_sec=all_mean(mask.sum().item() / gen_seconds, device) * world,
                        tokens_per_sec=throughput.window_rate(), lr=actor_sched.get_last_lr()[0],
                        rollout_wait_s=all_mean(gen_seconds, device),
                        grad_norm=grad_norm(actor_engine), bad_steps=guard.bad_steps,
                        **{k: all_mean(v, device) for k, v in stats.items()},
                        **episode_metrics(episodes, device, sampled.extra.get("tool_wait_s")))
                if episodes is not None and rank == 0:
                    write_trajectories(out_dir / "rollouts", step, episodes, total, each)
            if step % pc.save_every == 0 and step < pc.max_steps:
                save_step(engines, out_dir / "checkpoints", step, {"step": step, "loader": order.state_dict(),
                          "kl_coef": kl_ctl.value, "guard": guard.state_dict()}, rank, world, pc.keep_last,
                          {"rollouts": source.state()})
    finally:
        source.close()
    bar.close()
    log.close()

    tokens_per_sec = throughput.rate()
    export_model(actor_engine, tokenizer, out_dir / "model", rank, cfg.model.shard_bytes)
    barrier()
    return {"global_step": step, "bad_steps": guard.bad_steps, "rollbacks": guard.rollbacks, "kl_coef": kl_ctl.value,
            "tokens_per_sec": tokens_per_sec}


if __name__ == "__main__":
    exit_process(main("ppo", run))
