"""Sampling from a policy, what every room that generates shares: the turn samplers (`id_sampler`: ids in, ids and
their log-probabilities out), batched generation and its KV cache, the log-probabilities of given responses, a
reward model's scores, and the policy with its judge (the SFT model and the reward model a stage reads). The
rollout room's engines, the online stages, the reward stage's samples and the evaluation all generate through
here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from gptforge.core.errors import ConfigError, UserError
from gptforge.data.chat import collate, left_pad, prompt_ids


def stop_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def no_router_loss(model) -> dict:
    """generate() arguments that turn a mixture-of-experts model's router logits off: their load-balancing loss is
    for training, and under a KV cache its padding mask (the whole sequence) no longer matches the new tokens."""
    return {"output_router_logits": False} if hasattr(model.config, "output_router_logits") else {}


def generate_ids(model, tokenizer, prompts: list[list[dict]], synced: bool = False, **generation):
    """Chat prompts, left-padded, through `model.generate` with the KV cache, stopping at the model's stop tokens:
    the sequences (B, P+R), the prompts' attention mask (B, P) on the model's device, and the stop ids."""
    ids, attention = left_pad([prompt_ids(tokenizer, p) for p in prompts], tokenizer.pad_token_id)
    device, stops = next(model.parameters()).device, stop_ids(model)
    out = model.generate(input_ids=ids.to(device), attention_mask=attention.to(device),
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=list(stops), use_cache=True,
                         synced_gpus=synced, **generation, **no_router_loss(model))
    return out, attention.to(device), stops


class Turn(list):
    """A continuation's ids, as sampled; `logprobs` beside them where the sampler kept them (else None)."""

    logprobs: list[float] | None = None

    @classmethod
    def of(cls, ids: list[int], logprobs: list[float] | None) -> Turn:
        turn = cls(ids)
        turn.logprobs = logprobs
        return turn


def id_sampler(model, pad_id: int, max_new_tokens: int, synced: bool = False, logprobs: bool = False, **sampling):
    """sample(sequences, budgets) for gptforge.model.agents.episode: token id sequences, left-padded, through
    `model.generate` with the KV cache; each continuation cut after its first stop token, at most its budget and
    `max_new_tokens` long. One generate call samples as many tokens for every row, so the rows whose budget is
    below the batch's (the context nearly full) are sampled in calls of their own, each at most its rows' budget:
    a row never runs past the positions the budgets leave it (a model's learned positions end there). Under
    `synced` (ZeRO-3: the ranks generate in step) every rank makes two calls, the rows that may take the batch's
    tokens and the others at the least of their budgets, a dummy row where a rank has none. With `logprobs`, each
    continuation is a Turn holding the log-probability of each sampled token under the
    model's raw logits."""
    device, stops = next(model.parameters()).device, stop_ids(model)

    def call(rows: list[list[int]], new: int) -> tuple[list[list[int]], list[list[float]] | None]:
        ids, attention = left_pad(rows, pad_id)
        out = model.generate(input_ids=ids.to(device), attention_mask=attention.to(device), pad_token_id=pad_id,
                             eos_token_id=list(stops), use_cache=True, synced_gpus=synced, max_new_tokens=new,
                             output_logits=logprobs, return_dict_in_generate=logprobs, **sampling,
                             **no_router_loss(model))
        if not logprobs:
            return out[:, ids.shape[1]:].tolist(), None
        drawn = out.sequences[:, ids.shape[1]:]
        logits = torch.stack(out.logits, 1).float()  # (B, new, V): the raw logits that each token was drawn from
        return drawn.tolist(), torch.log_softmax(logits, -1).gather(-1, drawn[..., None])[..., 0].tolist()

    @torch.no_grad()
    def sample(sequences: list[list[int]], budgets: list[int]) -> list[list[int]]:
        new = max(1, min(max_new_tokens, max(budgets)))
        groups: dict[int, list[int]] = {}
        for i, b in enumerate(budgets):  # by how many tokens a row may take
            groups.setdefault(min(max(b, 1), new), []).append(i)
        if synced:  # as many calls on every rank: the rows that may take `new`, then the others at the least
            tight = [i for n, rows in groups.items() if n < new for i in rows]
            groups = {new: groups.get(new, []), -1: tight}
        turns: list[list[int]] = [[] for _ in sequences]
        for n, rows in groups.items():
            n = n if n > 0 else max(1, min((budgets[i] for i in rows), default=1))
            drawn, logps = call([sequences[i] for i in rows] or [sequences[0][:1]], n)
            for j, (i, row) in enumerate(zip(rows, drawn)):
                cut = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
                keep = max(1, min(cut, budgets[i]))
                turns[i] = Turn.of(row[:keep], logps[j][:keep]) if logprobs else row[:keep]
        return turns

    return sample


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int = 64,
             do_sample: bool = False, synced: bool = False, **sampling) -> list[str]:
    """Responses to chat prompts (left-padded batches, KV cache), cut at the first stop token. `synced`: the model
    is partitioned over the ranks (ZeRO-3), so every rank generates in step with the others, the same number of
    batches (a rank with fewer prompts generates for a dummy one meanwhile) and until the last rank's batch ends."""
    model.eval()
    device = next(model.parameters()).device
    batches = -(-len(prompts) // batch_size)
    if synced:
        count = torch.tensor([batches], device=device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        batches = int(count.item())
    responses = []
    for i in range(0, batches * batch_size, batch_size):
        batch = prompts[i:i + batch_size] or [[{"role": "user", "content": ""}]]  # a dummy in step with the others
        out, attention, stops = generate_ids(model, tokenizer, batch, synced, max_new_tokens=max_new_tokens,
                                             do_sample=do_sample, **sampling)
        for row in out[:, attention.shape[1]:].tolist()[:len(prompts[i:i + batch_size])]:
            cut = next((k for k, t in enumerate(row) if t in stops), len(row))
            responses.append(tokenizer.decode(row[:cut], skip_special_tokens=True).strip())
    return responses


KV_CACHES = {"full": {}, "fp8": {"backend": "fp8"}, "quanto-int4": {"backend": "quanto", "nbits": 4}}


def kv_cache(name: str, key: str = "eval.kv_cache") -> dict:
    """generate()'s arguments for a KV cache (full, fp8 or quanto-int4: transformers' QuantizedCache)."""
    if name not in KV_CACHES:
        raise ConfigError(f"{key}={name!r}: choose one of {', '.join(KV_CACHES)}")
    if not KV_CACHES[name]:
        return {}
    if name.startswith("quanto") and importlib.util.find_spec("optimum") is None:
        raise ConfigError(f"{key}={name} needs optimum-quanto, which is not installed: pip install optimum-quanto, "
                          "or use fp8")
    return {"cache_implementation": "quantized", "cache_config": dict(KV_CACHES[name])}


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
def response_logprobs(model, tokenizer, prompts: list[list[dict]], responses: list[list[int]],
                      batch_size: int = 64) -> list[float]:
    """Sum of log-probabilities of each response's tokens given its prompt (right-padded batches)."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(prompts), batch_size):
        heads = [prompt_ids(tokenizer, p) for p in prompts[i:i + batch_size]]  # the chat template applied once
        starts = [len(h) for h in heads]
        seqs = [h + r for h, r in zip(heads, responses[i:i + batch_size])]
        x, a, _ = collate([(s, s) for s in seqs], tokenizer.pad_token_id)
        x, a = x.to(device), a.to(device)
        logp = torch.log_softmax(model(input_ids=x, attention_mask=a).logits[:, :-1].float(), -1)  # (B, T-1, V)
        token_logp = logp.gather(-1, x[:, 1:, None])[..., 0]  # (B, T-1): log p of each next token
        for row, (start, seq) in enumerate(zip(starts, seqs)):
            out.append(token_logp[row, start - 1:len(seq) - 1].sum().item())
    return out


@torch.no_grad()
def sample_responses(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, seed: int,
                     synced: bool = False) -> list[list[int]]:
    """One sampled response per prompt (temperature 1, one batch seeded by `seed`), as token ids up to and
    including the first stop token."""
    torch.manual_seed(seed)
    out, attention, stops = generate_ids(model, tokenizer, prompts, synced, do_sample=True, temperature=1.0, top_k=0,
                                         top_p=1.0, max_new_tokens=max_new_tokens)
    responses = []
    for row in out[:, attention.shape[1]:].tolist():
        cut = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
        responses.append(row[:cut])
    return responses


def check_same_vocabulary(a, b, what: str) -> None:
    """Raise a UserError when two tokenizers do not share one vocabulary."""
    if a.get_vocab() != b.get_vocab():
        raise UserError(f"{what}: vocabularies differ ({len(a)} vs {len(b)} tokens); "
                        "the policy, reference and reward model must share one tokenizer")


def judge(cfg, inputs: dict[str, Path]):
    """The reward model dir (the reward stage's, or preference.reward_model; None where preference.rewards has none)
    and its tokenizer, ready to read responses as text through its own chat template."""
    from transformers import AutoTokenizer

    from gptforge.model.pretrained import prepare_tokenizer, reward_model_dir

    reward_dir = reward_model_dir(cfg, inputs)
    if reward_dir is None:
        return None, None
    reward_tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    prepare_tokenizer(reward_tokenizer, grow=False)  # a ready reward model may have no template or pad of its own
    return reward_dir, reward_tokenizer


def policy_and_judge(cfg, inputs: dict[str, Path]):
    """The SFT model dir, the reward model dir (the reward stage's, or preference.reward_model; None where
    preference.rewards has none) and their tokenizers. They need not share a vocabulary: the reward model reads each
    response as text, through its own chat template (as veRL bridges a policy and a reward model)."""
    from transformers import AutoTokenizer

    sft_dir = inputs["sft"] / "model"
    reward_dir, reward_tokenizer = judge(cfg, inputs)
    return sft_dir, reward_dir, AutoTokenizer.from_pretrained(sft_dir), reward_tokenizer


def same_vocabulary(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()
