"""Evaluation step: held-out generation over a finished stage output, its own step so that changing what is
evaluated (the `eval` section) reruns this and never the training before it.

    gptforge stage eval-sft -c configs/tiny.yaml      (eval-dpo, eval-ppo, ...; inputs and output from the store)
    python -m gptforge.stages.evaluate --config CONFIG --out DIR --input sft=DIR --input pretrain=DIR
    python -m gptforge.stages.evaluate --config CONFIG --out DIR --input dpo=DIR --input sft=DIR --input reward=DIR

After SFT (inputs sft and pretrain): greedy exact match of the SFT model and of the pretrained base model,
prompted in the same chat format, on the held-out verifiable items. After a preference stage (inputs the
policy, sft and reward): the preference report (gptforge.model.evaluate.preference_report). Greedy answers
go to `answers.jsonl`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gptforge.core.config import ALGORITHMS, PipelineConfig
from gptforge.data import loaders
from gptforge.model.evaluate import check_same_vocabulary, exact_match, preference_report
from gptforge.stages.cli import main

OUTPUTS = {"answers": "answers.jsonl"}


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    items = loaders.eval_items(cfg.data)[:cfg.eval.items]
    policy = next((s for s in ALGORITHMS if s in inputs), None)
    model_dir = inputs[policy or "sft"] / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if policy is None:  # after SFT: the SFT model against the pretrained one
        base = AutoModelForCausalLM.from_pretrained(inputs["pretrain"] / "model")
        em, responses = exact_match(model, tokenizer, items, cfg.eval.max_new_tokens)
        base_em, _ = exact_match(base, tokenizer, items, cfg.eval.max_new_tokens)
        metrics = {"exact_match": em, "base_exact_match": base_em}
    else:
        reward_dir = inputs["reward"] / "model"
        check_same_vocabulary(tokenizer, AutoTokenizer.from_pretrained(reward_dir), f"reward model {reward_dir}")
        metrics, responses = preference_report(
            model, AutoModelForCausalLM.from_pretrained(inputs["sft"] / "model"),
            AutoModelForSequenceClassification.from_pretrained(reward_dir), tokenizer, items,
            cfg.eval.max_new_tokens, cfg.run.seed)
    with open(out_dir / OUTPUTS["answers"], "w") as f:
        for it, r in zip(items, responses):
            f.write(json.dumps({"prompt": it["prompt"], "answer": it["answer"], "response": r}) + "\n")
    for it, r in list(zip(items, responses))[:5]:
        print(f"[eval] {it['prompt'][-1]['content']!r} -> {r!r} (answer {it['answer']!r})", flush=True)
    return {**{k: round(v, 6) for k, v in metrics.items()}, "eval_items": len(items)}


if __name__ == "__main__":
    sys.exit(main("evaluate", run))
