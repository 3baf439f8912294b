"""Verifiable rewards end to end: a tiny model from elsewhere is fine-tuned on the user's demonstrations of the
demo's successor task, 60% of which slip one too high, then GRPO (TRL's trainer, no tools) and our PPO, rewarded by
math_equal alone on a GSM8K-shaped file of the same problems (`#### n` answers), with no reward model and so no
reward stage, each raise the held-out accuracy the SFT model had. PPO is also given the user's own function from a
module in the working folder and a reward server on 127.0.0.1 (at weight 0, so that math_equal alone moves it): each
is called from the launched processes, logged by name, and scores the evaluation. (Both over 3 seeds on the demo's
models: bench/rlvr.py, run shrunk by tests/bench/.)

The model's chat template puts the answer right after the number that ends the question, so that a 2-layer model
learns the task within the suite's time (a lookup at the last position; attending back to an operand takes it far
longer). bench/rlvr.py shows the same over 3 seeds on the demo's models and all of its arithmetic."""

import json
import random

import pytest

from gptforge.core.registry import pipeline_stages
from gptforge.model import rewards as rewards_module
from gptforge.pipeline.store import pipeline_steps
from tests.helpers import config, logged, run_stage
from tests.model.test_rewards import RewardServer

pytestmark = pytest.mark.slow

# The prompt is the question alone and the answer follows it after a space: the operand is the last token before it
TEMPLATE = ("{%- for m in messages %}{%- if m['role'] == 'user' %}{{- m['content'] }}"
            "{%- else %}{{- ' ' + m['content'] + eos_token }}{%- endif %}{%- endfor %}")
SLIPS = 0.6

STEPS = [
    "pretrain.enabled=false", "distributed.zero_stage=2",
    "sft.max_steps=600", "sft.lr=3e-3", "sft.global_batch_size=32", "sft.micro_batch_size=8", "sft.warmup_steps=30",
    "sft.log_every=50", "sft.eval_every=600", "sft.save_every=600",
    "preference.max_steps=30", "preference.lr=1e-3", "preference.global_batch_size=16", "preference.save_every=100",
    "preference.grpo.ptx_coef=0", "preference.ppo.ptx_coef=0", "eval.items=20", "eval.samples=3",
]


DISTILL = ["distill.enabled=true", "distill.teacher=grpo", "distill.max_steps=7", "distill.lr=1e-3",
           "distill.warmup_steps=0", "distill.global_batch_size=16", "distill.micro_batch_size=8",
           "distill.log_every=1", "distill.save_every=100"]


def question(n: int) -> str:
    return f"What number comes after {n}"


def successor_model(out):
    """A tiny GPT-2 with its own byte-level BPE (every number up to 101 one token), chat template and stop token,
    randomly initialised."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, GenerationConfig, GPT2Config, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([f"{question(n)} {n}" for n in range(102)] * 5, trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = TEMPLATE
    assert hf.tokenize(f"{question(52)} 53")[-2:] == ["Ġ52", "Ġ53"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config(
        vocab_size=len(hf), n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=hf.eos_token_id,
        eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id)).save_pretrained(out)
    hf.save_pretrained(out)
    GenerationConfig(eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id).save_pretrained(out)
    return out


def write_task(tmp_path):
    """400 GSM8K-shaped problems and 4000 demonstrations, SLIPS of which answer one too high."""
    rng = random.Random(0)
    problems, demos = tmp_path / "problems.jsonl", tmp_path / "demonstrations.jsonl"
    with open(problems, "w") as f:
        for n in (rng.randrange(10, 99) for _ in range(400)):
            f.write(json.dumps({"question": question(n), "answer": f"{n} + 1 = {n + 1}.\n#### {n + 1}",
                                "task": "succ"}) + "\n")
    with open(demos, "w") as f:
        for n in (rng.randrange(10, 99) for _ in range(4000)):
            said = str(n + 2 if rng.random() < SLIPS else n + 1)
            f.write(json.dumps({"messages": [{"role": "user", "content": question(n)},
                                             {"role": "assistant", "content": said}]}) + "\n")
    return problems, demos


def test_grpo_and_ppo_rewarded_by_math_equal_raise_held_out_accuracy(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(prompts, responses, answers, **row):\n"
        "    assert set(row) == {'task'}, row  # the file's other column\n"
        "    return [-float(len(r)) for r in responses]\n")
    monkeypatch.chdir(tmp_path)  # the user's working folder: the launched stages import from it
    problems, demos = write_task(tmp_path)
    base = successor_model(tmp_path / "base")
    common = [*STEPS, f"model.pretrained={base}", f"data.sft={demos}", f"data.prompts={problems}",
              "preference.algorithm=[grpo,ppo]"]
    server = RewardServer()
    rewards = [{"name": "math_equal"}, {"name": "my_rewards:brevity", "weight": 0.0},
               {"url": server.url, "name": "remote", "weight": 0.0}]
    try:
        cfg, path = config(tmp_path / "runs", *common, "preference.rewards=[{name: math_equal}]")
        assert pipeline_stages(cfg) == ["sft", "grpo", "ppo"]  # no reward stage (and nothing to pretrain)
        assert "reward" not in pipeline_steps(cfg)
        run_stage(cfg, path, "sft")
        _, grpo_dir, _ = run_stage(cfg, path, "grpo")  # TRL's GRPOTrainer, no tools: not the agentic rollout_func
        grpo = run_stage(cfg, path, "eval-grpo")[0]["metrics"]
        # on-policy distillation of the SFT model toward the GRPO policy, in a quarter of GRPO's steps
        cfg, path = config(tmp_path / "runs", *common, "preference.rewards=[{name: math_equal}]", *DISTILL)
        distill_manifest, distill_dir, _ = run_stage(cfg, path, "distill")
        distilled = run_stage(cfg, path, "eval-distill")[0]["metrics"]
        cfg, path = config(tmp_path / "runs", *common, f"preference.rewards={json.dumps(rewards)}")
        ppo_manifest, ppo_dir, _ = run_stage(cfg, path, "ppo")  # the same SFT: rewards are not in its fingerprint
        ppo, eval_dir, _ = run_stage(cfg, path, "eval-ppo")
    finally:
        server.close()
    assert ppo_manifest["inputs"].keys() == {"sft"}
    # GRPO rewarded by math_equal alone, from the same SFT model as PPO, raised held-out accuracy too (0.15 -> 0.65
    # when this was first measured; 20 items, so 0.25 is 5 more right answers)
    assert logged(grpo_dir, "rewards/math_equal") == pytest.approx(logged(grpo_dir, "reward_mean"), abs=1e-6)
    assert grpo["sft_accuracy/math_equal"] == ppo["metrics"]["sft_accuracy/math_equal"] <= 0.5
    assert grpo["accuracy/math_equal"] >= grpo["sft_accuracy/math_equal"] + 0.25
    # distill: the student, from the same SFT model, learnt toward its teacher on its own samples (bench/distill.py:
    # 3 seeds, against GRPO's steps and off-policy distillation); its teacher's greedy answers are GRPO's own
    assert distilled["teacher_accuracy/math_equal"] == grpo["accuracy/math_equal"]
    assert distilled["start_accuracy/math_equal"] == grpo["sft_accuracy/math_equal"]
    assert distilled["accuracy/math_equal"] >= distilled["start_accuracy/math_equal"] + 0.25
    assert distill_manifest["metrics"]["global_step"] == 7 and len(logged(distill_dir, "distill_kl")) == 7  # < 30/4
    # (here 0.15 -> 0.70 in 7 steps, the teacher 0.65 after 30)

    # the held-out accuracy is math_equal on the greedy answers the evaluation wrote, against the file's #### answers
    rows = [json.loads(line) for line in (eval_dir / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and rows[0]["answer"] == answer_of(problems, rows[0]["prompt"])
    right = rewards_module.math_equal(None, [r["response"] for r in rows], [r["answer"] for r in rows])
    m = ppo["metrics"]
    assert m["accuracy/math_equal"] == pytest.approx(sum(right) / len(rows), abs=1e-6)
    sft_right = rewards_module.math_equal(None, [r["sft_response"] for r in rows], [r["answer"] for r in rows])
    assert m["sft_accuracy/math_equal"] == pytest.approx(sum(sft_right) / len(rows), abs=1e-6)
    # The SFT model copied the slip: its greedy answer is mostly one too high. The checker alone raised held-out
    # accuracy (here 0.15 -> 0.95; 20 items, so 0.25 is 5 more right answers)
    assert m["sft_accuracy/math_equal"] <= 0.5
    assert m["accuracy/math_equal"] >= m["sft_accuracy/math_equal"] + 0.25
    # SFT's samples found the right answer where its greedy one slipped: pass@3 above greedy accuracy
    assert all(abs(20 * m[k] - round(20 * m[k])) < 1e-6 for k in ("pass@3/math_equal", "sft_pass@3/math_equal"))
    assert m["sft_pass@3/math_equal"] > m["sft_accuracy/math_equal"]

    # each reward logged by name from the launched processes, and scoring the evaluation too
    assert server.state["seen"] >= 2 * 30  # each of PPO's 2 processes posts its rollouts every step, then the eval
    assert server.state["bodies"][0]["answers"][0] is not None and "task" in server.state["bodies"][0]
    assert {"rewards/math_equal", "rewards/brevity", "rewards/remote"} <= set(json.loads(
        (ppo_dir / "logs" / "metrics.jsonl").read_text().splitlines()[-1]))
    assert all(b < 0 for b in logged(ppo_dir, "rewards/brevity"))  # minus the length of every response
    assert logged(ppo_dir, "reward_mean") == pytest.approx(logged(ppo_dir, "rewards/math_equal"), abs=1e-6)  # weight 0
    # the server scores len(response), brevity minus it: both evaluations are the policy's mean answer length
    length = sum(len(r["response"]) for r in rows) / len(rows)
    assert m["accuracy/remote"] == pytest.approx(length) and m["accuracy/brevity"] == pytest.approx(-length)


def answer_of(problems, prompt) -> str:
    """The #### answer of the file's row with this prompt."""
    for line in problems.read_text().splitlines():
        row = json.loads(line)
        if row["question"] == prompt[-1]["content"]:
            return row["answer"].rsplit("#### ", 1)[1]
    raise AssertionError(prompt)
