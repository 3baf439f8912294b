"""The rewards of the online stages (ppo, grpo, rloo): `preference.rewards`, a list of `{name, weight}` or
`{url, weight}`, composed the same way in our PPO and in TRL's GRPO and RLOO: the total is the weighed sum of
each function's reward, and each function's mean is logged under its own name (`rewards/<label>`).

A function is called on a batch as `f(prompts, responses, answers, **columns) -> list[float]`: the chat prompts
(lists of messages), the decoded responses, the reference answers (None where a row has none) and every other
column of the prompts' rows, one list each (as TRL hands its reward functions the dataset's columns). Built in:

- `reward_model`: the trained (or `preference.reward_model`'s) reward model's score; the stage computes it
  itself, as it holds that model;
- `exact_match`: 1 where the response, whitespace-trimmed, is the reference answer;
- `math_equal`: 1 where the response's final answer is mathematically equal to the reference's (the maintained
  `math-verify` package: LaTeX, plain numbers, fractions; the reference's GSM8K `#### 42` already cut to 42);
- `format`: 1 where the whole response matches `preference.format_pattern` (a regex, such as think/answer tags);
- `length`: minus the response's tokens over `preference.length_target` (0 at or under it);
- `reasoning_gym`: on `data.prompts: reasoning_gym:<dataset>` rows, the dataset's own `score_answer` of the
  response (gptforge.core.procedural), 0 on a row reasoning-gym did not generate;
- `unit_tests`: the share of the row's `tests` (asserts of one expression each) the response's program passes:
  the parts of each test that call the program evaluated in the sandbox, the comparison made here
  (gptforge.model.agents.judge).

A stage with `overlong: penalty` adds `overlong` (gptforge.model.trainers.overlong), DAPO's soft penalty of
responses near their length budget.

A name with a colon is the user's own function, `package.module:function`, imported from the working folder or
an installed package. A `url` is a reward server: the batch as one JSON POST
(`{"prompts", "responses", "answers", **columns}`), answered by `{"rewards": [...]}` or a list, with a timeout and
retries, so that rewards that need a sandbox (running generated code) are computed elsewhere.

What a function returns is checked: one finite number per response, else one error line naming the function and
the first bad index."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from collections.abc import Callable

from gptforge.data import procedural
from gptforge.core.declarations import REWARDS, reward_kind
from gptforge.core.errors import UserError
from gptforge.core.extras import require



@dataclass
class Reward:
    """One entry of preference.rewards, ready to score: `label` names its metric (rewards/<label>)."""

    label: str
    weight: float
    key: str  # preference.rewards[i], for errors
    fn: Callable | None = None  # None: the reward model, which the stage scores
    passes: bool = True  # whether pass@k means anything for it (a 0/1 check or the user's own), not for length
    needs_answers: bool = False  # whether it compares responses with reference answers

    def __call__(self, prompts: list, responses: list[str], answers: list, columns: dict | None = None) -> list[float]:
        try:
            values = self.fn(prompts, responses, answers, **(columns or {}))
        except (UserError, KeyboardInterrupt):
            raise
        except Exception as e:  # a user's function (or a check) that raises: one line naming it, not a traceback
            raise UserError(f"{self.key} ({self.label}) raised {type(e).__name__}: {e}") from e
        return checked(values, len(responses), f"{self.key} ({self.label})")


def checked(values, n: int, what: str) -> list[float]:
    """`values` as n finite floats, or one error naming `what` and the first bad index."""
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as e:
        raise UserError(f"{what} returned {type(values).__name__} {str(values)[:80]!r}, not a list of numbers: "
                        f"{e}") from None
    if len(values) != n:
        raise UserError(f"{what} returned {len(values)} rewards for {n} responses; it must return one per response")
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        raise UserError(f"{what} returned a non-finite reward ({values[bad]}) at index {bad}")
    return values


# --- built in -------------------------------------------------------------------------------------------------


def verify(responses: list[str], answers: list[str]) -> list[float]:
    """The demo's verifier: 1 for a response that is exactly its known answer (whitespace-trimmed), else 0."""
    return [float(r.strip() == a.strip()) for r, a in zip(responses, answers)]


def reasoning_gym(prompts, responses, answers, **columns) -> list[float]:
    """reasoning-gym's score of each response, by its item's dataset (the rows' `reasoning_gym` column)."""
    return procedural.score(responses, columns.get(procedural.COLUMN) or [None] * len(responses))


def environment_reward(prompts, responses, answers, environment_reward=None, **_) -> list[float]:
    """Each episode's environment's get_reward() (the rollout puts it in the `environment_reward` column), 0 where
    it gave none (a failure is in the episode's trajectory)."""
    values = environment_reward if environment_reward is not None else [None] * len(responses)
    return [0.0 if v is None else float(v) for v in values]


def exact_match(prompts, responses, answers, **_) -> list[float]:
    """1 for a response that is exactly its reference answer (whitespace-trimmed), else 0: the demo's verifier."""
    return verify(responses, answers)


def math_equal(prompts, responses, answers, **_) -> list[float]:
    """1 where the response's final answer equals the reference's, by math-verify (LaTeX and plain numbers)."""
    from math_verify import parse
    from math_verify import verify as equivalent

    # math-verify bounds its time with SIGALRM, which only the main thread may set; elsewhere unbounded
    main = threading.current_thread() is threading.main_thread()
    parsing, checking = ({}, {}) if main else ({"parsing_timeout": None}, {"timeout_seconds": None})
    out = []
    for r, a in zip(responses, answers):
        gold, pred = parse(a, **parsing), parse(r, **parsing)
        out.append(float(bool(gold) and bool(pred) and equivalent(gold, pred, **checking)))
    return out


def format_match(pattern: str) -> Callable:
    regex = re.compile(pattern, re.DOTALL)

    def format(prompts, responses, answers, **_) -> list[float]:
        return [float(regex.fullmatch(r.strip()) is not None) for r in responses]

    return format


def length_penalty(tokenizer, target: int) -> Callable:
    def length(prompts, responses, answers, **_) -> list[float]:
        return [-float(max(0, len(tokenizer(r, add_special_tokens=False)["input_ids"]) - target)) for r in responses]

    return length


def user_function(spec: str, key: str) -> Callable:
    """`package.module:function`, imported from the working folder or an installed package."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an ImportError, or the module's own error as it runs
        raise UserError(f"{key}: cannot import module {module_name!r} for {spec!r} ({type(e).__name__}: {e}); it "
                        f"must be importable from the working folder ({os.getcwd()}) or an installed package") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"{key}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no function "
                        f"{attr!r} for {spec!r}")
    return fn


@dataclass
class RemoteReward:
    """A reward server: one JSON POST a batch, `timeout_s` a try, `retries` tries with a growing pause between."""

    url: str
    timeout_s: float = 30.0
    retries: int = 3
    key: str = "preference.rewards"
    errors: list = field(default_factory=list)

    def __call__(self, prompts, responses, answers, **columns) -> list[float]:
        body = json.dumps({"prompts": prompts, "responses": responses, "answers": answers, **columns},
                          default=str).encode()
        last = None
        for attempt in range(self.retries):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 10.0))
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    answer = json.loads(response.read())
                return answer["rewards"] if isinstance(answer, dict) and "rewards" in answer else answer
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read()[:200].decode(errors='replace').strip()}"
                if e.code < 500 and e.code != 429:  # the server refused the request itself: no retry mends it
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f"{self.key}: reward server {self.url} answered with no JSON rewards ({e}); it must "
                                "answer {\"rewards\": [one number per response]}") from None
        raise UserError(f"{self.key}: reward server {self.url} did not answer within {self.retries} tries of "
                        f"{self.timeout_s:g} s (last: {last}); check that it runs, or raise timeout_s / retries")


# --- composing ------------------------------------------------------------------------------------------------


def _unit_tests(pc, key, tokenizer):
    from gptforge.model.agents import judge, sandbox
    from gptforge.model.agents.concurrency import Concurrent

    sandbox.require(key)
    return judge.unit_tests(pc.sandbox, Concurrent(pc.tool_concurrency))


def _reasoning_gym(pc, key, tokenizer):
    require(procedural.GYM.extra, key)
    return reasoning_gym


# Each built-in reward's scorer, registered by its name (its facts: gptforge.core.declarations.REWARDS): (the
# preference section, its entry's key, the tokenizer) -> fn(prompts, responses, answers, **columns); the reward
# model's is None (the stage scores it with the model it loads).
SCORERS: dict[str, Callable] = {
    "reward_model": lambda pc, key, tokenizer: None,
    "exact_match": lambda pc, key, tokenizer: exact_match,
    "math_equal": lambda pc, key, tokenizer: math_equal,
    "format": lambda pc, key, tokenizer: format_match(pc.format_pattern),
    "length": lambda pc, key, tokenizer: length_penalty(tokenizer, pc.length_target),
    "environment": lambda pc, key, tokenizer: environment_reward,
    "reasoning_gym": _reasoning_gym,
    "unit_tests": _unit_tests,
}
assert SCORERS.keys() == REWARDS.keys(), "every declared reward has its scorer, and no other"


def build(pc, tokenizer=None) -> list[Reward]:
    """The rewards of the preference section `pc` (its `rewards` list), each ready to call but the reward model's.
    Import errors and missing settings are one error line naming the entry."""
    out = []
    for i, spec in enumerate(pc.rewards):
        key = f"preference.rewards[{i}]"
        if spec.url:
            out.append(Reward(spec.label(), spec.weight, key,
                              RemoteReward(spec.url, spec.timeout_s, spec.retries, key)))
        elif (kind := reward_kind(spec)) is not None:
            out.append(Reward(kind.name, spec.weight, key, SCORERS[kind.name](pc, key, tokenizer),
                              passes=kind.passes, needs_answers=kind.answers))
        else:
            out.append(Reward(spec.label(), spec.weight, key, user_function(spec.name, key)))
    return out


def check_answers(rewards: list[Reward], answers: list, source: str) -> None:
    """A checker against references on prompts that have none: one error line naming the rewards and the data."""
    need = [r for r in rewards if r.needs_answers]
    missing = sum(a is None for a in answers)
    if need and missing:
        raise UserError(f"{need[0].key} ({need[0].label}) compares responses with reference answers, but {missing} "
                        f"of the {len(answers)} prompts of {source} have none; give data.prompts rows with an answer "
                        "({prompt, answer}, a conversation ending in the reference, or GSM8K's #### answer)")


def for_stage(cfg, tokenizer, need: int, split: str = "train", sampling=None) -> tuple[list[Reward], list[dict]]:
    """An online stage's rewards and prompts (gptforge.data.splits.online_prompts, the `split` rows): at least
    `need` of them, with reference answers where a checker needs them; else one error line naming the data.
    `sampling`: the stage's online section, whose `overlong: penalty` adds the reward `overlong`
    (gptforge.model.trainers.overlong)."""
    from gptforge.data import splits

    rewards = build(cfg.preference, tokenizer)
    if sampling is not None and sampling.overlong == "penalty":
        from gptforge.model.trainers import overlong

        fn = overlong.penalty(tokenizer, sampling.max_new_tokens, sampling.overlong_buffer, sampling.overlong_penalty)
        rewards.append(Reward("overlong", 1.0, "overlong", fn, passes=False))
    key = "data.prompts" if cfg.data.prompts.path is not None else "data.preference"
    items = getattr(splits.online_prompts(cfg.data), split)
    splits.require(len(items), need, "distinct prompts", "preference.global_batch_size", key)
    check_answers(rewards, [it["answer"] for it in items], key)
    return rewards, items


def score(rewards: list[Reward], prompts: list, responses: list[str], answers: list, columns: dict | None = None,
          reward_model: Callable | None = None, calls=None) -> tuple[list[float], dict[str, list[float]]]:
    """(the weighed total of each response, {label: each response's reward}); `reward_model(prompts, responses)`
    scores the reward model's entry (in this thread); the others (checks, functions, reward servers) are called at
    once through `calls` (gptforge.model.agents.concurrency.Concurrent) where given."""
    others = [r for r in rewards if r.fn is not None]
    each = dict(zip([r.label for r in others], (calls.map if calls else map)(
        lambda r: r(prompts, responses, answers, columns), others)))
    for r in rewards:
        if r.fn is None:
            each[r.label] = checked(reward_model(prompts, responses), len(responses), f"{r.key} (reward_model)")
    each = {r.label: each[r.label] for r in rewards}  # in the rewards' order
    total = [sum(r.weight * each[r.label][j] for r in rewards) for j in range(len(responses))]
    return total, each


def columns_of(items: list[dict]) -> dict[str, list]:
    """The columns of prompt rows but the prompt and its answer, one list each: what a reward function gets as
    `**row`."""
    keys = [k for k in (items[0] if items else {}) if k not in ("prompt", "answer")]
    return {k: [it.get(k) for it in items] for k in keys}


def checks_for(pc, tokenizer, items: list[dict]) -> tuple[list[Reward], list[str]]:
    """The rewards that score held-out answers beside the reward model: every one of `pc.rewards` but the reward
    model, less those that need reference answers where some item has none; (checks, labels left out)."""
    checks = [r for r in build(pc, tokenizer) if r.fn is not None]
    unanswered = any(it.get("answer") is None for it in items)
    skipped = [r.label for r in checks if unanswered and r.needs_answers]
    return [r for r in checks if r.label not in skipped], skipped


def trl_functions(rewards: list[Reward], reward_model_dir, reward_tokenizer) -> dict:
    """GRPOTrainer/RLOOTrainer arguments for `rewards`: the reward model as its directory (TRL scores it), every
    other one a TRL reward function over the same columns, the weights in TRL's `reward_weights`. The labels go to
    the trainer's `reward_func_names` (`name_rewards`), so that TRL logs rewards/<label>/mean."""
    funcs, tokenizers = [], []
    for r in rewards:
        if r.fn is None:
            funcs.append(str(reward_model_dir))
            tokenizers.append(reward_tokenizer)
        else:
            funcs.append(_trl_function(r))
            tokenizers.append(None)
    return {"reward_funcs": funcs, "reward_processing_classes": tokenizers,
            "reward_weights": [r.weight for r in rewards]}


TRL_EXTRA = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


def _trl_function(reward: Reward) -> Callable:
    def reward_func(prompts, completions, answer=None, **kwargs):
        responses = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        columns = {k: v for k, v in kwargs.items() if k not in TRL_EXTRA}
        return reward(prompts, responses, answer if answer is not None else [None] * len(responses), columns)

    reward_func.__name__ = reward.label
    return reward_func


def name_rewards(trainer, rewards: list[Reward]) -> None:
    trainer.reward_func_names = [r.label for r in rewards]
