"""Evaluation step: held-out generation over a finished stage output, its own step so that changing what is
evaluated (the `eval` section) reruns this and never the training before it.

    gptforge stage eval-sft -c configs/tiny.yaml      (eval-dpo, eval-ppo, ...; inputs and output from the store)
    python -m gptforge.stages.evaluate --config CONFIG --out DIR --input sft=DIR --input pretrain=DIR
    torchrun --nproc_per_node 8 -m gptforge.stages.evaluate --config CONFIG --out DIR --input dpo=DIR \\
        --input sft=DIR --input reward=DIR

What is evaluated is the run's own held-out data (gptforge.data.splits.eval_set): the demo's verifiable items,
the rows held out of data.sft / data.preference, or data.eval. After SFT (inputs sft and pretrain): the greedy
answers of the SFT model and of the pretrained base model, prompted in the same chat format, scored against the
reference answers (ROUGE-L; exact match where the answers are short; without references, `unscored` says what
could not be computed). After a preference stage (inputs the policy, sft, and reward where preference.rewards
has a reward model): the preference report (gptforge.model.eval.generation.preference_report), exact match only on the
demo's verifiable items, and each of the other rewards' accuracy for both models (with eval.samples, pass@k as
well). After distill: the student against where it started (`start_`) and against its teacher (`teacher_`),
the models its declaration compares it with. With preference.environment or preference.tools, each answer of
both models is an episode through the environment and tools (gptforge.model.agents), the rewards reading its last
turn, its trajectory and the environment's get_reward(). Each item's greedy answers go to `answers.jsonl`: the
model's `response` beside its base's (`base_response`) after SFT, or beside the SFT model's (`sft_response`) with
both scores after a preference stage, so that every figure of the report can be recomputed from it. Then
`eval.harness_tasks` through lm-evaluation-harness (gptforge.model.eval.harness), results in `harness/`.

Where it runs: on the CPU one process, in fp32. On GPUs (`eval.processes`) every process of the stage's layout
takes its share of fixed batches (the results do not depend on how many there are), in bf16 where training is;
under ZeRO-3 the models are partitioned over the processes, as in training, and generate in step.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch

from gptforge.core.config import PipelineConfig
from gptforge.data import splits
from gptforge.model.attention import load_kwargs
from gptforge.model.train.distributed import barrier, setup_distributed
from gptforge.model.train.engine import frozen, inference_config, partitioned, unwrap
from gptforge.model.eval.generation import answers, preference_report, reference_metrics, score_references
from gptforge.model.sampling.generate import judge, stop_ids
from gptforge.model import rewards
from gptforge.model.eval.harness import check_tasks, run_harness
from gptforge.model.pretrained import fit_embeddings, stage_or_model, start_model
from gptforge.model.agents.calls import format_of
from gptforge.model.agents.episode import Agent
from gptforge.model.agents.tools import Setup
from gptforge.stages.entry import exit_process, main
from gptforge.core.declarations import EVAL_OUTPUTS, STAGES



def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    rank, world, device = setup_distributed(cfg.distributed)
    evaluated = next(iter(inputs))  # an evaluation step's first input is the stage it evaluates (its declaration)
    policy = evaluated if STAGES[f"eval-{evaluated}"].rewarded else None  # a policy, rather than an SFT model
    harness = bool(cfg.eval.harness_tasks) and (policy or "sft") in cfg.eval.harness_stages
    manager = check_tasks(cfg.eval) if harness else None
    held_out = splits.eval_set(cfg.data, policy or "sft")
    items = held_out.items[:cfg.eval.items]
    references = [it["answer"] for it in items]
    scored, unscored = (["exact_match"], None) if held_out.demo else reference_metrics(references)
    if policy is None and unscored and rank == 0:
        print(f"[eval] {held_out.source}: not computed: {unscored}", flush=True)
    model_dir = inputs[policy or "sft"] / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    partition = world > 1 and cfg.distributed.zero_stage == 3
    config = inference_config(cfg.distributed, device, world, AutoConfig.from_pretrained(model_dir).hidden_size,
                              partition)
    split = {"batch_size": cfg.eval.batch_size, "rank": rank, "world": world, "synced": partition}
    cache = {"cache": cfg.eval.kv_cache}

    loaded = []

    def load(cls, path: Path, fit: bool = False):  # held as training holds it: on the device, in its precision
        with partitioned(config):
            model = cls.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code,
                                        **load_kwargs(path, cfg.model))
            if fit:  # a base whose vocabulary SFT grew (a chat template's tokens): new rows around the old ones' mean
                fit_embeddings(model, tokenizer)
            loaded.append(frozen(model, config, device))
        return loaded[-1]

    model = load(AutoModelForCausalLM, model_dir)
    if policy is None:  # after SFT: the SFT model against the pretrained one, on reference answers
        prompts = [it["prompt"] for it in items]
        responses = answers(unwrap(model), tokenizer, prompts, cfg.eval.max_new_tokens, **split, **cache)
        base = load(AutoModelForCausalLM, start_model(cfg, inputs), fit=True)
        base_responses = answers(unwrap(base), tokenizer, prompts, cfg.eval.max_new_tokens, **split, **cache)
        metrics = {**score_references(responses, references, scored),
                   **{f"base_{k}": v for k, v in score_references(base_responses, references, scored).items()}}
        rows = [{"response": r, "base_response": b} for r, b in zip(responses, base_responses)]
    else:  # the policy against the models its declaration names (the SFT model; distill: where it started, and its
        # teacher): judged by the reward model, scored by the other rewards
        reward_dir, reward_tokenizer = judge(cfg, inputs)
        against = {name: unwrap(load(AutoModelForCausalLM, stage_or_model(cfg, inputs, ref)))
                   for name, ref in STAGES[policy].compared_with.items()}
        reward_model = None if reward_dir is None else unwrap(load(AutoModelForSequenceClassification, reward_dir))
        checks, skipped = rewards.checks_for(cfg.preference, tokenizer, items)
        if skipped and rank == 0:
            print(f"[eval] {held_out.source}: not computed: {', '.join(skipped)} (no reference answers)", flush=True)
        pc = cfg.preference
        agent = Agent(Setup.of(pc),
                      format_of(tokenizer.chat_template, str(model_dir)), pc.max_turns, pc.max_length) \
            if pc.environment or pc.tools else None  # each answer an episode through the stage's environment
        metrics, rows = preference_report(unwrap(model), against, reward_model, tokenizer, items,
                                          cfg.eval.max_new_tokens, cfg.run.seed, verifiable=held_out.demo,
                                          reward_tokenizer=reward_tokenizer, checks=checks,
                                          samples=cfg.eval.samples, agent=agent, **split, **cache)
    if rank == 0:
        with open(out_dir / EVAL_OUTPUTS["answers"], "w") as f:
            for it, row in zip(items, rows):
                f.write(json.dumps({"prompt": it["prompt"], "answer": it["answer"], **row}) + "\n")
        for it, row in list(zip(items, rows))[:5]:
            print(f"[eval] {it['prompt'][-1]['content']!r} -> {row['response']!r} (answer {it['answer']!r})",
                  flush=True)
        if "kl_stderr" in metrics:
            print(f"[eval] KL to the SFT model: {metrics['kl']:.4f} ± {metrics['kl_stderr']:.4f} nats/response "
                  f"(standard error, {len(items)} items)", flush=True)
    metrics = {k: round(v, 6) for k, v in metrics.items()}
    if policy is None and unscored:
        metrics["unscored"] = f"{unscored} in {held_out.source}"
    if harness:
        stops = [tokenizer.decode([i]) for i in sorted(stop_ids(unwrap(model)))]
        model = base = against = reward_model = None  # the harness loads the exported model on this device itself
        loaded.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            metrics |= run_harness(model_dir, cfg.eval, str(device), "bfloat16" if config.get("bf16") else "float32",
                                   out_dir / EVAL_OUTPUTS["harness"], cfg.run.seed, items if held_out.demo else None,
                                   stops, manager)
        barrier()
    return {**metrics, "eval_items": len(items)}


if __name__ == "__main__":
    exit_process(main("evaluate", run))
