"""A verifiers environment for the tests, written with verifiers.v1's own classes (its id: this module's name,
`verifiers_game`, importable from the working folder): a number to guess in three turns, the environment the user
who answers "higher" or "lower", a harness of its own that offers a `hint` tool and reaches the model through the
OpenAI-compatible client it is given, and exact match on the last reply as its reward."""

import re

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import SubprocessConfig

__all__ = ["GuessTaskset", "GuessHarness", "GuessEnv"]
SECRETS = [3, 5, 7, 2, 8, 6, 4, 9, 1, 5, 3, 7, 2, 8, 6, 4, 9, 1, 5, 3, 7, 2, 8, 6]
HINT = {"type": "function", "function": {"name": "hint", "description": "Get a hint.",
                                         "parameters": {"type": "object", "properties": {}}}}
TOOLS = [HINT]  # the harness's tools


class AnswerData(vf.TaskData):
    answer: str


class AnswerTask(vf.Task[AnswerData]):
    """A task whose answer is a number: exact match of the last number of the last reply (the agentic bench's
    `add` environment's too)."""

    @vf.reward
    async def exact_match(self, task: AnswerData, trace: vf.Trace) -> float:
        found = re.findall(r"\d+", trace.last_reply or "")
        return float(bool(found) and found[-1] == task.answer)


class GuessTaskset(vf.Taskset[AnswerTask, vf.TasksetConfig]):
    def load(self):
        for i, secret in enumerate(SECRETS):
            yield AnswerTask(AnswerData(id=f"guess-{i}", answer=str(secret),
                                      prompt=f"Guess my number ({i}), from 1 to 9."), self.config.task)


class ToolLoop(vf.Harness[vf.HarnessConfig]):
    """A chat loop in the process: up to three model calls to the endpoint it is given, offering `OFFERS`, each tool
    call answered by `answer` (tests/bench/test_agentic.py's `add` harness is one too)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False
    OFFERS: list = []  # the tools' schemas

    def answer(self, name: str, arguments) -> str:
        raise NotImplementedError

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            for _ in range(3):
                out = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                           tools=self.OFFERS or None)
                message = out.choices[0].message
                if not message.tool_calls:
                    break
                messages.append(message.model_dump(exclude_none=True))
                messages += [{"role": "tool", "tool_call_id": c.id,
                              "content": self.answer(c.function.name, c.function.arguments)}
                             for c in message.tool_calls]
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


class GuessHarness(ToolLoop):
    """The `hint` tool offered, and every hint "odd"."""

    OFFERS = TOOLS

    def answer(self, name: str, arguments) -> str:
        return "odd"


class ChatConfig(vf.EnvConfig):
    """One agent in a subprocess runtime, up to 10 turns (the agentic bench's `add` environment's too)."""

    agent: vf.AgentConfig = vf.AgentConfig(runtime=SubprocessConfig(), max_turns=10)


class GuessEnv(vf.Env[ChatConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            turn = await chat.turn()
            for _ in range(2):
                found = re.findall(r"\d+", turn.last_reply or "")
                if found and found[-1] == task.data.answer:
                    break
                higher = not found or int(found[-1]) < int(task.data.answer)
                turn = await chat.turn("higher" if higher else "lower")
