"""Distill stage: on-policy distillation. The student samples the run's prompts (data.prompts; with
preference.environment and preference.tools each sample is an episode with tools), the teacher scores every token of
those samples, and the student learns toward the teacher's next-token distribution at each of its own tokens
(Agarwal et al. 2024, GKD; Thinking Machines' on-policy distillation; Qwen3's small models). The signal is dense and
on the student's own distribution: it reaches an RL-trained teacher's accuracy in a fraction of RL's steps
(bench/distill.py).

    gptforge stage distill -c CONFIG --set distill.enabled=true --set distill.teacher=grpo
    deepspeed --num_gpus 8 -m gptforge.stages.distill --config CONFIG --out DIR --input sft=DIR --input grpo=DIR

- The teacher (distill.teacher): a stage of the run (grpo, ppo, ...) or a model (hub name or directory); the
  student starts from distill.student (the SFT stage's output by default, or a model: smaller than its teacher is
  the common case). They must share one tokenizer: the stage (and the preflight, where both are on disk) refuses
  two vocabularies with one error line naming both (docs/distill.md says why, and what TRL's GOLD does instead).
- The loss, per student token (the prompt and tool results masked, as the rollout room masks them for PPO): the
  divergence of distill.beta in TRL's convention (1, the default: reverse KL(student || teacher); 0: forward KL;
  between: the generalised JSD) over the teacher's whole distribution, or its distill.teacher_top_k most likely
  tokens with both renormalised on them (gptforge.model.train.losses.generalized_jsd). The student's logits are
  taken a tile at a time where they would be large (gptforge.model.train.tiling), as PPO's are.
- The teacher scores through the engine seam (gptforge.model.sampling.engine: `score`): hf is the teacher in the
  training processes (partitioned under ZeRO-3 like a reference model); distill.teacher_engine names a served one.
- Rollouts come from the rollout room as PPO's do (preference.rollout: sync, or async workers sampling ahead with
  the student's newer weights), so tools, token-exact episodes and off-policy staleness work unchanged.

Why not TRL's DistillationTrainer (TRL 1.16): its teacher is a model in the trainer's processes, reached through its
hidden states and LM head, so a served teacher cannot score; it samples with its own tool loop (no timeouts, the
call schemas of the templates it knows) rather than the rollout room's episodes; and it has no rollout workers
ahead of the trainer. Its divergence is the same (TRL's beta convention, tested against its kernel in
tests/model/test_losses.py).

Metrics: `loss` (the divergence a token), `distill_kl` (the reverse KL a token over the support, whatever beta),
`teacher_logp` and `student_logp` (the mean log-probability of the student's sampled tokens under each), the
rollouts' (response_length, gen_tokens_per_sec, rollout_wait_s, staleness) and tokens_per_sec; in its result,
`teacher_scored_tokens` (every student token the teacher scored, skipped steps' too). Each logged step's samples
(rank 0's) go to `rollouts/step-<step>.jsonl`: their ids, and each token's log-probability when sampled, under the
teacher and under the student as it trained on them.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from gptforge.core.config import PipelineConfig
from gptforge.data import splits
from gptforge.data.batches import DistributedOrder
from gptforge.data.chat import positions
from gptforge.model.attention import load_kwargs
from gptforge.model.lora import wrap
from gptforge.model.plan import stage_verdict
from gptforge.model.pretrained import check_same_tokenizer, load_causal_lm, stage_or_model
from gptforge.model.agents.calls import format_of
from gptforge.model.sampling.engine import HFEngine, engine_class
from gptforge.model.agents.episode import agent_spec as make_spec
from gptforge.model.agents.episode import episode_metrics, spec_agent
from gptforge.model.sampling.generate import stop_ids
from gptforge.model.sampling.workers import rollout_source
from gptforge.model.train.checkpoints import find_checkpoint
from gptforge.model.train.distributed import all_mean, all_sum, setup_distributed
from gptforge.model.train.engine import deepspeed_config, frozen, init_engine, partitioned, uses_bf16
from gptforge.model.train.loop import TrainLoop
from gptforge.model.train.losses import generalized_jsd, masked_mean, on_support
from gptforge.model.train.tiling import final_hidden, logit_tiles
from gptforge.stages.entry import exit_process, main


def _tile(logits: torch.Tensor, teacher_logp: torch.Tensor, ids: torch.Tensor | None, tokens: torch.Tensor,
          beta: float):
    """For one tile of response positions: the divergence of `beta`, the reverse KL and the student's log-probability
    of its own token, (b, r) each."""
    logp = torch.log_softmax(logits.float(), -1)
    s, t = on_support(logp, teacher_logp, ids)
    divergence = generalized_jsd(s, t, beta)
    with torch.no_grad():
        reverse = divergence.detach() if beta == 1 else generalized_jsd(s, t, 1.0)
    return divergence, reverse, logp.gather(-1, tokens[..., None])[..., 0].detach()


def divergences(model, seqs: torch.Tensor, attention: torch.Tensor, P: int, scores, beta: float, tiles: int):
    """The student's (divergence, reverse KL, log-probability of its token), (b, R) each, at the response positions
    of `seqs` against the teacher's `scores`: from the whole logits, or (tiles > 1) a checkpointed tile of positions
    at a time from the final hidden states, so that no more than one tile's logits exist."""
    inputs = {"input_ids": seqs, "attention_mask": attention, "position_ids": positions(attention), "use_cache": False}
    tokens = seqs[:, P:]
    if tiles <= 1:
        return _tile(model(**inputs).logits[:, P - 1:-1], scores.logprobs, scores.ids, tokens, beta)
    head, hidden, _ = final_hidden(model, inputs)
    hidden = hidden[:, P - 1:-1]

    def tile(h, t, i, tok):
        return _tile(head(h), t, i, tok, beta)

    chunks = [x.chunk(tiles, dim=1) if x is not None else [None] * tiles
              for x in (hidden, scores.logprobs, scores.ids, tokens)]
    parts = [checkpoint(tile, *c, use_reentrant=False) for c in zip(*chunks)]
    return tuple(torch.cat([p[k] for p in parts], 1) for k in range(3))


def sample_rows(seqs, attention, P: int, mask, sampling, teacher, student) -> list[dict]:
    """A micro-batch's samples as trajectory rows: the prompt's and the response's ids (padding dropped), and for
    each response token its log-probability when sampled, under the teacher and under the student trained on it."""
    rows = []
    for i in range(seqs.size(0)):
        n = int(attention[i, P:].sum())  # the response, tool tokens (mask 0) included
        prompt = seqs[i, :P][attention[i, :P].bool()]
        rows.append({"prompt_ids": prompt.tolist(), "ids": seqs[i, P:P + n].tolist(),
                     "mask": [int(x) for x in mask[i, :n]],
                     **{k: [round(float(x), 6) for x in v[i, :n]] for k, v in
                        (("logprobs", sampling), ("teacher_logprobs", teacher), ("student_logprobs", student))}})
    return rows


def write_samples(folder: Path, step: int, rows: list[dict]) -> None:
    """A logged step's samples (rank 0's) as `rollouts/step-<step>.jsonl`, written whole or not at all."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"step-{step:08d}.jsonl.part"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(folder / f"step-{step:08d}.jsonl")


def teacher_engine(cfg, teacher_dir: Path, config: dict, device, pad_id: int, synced: bool):
    """What scores the samples under the teacher (distill.teacher_engine): the teacher in this process, held as a
    reference model is (partitioned under ZeRO-3), or the user's engine over its directory."""
    spec = cfg.distill.teacher_engine
    cls = engine_class(spec, "distill.teacher_engine", ("score",))
    if cls is not HFEngine:
        return cls(str(teacher_dir))
    from transformers import AutoModelForCausalLM

    with partitioned(config):
        model = AutoModelForCausalLM.from_pretrained(teacher_dir, **load_kwargs(teacher_dir, cfg.model))
        return HFEngine(frozen(model, config, device), pad_id, synced)


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    dc, pc, rc, dist = cfg.distill, cfg.preference, cfg.preference.rollout, cfg.distributed
    rank, world, device = setup_distributed(dist, reserve=rc.workers if rc.mode == "async" else 0)
    student_dir = stage_or_model(cfg, inputs, "distill.student")
    teacher_dir = stage_or_model(cfg, inputs, "distill.teacher")
    check_same_tokenizer(student_dir, teacher_dir, f"distill.teacher={dc.teacher}")
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    per_rank = dc.global_batch_size // world  # prompts each rank samples a step
    key = "data.prompts" if cfg.data.prompts.path is not None else "data.preference"
    items = splits.online_prompts(cfg.data).train
    splits.require(len(items), per_rank * world, "distinct prompts", "distill.global_batch_size", key)
    prompts = [it["prompt"] for it in items]
    agent = agent_spec = None
    if pc.environment or pc.tools:  # each sample an episode through the stage's environment and tools
        agent_spec = make_spec(pc, format_of(tokenizer.chat_template, str(student_dir)), dc.max_length)
        agent = spec_agent(agent_spec)

    hidden = AutoConfig.from_pretrained(student_dir).hidden_size
    ds_config = deepspeed_config(dist, dc, world, device, hidden)
    torch.manual_seed(cfg.run.seed)
    synced = dist.zero_stage == 3
    with partitioned(ds_config):  # ZeRO-3: the student partitioned as it loads
        student = load_causal_lm(student_dir, cfg.model, uses_bf16(dist, device), lora=dc.lora)
    student = wrap(student, dc.lora, "causal-lm", "distill.lora", checkpointing=dist.activation_checkpointing)
    teacher = teacher_engine(cfg, teacher_dir, ds_config, device, tokenizer.pad_token_id, synced)
    ckpt, elastic = find_checkpoint(out_dir / "checkpoints", rank, world)
    verdict = partial(stage_verdict, cfg, dc, world, device, len(tokenizer))
    engine, scheduler, grad_accum = init_engine(student, ds_config, dc, dist, elastic, verdict)
    order = DistributedOrder(len(prompts), per_rank, rank, world, seed=cfg.run.seed)
    loop = TrainLoop("distill", dc, engine, scheduler, grad_accum, order, ckpt, elastic, out_dir, rank, world, device)
    everyone = (lambda any_open: all_sum([float(any_open)], device)[0] > 0) if synced else None
    source = rollout_source(cfg, dc, engine.module, student_dir, tokenizer, agent, agent_spec,
                            lambda ids: ([prompts[i] for i in ids], [items[i] for i in ids]), rank, world, synced,
                            everyone, stop_ids(engine.module), out_dir / "logs")
    tiles = logit_tiles(dist, dc.micro_batch_size, dc.max_length if agent else dc.max_new_tokens, len(tokenizer))
    scored = (loop.state or {}).get("scored_tokens", 0)  # the student's tokens the teacher scored, every rank's
    try:
        kept = (loop.state or {}).get("rank_state", {}).get("rollouts") or {"version": loop.step}
        source.load_state(kept, engine.module)
        while loop.running():
            t0 = time.perf_counter()
            _, sampled = source.next(lambda: loop.guard.next(order.next_ids), loop.step + 1)
            sampled = sampled.to(device)
            wait, trained_from = time.perf_counter() - t0, time.time()
            staleness = source.version - sampled.version
            scored_rows = []  # rank 0's samples, each token with the teacher's and the student's log-probability
            for mb in torch.arange(per_rank).split(dc.micro_batch_size):
                seqs, attention, m = sampled.seqs[mb], sampled.attention[mb], sampled.mask[mb].float()
                with torch.no_grad():
                    scores = teacher.score(seqs, attention, sampled.P, dc.teacher_top_k)
                divergence, reverse, student_logp = divergences(engine, seqs, attention, sampled.P, scores, dc.beta,
                                                                tiles)
                loop.backward(masked_mean(divergence, m), tokens=int(attention.sum()),
                              distill_kl=masked_mean(reverse, m).item(),
                              student_logp=masked_mean(student_logp, m).item(),
                              teacher_logp=masked_mean(scores.sampled.to(m.device), m).item())
                if rank == 0:
                    scored_rows += sample_rows(seqs, attention, sampled.P, m, sampled.logprobs[mb], scores.sampled,
                                               student_logp)
            scored += int(all_sum([sampled.mask.sum().item()], device)[0])
            counts = loop.advance()
            source.updated(engine.module, loop.step)  # one update a step: the version is the steps taken
            source.timeline.span("trainer", "train", trained_from, time.time(), loop.step)
            if not counts:
                continue
            if loop.due(dc.log_every):
                if rank == 0:
                    write_samples(out_dir / "rollouts", loop.step, scored_rows)
                loop.log_train(response_length=all_mean(sampled.mask.sum(1).float().mean().item(), device),
                               gen_tokens_per_sec=all_mean(sampled.mask.sum().item() / wait, device) * world,
                               rollout_wait_s=all_mean(wait, device),
                               **{"rollout/staleness": staleness,
                                  "rollout/version": sampled.version}, **episode_metrics(sampled.episodes, device,
                                                                           sampled.extra.get("tool_wait_s")))
            loop.save(rank_state=lambda: {"rollouts": source.state()}, scored_tokens=scored)
    finally:
        source.close()
    return {**loop.finish(tokenizer, out_dir, cfg.model.shard_bytes), "teacher_scored_tokens": scored}


if __name__ == "__main__":
    exit_process(main("distill", run))
