"""Built-in demo data: deterministic, seeded, no download, with verifiable answers.

Six tasks graded from easy to hard, phrased as natural text:
  repeat  "Repeat the word cat twice."           -> "cat cat"
  succ    "What number comes after 41?"          -> "42"
  max     "Which is larger, 37 or 52?"           -> "52"
  min     "Which is smaller, 37 or 52?"          -> "37"
  add1    "What is 3 plus 5?"                    -> "8"
  add2    "What is 23 plus 45?"                  -> "68"

Each item has a key (task and operands). A fixed hash of the key puts about one key in ten in the
held-out set, whatever the seed or the sizes: held-out keys never appear in the pretraining corpus,
the conversations or the preference pairs, so every stage's effect is measured on unseen items.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

# Bumped when a part's generator changes, so that only the stages reading that part recompute.
VERSIONS = {"pretrain": 4, "sft": 1, "preference": 7, "eval": 1}

WORDS = ("cat dog sun red blue tree book fish bird car hat cup box pen map egg king moon star ship "
         "rain snow wind fire milk bread apple green door road lamp bell ring rose sand song "
         "wolf bear frog duck lion horse cake salt gold iron hill lake river stone leaf seed farm barn "
         "coat shoe sock bed desk chair glass plate spoon fork knife bowl pot pan oven soap towel "
         "coin card gift box kite ball doll drum horn flute harp bus train boat plane road bridge "
         "tower castle queen prince cow pig goat sheep mouse owl crow hawk swan deer fox seal shark "
         "whale crab worm bee ant moth rice corn bean pea plum pear lime lemon grape melon nut tea "
         "wine beer jam pie soup cloud storm fog ice frost dust ash smoke flame wave tide shell").split()
WORDS = tuple(dict.fromkeys(WORDS))  # unique, in order
TASKS = ("repeat", "succ", "max", "min", "add1", "add2")
# Sampling weights: harder tasks get more examples.
WEIGHTS = {"repeat": 1, "succ": 1, "max": 2, "min": 2, "add1": 2, "add2": 4}


@dataclass(frozen=True)
class Item:
    task: str
    args: tuple
    question: str
    answer: str

    @property
    def key(self) -> str:
        return f"{self.task}:{','.join(map(str, self.args))}"


def make_item(task: str, args: tuple) -> Item:
    if task == "repeat":
        (w,) = args
        return Item(task, args, f"Repeat the word {w} twice.", f"{w} {w}")
    if task == "succ":
        (n,) = args
        return Item(task, args, f"What number comes after {n}?", str(n + 1))
    if task == "max":
        a, b = args
        return Item(task, args, f"Which is larger, {a} or {b}?", str(max(a, b)))
    if task == "min":
        a, b = args
        return Item(task, args, f"Which is smaller, {a} or {b}?", str(min(a, b)))
    a, b = args
    return Item(task, args, f"What is {a} plus {b}?", str(a + b))


def all_keys(task: str) -> list[tuple]:
    if task == "repeat":
        return [(w,) for w in WORDS]
    if task == "succ":
        return [(n,) for n in range(99)]
    if task in ("max", "min"):
        return [(a, b) for a in range(100) for b in range(100) if a != b]
    if task == "add1":
        return [(a, b) for a in range(10) for b in range(10)]
    return [(a, b) for a in range(10, 100) for b in range(10, 100)]


def is_held_out(item: Item) -> bool:
    """About 10% of keys, fixed by a hash of the key alone (independent of seed and sizes)."""
    return int(hashlib.sha256(item.key.encode()).hexdigest()[:8], 16) % 10 == 0


def _pools() -> tuple[dict, dict]:
    train, held = {}, {}
    for task in TASKS:
        items = [make_item(task, k) for k in all_keys(task)]
        held[task] = [it for it in items if is_held_out(it)]
        train[task] = [it for it in items if not is_held_out(it)]
    return train, held


def _sentence(item: Item, rng: random.Random) -> str:
    """A pretraining document stating one fact, in one of several phrasings."""
    q, a, args = item.question, item.answer, item.args
    # The answer alone on the line after the question is how the chat template lays out a reply
    # ("...assistant\n68"), so the numbers the assistant writes are the tokens pretraining saw there.
    styles = [f"{q}\n{a}", f"{q}\n{a}", f"Question: {q} Answer: {a}"]
    if item.task == "repeat":
        styles.append(f"The word {args[0]} said twice is {a}.")
    elif item.task == "succ":
        styles.append(f"The number after {args[0]} is {a}.")
        styles.append(f"{args[0]}, {a}.")
    elif item.task == "max":
        styles.append(f"{a} is larger than {min(args)}.")
        styles.append(f"Between {args[0]} and {args[1]}, the larger is {a}.")
    elif item.task == "min":
        styles.append(f"{a} is smaller than {max(args)}.")
        styles.append(f"Between {args[0]} and {args[1]}, the smaller is {a}.")
    else:
        styles.append(f"{args[0]} plus {args[1]} is {a}.")
        styles.append(f"{args[0]} + {args[1]} = {a}")
    return rng.choice(styles)


def _wrong_answer(item: Item, rng: random.Random) -> str:
    """A plausible wrong answer, of the kinds people and small models make: an off-by-one or a slip of
    ten, echoing an operand, the other number, the wrong operation, a different or missing word."""
    if item.task == "repeat":
        w = item.args[0]
        other = rng.choice([x for x in WORDS if x != w])
        return rng.choice([w, f"{other} {other}", f"{w} {other}", f"{w} {w} {w}"])
    right = int(item.answer)
    if item.task in ("max", "min"):
        # the other number, or a near miss of the right one: the SFT model's own wrong answers are mostly
        # neighbours of the operand it meant to copy ("89 or 3" -> 90), rarely the other operand
        other = min(item.args) if item.task == "max" else max(item.args)
        candidates = [other, other, right - 1, right + 1, right - 2, right + 2]
        return str(rng.choice([c for c in candidates if 0 <= c <= 99 and c != right]))
    if item.task == "succ":
        n = item.args[0]
        candidates = [n, n + 2, n - 1]
    else:
        a, b = item.args
        candidates = [right - 1, right + 1, right + 10, right - 10, abs(a - b), max(a, b)]
    return str(rng.choice([c for c in candidates if c >= 0 and c != right]))


@dataclass
class DemoData:
    pretrain: list[str] = field(default_factory=list)
    sft: list[dict] = field(default_factory=list)
    preference: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)  # {"task", "prompt": [messages], "answer"}
    preference_eval: list[dict] = field(default_factory=list)  # pairs on the held-out items


def _draw(pool: dict, n: int, rng: random.Random) -> list[Item]:
    tasks = list(TASKS)
    weights = [WEIGHTS[t] for t in tasks]
    return [rng.choice(pool[t]) for t in rng.choices(tasks, weights, k=n)]


def generate(seed: int = 0, pretrain_docs: int = 20000, sft_items: int = 3000,
             preference_pairs: int = 2000, eval_items: int = 200, sft_flaws: float = 0.0) -> DemoData:
    """Generate the demo data; the same arguments always give the same data. `sft_flaws`: the share of
    demonstrations whose answer is a plausible wrong one (`_wrong_answer`), as in human demonstrations; the
    preference pairs always rank the right answer first."""
    train, held = _pools()
    out = DemoData()
    rng = random.Random(f"pretrain-{seed}")
    out.pretrain = [_sentence(it, rng) for it in _draw(train, pretrain_docs, rng)]
    rng, slips = random.Random(f"sft-{seed}"), random.Random(f"sft-flaws-{seed}")
    out.sft = [{"messages": [{"role": "user", "content": it.question},
                             {"role": "assistant", "content": _wrong_answer(it, slips) if slips.random() < sft_flaws
                              else it.answer}]}
               for it in _draw(train, sft_items, rng)]
    rng = random.Random(f"preference-{seed}")
    for it in _draw(train, preference_pairs, rng):
        out.preference.append({"prompt": [{"role": "user", "content": it.question}],
                               "chosen": it.answer, "rejected": _wrong_answer(it, rng)})
    # Held-out items: round-robin over tasks, each task's held-out keys in a seeded order.
    rng = random.Random(f"eval-{seed}")
    queues = {t: rng.sample(held[t], len(held[t])) for t in TASKS}
    while len(out.eval) < eval_items and any(queues.values()):
        for t in TASKS:
            if queues[t] and len(out.eval) < eval_items:
                it = queues[t].pop()
                prompt = [{"role": "user", "content": it.question}]
                out.eval.append({"task": t, "prompt": prompt, "answer": it.answer})
                out.preference_eval.append({"prompt": prompt, "chosen": it.answer, "rejected": _wrong_answer(it, rng)})
    return out


def part_settings(which: str, demo) -> dict:
    """What determines one part of the demo data (the fingerprint of `data.<which>: demo`, or of the held-out
    items with `which="eval"`)."""
    size = {"pretrain": demo.pretrain_docs, "sft": demo.sft_items, "preference": demo.preference_pairs,
            "eval": demo.eval_items}[which]
    held_out = None if which == "pretrain" else demo.eval_items  # validation rows come from held-out items
    flaws = {"sft_flaws": demo.sft_flaws} if which == "sft" else {}
    return {"part": which, "seed": demo.seed, "size": size, "eval_items": held_out, "version": VERSIONS[which],
            **flaws}


def from_settings(demo, *parts: str) -> DemoData:
    """Generate from a `data.demo` config section: every part, or only the parts named (pretrain, sft,
    preference; the held-out items, `eval`, always). Each part is drawn with its own seed, so it is the same
    whichever others are generated."""
    want = set(parts or ("pretrain", "sft", "preference"))
    return generate(demo.seed, demo.pretrain_docs if "pretrain" in want else 0, demo.sft_items if "sft" in want else 0,
                    demo.preference_pairs if "preference" in want else 0, demo.eval_items, demo.sft_flaws)
