"""Evaluation step: held-out generation over a finished stage output, its own step so that changing what is
evaluated (the `eval` section) reruns this and never the training before it.

    gptforge stage eval-sft -c configs/tiny.yaml      (eval-dpo, eval-ppo, ...; inputs and output from the store)
    python -m gptforge.stages.evaluate --config CONFIG --out DIR --input sft=DIR --input pretrain=DIR
    torchrun --nproc_per_node 8 -m gptforge.stages.evaluate --config CONFIG --out DIR --input dpo=DIR \\
        --input sft=DIR --input reward=DIR

After SFT (inputs sft and pretrain): greedy exact match of the SFT model and of the pretrained base model,
prompted in the same chat format, on the held-out verifiable items. After a preference stage (inputs the
policy, sft and reward): the preference report (gptforge.model.evaluate.preference_report). Greedy answers
go to `answers.jsonl`.

Where it runs: on the CPU one process, in fp32. On GPUs (`eval.processes`) every process of the stage's layout
takes its share of fixed batches (the results do not depend on how many there are), in bf16 where training is;
under ZeRO-3 the models are partitioned over the processes, as in training, and generate in step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gptforge.core.config import ALGORITHMS, PipelineConfig
from gptforge.data import loaders
from gptforge.model.distributed import setup_distributed
from gptforge.model.engine import frozen, inference_config, partitioned, unwrap
from gptforge.model.evaluate import check_same_vocabulary, exact_match, preference_report
from gptforge.stages.cli import main

OUTPUTS = {"answers": "answers.jsonl"}


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    rank, world, device = setup_distributed()
    items = loaders.eval_items(cfg.data)[:cfg.eval.items]
    policy = next((s for s in ALGORITHMS if s in inputs), None)
    model_dir = inputs[policy or "sft"] / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    partition = world > 1 and cfg.distributed.zero_stage == 3
    config = inference_config(cfg.distributed, device, world, AutoConfig.from_pretrained(model_dir).hidden_size,
                              partition)
    split = {"batch_size": cfg.eval.batch_size, "rank": rank, "world": world, "synced": partition}

    def load(cls, path: Path):  # held as training holds it: on the device, in its precision, partitioned or not
        with partitioned(config):
            return frozen(cls.from_pretrained(path), config, device)

    model = load(AutoModelForCausalLM, model_dir)
    if policy is None:  # after SFT: the SFT model against the pretrained one
        base = load(AutoModelForCausalLM, inputs["pretrain"] / "model")
        em, responses = exact_match(unwrap(model), tokenizer, items, cfg.eval.max_new_tokens, **split)
        base_em, _ = exact_match(unwrap(base), tokenizer, items, cfg.eval.max_new_tokens, **split)
        metrics = {"exact_match": em, "base_exact_match": base_em}
    else:
        reward_dir = inputs["reward"] / "model"
        check_same_vocabulary(tokenizer, AutoTokenizer.from_pretrained(reward_dir), f"reward model {reward_dir}")
        sft, reward_model = (load(AutoModelForCausalLM, inputs["sft"] / "model"),
                             load(AutoModelForSequenceClassification, reward_dir))
        metrics, responses = preference_report(unwrap(model), unwrap(sft), unwrap(reward_model), tokenizer, items,
                                               cfg.eval.max_new_tokens, cfg.run.seed, **split)
    if rank == 0:
        with open(out_dir / OUTPUTS["answers"], "w") as f:
            for it, r in zip(items, responses):
                f.write(json.dumps({"prompt": it["prompt"], "answer": it["answer"], "response": r}) + "\n")
        for it, r in list(zip(items, responses))[:5]:
            print(f"[eval] {it['prompt'][-1]['content']!r} -> {r!r} (answer {it['answer']!r})", flush=True)
    return {**{k: round(v, 6) for k, v in metrics.items()}, "eval_items": len(items)}


if __name__ == "__main__":
    sys.exit(main("evaluate", run))
