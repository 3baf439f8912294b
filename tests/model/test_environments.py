"""Environments of other libraries through the rollout room (gptforge.model.rollout.environments): an OpenEnv
environment served by openenv's own app, each episode a session of it, token-exact, concurrent; and the mistakes a
user can make naming one, each one error line. (Through the stages: tests/stages/test_agents.py.)"""

import time

import pytest

from gptforge.core.config import load_config
from gptforge.core.errors import UserError
from gptforge.model.rollout.episode import environment_rewards, render, rollouts
from gptforge.model.rollout.tools import Setup
from tests import openenv_game as game
from tests.conftest import TINY
from tests.model.test_rollout import call_text, scripted, tokenizers  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def tally():
    url, stop = game.serve(game.Tally, game.Say, game.Heard)
    yield url
    stop()


def test_an_openenv_text_game_is_three_turns_token_exact_and_its_sessions_run_at_once(tokenizers, tally):  # noqa: F811
    tok = tokenizers["hermes"]
    setup = Setup.load("openenv:tests.openenv_game:TallyClient", [], timeout_s=10, concurrency=4, url=tally)
    said = [["one", "two words", "three more words"], ["a", "bb", "ccc"]]
    turns = [t for step in zip(*said) for t in step]  # the policy samples both episodes' turns at once, turn by turn
    sampled: list[list[int]] = []
    sample, eot = scripted(tok, turns, sampled)
    rows = [{"prompt": [{"role": "user", "content": f"Play {i}."}], "answer": None} for i in range(2)]
    game.LOG.clear()
    episodes = rollouts(setup, sample, tok, rows, "hermes", max_turns=5, max_length=2048, stop_ids={eot})

    for e, words, row in zip(episodes, said, rows):
        assert (e.turns, e.ended) == (3, "environment")  # the environment said done after its third step
        assert e.messages[0]["content"] == row["prompt"][0]["content"] + " (three turns)"  # reset's observation
        assert [m["role"] for m in e.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
        assert [m["content"] for m in e.messages[1::2]] == words  # each turn was the action
        assert [m["content"] for m in e.messages[2::2]] == [f"turn {k + 1}: {len(w)} characters"
                                                           for k, w in enumerate(words[:2])]
        own = [i for i, m in zip(e.ids, e.mask) if m]  # the ids trained are the ids sampled, the observations masked
        assert own == [i for turn in sampled[episodes.index(e)::2] for i in turn]
        whole = render(tok, e.messages, None, False)
        assert tok.decode(e.prompt_ids + e.ids) == whole[:whole.rfind("<|im_end|>") + len("<|im_end|>")]
    assert environment_rewards(episodes) == [game.tally_reward(w) for w in said]  # the steps' rewards, summed
    sessions = {}
    for episode_id, message, _ in game.LOG:
        sessions.setdefault(episode_id, []).append(message)
    assert sorted(sessions.values()) == sorted(said)  # one session an episode


def test_an_openenv_action_of_several_fields_is_a_tool(tokenizers):  # noqa: F811
    tok = tokenizers["hermes"]
    url, stop = game.serve(game.Walk, game.StepAction, game.Where)
    try:
        setup = Setup.load("openenv:tests.openenv_game:WalkClient", [], timeout_s=10, url=url)
        box = setup.toolbox({"prompt": []})
        assert [s["function"]["name"] for s in box.schemas] == ["step"]
        assert set(box.schemas[0]["function"]["parameters"]["properties"]) == {"dx", "dy"}
        assert box.schemas[0]["function"]["description"] == "Take a step on the grid."
        turns = [call_text("hermes", "step", {"dx": 1, "dy": 1}), call_text("hermes", "step", {"dx": "far"}),
                 call_text("hermes", "step", {"dx": 1, "dy": 0}), "There."]
        sample, eot = scripted(tok, turns, [])
        [e] = rollouts(setup, sample, tok, [{"prompt": [{"role": "user", "content": "Walk to (2, 1)."}]}], "hermes",
                       max_turns=5, max_length=2048, stop_ids={eot})
        assert e.messages[0]["content"].endswith('{"x": 0, "y": 0}')
        assert [c.result for c in e.calls] == ['{"x": 1, "y": 1}', None, '{"x": 2, "y": 1}']
        assert "validation error" in e.calls[1].error  # a bad action is the tool's error, and the episode goes on
        assert (e.turns, e.ended) == (4, "answer") and environment_rewards([e]) == [1.0]
    finally:
        stop()


def test_openenv_mistakes_are_one_line_naming_the_key(tally, monkeypatch):
    with socket_closed() as url:
        t0 = time.perf_counter()
        with pytest.raises(UserError, match=r"preference.environment_url: the OpenEnv environment server at "
                                            rf"{url} does not answer .*; start it, or correct the address"):
            Setup.load("openenv:tests.openenv_game:TallyClient", [], timeout_s=10, url=url)
        assert time.perf_counter() - t0 < 10
    with pytest.raises(UserError, match=r"openenv:tests.openenv_game:tally_reward is <function .*>, not a subclass "
                                        r"of openenv's EnvClient"):
        Setup.load("openenv:tests.openenv_game:tally_reward", [], timeout_s=10, url=tally)
    with pytest.raises(UserError, match=r"preference.environment_url is the address of an openenv: environment's "
                                        r"server: set both or neither"):
        load_config(TINY, ["preference.environment=openenv:tests.openenv_game:TallyClient"])
    monkeypatch.setitem(__import__("sys").modules, "openenv.core", None)  # not installed
    with pytest.raises(UserError, match=r"preference.environment: openenv:tests.openenv_game:TallyClient needs "
                                        r"openenv-core, which is not installed .*gptforge\[environments\]"):
        Setup.load("openenv:tests.openenv_game:TallyClient", [], timeout_s=10, url=tally)


class socket_closed:
    """The address of a port nothing listens on."""

    def __enter__(self):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"http://127.0.0.1:{s.getsockname()[1]}"

    def __exit__(self, *exc):
        return False
