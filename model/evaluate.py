"""Held-out evaluation by generation: exact match of greedy answers to verifiable items, and the preference
report (the policy against the SFT model, judged by the reward model, and the KL between them)."""

from __future__ import annotations

from pathlib import Path

import torch

from gptforge.core.errors import UserError
from gptforge.data.chat import collate, left_pad, prompt_ids


def stop_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int = 64,
             do_sample: bool = False, **sampling) -> list[str]:
    """Responses to chat prompts (left-padded batches, KV cache), cut at the first stop token."""
    model.eval()
    stops, pad = stop_ids(model), tokenizer.pad_token_id
    responses = []
    for i in range(0, len(prompts), batch_size):
        ids, attention = left_pad([prompt_ids(tokenizer, p) for p in prompts[i:i + batch_size]], pad)
        T = ids.shape[1]
        out = model.generate(input_ids=ids.to(model.device), attention_mask=attention.to(model.device),
                             max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad,
                             eos_token_id=list(stops), use_cache=True, **sampling)
        for row in out[:, T:].tolist():
            cut = next((k for k, t in enumerate(row) if t in stops), len(row))
            responses.append(tokenizer.decode(row[:cut], skip_special_tokens=True).strip())
    return responses


def verify(responses: list[str], answers: list[str]) -> list[float]:
    """The demo's verifier: 1 for a response that is exactly its known answer (whitespace-trimmed), else 0."""
    return [float(r.strip() == a.strip()) for r, a in zip(responses, answers)]


def exact_match(model, tokenizer, items: list[dict], max_new_tokens: int) -> tuple[float, list[str]]:
    """Fraction of items whose greedy response is the known answer (`verify`); and the responses."""
    responses = generate(model, tokenizer, [it["prompt"] for it in items], max_new_tokens)
    return sum(verify(responses, [it["answer"] for it in items])) / len(items), responses


@torch.no_grad()
def reward_scores(reward_model, tokenizer, prompts: list[list[dict]], responses: list[str],
                  batch_size: int = 64) -> list[float]:
    """The reward model's score of each prompt + response (the response as the assistant turn)."""
    reward_model.eval()
    scores = []
    for i in range(0, len(prompts), batch_size):
        seqs = [tokenizer.apply_chat_template(p + [{"role": "assistant", "content": r}], tokenize=True,
                                              return_dict=True)["input_ids"]
                for p, r in zip(prompts[i:i + batch_size], responses[i:i + batch_size])]
        x, a, _ = collate([(list(s), list(s)) for s in seqs], tokenizer.pad_token_id)
        scores += reward_model(input_ids=x.to(reward_model.device),
                               attention_mask=a.to(reward_model.device)).logits.squeeze(-1).float().tolist()
    return scores


@torch.no_grad()
def response_logprobs(model, tokenizer, prompts: list[list[dict]], responses: list[list[int]]) -> list[float]:
    """Sum of log-probabilities of each response's tokens given its prompt."""
    model.eval()
    out = []
    for p, r in zip(prompts, responses):
        ids = prompt_ids(tokenizer, p)
        x = torch.tensor([ids + r], device=model.device)
        logp = torch.log_softmax(model(input_ids=x).logits[0, len(ids) - 1:-1].float(), -1)  # (len(r), V)
        out.append(logp.gather(-1, torch.tensor(r, device=model.device)[:, None]).sum().item())
    return out


@torch.no_grad()
def sample_response_ids(model, tokenizer, prompt: list[dict], max_new_tokens: int, generator_seed: int) -> list[int]:
    """One sampled response (temperature 1), as token ids up to and including the first stop token."""
    ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=model.device)
    torch.manual_seed(generator_seed)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                         top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=list(stop_ids(model)))[0, ids.shape[1]:].tolist()
    stops = stop_ids(model)
    cut = next((k + 1 for k, t in enumerate(out) if t in stops), len(out))
    return out[:cut]


def win_rate(answers: list[str], other_answers: list[str], scores: list[float], other_scores: list[float]) -> float:
    """Share of prompts whose answer the reward model scores above the other's; the same answer, or the same
    score, is a tie and counts half."""
    wins = [0.5 if a == b or s == t else float(s > t)
            for a, b, s, t in zip(answers, other_answers, scores, other_scores)]
    return sum(wins) / len(wins)


def preference_report(policy, sft, reward_model, tokenizer, items: list[dict], max_new_tokens: int,
                      seed: int = 0) -> tuple[dict, list[str]]:
    """Held-out metrics of a preference stage: exact match of the policy and of the SFT model, the reward
    model's mean score of the policy's answers, its win rate against the SFT model's answers (ties count
    half), and KL(policy || SFT) estimated on samples from the policy (nats per response); and the policy's
    greedy answers."""
    prompts = [it["prompt"] for it in items]
    em, policy_answers = exact_match(policy, tokenizer, items, max_new_tokens)
    sft_em, sft_answers = exact_match(sft, tokenizer, items, max_new_tokens)
    policy_scores = reward_scores(reward_model, tokenizer, prompts, policy_answers)
    sft_scores = reward_scores(reward_model, tokenizer, prompts, sft_answers)
    samples = [sample_response_ids(policy, tokenizer, p, max_new_tokens, seed + i) for i, p in enumerate(prompts)]
    kl = [a - b for a, b in zip(response_logprobs(policy, tokenizer, prompts, samples),
                                response_logprobs(sft, tokenizer, prompts, samples))]
    return {"exact_match": em, "sft_exact_match": sft_em,
            "win_rate_vs_sft": win_rate(policy_answers, sft_answers, policy_scores, sft_scores),
            "reward_mean": sum(policy_scores) / len(policy_scores), "kl": sum(kl) / len(kl)}, policy_answers


def check_same_vocabulary(a, b, what: str) -> None:
    """Raise a UserError when two tokenizers do not share one vocabulary."""
    if a.get_vocab() != b.get_vocab():
        raise UserError(f"{what}: vocabularies differ ({len(a)} vs {len(b)} tokens); "
                        "the policy, reference and reward model must share one tokenizer")


def policy_and_judge(inputs: dict[str, Path]):
    """The SFT model dir, the reward model dir and their tokenizers, checked to share one vocabulary."""
    from transformers import AutoTokenizer

    sft_dir, reward_dir = inputs["sft"] / "model", inputs["reward"] / "model"
    tokenizer, reward_tokenizer = AutoTokenizer.from_pretrained(sft_dir), AutoTokenizer.from_pretrained(reward_dir)
    check_same_vocabulary(tokenizer, reward_tokenizer, f"reward model {reward_dir}")
    return sft_dir, reward_dir, tokenizer, reward_tokenizer
