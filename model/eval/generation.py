"""Held-out evaluation by generation: greedy answers scored against reference answers (exact match where they are
short, ROUGE-L), pass@k of the rewards' checks, and the preference report (the policy against the SFT model, judged
by the reward model, and the KL between them). Sampling itself: gptforge.model.sampling.generate."""

from __future__ import annotations

import re

import torch

from gptforge.model.rewards import columns_of, verify
from gptforge.model.sampling.generate import (generate, id_sampler, kv_cache, response_logprobs,
                                             reward_scores, sample_responses, stop_ids)


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


def agent_answers(agent, model, tokenizer, items: list[dict], max_new_tokens: int, synced: bool = False,
                  **sampling) -> tuple[list[str], dict[str, list], list[int]]:
    """Each item's episode through `agent` (gptforge.model.agents.episode.Agent: the environment and tools, the
    policy's call format, the turn and length budgets), greedy unless `sampling` says otherwise: (the last turns,
    the reward columns: `messages`, the trajectories, and `environment_reward`; the tool calls of each).
    `synced`: the model is partitioned (ZeRO-3), the ranks sample in step until every rank's episodes end."""
    from gptforge.model.agents.episode import environment_rewards, rollouts
    from gptforge.model.train.distributed import all_sum

    model.eval()
    device = next(model.parameters()).device
    sample = id_sampler(model, tokenizer.pad_token_id, max_new_tokens, synced, **(sampling or {"do_sample": False}))
    everyone = (lambda any_open: all_sum([float(any_open)], device)[0] > 0) if synced else None
    episodes = rollouts(agent.setup, sample, tokenizer, items, agent.fmt, agent.max_turns, agent.max_length,
                        stop_ids(model), everyone)
    return ([e.response.strip() for e in episodes], {"messages": [e.messages for e in episodes],
                                                     "environment_reward": environment_rewards(episodes,
                                                                                               agent.setup.calls)},
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


def preference_report(policy, against, reward_model, tokenizer, items: list[dict], max_new_tokens: int,
                      seed: int = 0, batch_size: int = 64, rank: int = 0, world: int = 1,
                      synced: bool = False, verifiable: bool = True,
                      reward_tokenizer=None, cache: str = "full", checks: list | None = None,
                      samples: int = 0, agent=None) -> tuple[dict, list[dict]]:
    """Held-out metrics of a policy against the models it is compared with (`against`: {name: model}, or one model,
    the SFT model, named `sft`): the reward model's mean score of the policy's answers and of each other's
    (`<name>_reward_mean`), its win rate of the policy against each (`win_rate_vs_<name>`, ties count half),
    KL(policy || the first of them) estimated on samples from the policy (nats per response, `kl`, with the
    standard error of that mean: a single-sample estimate, it can come out slightly negative where the two models are
    close; `kl_<name>` against each of the others), and on `verifiable` items (the demo's) the exact match of each
    (`reward_tokenizer`: the reward model's, where it is not the policy's); and each item's row: every model's
    greedy answer and its score (`response`, `<name>_response`, ...). Each of `checks` (gptforge.model.rewards, the
    rewards but the reward model) scores every model's greedy answers (accuracy/<label>, <name>_accuracy/<label>)
    and, with `samples`, `samples` sampled answers of each (pass@<samples>/<label>: a positive reward among them).
    Without a reward model the checks' weighed total is the score. Batched; each rank takes its share of the
    batches (`shares`), every rank gets the report; `synced`: the models are partitioned (ZeRO-3). With an `agent`
    (the stage's environment and tools), each answer, greedy or sampled, is an episode through it
    (`agent_answers`): the rewards read its last turn and its trajectory, the rows keep the trajectories, and
    tool_calls_per_episode counts the calls of every model; the KL stays that of single responses to the prompts."""
    against = against if isinstance(against, dict) else {"sft": against}
    checks, records = checks or [], []
    models = {"policy": policy, **against}
    prefix = {name: "" if name == "policy" else f"{name}_" for name in models}
    for share in shares(len(items), batch_size, rank, world):
        batch = [items[i] for i in share or range(1)]  # None: a pass in step with the other ranks, discarded
        prompts, truth, columns = [it["prompt"] for it in batch], [it["answer"] for it in batch], columns_of(batch)
        if agent is None:
            answers = {name: generate(model, tokenizer, prompts, max_new_tokens, batch_size, synced=synced,
                                      **kv_cache(cache)) for name, model in models.items()}
            extra = {name: {} for name in models}
        else:
            answers, extra, calls = {}, {}, {}
            for name, model in models.items():
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
                  for name, model in models.items()} if samples else {}
        drawn = sample_responses(policy, tokenizer, prompts, max_new_tokens, seed + (share or range(1))[0], synced)
        mine = response_logprobs(policy, tokenizer, prompts, drawn, batch_size)
        kl = {name: [a - b for a, b in zip(mine, response_logprobs(model, tokenizer, prompts, drawn, batch_size))]
              for name, model in against.items()}
        records += [(i, {**{f"{prefix[name]}answer": answers[name][j] for name in models},
                         **{f"{prefix[name]}score": scores[name][j] for name in models},
                         **{f"kl/{name}": kl[name][j] for name in against},
                         **{f"{prefix[name]}accuracy/{label}": values[j] for name in models
                            for label, values in checked[name].items()},
                         **{f"{prefix[name]}pass@{samples}/{label}": values[j] for name in models
                            for label, values in passed.get(name, {}).items()},
                         **({f"{prefix[name]}{k}": v for name in models
                             for k, v in (("messages", extra[name]["messages"][j]), ("tool_calls", calls[name][j]))}
                            if agent is not None else {})})
                    for j, i in enumerate(share or [])]
    rows = gather_items(records, world)
    col = {key: [r[key] for r in rows] for key in rows[0]}
    report = {"reward_mean": sum(col["score"]) / len(items)}
    for k, name in enumerate(against):
        kl_key = "kl" if k == 0 else f"kl_{name}"
        report |= {f"win_rate_vs_{name}": win_rate(col["answer"], col[f"{name}_answer"], col["score"],
                                                   col[f"{name}_score"]),
                   f"{name}_reward_mean": sum(col[f"{name}_score"]) / len(items),
                   kl_key: sum(col[f"kl/{name}"]) / len(items), f"{kl_key}_stderr": standard_error(col[f"kl/{name}"])}
    report |= {key: sum(values) / len(items) for key, values in col.items() if "accuracy/" in key or "pass@" in key}
    if agent is not None:
        report |= {f"{prefix[name]}tool_calls_per_episode": sum(col[f"{prefix[name]}tool_calls"]) / len(items)
                   for name in models}
    if verifiable:
        truth = [it["answer"] for it in items]
        report |= {f"{prefix[name]}exact_match": score_references(col[f"{prefix[name]}answer"], truth,
                                                                  ["exact_match"])["exact_match"] for name in models}
    return report, [{**{f"{prefix[name]}response": r[f"{prefix[name]}answer"] for name in models},
                     **{f"{prefix[name]}score": r[f"{prefix[name]}score"] for name in models},
                     **{f"{prefix[name]}messages": r[f"{prefix[name]}messages"] for name in models
                        if f"{prefix[name]}messages" in r}}
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
