"""The rollout room (gptforge.model.agents): multi-turn episodes with tools, token-exact, for two template
families: gptforge's own (ChatML, Hermes / Qwen2.5 tool calls) and Llama 3.1's (JSON calls, ipython results). A
scripted policy stands in for the model: what it "samples" is known, so the test can tell that the trained ids are
the sampled ids and that the mask covers exactly them."""

import time

import pytest

from gptforge.core.errors import ConfigError
from gptforge.data.tokenizer import chat_template, save_hf, train_bpe
from gptforge.model.agents.calls import format_of, parse
from gptforge.model.agents.episode import render, run_episodes, start
from gptforge.model.agents.tools import Setup, Toolbox, environment_tools, schema
from tests.hub_models import LLAMA3_TEMPLATE, texts
from tests.hub_models import tokenizer as family_tokenizer

LLAMA31_TOOLS = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n\\n' }}"
    "{%- for t in tools %}{{- (t | tojson) + '\\n\\n' }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and m['tool_calls'] %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for c in m['tool_calls'] %}{{- '{\"name\": \"' + c['function']['name'] + '\", \"parameters\": ' + "
    "(c['function']['arguments'] | tojson) + '}' }}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif m['role'] == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + "
    "'<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


class Ledger:
    """An environment: a running total the model adds to and reads (TRL's conventions)."""

    def reset(self, start: int = 0, **_) -> str:
        self.total = start
        return f" (the ledger starts at {start})"

    def add(self, amount: int) -> int:
        """Add an amount to the ledger.

        Args:
            amount: what to add
        """
        self.total += amount
        return self.total

    def fail(self, why: str) -> str:
        """Raise an error.

        Args:
            why: the message
        """
        raise RuntimeError(why)

    def stall(self, seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "woke"

    def get_reward(self) -> float:
        return float(self.total == 15)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """gptforge's own tokenizer (the tokenize stage's files) and a Llama 3 one with Llama 3.1's tool template."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    corpus = texts(300) + ['{"name": "add", "arguments": {"amount": 5}} <tool_call> </tool_call> <tool_response>']
    save_hf(train_bpe(corpus, 400, 2, special), out, special)
    ours = AutoTokenizer.from_pretrained(out)
    llama = family_tokenizer("llama3")
    llama.chat_template = LLAMA31_TOOLS
    return {"hermes": ours, "llama3_json": llama}


def call_text(fmt: str, name: str, args: dict) -> str:
    import json

    if fmt == "hermes":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
    return json.dumps({"name": name, "parameters": args})


def scripted(tokenizer, turns: list[str], log: list):
    """A policy that samples `turns` in order: each the tokens of its text and the end-of-turn token."""
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>" if "<|im_end|>" in tokenizer.get_vocab() else "<|eot_id|>")
    it = iter(turns)

    def sample(sequences, budgets):
        out = []
        for _ in sequences:
            ids = tokenizer(next(it), add_special_tokens=False)["input_ids"] + [eot]
            log.append(ids)
            out.append(ids)
        return out

    return sample, eot


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_a_three_turn_episode_trains_the_sampled_ids_and_masks_the_rest(tokenizers, fmt):
    tok = tokenizers[fmt]
    assert format_of(tok.chat_template, "the model") == fmt
    setup = Setup(Ledger, [], timeout_s=5)
    box = setup.toolbox({"start": 2})
    episode = start(tok, [{"role": "user", "content": "Add 3, then 10; say the total."}], box)
    assert episode.messages[-1]["content"].endswith("(the ledger starts at 2)")  # reset's observation
    turns = [call_text(fmt, "add", {"amount": 3}), call_text(fmt, "add", {"amount": 10}), "The total is 15."]
    sampled: list[list[int]] = []
    sample, eot = scripted(tok, turns, sampled)
    [done] = run_episodes(sample, tok, [episode], fmt, max_turns=3, max_length=2048, stop_ids={eot})

    assert (done.turns, done.ended, len(done.calls), done.tool_errors) == (3, "answer", 2, 0)
    assert [c.result for c in done.calls] == ["5", "15"] and box.reward() == 1.0
    # the ids trained are the ids sampled, in order, and the mask covers exactly them
    own = [i for i, m in zip(done.ids, done.mask) if m]
    assert own == [i for turn in sampled for i in turn] and sum(done.mask) == sum(map(len, sampled))
    runs, at = [], 0  # the masked tokens come as the three turns, with the template's tokens between them
    while at < len(done.mask):
        end = at
        while end < len(done.mask) and done.mask[end] == done.mask[at]:
            end += 1
        runs.append((done.mask[at], done.ids[at:end]))
        at = end
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1] and [ids for m, ids in runs if m] == sampled
    # and the whole sequence is the template's rendering of the trajectory, through the last end of turn
    whole = render(tok, done.messages, box.schemas, False)
    eot_text = tok.convert_ids_to_tokens(eot)
    assert tok.decode(done.prompt_ids + done.ids) == whole[:whole.rfind(eot_text) + len(eot_text)]
    assert [m["role"] for m in done.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert done.messages[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"amount": 3}}


def test_tool_failures_become_messages_and_the_episode_goes_on(tokenizers):
    tok = tokenizers["hermes"]
    box = Setup(Ledger, [], timeout_s=0.5).toolbox({})
    episode = start(tok, [{"role": "user", "content": "Try things."}], box)
    bad = ["<tool_call>\n{\"name\": \"add\", \"arguments\": {\"amount\": \n</tool_call>",  # not JSON
           call_text("hermes", "fail", {"why": "no ink"}) + "\n" + call_text("hermes", "nope", {}),
           call_text("hermes", "add", {"amount": "x", "extra": 1}),  # an unknown argument
           call_text("hermes", "stall", {"seconds": 3}), call_text("hermes", "add", {"amount": 1}), "Done."]
    sample, eot = scripted(tok, bad, [])
    t0 = time.perf_counter()
    [done] = run_episodes(sample, tok, [episode], "hermes", max_turns=10, max_length=4096, stop_ids={eot})
    assert time.perf_counter() - t0 < 3  # the stalled call was given up after its timeout
    results = [m["content"] for m in done.messages if m["role"] == "tool"]
    assert results[0].startswith("error: ValueError: the tool call is not JSON")
    assert results[1] == "error: RuntimeError: no ink" and results[2].startswith("error: LookupError: no tool named")
    assert results[3].startswith("error: TypeError: got an unexpected keyword argument 'extra'")
    assert results[4].startswith("error: TimeoutError: stall did not return within 0.5 s")
    assert results[5].startswith("error: RuntimeError: the environment is still running stall")  # broken since
    assert (done.ended, done.turns, done.tool_errors) == ("answer", 6, 6)


def test_the_episode_ends_at_max_turns_and_at_the_length_budget(tokenizers):
    tok = tokenizers["hermes"]
    turn = call_text("hermes", "add", {"amount": 1})
    sample, eot = scripted(tok, [turn] * 4, [])
    episode = start(tok, [{"role": "user", "content": "Count."}], Setup(Ledger, [], 5).toolbox({}))
    [done] = run_episodes(sample, tok, [episode], "hermes", max_turns=2, max_length=4096, stop_ids={eot})
    assert (done.ended, done.turns, len(done.calls)) == ("max_turns", 2, 1)
    sample, eot = scripted(tok, [turn] * 4, [])
    episode = start(tok, [{"role": "user", "content": "Count."}], Setup(Ledger, [], 5).toolbox({}))
    budget = len(episode.prompt_ids) + len(tok(turn)["input_ids"]) + 5
    [done] = run_episodes(sample, tok, [episode], "hermes", max_turns=4, max_length=budget, stop_ids={eot})
    assert done.ended == "max_length" and done.turns == 1 and len(done.prompt_ids) + len(done.ids) < budget


def test_tools_need_hints_and_docstrings_and_templates_must_render_tools():
    def undocumented(x: int) -> int:
        return x

    def unhinted(x):
        """Echo.

        Args:
            x: the value
        """
        return x

    with pytest.raises(ConfigError, match="preference.tools: tool .*undocumented: .*no docstring"):
        schema(undocumented, "preference.tools")
    with pytest.raises(ConfigError, match="preference.tools: tool .*unhinted: .*missing a type hint"):
        schema(unhinted, "preference.tools")
    assert set(environment_tools(Ledger())) == {"add", "fail", "stall"}
    assert format_of(chat_template("<|im_start|>", "<|im_end|>"), "m") == "hermes"
    with pytest.raises(ConfigError, match="the chat template of org/llama cannot render tools"):
        format_of(LLAMA3_TEMPLATE, "org/llama")
    assert parse('Sure.\n<tool_call>\n{"name": "add", "arguments": "{\\"amount\\": 2}"}\n</tool_call>',
                 "hermes").calls == [("add", {"amount": 2})]
    assert parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 1}}',
                 "llama3_json").calls == [("a", {}), ("b", {"k": 1})]
    assert Toolbox(None, {}, 1).call("x", {}).error.startswith("LookupError")


@pytest.mark.parametrize("algorithm", ["GRPO", "RLOO"])
def test_trls_trainers_train_the_sampled_ids_of_a_three_turn_episode_with_the_tool_turns_masked(
        algorithm, tokenizers, tmp_path, monkeypatch):
    """The hand-off to TRL (gptforge.model.trainers.online): TRL's GRPOTrainer and RLOOTrainer, in this process on
    the CPU, take the episodes' ids and masks as they are; the loss mask is exactly the policy's tokens (RLOO: its
    sequence log-probability, which its ratio and its KL penalty sum, is over them alone); the rewards read the
    last turn, the trajectory and the environment's reward; the loss is finite."""
    import torch
    import trl
    from transformers import AutoModelForCausalLM, Qwen2Config

    from gptforge.core.config import PreferenceSection
    from gptforge.model.trainers import online

    tok = tokenizers["hermes"]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [call_text("hermes", "add", {"amount": 3}), call_text("hermes", "add", {"amount": 10}),
             "The total is 15."]
    sampled: list[list[int]] = []

    def sampler(model, pad_id, max_new_tokens, **sampling):  # a turn chosen by the results seen so far
        def sample(sequences, budgets):
            out = [tok(turns[tok.decode(s).count("<tool_response>")], add_special_tokens=False)["input_ids"] + [eot]
                   for s in sequences]
            sampled.extend(out)
            return out
        return sample

    monkeypatch.setattr(online, "id_sampler", sampler)
    monkeypatch.setattr(online, "stop_ids", lambda model: {eot})
    seen = {}

    def outcome(prompts, completions, messages, environment_reward, **_):
        seen.update(completions=completions, messages=messages, environment_reward=environment_reward)
        return [float(c[-1]["content"] == "The total is 15.") for c in completions]

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=4096, eos_token_id=eot, pad_token_id=tok.pad_token_id))
    pc = PreferenceSection(max_turns=3, max_length=4096, log_every=1)
    cls = online.rollout_trainer(getattr(trl, f"{algorithm}Trainer"), algorithm, pc, pc.grpo, tmp_path / "rollouts",
                                 Setup(Ledger, [], 5), "hermes")
    args = getattr(trl, f"{algorithm}Config")(output_dir=str(tmp_path / "out"), use_cpu=True,
                                              per_device_train_batch_size=2, num_generations=2,
                                              max_completion_length=64, report_to=[], beta=0.0, logging_steps=1)
    row = {"prompt": [{"role": "user", "content": "Add 3, then 10; say the total."}], "start": 2}
    from datasets import Dataset

    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list([row] * 2), processing_class=tok,
                  reward_funcs=[outcome])
    batch = trainer._generate_and_score_completions([dict(row), dict(row)])

    episodes = trainer._episodes
    assert [(e.turns, e.ended, len(e.calls)) for e in episodes] == [(3, "answer", 2)] * 2
    assert len(sampled) == 6
    for b, e in enumerate(episodes):
        n = len(e.ids)
        assert batch["completion_ids"][b, :n].tolist() == e.ids  # the ids trained are the episode's, as sampled
        trained = (batch["completion_mask"] * batch["tool_mask" if algorithm == "GRPO" else "env_mask"])[b]
        assert trained[:n].tolist() == e.mask and int(trained[n:].sum()) == 0  # the loss mask: the policy's tokens
        assert [i for i, m in zip(e.ids, e.mask) if m] == [i for turn in sampled[b::2] for i in turn]
        assert batch["completion_mask"][b, :n].tolist() == [1] * n  # attention sees the tool results
    if algorithm == "RLOO":  # the sequence log-probability: the policy's tokens, not the tool results between them
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        with torch.no_grad():
            logits = trainer.model(input_ids=ids, attention_mask=torch.cat([batch["prompt_mask"],
                                                                              batch["completion_mask"]], 1)).logits
        P = batch["prompt_ids"].size(1)
        per_token = logits[:, P - 1:-1].log_softmax(-1).gather(-1, batch["completion_ids"][..., None])[..., 0]
        policy = (per_token * batch["env_mask"]).sum(1)
        assert batch["old_logps"].tolist() == pytest.approx(policy.tolist(), rel=1e-5)  # float32 sums of ~100 terms
        assert (per_token * batch["completion_mask"]).sum(1).tolist() != pytest.approx(policy.tolist(), rel=1e-2)
    assert [m["role"] for m in seen["completions"][0]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert seen["messages"][0][0]["content"].endswith("(the ledger starts at 2)")
    assert seen["environment_reward"] == [1.0, 1.0]  # 2 + 3 + 10: get_reward() of each episode's own ledger
    trainer.current_gradient_accumulation_steps = 1  # what the training loop sets before each step
    loss = trainer.compute_loss(trainer.model, batch)
    assert torch.isfinite(loss)
    lines = (tmp_path / "rollouts" / "step-00000001.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"reward": 1.0' in lines[0]


def test_a_turn_never_runs_past_the_positions_its_budget_leaves():
    """Rows of one batch with different budgets (one context nearly full): each is sampled at most its budget, and
    none runs past the model's learned positions (one generate call for all would give every row the most tokens
    any may take, and the fuller row's positions would run off the end of the position table)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gptforge.model.sampling.generate import id_sampler

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       eos_token_id=39, bos_token_id=39, pad_token_id=0))
    model.generation_config.eos_token_id = 39
    sample = id_sampler(model, pad_id=0, max_new_tokens=14, do_sample=True, top_k=0, temperature=1.0)
    full, short, middle = list(range(1, 15)), [5, 6], list(range(1, 9))
    turns = sample([full, short, middle], [2, 14, 8])
    assert [len(t) <= b for t, b in zip(turns, [2, 14, 8])] == [True] * 3 and all(turns)
    assert all(len(s) + len(t) <= 16 for s, t in zip([full, short, middle], turns))


class Waiting:
    """An environment whose tools wait (a sandbox, an HTTP call), each call's start and end recorded; `fetch` is
    written as `async def`."""

    spans: list = []

    def reset(self, n: int = 0, **_) -> str:
        self.n = n
        return f" (item {n})"

    def wait(self, seconds: float) -> str:
        """Wait, then say which item this is.

        Args:
            seconds: how long
        """
        t0 = time.perf_counter()
        time.sleep(seconds)
        Waiting.spans.append((t0, time.perf_counter()))
        return f"item {self.n} waited"

    async def fetch(self, seconds: float) -> str:
        """Wait on the event loop, then say which item this is.

        Args:
            seconds: how long
        """
        import asyncio

        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        Waiting.spans.append((t0, time.perf_counter()))
        return f"item {self.n} fetched"

    def get_reward(self) -> float:
        return float(self.n)


@pytest.mark.parametrize("tool", ["wait", "fetch"])
def test_a_turns_tool_calls_run_at_once_and_the_trajectories_are_the_sequential_ones(tokenizers, tool):
    """Four episodes whose first turn calls a tool that waits 0.3 s (a plain function in the thread pool, or an
    `async def` on the event loop): with tool_concurrency 4 the four calls of that turn overlap (each started before
    any ended), and every trajectory (messages, ids, masks, calls, rewards) is the one the calls made one after
    another give."""
    from gptforge.model.agents.episode import environment_rewards, rollouts

    tok = tokenizers["hermes"]
    rows = [{"prompt": [{"role": "user", "content": f"Wait for item {n}."}], "n": n} for n in range(4)]
    turns = [call_text("hermes", tool, {"seconds": 0.3})] * 4 + [f"Item {n} is done." for n in range(4)]
    done = {}
    for concurrency in (1, 4):
        Waiting.spans.clear()
        setup = Setup(Waiting, [], timeout_s=5, concurrency=concurrency)
        sample, eot = scripted(tok, turns, [])
        episodes = rollouts(setup, sample, tok, rows, "hermes", max_turns=3, max_length=4096, stop_ids={eot})
        done[concurrency] = ([(e.messages, e.prompt_ids, e.ids, e.mask, e.logprobs, e.turns, e.ended,
                               [(c.name, c.arguments, c.result, c.error) for c in e.calls]) for e in episodes],
                             environment_rewards(episodes, setup.calls), list(Waiting.spans))
    assert done[4][:2] == done[1][:2]  # the same trajectories, in the same order
    assert [e[0][2]["content"] for e in done[4][0]] == [f"item {n} {tool}ed" for n in range(4)]
    assert done[4][1] == [0.0, 1.0, 2.0, 3.0]
    one_by_one, at_once = done[1][2], done[4][2]
    assert max(s for s, _ in one_by_one) >= min(e for _, e in one_by_one)  # in turn: one ended before the last began
    assert max(s for s, _ in at_once) < min(e for _, e in at_once)  # at once: all four began before any ended
