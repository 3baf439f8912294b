"""Rollouts with an environment through the online stages: a user's environment class from the working folder
(TRL's conventions), reset with each prompt's row, its get_reward() a reward, its episodes written as trajectories
and their turns and calls logged; bad environments and tools are one error line before anything runs. (Episodes
turn by turn, token-exact, with tools that fail and stall: tests/model/test_rollout.py.)"""

import json
import subprocess
import sys

import pytest

from tests.conftest import PPO, TINY
from tests.helpers import logged, prepared, run_stage

pytestmark = pytest.mark.slow

LEDGER = '''
class Ledger:
    def reset(self, prompt, **row):
        self.total = len(prompt[-1]["content"]) % 5
        return " (ledger open)"

    def get_reward(self) -> float:
        return self.total / 4


class ToolLedger(Ledger):
    def add(self, amount: int) -> int:
        """Add to the ledger.

        Args:
            amount: what to add
        """
        self.total += amount
        return self.total


def undocumented(x: int) -> int:
    return x
'''


def ledger_reward(asked: str) -> float:
    """What the ledger of a prompt ending with reset's observation gives as its reward."""
    return (len(asked.removesuffix(" (ledger open)")) % 5) / 4


def run_with_ledger(chain, tmp_path, monkeypatch, stage: str, *overrides: str):
    """The stage, 2 steps, with the user's Ledger environment from the working folder (imported from there, as
    reward functions are) and its get_reward() a reward beside the reward model's; checks what every online stage
    logs of its episodes and returns (cfg, path, out_dir)."""
    (tmp_path / "ledger_env.py").write_text(LEDGER)
    monkeypatch.chdir(tmp_path)
    cfg, path = prepared(chain, tmp_path / "run", *overrides, "preference.max_steps=2", "preference.log_every=1",
                         "preference.environment=ledger_env:Ledger", "preference.max_turns=3",
                         "preference.rewards=[{name: reward_model}, {name: environment, weight: 0.5}]")
    manifest, out_dir, _ = run_stage(cfg, path, stage)
    assert manifest["metrics"]["global_step"] == 2
    for key in ("turns_per_episode", "tool_calls_per_episode", "tool_errors", "rewards/environment", "tool_wait_s"):
        assert len(logged(out_dir, key)) == 2, key
    assert logged(out_dir, "turns_per_episode") == [1, 1]  # no tools: one turn each (tool turns: test_rollout.py)
    return cfg, path, out_dir


def episodes_of(out_dir, step: int) -> list[dict]:
    lines = (out_dir / "rollouts" / f"step-{step:08d}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_ppo_rolls_out_a_users_environment(chain, tmp_path, monkeypatch):
    cfg, path, out_dir = run_with_ledger(chain, tmp_path, monkeypatch, "ppo", *PPO)
    episodes = episodes_of(out_dir, 2)
    assert len(episodes) == 4  # rank 0's prompts of the step
    for e in episodes:
        asked = e["messages"][0]["content"]
        assert asked.endswith(" (ledger open)")  # reset's observation, appended to the prompt
        assert e["rewards"]["environment"] == pytest.approx(ledger_reward(asked))  # its get_reward(), its own
        assert e["policy_tokens"] >= 1 and e["ended"] in ("answer", "truncated", "max_turns", "max_length")
        assert e["messages"][-1]["role"] == "assistant"

    # the held-out prompts through the same environment, for the SFT model and the policy
    report, eval_dir, _ = run_stage(cfg, path, "eval-ppo")
    rows = [json.loads(line) for line in (eval_dir / "answers.jsonl").read_text().splitlines()]
    expected = [ledger_reward(r["prompt"][-1]["content"]) for r in rows]  # each held-out ledger's own reward
    for key in ("accuracy/environment", "sft_accuracy/environment"):
        assert report["metrics"][key] == pytest.approx(sum(expected) / len(rows), abs=1e-6), key
    for r in rows:
        for key, response in (("messages", "response"), ("sft_messages", "sft_response")):
            assert r[key][0]["content"].endswith(" (ledger open)") and r[key][-1]["content"].strip() == r[response]
    assert report["metrics"]["tool_calls_per_episode"] == 0  # no tools: each episode one turn


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_trls_trainers_roll_out_a_users_environment(algorithm, chain, tmp_path, monkeypatch):
    _, _, out_dir = run_with_ledger(chain, tmp_path, monkeypatch, algorithm, f"preference.algorithm={algorithm}",
                                    "distributed.zero_stage=2", f"preference.{algorithm}.ptx_coef=0")
    total = logged(out_dir, "reward_mean")  # TRL's weighed sum, with the environment's reward in it
    parts = [m + 0.5 * e for m, e in zip(logged(out_dir, "rewards/reward_model"),
                                         logged(out_dir, "rewards/environment"))]
    assert total == pytest.approx(parts, abs=1e-4)
    for step in (1, 2):
        episodes = episodes_of(out_dir, step)
        assert episodes
        for e in episodes:
            asked = e["messages"][0]["content"]
            assert asked.endswith(" (ledger open)")
            assert e["rewards"]["environment"] == pytest.approx(ledger_reward(asked))
            assert e["reward"] == pytest.approx(e["rewards"]["reward_model"] + 0.5 * e["rewards"]["environment"])
            assert e["policy_tokens"] >= 1 and e["messages"][-1]["role"] == "assistant"


def test_bad_environments_and_tools_are_one_line_before_anything_runs(tmp_path):
    import shutil

    from tests import openenv_game
    from tests.helpers import free_port

    (tmp_path / "ledger_env.py").write_text(LEDGER)
    shutil.copy(openenv_game.__file__, tmp_path / "openenv_game.py")
    rows = [{"prompt": "Write f.", "tests": ["assert f() == 7"]}, {"prompt": "Write g.", "tests": ["print(g())"]}]
    (tmp_path / "coding.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    base = ["--set", "preference.algorithm=ppo"]
    cases = [
        (["preference.environment=no_such_module:Env"],
         "preference.environment: cannot import module 'no_such_module'"),
        (["preference.tools=[ledger_env:undocumented]"], "preference.tools: tool undocumented: Cannot generate JSON "
                                                          "schema for undocumented because it has no docstring"),
        (["preference.max_turns=0"], "preference.max_turns: Input should be greater than or equal to 1"),
        (["preference.rewards=[{name: environment}]"], "preference.rewards names environment but "
                                                        "preference.environment is not set"),
        (["preference.environment=openenv:openenv_game:TallyClient", f"preference.environment_url={closed}"],
         f"preference.environment_url: the OpenEnv environment server at {closed} does not answer"),
        (["preference.environment=verifiers:no_such_env", "data.prompts=verifiers:no_such_env"],
         "data.prompts: verifiers:no_such_env does not load: "),
        (["data.prompts=reasoning_gym:no_such_dataset"],
         "data.prompts: reasoning-gym has no dataset 'no_such_dataset'"),
        (["preference.tools=[mcp:/no/such/server]"],
         "preference.tools: MCP server mcp:/no/such/server does not start: FileNotFoundError"),
        (["preference.tools=[python]", "preference.sandbox.wall_s=0"],
         "preference.sandbox.wall_s: Input should be greater than 0"),
        (["preference.tools=[python]", "preference.tool_timeout_s=12"],
         "preference.tool_timeout_s (12) must be at least preference.sandbox.wall_s (10) + 5 with the python tool"),
        ([f"data.prompts={tmp_path / 'coding.jsonl'}", "preference.rewards=[{name: unit_tests}]",
          "preference.algorithm=grpo"],
         f"{tmp_path / 'coding.jsonl'}:2: test 'print(g())': not a single `assert <expression>`"),
    ]
    for overrides, line in cases:
        proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c", str(TINY), *base,
                               "--set", f"run.root={tmp_path / 'runs'}", *[a for o in overrides for a in ("--set", o)]],
                              capture_output=True, text=True, cwd=tmp_path)
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert proc.returncode != 0 and len(errors) == 1 and line in errors[0], (overrides, proc.stderr[-800:])
        assert not (tmp_path / "runs" / "store").exists()  # nothing ran


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_an_openenv_environment_trains_ppo_and_grpo(algorithm, chain, tmp_path, monkeypatch):
    """An OpenEnv environment served by openenv's own app (tests/openenv_game.py, a text game, each turn of the policy
    its action): every episode is a session, its observations the user turns between the policy's, its reward the
    server's. The game is two turns here, and the policy samples at temperature 0.3 with 24 tokens a turn, so that
    the server ends most games within the model's 128 positions (its observations take 35 of them)."""
    import shutil

    from tests import openenv_game as game

    shutil.copy(game.__file__, tmp_path / "openenv_game.py")  # the user's module, in the working folder
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(game.Tally, "TURNS", 2)
    url, stop = game.serve(game.Tally, game.Say, game.Heard)
    game.LOG.clear()
    try:
        trainer = PPO if algorithm == "ppo" else [f"preference.algorithm={algorithm}", "distributed.zero_stage=2",
                                                  f"preference.{algorithm}.ptx_coef=0"]
        cfg, path = prepared(chain, tmp_path / "run", *trainer, "preference.max_steps=2", "preference.log_every=1",
                             "preference.environment=openenv:openenv_game:TallyClient",
                             f"preference.environment_url={url}", "preference.max_turns=3",
                             "preference.max_length=128", f"preference.{algorithm}.max_new_tokens=24",
                             f"preference.{algorithm}.temperature=0.3",
                             "preference.rewards=[{name: reward_model}, {name: environment}]")
        manifest, out_dir, _ = run_stage(cfg, path, algorithm)
    finally:
        stop()
    assert manifest["metrics"]["global_step"] == 2
    assert len(logged(out_dir, "rewards/environment")) == 2
    ended = []
    for step in (1, 2):
        for e in episodes_of(out_dir, step):
            said = [m["content"] for m in e["messages"] if m["role"] == "assistant"]
            assert e["messages"][0]["content"].endswith(" (three turns)")  # reset's observation
            heard = [m["content"] for m in e["messages"][2::2]]
            assert heard == [f"turn {k + 1}: {len(s)} characters" for k, s in enumerate(said[:len(heard)])]
            ended.append(e["ended"])
            if e["ended"] == "environment":  # the server's reward of the two turns it heard
                assert len(said) == 2 and e["rewards"]["environment"] == pytest.approx(game.tally_reward(said))
            else:
                assert e["rewards"]["environment"] == 0.0  # ended before the game did: no reward
    assert ended.count("environment") > len(ended) / 2, ended  # the server's rewards are what is checked
    said = {m["content"] for step in (1, 2) for e in episodes_of(out_dir, step) for m in e["messages"]
            if m["role"] == "assistant"}
    assert game.LOG and said & {message for _, message, _ in game.LOG}  # the server heard the policy's turns


def test_grpo_on_a_reasoning_gym_dataset_is_scored_by_the_datasets_own_check(chain, tmp_path):
    """data.prompts: reasoning_gym:<dataset> and the reward {name: reasoning_gym} through GRPO and its evaluation:
    the held-out items are the dataset's, and their accuracy is the dataset's score_answer of the answers written."""
    from gptforge.data import procedural

    cfg, path = prepared(chain, tmp_path / "run", "preference.algorithm=grpo", "distributed.zero_stage=2",
                         "preference.grpo.ptx_coef=0", "preference.max_steps=2", "preference.log_every=1",
                         "data.prompts={path: reasoning_gym:basic_arithmetic, size: 64, held_out_size: 12, "
                         "options: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}",
                         "preference.rewards=[{name: reasoning_gym}]")
    manifest, _, _ = run_stage(cfg, path, "grpo")
    assert manifest["metrics"]["global_step"] == 2
    report, eval_dir, _ = run_stage(cfg, path, "eval-grpo")
    rows = [json.loads(line) for line in (eval_dir / "answers.jsonl").read_text().splitlines()]
    held = splits_of(cfg).val
    assert [r["prompt"] for r in rows] == [it["prompt"] for it in held] and len(rows) >= 10
    for key, response in (("accuracy/reasoning_gym", "response"), ("sft_accuracy/reasoning_gym", "sft_response")):
        scores = procedural.score([r[response] for r in rows], [it["reasoning_gym"] for it in held])
        assert report["metrics"][key] == pytest.approx(sum(scores) / len(rows), abs=1e-6), key


def splits_of(cfg):
    from gptforge.data import splits

    return splits.online_prompts(cfg.data)


@pytest.mark.parametrize("algorithm,mode", [("ppo", "sync")])
def test_a_verifiers_environment_trains_ppo(algorithm, mode, chain, tmp_path, monkeypatch):
    """A verifiers environment (tests/verifiers_game.py, verifiers.v1's own classes): its taskset the prompts, its
    harness driving each episode against the policy behind gptforge's endpoint, the environment the user between
    the policy's turns, its rubric's reward the reward. (GRPO in a rollout worker, with a harness whose tool the
    policy calls: tests/bench/test_agentic.py, on the agentic bench's model, whose compact template holds a tool's
    schema in 128 positions.)"""
    import re
    from pathlib import Path

    from tests import verifiers_game as game

    # the user's module, in the working folder; its harness without its tool, whose schema alone would fill the tiny
    # model's 128 positions
    (tmp_path / "verifiers_game.py").write_text(Path(game.__file__).read_text().replace("TOOLS = [HINT]", "TOOLS = []"))
    monkeypatch.chdir(tmp_path)
    trainer = PPO if algorithm == "ppo" else [f"preference.algorithm={algorithm}", "distributed.zero_stage=2",
                                              f"preference.{algorithm}.ptx_coef=0"]
    cfg, path = prepared(chain, tmp_path / "run", *trainer, "preference.max_steps=2", "preference.log_every=1",
                         "preference.environment=verifiers:verifiers_game", "data.prompts=verifiers:verifiers_game",
                         "preference.max_turns=3", "preference.max_length=128",
                         f"preference.{algorithm}.max_new_tokens=16", "preference.global_batch_size=8",
                         f"preference.rollout.mode={mode}", "preference.rewards=[{name: reward_model}, "
                                                            "{name: environment}]")
    manifest, out_dir, _ = run_stage(cfg, path, algorithm)
    assert manifest["metrics"]["global_step"] == 2
    assert len(logged(out_dir, "rewards/environment")) == 2
    answers = {f"Guess my number ({i}), from 1 to 9.": str(s) for i, s in enumerate(game.SECRETS)}
    hints = 0
    for step in (1, 2):
        episodes = episodes_of(out_dir, step)
        assert episodes
        for e in episodes:
            secret = int(answers[e["messages"][0]["content"]])
            assert e["policy_tokens"] >= 1
            said = [m for m in e["messages"] if m["role"] == "assistant"]
            assert len(said) == e["turns"] <= 3
            for before, m in zip(e["messages"][1:], e["messages"][2:]):
                assert m["role"] in ("assistant", "tool", "user")
                if m["role"] == "user":  # the environment, as the user, after a wrong guess: the way to the secret
                    guess = re.findall(r"\d+", before["content"] or "")
                    assert before["role"] == "assistant" and (not guess or guess[-1] != str(secret)), e
                    assert m["content"] == ("higher" if not guess or int(guess[-1]) < secret else "lower"), e
                    hints += 1
            # the rubric's exact match on the last reply the harness read, however the episode ended
            found = re.findall(r"\d+", said[-1]["content"] or "")
            assert e["rewards"]["environment"] == float(bool(found) and found[-1] == str(secret)), e
    assert hints > 0  # the environment answered wrong guesses through the harness
