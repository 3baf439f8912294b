"""preference.rewards (gptforge.model.rewards): the built-in checks, the user's own function, a reward server on
127.0.0.1 with its error paths, the weighed total, TRL's view of the same functions, and the prompts they score
(data.prompts: {prompt, answer}, conversations, GSM8K's #### answers)."""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gptforge.core.config import load_config
from gptforge.core.errors import UserError
from gptforge.data import splits
from gptforge.data.formats import to_prompt_item
from gptforge.model import rewards
from tests.conftest import TINY


def built(*specs, **settings):
    overrides = [f"preference.rewards={json.dumps(list(specs))}"] + [f"preference.{k}={v}" for k, v in settings.items()]
    return rewards.build(load_config(TINY, overrides).preference)


def test_built_in_checks():
    (exact, math, fmt), = [built({"name": "exact_match"}, {"name": "math_equal"}, {"name": "format"},
                                 format_pattern=r"<answer>\d+</answer>")]
    assert exact(None, ["8", " 8 ", "9"], ["8", "8", "8"]) == [1.0, 1.0, 0.0]
    assert math(None, ["The answer is 8.", r"$\frac{1}{2}$", "0.5", "9", ""], ["8", "0.5", "1/2", "8", "8"]) == \
        [1.0, 1.0, 1.0, 0.0, 0.0]
    assert fmt(None, ["<answer>12</answer>", "<answer>12</answer> and more", "12"], [None] * 3) == [1.0, 0.0, 0.0]


def test_length_penalises_each_token_over_the_target():
    class Words:  # a tokenizer of whitespace-separated words
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": text.split()}

    cfg = load_config(TINY, ["preference.rewards=[{name: length}]", "preference.length_target=2"])
    (length,) = rewards.build(cfg.preference, Words())
    assert length(None, ["a", "a b", "a b c d e"], [None] * 3) == [0.0, 0.0, -3.0]
    assert not length.passes


def test_the_weighed_total_and_each_reward_by_name():
    checks = built({"name": "exact_match", "weight": 2.0}, {"name": "reward_model", "weight": 0.5})
    total, each = rewards.score(checks, [[{"role": "user", "content": "q"}]] * 2, ["8", "7"], ["8", "8"],
                                reward_model=lambda prompts, responses: [1.0, -4.0])
    assert each == {"exact_match": [1.0, 0.0], "reward_model": [1.0, -4.0]}
    assert total == [2.5, -2.0]


def test_a_users_function_gets_every_column_and_is_checked(tmp_path, monkeypatch):
    (tmp_path / "my_checks.py").write_text(
        "def by_id(prompts, responses, answers, **row):\n"
        "    return [float(r == str(i)) for r, i in zip(responses, row['id'])]\n"
        "def short(prompts, responses, answers, **row):\n"
        "    return [1.0]\n"
        "def nan(prompts, responses, answers, **row):\n"
        "    return [0.0, float('nan')]\n"
        "def crash(prompts, responses, answers, **row):\n"
        "    raise RuntimeError('the grader crashed')\n")
    monkeypatch.chdir(tmp_path)  # importable from the working folder
    fn, short, nan, crash = built({"name": "my_checks:by_id"}, {"name": "my_checks:short"}, {"name": "my_checks:nan"},
                                  {"name": "my_checks:crash"})
    assert fn.label == "by_id"
    assert fn(None, ["3", "5"], [None, None], {"id": [3, 4]}) == [1.0, 0.0]
    with pytest.raises(UserError, match=r"preference.rewards\[1\] \(short\) returned 1 rewards for 2 responses"):
        short(None, ["a", "b"], [None, None])
    with pytest.raises(UserError, match=r"preference.rewards\[2\] \(nan\) returned a non-finite reward \(nan\) at "
                                        r"index 1"):
        nan(None, ["a", "b"], [None, None])
    with pytest.raises(UserError, match=r"^preference.rewards\[3\] \(crash\) raised RuntimeError: the grader crashed$"):
        crash(None, ["a"], [None])  # one line naming the entry, not a traceback
    with pytest.raises(UserError, match=r"preference.rewards\[0\]: cannot import module 'no_such_module' for "
                                        r"'no_such_module:f'"):
        built({"name": "no_such_module:f"})
    with pytest.raises(UserError, match=r"module 'my_checks' .* has no function 'missing'"):
        built({"name": "my_checks:missing"})


class RewardServer:
    """A reward server on 127.0.0.1 that fails its first `failures` requests with HTTP 503, or sleeps `delay`."""

    def __init__(self, failures=0, delay=0.0, reply=None):
        state = {"seen": 0, "bodies": []}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                state["seen"] += 1
                state["bodies"].append(body)
                if state["seen"] <= failures:
                    self.send_response(503)
                    self.end_headers()
                    self.wfile.write(b"busy")
                    return
                import time
                time.sleep(delay)
                answer = reply if reply is not None else {
                    "rewards": [float(len(r)) for r in body["responses"]]}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.state = state
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.handle_error = lambda *args: None  # a client that gave up (the timeout test) is no error here
        self.url = f"http://127.0.0.1:{self.server.server_port}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_reward_server_scores_a_batch_and_is_retried():
    server = RewardServer(failures=2)
    try:
        (remote,) = built({"url": server.url, "name": "code_tests", "retries": 3, "timeout_s": 5})
        assert remote.label == "code_tests"
        prompts = [[{"role": "user", "content": "q"}]] * 2
        assert remote(prompts, ["abc", "de"], ["x", None], {"tests": ["t1", "t2"]}) == [3.0, 2.0]
        assert server.state["seen"] == 3  # two 503s, then an answer
        assert server.state["bodies"][-1] == {"prompts": prompts, "responses": ["abc", "de"], "answers": ["x", None],
                                              "tests": ["t1", "t2"]}
    finally:
        server.close()


def test_a_reward_server_that_does_not_answer_is_named():
    slow = RewardServer(delay=3.0)
    wrong = RewardServer(reply={"rewards": [1.0]})
    try:
        (remote,) = built({"url": slow.url, "retries": 2, "timeout_s": 0.5})
        with pytest.raises(UserError, match=rf"preference.rewards\[0\]: reward server {slow.url} did not answer within "
                                            r"2 tries of 0.5 s"):
            remote(None, ["a"], [None])
        (remote,) = built({"url": wrong.url})
        with pytest.raises(UserError, match=r"\(remote\) returned 1 rewards for 2 responses"):
            remote(None, ["a", "b"], [None, None])
    finally:
        slow.close()
        wrong.close()
    (gone,) = built({"url": slow.url, "retries": 1, "timeout_s": 1})  # nothing listens there now
    with pytest.raises(UserError, match=rf"reward server {slow.url} did not answer within 1 tries"):
        gone(None, ["a"], [None])


def test_trl_sees_the_same_functions_under_their_labels(tmp_path):
    checks = built({"name": "exact_match", "weight": 2.0}, {"name": "reward_model", "weight": 0.5})
    args = rewards.trl_functions(checks, tmp_path / "rm", "rm-tokenizer")
    assert args["reward_weights"] == [2.0, 0.5] and args["reward_funcs"][1] == str(tmp_path / "rm")
    assert args["reward_processing_classes"] == [None, "rm-tokenizer"]
    exact = args["reward_funcs"][0]
    assert exact.__name__ == "exact_match"
    completions = [[{"role": "assistant", "content": "68"}], [{"role": "assistant", "content": "67"}]]
    assert exact(prompts=None, completions=completions, answer=["68", "68"], completion_ids=None,
                 trainer_state=None) == [1.0, 0.0]


def test_prompt_rows_gsm8k_conversations_and_plain(tmp_path):
    assert to_prompt_item({"question": "Tom has 3 apples and buys 5. How many?",
                           "answer": "He has 3 + 5 = 8.\n#### 8"}) == \
        {"prompt": [{"role": "user", "content": "Tom has 3 apples and buys 5. How many?"}], "answer": "8"}
    assert to_prompt_item({"question": "q", "answer": "#### 1,250"})["answer"] == "1250"
    assert to_prompt_item({"prompt": "2+2?", "answer": 4, "id": 7}) == \
        {"id": 7, "prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}
    assert to_prompt_item({"messages": [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "hello"}]})["answer"] == "hello"
    assert to_prompt_item({"prompt": "open question"})["answer"] is None
    rows = [{"question": f"What is {i} plus 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(40)]
    rows[3]["level"] = "easy"
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(TINY, [f"data.prompts={path}"])
    split = splits.online_prompts(cfg.data)
    assert len(split.train) == 38 and len(split.val) == 2  # every 20th row held out
    assert split.train[2] == {"prompt": [{"role": "user", "content": "What is 3 plus 1?"}], "answer": "4",
                              "level": "easy"}
    assert split.train[0]["level"] is None  # one set of columns for every row
    assert splits.eval_set(cfg.data, "grpo").items == split.val  # the held-out prompts evaluate the policy


def test_the_default_prompts_are_the_preference_pairs_with_the_demos_answers():
    cfg = load_config(TINY, [])
    split = splits.online_prompts(cfg.data)
    pairs = splits.preference_pairs(cfg.data).train
    assert len(split.train) == len({str(p["prompt"]) for p in pairs})
    first = next(p for p in pairs if p["prompt"] == split.train[0]["prompt"])
    assert split.train[0]["answer"] == first["chosen"]


def test_checkers_on_prompts_without_answers_are_one_error(tmp_path):
    path = tmp_path / "open.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"tell me about {i}"}) + "\n" for i in range(100)))
    cfg = load_config(TINY, [f"data.prompts={path}", "preference.rewards=[{name: math_equal}]",
                             "preference.algorithm=grpo"])
    with pytest.raises(UserError, match=r"preference.rewards\[0\] \(math_equal\) compares responses with reference "
                                        r"answers, but 95 of the 95 prompts of data.prompts have none"):
        rewards.for_stage(cfg, None, 16)


def test_pass_at_k_counts_an_item_passed_when_any_of_its_k_samples_is_right(monkeypatch):
    from gptforge.model.eval import generation

    drawn = ["1", "2", "3", "5", "5", "5"]  # 3 samples for each of two items, answers 3 and 4
    monkeypatch.setattr(generation, "generate", lambda model, tokenizer, prompts, *a, **k: drawn[:len(prompts)])
    (exact,) = built({"name": "exact_match"})
    items = [{"prompt": [{"role": "user", "content": "a"}], "answer": "3"},
             {"prompt": [{"role": "user", "content": "b"}], "answer": "4"}]
    assert generation.passes(None, None, items, [exact], 3, 8, 0, 8, False) == {"exact_match": [1.0, 0.0]}


def test_reasoning_gym_items_held_out_from_their_own_seed_and_scored_by_their_dataset():
    cfg = load_config(TINY, ["data.prompts={path: reasoning_gym:basic_arithmetic, size: 60, held_out_size: 20, "
                             "options: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}",
                             "preference.rewards=[{name: reasoning_gym}]", "preference.algorithm=grpo"])
    split = splits.online_prompts(cfg.data)
    train = {str(it["prompt"]) for it in split.train}
    assert len(split.train) == 60 and 0 < len(split.val) <= 20
    assert not train & {str(it["prompt"]) for it in split.val}  # a held-out item asked in training is dropped
    assert splits.eval_set(cfg.data, "grpo").items == split.val
    again = load_config(TINY, ["data.prompts={path: reasoning_gym:basic_arithmetic, size: 60, held_out_size: 20, "
                               "seed: 1, options: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}"])
    assert splits.source_fingerprint(cfg.data, "prompts") != splits.source_fingerprint(again.data, "prompts")
    (graded,) = rewards.build(cfg.preference)
    items = split.val[:3]
    entries = {"reasoning_gym": [it["reasoning_gym"] for it in items]}
    right = [f" {it['answer']} " for it in items]
    assert graded(None, right, [None] * 3, entries) == [1.0, 1.0, 1.0]  # the dataset's own score_answer
    assert graded(None, ["x", right[1], str(int(items[2]["answer"]) + 1)], [None] * 3, entries) == [0.0, 1.0, 0.0]


def test_reasoning_gym_mistakes_are_one_line_naming_the_key(monkeypatch):
    """The schema reads the dataset's name alone (a head node without the extra loads the config); the preflight asks
    the library."""
    from gptforge.pipeline.preflight import check_sources

    with pytest.raises(UserError, match=r"data.prompts: reasoning-gym has no dataset 'basic_arithmetc'; did you mean "
                                        r"basic_arithmetic"):
        check_sources(load_config(TINY, ["data.prompts=reasoning_gym:basic_arithmetc"]))
    with pytest.raises(UserError, match=r"data.eval.options: reasoning-gym's basic_arithmetic refuses"):
        check_sources(load_config(TINY, ["data.eval={path: reasoning_gym:basic_arithmetic, options: {bogus: 1}}"]))
    with pytest.raises(UserError, match=r"preference.rewards\[0\] \(reasoning_gym\) scores reasoning-gym's items, "
                                        r"but data.prompts is None"):
        load_config(TINY, ["preference.rewards=[{name: reasoning_gym}]", "preference.algorithm=grpo"])
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # not installed
    cfg = load_config(TINY, ["data.prompts=reasoning_gym:gcd"])
    with pytest.raises(UserError, match=r"data.prompts: reasoning_gym:gcd needs reasoning-gym, which is not installed "
                                        r".*pip install 'gptforge\[environments\]'"):
        check_sources(cfg)
