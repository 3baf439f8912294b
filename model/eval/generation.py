"""Held-out evaluation by generation: greedy answers scored against reference answers (exact match where they are
short, ROUGE-L), and the preference report (the policy against the SFT model, judged by the reward model, and the
KL between them)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch

from gptforge.core.errors import ConfigError, UserError
from gptforge.data.chat import collate, left_pad, prompt_ids
from gptforge.model.eval.rewards import columns_of, verify


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
    """sample(sequences, budgets) for gptforge.model.rollout.episode: token id sequences, left-padded, through
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


SHORT_ANSWER_WORDS = 5  # references this short (the median, in words) are scored by exact match as well


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def rouge_l(response: str, reference: str) -> float:
    """ROUGE-L F1: the longest common subsequence of the two texts' words (lowercased, punctuation dropped)."""
    a, b = words(response), words(reference)
    row = [0] * (len(b) + 1)  # LCS lengths of a[:i] against every prefix of b
    for x in a:
        prev, row = row, [0]
        for j, y in enumerate(b):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
    lcs = row[-1]
    return 0.0 if lcs == 0 else 2 * lcs / (len(a) + len(b))


def reference_metrics(references: list[str | None]) -> tuple[list[str], str | None]:
    """The reference-based metrics that held-out items with these references support: rouge_l where any item has a
    reference, exact_match too where the references are short answers; and, where some cannot be computed, why."""
    given = [r for r in references if r is not None]
    if not given:
        return [], "no reference answers"
    median = sorted(len(words(r)) for r in given)[len(given) // 2]
    if median <= SHORT_ANSWER_WORDS:
        return ["exact_match", "rouge_l"], None
    return ["rouge_l"], f"exact_match: the reference answers are long (median {median} words)"


def score_references(responses: list[str], references: list[str | None], metrics: list[str]) -> dict:
    """Mean exact match and ROUGE-L of responses against their references, over the items that have one."""
    pairs = [(r, a) for r, a in zip(responses, references) if a is not None]
    score = {"exact_match": lambda r, a: verify([r], [a])[0], "rouge_l": rouge_l}
    return {m: sum(score[m](r, a) for r, a in pairs) / len(pairs) for m in metrics}


def shares(n: int, batch_size: int, rank: int, world: int) -> list[range | None]:
    """The item ranges this rank evaluates: fixed batches of the n items (the same whatever the world size, so the
    results are too), every world-th one from the rank's own; padded with None to as many as any rank has, so
    that partitioned (ZeRO-3) models run every forward pass in step on all ranks."""
    batches = [range(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    mine = batches[rank::world]
    return mine + [None] * (-(-len(batches) // world) - len(mine))


def gather_items(records: list[tuple[int, dict]], world: int) -> list[dict]:
    """Every rank's (item index, record) pairs, on every rank, in item order."""
    if world > 1:
        parts = [None] * world
        torch.distributed.all_gather_object(parts, records)
        records = [r for part in parts for r in part]
    return [r for _, r in sorted(records, key=lambda r: r[0])]


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


def answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int = 64, rank: int = 0,
            world: int = 1, synced: bool = False, cache: str = "full") -> list[str]:
    """Greedy responses to every prompt, on every rank: each rank answers its share of the batches (`shares`);
    `synced`: the model is partitioned (ZeRO-3); `cache`: the KV cache (`kv_cache`)."""
    records = []
    for share in shares(len(prompts), batch_size, rank, world):
        batch = [prompts[i] for i in share or range(1)]  # None: a pass in step with the other ranks, discarded
        responses = generate(model, tokenizer, batch, max_new_tokens, batch_size, synced=synced, **kv_cache(cache))
        records += list(zip(share, responses)) if share else []
    return gather_items(records, world)


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


def agent_answers(agent, model, tokenizer, items: list[dict], max_new_tokens: int, synced: bool = False,
                  **sampling) -> tuple[list[str], dict[str, list], list[int]]:
    """Each item's episode through `agent` (gptforge.model.rollout.episode.Agent: the environment and tools, the
    policy's call format, the turn and length budgets), greedy unless `sampling` says otherwise: (the last turns,
    the reward columns: `messages`, the trajectories, and `environment_reward`; the tool calls of each).
    `synced`: the model is partitioned (ZeRO-3), the ranks sample in step until every rank's episodes end."""
    from gptforge.model.rollout.episode import rollouts
    from gptforge.model.train.distributed import all_sum

    model.eval()
    device = next(model.parameters()).device
    sample = id_sampler(model, tokenizer.pad_token_id, max_new_tokens, synced, **(sampling or {"do_sample": False}))
    everyone = (lambda any_open: all_sum([float(any_open)], device)[0] > 0) if synced else None
    episodes = rollouts(agent.setup, sample, tokenizer, items, agent.fmt, agent.max_turns, agent.max_length,
                        stop_ids(model), everyone)
    return ([e.response.strip() for e in episodes], {"messages": [e.messages for e in episodes],
                                                     "environment_reward": [e.toolbox.reward() for e in episodes]},
            [len(e.calls) for e in episodes])


def win_rate(answers: list[str], other_answers: list[str], scores: list[float], other_scores: list[float]) -> float:
    """Share of prompts whose answer the reward model scores above the other's; the same answer, or the same
    score, is a tie and counts half."""
    wins = [0.5 if a == b or s == t else float(s > t)
            for a, b, s, t in zip(answers, other_answers, scores, other_scores)]
    return sum(wins) / len(wins)


def standard_error(values: list[float]) -> float:
    """The standard error of the mean of `values` (0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5


def preference_report(policy, sft, reward_model, tokenizer, items: list[dict], max_new_tokens: int,
                      seed: int = 0, batch_size: int = 64, rank: int = 0, world: int = 1,
                      synced: bool = False, verifiable: bool = True,
                      reward_tokenizer=None, cache: str = "full", checks: list | None = None,
                      samples: int = 0, agent=None) -> tuple[dict, list[dict]]:
    """Held-out metrics of a preference stage: the reward model's mean score of the policy's answers and of the
    SFT model's, its win rate of the policy against the SFT model (ties count half), KL(policy || SFT) estimated on
    samples from the policy (nats per response, with the standard error of that mean: a single-sample estimate, it
    can come out slightly negative where the two models are close), and on `verifiable` items (the demo's) the
    exact match of both (`reward_tokenizer`: the reward model's, where it is not the policy's);
    and each item's row: the policy's and the SFT model's greedy answers and their scores. Each of `checks`
    (gptforge.model.eval.rewards, the rewards but the reward model)
    scores both models' greedy answers (accuracy/<label>, sft_accuracy/<label>) and, with `samples`, `samples`
    sampled answers of each (pass@<samples>/<label>: a positive reward among them). Without a reward model the
    checks' weighed total is the score. Batched; each rank takes its share of the batches (`shares`), every rank
    gets the report; `synced`: the models are partitioned (ZeRO-3). With an `agent` (the stage's environment and
    tools), each answer, greedy or sampled, is an episode through it (`agent_answers`): the rewards read its last
    turn and its trajectory, the rows keep the trajectories, and tool_calls_per_episode counts the calls of both
    models; the KL stays that of single responses to the prompts."""
    checks, records = checks or [], []
    models = (("policy", policy), ("sft", sft))
    for share in shares(len(items), batch_size, rank, world):
        batch = [items[i] for i in share or range(1)]  # None: a pass in step with the other ranks, discarded
        prompts, truth, columns = [it["prompt"] for it in batch], [it["answer"] for it in batch], columns_of(batch)
        if agent is None:
            answers = {name: generate(model, tokenizer, prompts, max_new_tokens, batch_size, synced=synced,
                                      **kv_cache(cache)) for name, model in models}
            extra = {name: {} for name, _ in models}
        else:
            answers, extra, calls = {}, {}, {}
            for name, model in models:
                answers[name], extra[name], calls[name] = agent_answers(agent, model, tokenizer, batch, max_new_tokens,
                                                                        synced)
        checked = {name: {r.label: r(prompts, answers[name], truth, columns | extra[name]) for r in checks}
                   for name in answers}
        scores = {name: reward_scores(reward_model, reward_tokenizer or tokenizer, prompts, answers[name], batch_size)
                  if reward_model is not None else
                  [sum(r.weight * checked[name][r.label][j] for r in checks) for j in range(len(batch))]
                  for name in answers}
        passed = {name: passes(model, tokenizer, batch, [r for r in checks if r.passes], samples, max_new_tokens,
                               seed + 1 + (share or range(1))[0], batch_size, synced, agent)
                  for name, model in models} if samples else {}
        drawn = sample_responses(policy, tokenizer, prompts, max_new_tokens, seed + (share or range(1))[0], synced)
        kl = [a - b for a, b in zip(response_logprobs(policy, tokenizer, prompts, drawn, batch_size),
                                    response_logprobs(sft, tokenizer, prompts, drawn, batch_size))]
        records += [(i, {"answer": answers["policy"][j], "sft_answer": answers["sft"][j], "score": scores["policy"][j],
                         "sft_score": scores["sft"][j], "kl": kl[j],
                         **{f"{prefix}accuracy/{label}": values[j] for name, prefix in (("policy", ""), ("sft", "sft_"))
                            for label, values in checked[name].items()},
                         **{f"{prefix}pass@{samples}/{label}": values[j] for name, prefix in (("policy", ""),
                                                                                             ("sft", "sft_"))
                            for label, values in passed.get(name, {}).items()},
                         **({"messages": extra["policy"]["messages"][j], "sft_messages": extra["sft"]["messages"][j],
                             "tool_calls": calls["policy"][j], "sft_tool_calls": calls["sft"][j]}
                            if agent is not None else {})})
                    for j, i in enumerate(share or [])]
    rows = gather_items(records, world)
    col = {key: [r[key] for r in rows] for key in rows[0]}
    report = {"win_rate_vs_sft": win_rate(col["answer"], col["sft_answer"], col["score"], col["sft_score"]),
              "reward_mean": sum(col["score"]) / len(items), "sft_reward_mean": sum(col["sft_score"]) / len(items),
              "kl": sum(col["kl"]) / len(items), "kl_stderr": standard_error(col["kl"])}
    report |= {key: sum(values) / len(items) for key, values in col.items() if "accuracy/" in key or "pass@" in key}
    if agent is not None:
        report |= {"tool_calls_per_episode": sum(col["tool_calls"]) / len(items),
                   "sft_tool_calls_per_episode": sum(col["sft_tool_calls"]) / len(items)}
    if verifiable:
        truth = [it["answer"] for it in items]
        report |= {"exact_match": score_references(col["answer"], truth, ["exact_match"])["exact_match"],
                   "sft_exact_match": score_references(col["sft_answer"], truth, ["exact_match"])["exact_match"]}
    return report, [{"response": r["answer"], "sft_response": r["sft_answer"], "score": r["score"],
                     "sft_score": r["sft_score"], **{k: r[k] for k in ("messages", "sft_messages") if k in r}}
                    for r in rows]


def passes(model, tokenizer, batch: list[dict], checks: list, k: int, max_new_tokens: int, seed: int,
           batch_size: int, synced: bool, agent=None) -> dict[str, list[float]]:
    """{label: 1.0 where any of k answers sampled for the item (temperature 1) gets a positive reward, else 0};
    with an `agent`, each answer an episode through it."""
    torch.manual_seed(seed)
    repeated = [it for it in batch for _ in range(k)]
    prompts = [it["prompt"] for it in repeated]
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    if agent is None:
        drawn, extra = generate(model, tokenizer, prompts, max_new_tokens, batch_size, synced=synced, **sampling), {}
    else:
        drawn, extra, _ = agent_answers(agent, model, tokenizer, repeated, max_new_tokens, synced, **sampling)
    out = {}
    for r in checks:
        values = r(prompts, drawn, [it["answer"] for it in repeated], columns_of(repeated) | extra)
        out[r.label] = [float(any(v > 0 for v in values[j * k:(j + 1) * k])) for j in range(len(batch))]
    return out


def check_same_vocabulary(a, b, what: str) -> None:
    """Raise a UserError when two tokenizers do not share one vocabulary."""
    if a.get_vocab() != b.get_vocab():
        raise UserError(f"{what}: vocabularies differ ({len(a)} vs {len(b)} tokens); "
                        "the policy, reference and reward model must share one tokenizer")


def policy_and_judge(cfg, inputs: dict[str, Path]):
    """The SFT model dir, the reward model dir (the reward stage's, or preference.reward_model; None where
    preference.rewards has none) and their tokenizers. They need not share a vocabulary: the reward model reads each
    response as text, through its own chat template (as veRL bridges a policy and a reward model)."""
    from transformers import AutoTokenizer

    from gptforge.model.pretrained import prepare_tokenizer, reward_model_dir

    sft_dir, reward_dir = inputs["sft"] / "model", reward_model_dir(cfg, inputs)
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    if reward_dir is None:
        return sft_dir, None, tokenizer, None
    reward_tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    prepare_tokenizer(reward_tokenizer, grow=False)  # a ready reward model may have no template or pad of its own
    return sft_dir, reward_dir, tokenizer, reward_tokenizer


def same_vocabulary(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()
