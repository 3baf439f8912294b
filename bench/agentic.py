"""Agents: a task the demo's model can solve only with a tool, learned from flawed demonstrations and then by RL
with the tool, over several seeds. Reported: held-out accuracy (greedy, each answer an episode with the tool) of the
SFT model and of each policy, the mean over the seeds with its standard error, each policy's gain over SFT with the
standard error of the paired difference, and the tool calls per episode.

    .venv/bin/python bench/agentic.py [-c configs/tiny.yaml] [--seeds 0 1 2] [--root runs/agentic]
                                      [--flaws 0.6] [--documents 20000] [--calls 4000]
                                      [--problems 4000] [--demonstrations 8000] [--tool add|python]
                                      [--set k=v ...]

The task: the sum of two numbers of two digits ("What is 37 plus 48?"), which the demo's 1M-parameter model gets
right a few times in a hundred on its own. A tool `add(a, b)` (`agentic_tools.py`, written into the run's folder,
which the stages import from their working folder) gives it. SFT learns to call it from tool-use demonstrations
(OpenAI messages: the call, the tool's result, the answer), a share `--flaws` (0.6) of which call it with the
second operand one too high, always, and so answer wrongly: the SFT model copies the slip in its greedy calls,
while its samples still call it right often enough for the reward to tell (bench/rlvr.py's slips, in a tool's
arguments). GRPO and PPO then roll out with the tool (`preference.tools`), rewarded by exact match with the true
sum alone. The chat template is compact (`TEMPLATE`: the tools listed by name and arguments, the Hermes
`<tool_call>` JSON calls gptforge parses) so that an episode fits the model's 128 positions; the pretraining corpus
is the demo's documents with lines of calls and results beside them, so that the tokenizer has their pieces (an
episode is about 90 tokens, not 140).

With `--tool python`, the tool is gptforge's own python tool: the demonstrations call it with `print(a+b)` (the
slip in b again), the sandbox runs the model's code (docs/sandbox.md), and its result is what the tool returns
("exit status 0", stdout). Its own corpus and demonstrations, in the same root.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import gain, mean_se, run_seed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b
'''
PYTHON_SCHEMA = {"type": "function", "function": {  # gptforge's built-in python tool, as get_json_schema gives it
    "name": "python", "description": "Run a Python program in a sandbox and return its exit status, stdout and stderr.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                   "required": ["code"]}}}
SCHEMA = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first number"},
                                                     "b": {"type": "integer", "description": "the second number"}},
                   "required": ["a", "b"]}}}
# ChatML with the tools as name(arguments) in the system turn, calls as compact Hermes JSON, results in a user turn
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}"
    "{%- for t in tools %}{%- set f = t['function'] if t['function'] is defined else t %}"
    "{{- ' ' + f['name'] + '(' + (f['parameters']['properties'] | list | join(', ')) + ')' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- m['content'] or '' }}"
    "{%- for c in m['tool_calls'] or [] %}{%- set f = c['function'] if c['function'] is defined else c %}"
    "{{- '<tool_call>{\"name\":\"' + f['name'] + '\",\"arguments\":' + (f['arguments'] | tojson | replace(' ', '')) "
    "+ '}</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user\\n' }}{%- endif %}"
    "{{- '<tool_response>' + m['content'] + '</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def question(a: int, b: int) -> str:
    return f"What is {a} plus {b}?"


def call(tool: str, a: int, b: int) -> tuple[dict, str]:
    """The call of the tool that sums a and b, and what the tool returns: add(a, b), or the python tool running
    print(a+b) in the sandbox (gptforge.model.agents.sandbox's Result.text)."""
    if tool == "python":
        return {"name": "python", "arguments": {"code": f"print({a}+{b})"}}, f"exit status 0\nstdout:\n{a + b}\n"
    return {"name": "add", "arguments": {"a": a, "b": b}}, str(a + b)


def write_demonstrations(path: Path, n: int, flaws: float, seed: int = 1, tool: str = "add") -> Path:
    """n tool-use conversations: the call of the tool, its result, the answer; a share `flaws` calling it with the
    second operand one too high, a slip the demonstrator makes again and again, and answered with the wrong sum
    the tool returned: the SFT model's greedy call is mostly the slip."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randrange(10, 100), rng.randrange(10, 99)
            x, y = a, b + 1 if rng.random() < flaws else b
            function, result = call(tool, x, y)
            messages = [{"role": "user", "content": question(a, b)},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"type": "function", "function": function}]},
                        {"role": "tool", "name": function["name"], "content": result},
                        {"role": "assistant", "content": str(x + y)}]
            schema = PYTHON_SCHEMA if tool == "python" else SCHEMA
            f.write(json.dumps({"tools": [schema], "messages": messages}) + "\n")
    return path


def write_problems(path: Path, n: int, seed: int = 0) -> Path:
    """n prompts with their answers ({"prompt", "answer"}), the held-out ones among them."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randrange(10, 100), rng.randrange(10, 100)
            f.write(json.dumps({"prompt": question(a, b), "answer": str(a + b)}) + "\n")
    return path


def write_corpus(path: Path, documents: int, calls: int, seed: int = 2, tool: str = "add") -> Path:
    """The demo's pretraining documents and `calls` lines of calls of add and its results, in the template's form
    (so that the tokenizer learns their pieces and the model their shape; none of them holds a question)."""
    from gptforge.data import demo

    rng = random.Random(seed)
    lines = list(demo.generate(pretrain_docs=documents, sft_items=1, preference_pairs=1, eval_items=1).pretrain)
    for _ in range(calls):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        function, result = call(tool, a, b)
        arguments = json.dumps(function["arguments"]).replace(" ", "")
        lines.append(f'<tool_call>{{"name":"{function["name"]}","arguments":{arguments}}}</tool_call> '
                     f"<tool_response>{result}</tool_response>")
    rng.shuffle(lines)
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return path


def overrides(root: Path, args) -> list[str]:
    """The settings of the run (its data written into `root`, with the tool's module)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "agentic_tools.py").write_text(TOOLS)
    tool = getattr(args, "tool", "add")
    suffix = "" if tool == "add" else f"-{tool}"
    corpus = write_corpus(root / f"corpus{suffix}.jsonl", args.documents, args.calls, tool=tool)
    problems, demonstrations, flaws, algorithms = args.problems, args.demonstrations, args.flaws, args.algorithms
    prompts = write_problems(root / "problems.jsonl", problems)
    demos = write_demonstrations(root / f"demonstrations-{flaws:g}{suffix}.jsonl", demonstrations, flaws, tool=tool)
    return [f"data.pretrain={corpus}", f"data.prompts={prompts}", f"data.sft={demos}",
            f"sft.chat_template={json.dumps(TEMPLATE)}",
            "sft.max_length=128", "preference.max_length=128",
            f"preference.tools=[{'python' if tool == 'python' else 'agentic_tools:add'}]",
            "preference.max_turns=3", "eval.max_new_tokens=40", "preference.rewards=[{name: exact_match}]",
            *[f"preference.{a}.max_new_tokens=40" for a in algorithms],
            *[f"preference.{a}.ptx_coef=0" for a in algorithms], f"preference.algorithm=[{','.join(algorithms)}]"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--root", default=str(ROOT / "runs" / "agentic"))
    p.add_argument("--documents", type=int, default=20000, help="the demo's pretraining documents")
    p.add_argument("--calls", type=int, default=4000, help="lines of calls and results beside them")
    p.add_argument("--problems", type=int, default=4000)
    p.add_argument("--demonstrations", type=int, default=8000)
    p.add_argument("--flaws", type=float, default=0.6, help="share of demonstrations with the slipped operand")
    p.add_argument("--tool", choices=["add", "python"], default="add",
                   help="add: a Python function of the working folder; python: gptforge's python tool, the model "
                        "writing print(a+b), run in the sandbox (docs/sandbox.md)")
    p.add_argument("--algorithms", nargs="+", default=["grpo", "ppo"])
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    root = Path(args.root).resolve()
    settings = overrides(root, args) + args.set
    os.chdir(root)  # the stages import agentic_tools from their working folder
    runs = {seed: run_seed(args.config, root, seed, settings) for seed in args.seeds}
    first = f"eval-{args.algorithms[0]}"
    sft = [runs[s][first]["sft_accuracy/exact_match"] for s in args.seeds]
    print(f"held-out accuracy with the tool (greedy episodes), {len(args.seeds)} seed(s) {args.seeds}, "
          f"{args.flaws:.0%} of the demonstrations flawed, rewarded by exact match alone:")
    calls = [runs[s][first]["sft_tool_calls_per_episode"] for s in args.seeds]
    print(f"  sft:  {mean_se(sft)}  (tool calls per episode {mean_se(calls)})")
    for algo in args.algorithms:
        acc = [runs[s][f"eval-{algo}"]["accuracy/exact_match"] for s in args.seeds]
        calls = [runs[s][f"eval-{algo}"]["tool_calls_per_episode"] for s in args.seeds]
        text, shown = gain(acc, sft)
        print(f"  {algo}: {mean_se(acc)}  gain over SFT {text}{'' if shown else ' (under two standard errors)'}"
              f"  (tool calls per episode {mean_se(calls)})")


if __name__ == "__main__":
    main()
