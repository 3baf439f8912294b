"""bench/agentic.py shrunk to one seed that learns; a user's environment whose tool raises and stalls, on its
SFT model."""

import json
import re
from pathlib import Path

import pytest

from tests.bench.run import bench, sets
from tests.helpers import FAST, logged, run_stage

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def agentic(tmp_path_factory) -> tuple[Path, str]:
    """bench/agentic.py shrunk to one seed that still learns (about 3 minutes of a core): its own corpus, 2,000 tool-use
    demonstrations (60% flawed) and 1,000 problems (50 held out); SFT learns to call the tool, GRPO and PPO roll out
    with it for 40 steps at twice the bench's learning rate, rewarded by exact match alone, and both evaluations
    answer through it (3 seeds at the bench's own size: bench/RESULTS.md). Its root (seed0.yaml, the store) and its
    output. Alone on one core on 2026-12-04: SFT 0.34, GRPO 0.62, PPO 0.74 in 195 s (at 100 steps and the bench's
    rate: 0.66 and 0.82 in 277 s; at 200 SFT steps the SFT model got 0.06 and neither policy learned). SFT's
    validation loss is measured twice, not 40 times: the same three figures, SFT in 93 s against 101-110."""
    root = tmp_path_factory.mktemp("agentic")
    shrunk = [*FAST, "distributed.nproc_per_node=1", "pretrain.max_steps=100", "sft.max_steps=400", "sft.lr=2e-3",
              "sft.global_batch_size=32", "sft.micro_batch_size=16", "sft.save_every=200", "sft.eval_every=200",
              "preference.max_steps=40", "preference.lr=1e-4", "preference.global_batch_size=16",
              "preference.save_every=20", "eval.items=64"]
    return root, bench("agentic.py", "--seeds", "0", "--root", str(root), "--documents", "1500", "--calls", "400",
                       "--problems", "1000", "--demonstrations", "2000", *sets(shrunk), one_core=True)


def test_agentic_bench(agentic):
    """One seed within the suite: the SFT model calls the tool but copies the demonstrations' slip; GRPO and PPO,
    rewarded by the outcome alone, raise held-out accuracy with the tool over it."""
    root, out = agentic
    accuracy = {a: float(re.search(rf"  {a}: +([\d.]+) ± nan", out).group(1)) for a in ("sft", "grpo", "ppo")}
    calls = re.search(r"  sft: +[\d.]+ ± nan  \(tool calls per episode ([\d.]+) ± nan\)", out)
    assert calls and float(calls.group(1)) > 0.9, out  # the SFT model calls the tool
    for algo in ("grpo", "ppo"):
        assert accuracy[algo] >= accuracy["sft"] + 0.1, out  # 5 of the 50 held-out problems at least
        assert re.search(rf"  {algo}: .*tool calls per episode [\d.]+ ± nan", out), out
    trajectory = next((root / "store" / "grpo").glob("*/rollouts/step-00000002.jsonl"))
    episode = json.loads(trajectory.read_text().splitlines()[0])
    assert episode["tool_tokens"] > 0 and any(m["role"] == "tool" for m in episode["messages"])


FLAKY = '''
import time


class Flaky:
    """The bench's add(a, b) in an environment: of the episodes a process starts, one in three has it raise and one
    in three stall past the stage's tool timeout; get_reward() is 1 once a call returned the sum."""

    started = 0

    def reset(self, **row):
        Flaky.started += 1
        self.mode, self.returned = Flaky.started % 3, False

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first number
            b: the second number
        """
        if self.mode == 1:
            raise ValueError("the adder is out of order")
        if self.mode == 2:
            time.sleep(5)
            return 0
        self.returned = True
        return a + b

    def get_reward(self) -> float:
        return float(self.returned)
'''


def test_a_users_environment_whose_tool_raises_and_stalls_through_ppo_grpo_and_rloo(agentic, monkeypatch):
    """The bench's SFT model (the one that calls the tool) rolls out through a user's environment class from the
    working folder, under PPO, GRPO and RLOO: a call that raises and one that passes preference.tool_timeout_s are
    the tool's error messages to the model (the timeout's, longer, leaves the 128-position model no room for another
    turn: the episode ends there), the stages train to their end, and get_reward() is a reward (0 for an environment
    still stuck in a call)."""
    from gptforge.core.config import dump_config, load_config

    root, _ = agentic
    (root / "flaky_env.py").write_text(FLAKY)
    monkeypatch.chdir(root)  # the stages import flaky_env from their working folder
    cfg = load_config(str(root / "seed0.yaml"), [
        "preference.tools=[]", "preference.environment=flaky_env:Flaky", "preference.tool_timeout_s=1",
        "preference.rewards=[{name: exact_match}, {name: environment}]", "preference.log_every=1",
        "preference.algorithm=[ppo,grpo,rloo]", "preference.rloo.max_new_tokens=40", "preference.rloo.ptx_coef=0",
        "preference.max_steps=2", "preference.global_batch_size=8"])
    path = root / "flaky.yaml"
    path.write_text(dump_config(cfg))
    for stage in ("ppo", "grpo", "rloo"):
        manifest, out_dir, _ = run_stage(cfg, path, stage)
        assert manifest["metrics"]["global_step"] == 2, stage
        episodes = [json.loads(line) for step in (1, 2)
                    for line in (out_dir / "rollouts" / f"step-{step:08d}.jsonl").read_text().splitlines()]
        errors = [c["error"] for e in episodes for c in e["tool_calls"] if c["error"]]
        assert any(x == "ValueError: the adder is out of order" for x in errors), (stage, errors)
        assert any(x.startswith("TimeoutError: add did not return within 1 s") for x in errors), (stage, errors)
        for e in episodes:
            calls = [c for c in e["tool_calls"] if c["name"] == "add"]
            # 1 once add returned; 0 where it raised, and where the environment is still stuck in a call (its
            # get_reward() not called: the environment reward is 0 where there is none)
            assert e["rewards"]["environment"] == float(any(c["result"] is not None for c in calls)), (stage, e)
            results = [m["content"] for m in e["messages"] if m["role"] == "tool"]
            for c in calls:  # each call's outcome is the tool turn the model read next, where it fits the positions
                outcome = f"error: {c['error']}" if c["error"] else c["result"]
                assert outcome in results or e["ended"] == "max_length", (stage, e)
        assert any(m["content"] == "error: ValueError: the adder is out of order" and e["ended"] == "answer"
                   for e in episodes for m in e["messages"]), stage  # read, and answered after
        assert sum(logged(out_dir, "tool_errors")) == len(errors), stage


def test_agentic_latency_bench():
    """bench/agentic_latency.py shrunk: 6 episodes, tools that wait 0.05 s, 3 at once: one by one never more than one
    call waits at a time, at once three do, and the trajectories are the same either way (no speed asserted)."""
    out = bench("agentic_latency.py", "--batch", "6", "--concurrency", "3", "--latency", "0.05", "--turns", "1")
    rows = re.findall(r"^\| (function|async def) \| 0.05 \| [\d.]+ \| [\d.]+ \| [\d.]+x \| 2.4x \| (\d+), (\d+) \| "
                      r"(True|False) \|$", out, re.M)
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("function", "1", "3", "True"),
                                                         ("async def", "1", "3", "True")], out


SCRIPTED = '''
import re

import torch
from transformers import AutoTokenizer

from gptforge.model.sampling.engine import HFEngine
from gptforge.model.sampling.generate import Turn


class PythonForEvenSums(HFEngine):
    """The policy's own samples, but where a question's sum is even its first turn is written: a call of the python
    tool that prints the sum, scored by the policy's model as if it had sampled it."""

    def __init__(self, model_dir, **options):
        tok = AutoTokenizer.from_pretrained(model_dir)
        super().__init__(HFEngine.load(model_dir, tok.pad_token_id).model, tok.pad_token_id)
        self.tok = tok

    def generate(self, sequences, budgets, max_new_tokens, **sampling):
        turns = super().generate(sequences, budgets, max_new_tokens, **sampling)
        for i, seq in enumerate(sequences):
            text = self.tok.decode(seq)
            a, b = map(int, re.findall(r"What is (\\d+) plus (\\d+)", text)[-1])
            if (a + b) % 2 == 0 and "<tool_response>" not in text:
                call = '<tool_call>{"name":"python","arguments":{"code":"print(%d+%d)"}}</tool_call><|im_end|>' % (a, b)
                ids = self.tok.encode(call, add_special_tokens=False)[:budgets[i]]
                with torch.no_grad():
                    logits = self.model(torch.tensor([seq + ids])).logits[0, len(seq) - 1:-1]
                logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
                turns[i] = Turn.of(ids, logp.tolist())
        return turns
'''


def test_the_python_tool_and_an_mcp_servers_tool_through_a_training_stage(agentic, monkeypatch):
    """GRPO on the bench's SFT model with two tools, gptforge's sandboxed python and `add` served by an MCP server
    (tests/mcp_server.py over stdio): the policy calls add itself, as it learned to, and reads the server's sum; for
    the questions whose sum is even a user engine (in its rollout worker) writes the first turn, a python call that
    prints the sum, which the sandbox runs. Both tools' results are the turns the policy read next, and the stage
    trains on those episodes."""
    import sys

    from gptforge.core.config import dump_config, load_config

    root, _ = agentic
    (root / "scripted_engine.py").write_text(SCRIPTED)
    monkeypatch.chdir(root)  # the stage imports the engine from its working folder
    server = Path(__file__).resolve().parents[1] / "mcp_server.py"
    cfg = load_config(str(root / "seed0.yaml"), [
        f"preference.tools=[python, 'mcp:{sys.executable} {server} --only add']",
        "preference.rollout.engine=scripted_engine:PythonForEvenSums", "preference.algorithm=grpo",
        "preference.max_steps=2", "preference.global_batch_size=8", "preference.log_every=1"])
    path = root / "tools.yaml"
    path.write_text(dump_config(cfg))
    manifest, out_dir, _ = run_stage(cfg, path, "grpo")
    assert manifest["metrics"]["global_step"] == 2
    called = {"python": 0, "add": 0}
    for step in (1, 2):
        for line in (out_dir / "rollouts" / f"step-{step:08d}.jsonl").read_text().splitlines():
            e = json.loads(line)
            a, b = map(int, re.search(r"What is (\d+) plus (\d+)", e["messages"][0]["content"]).groups())
            read = [m["content"] for m in e["messages"] if m["role"] == "tool"]
            for c in e["tool_calls"]:
                called[c["name"]] = called.get(c["name"], 0) + 1  # (a sample's call can be malformed: its error)
                if c["name"] == "python":  # the sandbox's run of the written program
                    assert (a + b) % 2 == 0 and c["result"] == f"exit status 0\nstdout:\n{a + b}\n", e
                elif c["name"] == "add" and isinstance(c["arguments"].get("a"), int) and \
                        isinstance(c["arguments"].get("b"), int):  # the MCP server's sum of what the policy asked
                    assert c["error"] is None and c["result"] == str(c["arguments"]["a"] + c["arguments"]["b"]), e
                outcome = f"error: {c['error']}" if c["error"] else c["result"]
                assert outcome in read or e["ended"] == "max_length", e  # read by the policy next
            assert e["tool_tokens"] > 0 or not e["tool_calls"] or e["ended"] == "max_length", e
    assert called["python"] > 0 and called["add"] > 0, called


ADDER = '''"""A verifiers environment of the agentic bench's task, with verifiers.v1's own classes: its taskset the
sums, its harness a chat loop that offers `add` and answers each call with the sum of the call's arguments, the
environment the user who says "wrong" once after a wrong answer, and exact match on the last reply as its reward."""

import json
import re

import verifiers.v1 as vf
from verifiers_game import AnswerData, AnswerTask, ChatConfig, ToolLoop  # (copied beside it)

__all__ = ["AddTaskset", "AddHarness", "AddEnv"]
PAIRS = [(10 + 7 * i % 89, 11 + 13 * i % 87) for i in range(40)]
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first number"},
                                                     "b": {"type": "integer", "description": "the second number"}},
                   "required": ["a", "b"]}}}


def total(arguments) -> str:
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError):
        return "error: add takes a and b"


class AddTaskset(vf.Taskset[AnswerTask, vf.TasksetConfig]):
    def load(self):
        for i, (a, b) in enumerate(PAIRS):
            yield AnswerTask(AnswerData(id=f"add-{i}", answer=str(a + b), prompt=f"What is {a} plus {b}?"),
                          self.config.task)


class AddHarness(ToolLoop):
    OFFERS = [ADD]

    def answer(self, name, arguments) -> str:
        return total(arguments)


class AddEnv(vf.Env[ChatConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            turn = await chat.turn()
            found = re.findall(r"\\d+", turn.last_reply or "")
            if not (found and found[-1] == task.data.answer):
                await chat.turn("wrong")
'''


def test_a_verifiers_environment_whose_harness_offers_a_tool_trains_grpo_in_a_rollout_worker(agentic, monkeypatch):
    """A verifiers environment of the bench's task (verifiers.v1's own classes): its harness drives each episode
    against the policy behind gptforge's endpoint, in a rollout worker (async GRPO), offering the harness's own `add`
    tool, which the bench's SFT model calls; the harness answers the call, the environment (as the user) answers a
    wrong sum with "wrong", and its rubric's exact match is the reward. (The session chain's model, whose 128
    positions hold no tool schema, plays a guessing game without tools: tests/stages/test_agents.py.)"""
    import shutil

    from gptforge.core.config import dump_config, load_config
    from tests import verifiers_game

    root, _ = agentic
    (root / "verifiers_adder.py").write_text(ADDER)
    shutil.copy(verifiers_game.__file__, root / "verifiers_game.py")  # its harness's chat loop
    monkeypatch.chdir(root)  # the user's module, in the working folder
    cfg = load_config(str(root / "seed0.yaml"), [
        "preference.tools=[]", "preference.environment=verifiers:verifiers_adder",
        "data.prompts=verifiers:verifiers_adder", "preference.algorithm=grpo", "preference.rollout.mode=async",
        "preference.rewards=[{name: environment}]", "preference.max_steps=2", "preference.global_batch_size=8",
        "preference.log_every=1"])
    path = root / "adder.yaml"
    path.write_text(dump_config(cfg))
    manifest, out_dir, _ = run_stage(cfg, path, "grpo")
    assert manifest["metrics"]["global_step"] == 2
    answered = wrong = 0
    for step in (1, 2):
        for line in (out_dir / "rollouts" / f"step-{step:08d}.jsonl").read_text().splitlines():
            e = json.loads(line)
            a, b = map(int, re.search(r"What is (\d+) plus (\d+)", e["messages"][0]["content"]).groups())
            said = [m for m in e["messages"] if m["role"] == "assistant"]
            for before, m in zip(e["messages"], e["messages"][1:]):
                if m["role"] == "tool":  # the harness's answer to the call before it
                    (call,) = before["tool_calls"]
                    args = call["function"]["arguments"]
                    args = json.loads(args) if isinstance(args, str) else args
                    assert call["function"]["name"] == "add" and m["content"] == str(args["a"] + args["b"]), e
                    answered += 1
                if m["role"] == "user":  # the environment, after a wrong final answer
                    found = re.findall(r"\d+", before["content"] or "")
                    assert m["content"] == "wrong" and not (found and found[-1] == str(a + b)), e
                    wrong += 1
            found = re.findall(r"\d+", said[-1]["content"] or "")
            assert e["rewards"]["environment"] == float(bool(found) and found[-1] == str(a + b)), e
    assert answered > 0 and wrong > 0, (answered, wrong)
