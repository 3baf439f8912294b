"""Sampling rollouts whose turns end at different lengths: the hf engine's static batches (gptforge.model.sampling.
generate.id_sampler: left-padded rows sampled together with the KV cache until the last one stops) against
transformers' continuous batching (`generate_batch`: a finished row's slot taken by a waiting one), the same model,
the same prompts, the same sampling settings.

    .venv/bin/python bench/continuous_batching.py [--model DIR] [--prompts 64] [--max-new-tokens 64] [--repeats 3]

Reported: response tokens a second of each (the best of `--repeats`), their ratio, the tokens' mean length and its
spread, and how far each one's log-probabilities of its sampled tokens are from the trainer's (a forward pass over
the whole sequence, temperature 1: `mismatch/logp_abs_diff` of gptforge.model.sampling.offpolicy). The model:
`--model`, else the demo pipeline's newest SFT model (`make run`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def trainer_logprobs(model, prompt: list[int], ids: list[int]) -> list[float]:
    """The trainer's log-probabilities of `ids` after `prompt` (raw logits, temperature 1)."""
    with torch.no_grad():
        seq = torch.tensor([prompt + ids])
        logp = torch.log_softmax(model(seq).logits[0, len(prompt) - 1:-1].float(), -1)
    return logp.gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from gptforge.core.console import quiet
    from gptforge.data import demo
    from gptforge.data.chat import prompt_ids
    from gptforge.model.sampling.engine import HFEngine
    from gptforge.model.sampling.generate import stop_ids

    quiet()
    path = args.model or max((ROOT / "runs" / "store" / "sft").glob("*/model"), key=lambda d: d.stat().st_mtime)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    items = demo.generate(pretrain_docs=1, sft_items=1, preference_pairs=1, eval_items=args.prompts).eval
    prompts = [prompt_ids(tok, it["prompt"] if isinstance(it["prompt"], list) else
                          [{"role": "user", "content": it["prompt"]}]) for it in items][:args.prompts]
    stops = sorted(stop_ids(model))
    settings = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    # the paged cache sized for these prompts: on a CPU, transformers sizes it (and the attention masks it clears at
    # every step) to the host's free memory, which took 0.3 s a token here (8 prompts: 3 tokens/s, against 1,900)
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    paged = {"page_size": 16, "num_blocks": len(prompts) * -(-longest // 16),
             "max_batch_tokens": len(prompts) * longest}
    engine = HFEngine(model, tok.pad_token_id)
    results = {}
    for name in ("static", "continuous"):
        best, turns = None, None
        for r in range(args.repeats):
            torch.manual_seed(r)
            t0 = time.perf_counter()
            if name == "static":
                out = engine.generate(prompts, [args.max_new_tokens] * len(prompts), args.max_new_tokens, **settings)
                got = [(list(t), list(t.logprobs)) for t in out]
            else:
                config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True, eos_token_id=stops,
                                          pad_token_id=tok.pad_token_id, **settings)
                out = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=
                                           ContinuousBatchingConfig(return_logprobs=True, **paged), progress_bar=False,
                                           warmup=False)
                order = sorted(out, key=lambda k: int(k.rsplit("_", 1)[-1]) if k.rsplit("_", 1)[-1].isdigit() else k)
                got = [(list(out[k].generated_tokens), list(out[k].logprobs)) for k in order]
            seconds = time.perf_counter() - t0
            rate = sum(len(ids) for ids, _ in got) / seconds
            if best is None or rate > best:
                best, turns = rate, got
        diffs = [abs(a - b) for (ids, lp), prompt in zip(turns, prompts) if ids
                 for a, b in zip(lp, trainer_logprobs(model, prompt, ids))]
        lengths = [len(ids) for ids, _ in turns]
        results[name] = best
        print(f"{name}: {best:.0f} response tokens/s, length {statistics.mean(lengths):.1f} ± "
              f"{statistics.pstdev(lengths):.1f} (max {max(lengths)}), |logp - trainer's| "
              f"{statistics.mean(diffs):.2e} a token", flush=True)
    print(f"continuous / static: {results['continuous'] / results['static']:.2f}x ({path}, {len(prompts)} prompts, "
          f"{args.max_new_tokens} new tokens at most)")


if __name__ == "__main__":
    main()
