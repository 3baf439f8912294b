"""Environments of other libraries through the rollout room (gptforge.model.agents.environments): an OpenEnv
environment served by openenv's own app, each episode a session of it, token-exact, concurrent; and the mistakes a
user can make naming one, each one error line. (Through the stages: tests/stages/test_agents.py.)"""

import re
import sys
import time
from pathlib import Path

import pytest

from gptforge.core.config import load_config
from gptforge.core.errors import UserError
from gptforge.model.agents.episode import environment_rewards, render, rollouts
from gptforge.model.agents.tools import Setup
from tests import openenv_game as game
from tests.conftest import TINY
from tests.model.test_rollout import call_text, scripted, tokenizers  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def tally():
    url, stop = game.serve(game.Tally, game.Say, game.Heard)
    yield url
    stop()


def test_an_openenv_text_game_is_three_turns_token_exact_and_its_sessions_run_at_once(tokenizers, tally,  # noqa: F811
                                                                                      monkeypatch):
    """Two episodes of a game whose every step takes 0.4 s on the server: the two sessions' steps of a turn are taken
    together (one after the other, they would start 0.4 s apart)."""
    tok = tokenizers["hermes"]
    monkeypatch.setattr(game.Tally, "DELAY", 0.4)
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
    sessions, times = {}, {}
    for episode_id, message, when in game.LOG:
        sessions.setdefault(episode_id, []).append(message)
        times.setdefault(episode_id, []).append(when)
    assert sorted(sessions.values()) == sorted(said)  # one session an episode
    first, second = times.values()
    assert len(first) == len(second) == 3
    assert all(abs(a - b) < 0.2 for a, b in zip(first, second)), times  # each turn's steps at once


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
    monkeypatch.setitem(sys.modules, "verifiers", None)  # not installed
    with pytest.raises(UserError, match=r"preference.environment: verifiers:verifiers_game needs verifiers, which is "
                                        r"not installed .*gptforge\[environments\]"):
        Setup.load("verifiers:verifiers_game", [], timeout_s=10)
    monkeypatch.setitem(sys.modules, "openenv.core", None)  # not installed
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


def test_a_verifiers_episode_of_three_turns_through_the_endpoint_trains_the_sampled_ids(tokenizers, monkeypatch):  # noqa: F811
    """verifiers' own harness and environment drive each episode against the policy behind gptforge's
    OpenAI-compatible endpoint: a hint tool's call, a guess the environment answers "lower", the right guess."""
    from gptforge.data import splits
    from gptforge.model.agents import endpoint as endpoints
    from tests import verifiers_game

    monkeypatch.syspath_prepend(str(Path(verifiers_game.__file__).parent))  # its id, a module of the working folder
    monkeypatch.delitem(sys.modules, "verifiers_game", raising=False)  # (a stage test's copy, where one ran here)
    tok = tokenizers["hermes"]
    cfg = load_config(TINY, ["data.prompts=verifiers:verifiers_game", "preference.environment=verifiers:verifiers_game",
                             "preference.algorithm=grpo"])
    prompts = splits.online_prompts(cfg.data)
    assert len(prompts.train) == 22 and len(prompts.val) == 2  # every 20th task held out
    assert prompts.train[0] == {"prompt": [{"role": "user", "content": "Guess my number (1), from 1 to 9."}],
                                "answer": "5", "verifiers_task": 1}
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    sampled: dict[int, list[list[int]]] = {}
    addresses = []
    opened = endpoints.Endpoint.open

    def open_(self):
        addresses.append(self.address)
        return opened(self)

    monkeypatch.setattr(endpoints.Endpoint, "open", open_)

    def sample(sequences, budgets):  # the hint, then 8, then the secret
        out = []
        for seq in sequences:
            text = tok.decode(seq)
            task = int(re.search(r"number \((\d+)\)", text)[1])
            turns = text.count("<|im_start|>assistant") - 1
            reply = call_text("hermes", "hint", {}) if turns == 0 else "8" if turns == 1 else \
                str(verifiers_game.SECRETS[task])
            ids = tok(reply, add_special_tokens=False)["input_ids"] + [eot]
            sampled.setdefault(task, []).append(ids)
            out.append(ids)
        return out

    setup = Setup.of(cfg.preference)
    rows = prompts.train[:3]
    episodes = rollouts(setup, sample, tok, rows, "hermes", max_turns=4, max_length=2048, stop_ids={eot})
    assert addresses and all(a.startswith("http://127.0.0.1:") for a in addresses)
    for row, e in zip(rows, episodes):
        task = row["verifiers_task"]
        assert (e.turns, e.ended) == (3, "answer")
        assert [m["role"] for m in e.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
        assert e.messages[1]["tool_calls"][0]["function"]["name"] == "hint" and e.messages[2]["content"] == "odd"
        assert e.messages[4]["content"] == ("lower" if verifiers_game.SECRETS[task] < 8 else "higher")
        own = [i for i, m in zip(e.ids, e.mask) if m]  # the ids trained are the ids sampled, in order
        assert own == [i for turn in sampled[task] for i in turn]
        whole = render(tok, e.messages, [verifiers_game.HINT], False)
        assert tok.decode(e.prompt_ids + e.ids) == whole[:whole.rfind("<|im_end|>") + len("<|im_end|>")]
    assert environment_rewards(episodes) == [1.0, 1.0, 1.0]  # verifiers' rubric: exact match on the last reply


def test_the_endpoint_serves_completions_token_exact_and_refuses_what_would_break_an_episode(tokenizers):  # noqa: F811
    """/v1/completions: a prompt of ids that extends the session's is sampled on; one that does not, a turn past
    max_turns and one past the length budget are answered with an error, and the episode ends there."""
    import json
    import threading
    import urllib.error
    import urllib.request

    from gptforge.model.agents.endpoint import Endpoint

    tok = tokenizers["hermes"]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    replies = iter([[5, 6, eot], [7, eot], [8, eot]])

    def sample(sequences, budgets):
        return [next(replies) for _ in sequences]

    endpoint = Endpoint(tok, "hermes", max_turns=2, max_length=40, stop_ids={eot})
    done = threading.Event()
    threading.Thread(target=endpoint.serve, args=(sample, done.is_set), daemon=True).start()

    def post(url, body, key=endpoint.key, raw=None, kind="completions"):
        request = urllib.request.Request(f"{url}/{kind}", raw if raw is not None else json.dumps(body).encode(),
                                         {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return 200, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        url = endpoint.open()
        assert post(url, {"prompt": [1, 2, 3]}, key="guessed")[0] == 401  # the run's key, or nothing
        # requests it cannot read: 400 with the reason, the session untouched (its first turn still to come)
        for body, raw, kind, why in (
                (None, b"{not json", "completions", "not JSON"), ([1, 2], None, "completions", "JSON object"),
                ({"prompt": [1, 2, 10 ** 6]}, None, "completions", "token ids must be integers in"),
                ({"prompt": [1, -2]}, None, "completions", "token ids"),
                ({"prompt": [1, 2], "max_tokens": "abc"}, None, "completions", "max_tokens must be"),
                ({"prompt": [1, 2], "max_tokens": -1}, None, "completions", "max_tokens must be"),
                ({"messages": "hi"}, None, "chat/completions", "messages must be"),
                ({"messages": [{"role": "user", "content": 5}]}, None, "chat/completions", "messages[0] needs")):
            code, answer = post(url, body, raw=raw, kind=kind)
            assert code == 400 and why in answer["error"]["message"], (body, answer)
            assert endpoint.session(url).open and endpoint.session(url).episode is None
        code, first = post(url, {"prompt": [1, 2, 3]})
        assert code == 200 and first["choices"][0]["token_ids"] == [5, 6, eot]
        assert len(first["choices"][0]["logprobs"]["content"]) == 3 and first["prompt_token_ids"] == [1, 2, 3]
        code, second = post(url, {"prompt": [1, 2, 3, 5, 6, eot, 9, 9]})  # the sampled ids, then what followed
        assert code == 200 and second["choices"][0]["token_ids"] == [7, eot]
        e = endpoint.session(url).episode
        assert (e.prompt_ids, e.ids, e.mask) == ([1, 2, 3], [5, 6, eot, 9, 9, 7, eot], [1, 1, 1, 0, 0, 1, 1])
        code, third = post(url, {"prompt": [1, 2, 3, 5, 6, eot, 9, 9, 7, eot, 4]})
        assert code == 400 and third["error"]["code"] == "max_turns" and e.ended == "max_turns"
        other = endpoint.open()
        assert post(other, {"prompt": [1, 2]})[0] == 200
        code, diverged = post(other, {"prompt": [1, 3, 8, eot, 4]})  # not the session's ids
        assert code == 400 and diverged["error"]["code"] == "diverged"
        long = endpoint.open()
        code, full = post(long, {"prompt": list(range(1, 41))})  # no room under max_length
        assert code == 400 and full["error"]["code"] == "max_length"
    finally:
        done.set()


def test_a_sampler_that_fails_answers_every_request_of_its_batch(tokenizers):  # noqa: F811
    """Two sessions' requests sampled as one batch by a sampler that raises: both are answered (500, the error), the
    serving loop raises the error to the rollout process, and nothing waits for ever."""
    import json
    import threading
    import urllib.error
    import urllib.request

    from gptforge.model.agents.endpoint import Endpoint

    tok = tokenizers["hermes"]
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    def sample(sequences, budgets):
        raise IndexError("index out of range in self")

    endpoint = Endpoint(tok, "hermes", max_turns=2, max_length=40, stop_ids={eot}, window_s=1.0)
    raised: list = []

    def serve():
        try:
            endpoint.serve(sample, lambda: False)
        except IndexError as e:
            raised.append(e)

    threading.Thread(target=serve, daemon=True).start()
    answers: dict = {}

    def post(url):
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {endpoint.key}"}
        request = urllib.request.Request(f"{url}/completions", json.dumps({"prompt": [1, 2]}).encode(), headers)
        try:
            urllib.request.urlopen(request, timeout=20)
        except urllib.error.HTTPError as e:
            answers[url] = (e.code, json.loads(e.read())["error"]["message"])

    urls = [endpoint.open(), endpoint.open()]
    posts = [threading.Thread(target=post, args=(u,)) for u in urls]
    for t in posts:
        t.start()
    for t in posts:
        t.join(30)
    assert {answers[u] for u in urls} == {(500, "the sampler failed: IndexError: index out of range in self")}
    assert raised and not any(endpoint.session(u).open for u in urls)
    endpoint.close()
