import json

import pytest
import torch

from gptforge.core.errors import UserError
from gptforge.core.presets import PRESETS
from gptforge.data.tokenizer import save_hf, train_bpe
from gptforge.model.build import build_model, hf_config
from gptforge.model.eval.generation import (answers, preference_report, reference_metrics, rouge_l, score_references,
                                            win_rate)
from gptforge.model.sampling.generate import check_same_vocabulary, stop_ids
from gptforge.model.eval.harness import run_harness
from gptforge.model.rewards import verify

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def test_the_verifier_accepts_the_known_answer_alone():
    assert verify(["52", " 52 ", "53", "", "52 52"], ["52"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_win_rate_counts_ties_half():
    assert win_rate(["a", "b", "c", "d"], ["a", "x", "y", "z"], [5.0, 1.0, 2.0, 3.0], [0.0, 1.0, 1.0, 4.0]) == \
        pytest.approx((0.5 + 0.5 + 1 + 0) / 4)  # same answer, same score, better, worse


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    save_hf(train_bpe([f"What is {i} plus {i}? {2 * i}" for i in range(50)] * 4, 300, 2, SPECIALS), d, SPECIALS)
    return AutoTokenizer.from_pretrained(d)


ARCH = PRESETS["tiny"].with_overrides(n_layer=1)


def policy(tokenizer, seed):
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    m = build_model(ARCH, len(tokenizer))
    m.generation_config = GenerationConfig(eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>")],
                                           pad_token_id=tokenizer.pad_token_id)
    return m.eval()


def judge(tokenizer, seed):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = hf_config(ARCH, len(tokenizer))
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    return AutoModelForSequenceClassification.from_config(config).eval()


def test_report_of_a_policy_against_itself_and_another(tokenizer):
    items = [{"prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}], "answer": str(2 * i)}
             for i in range(12)]
    sft, other, rm = policy(tokenizer, 0), policy(tokenizer, 1), judge(tokenizer, 2)
    same, answers = preference_report(sft, sft, rm, tokenizer, items, max_new_tokens=4)
    assert same["kl"] == pytest.approx(0.0, abs=1e-5) and same["win_rate_vs_sft"] == 0.5
    assert same["exact_match"] == same["sft_exact_match"] and len(answers) == len(items)
    with torch.no_grad():  # a policy far from the SFT model: KL(policy || SFT) on the policy's samples is large
        other.lm_head.weight.mul_(20.0)
    far, rows = preference_report(other, sft, rm, tokenizer, items, max_new_tokens=4)
    assert far["kl"] > 1.0
    assert [r["sft_response"] for r in rows] == [r["response"] for r in answers]  # the same SFT model each time
    assert far["win_rate_vs_sft"] == pytest.approx(win_rate(*zip(*[(r["response"], r["sft_response"], r["score"],
                                                                    r["sft_score"]) for r in rows])))
    assert far["reward_mean"] == pytest.approx(sum(r["score"] for r in rows) / len(rows))
    assert same["kl_stderr"] < 1e-5 and 0 < far["kl_stderr"] < far["kl"]  # the error of the mean


def test_standard_error_of_a_mean():
    from gptforge.model.eval.generation import standard_error

    assert standard_error([1.0, 3.0]) == pytest.approx(1.0)  # sd sqrt(2) over sqrt(2)
    assert standard_error([2.0] * 5) == 0.0 and standard_error([4.0]) == 0.0


def test_a_reward_model_with_another_vocabulary_is_an_error(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    save_hf(train_bpe(["completely different text"] * 20, 280, 2, SPECIALS), tmp_path, SPECIALS)
    with pytest.raises(UserError, match="vocabularies differ"):
        check_same_vocabulary(tokenizer, AutoTokenizer.from_pretrained(tmp_path), "reward model")
    check_same_vocabulary(tokenizer, tokenizer, "the same")


def test_rouge_l_is_the_f1_of_the_longest_common_word_subsequence():
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(2 * 5 / 12)
    assert rouge_l("Hello, World!", "hello world") == 1.0 and rouge_l("", "hello") == 0.0
    assert rouge_l("b a", "a b") == pytest.approx(0.5)  # order matters: a subsequence, not a bag of words


def test_the_references_decide_which_metrics_are_computed():
    assert reference_metrics(["58", "kite kite", None]) == (["exact_match", "rouge_l"], None)
    long = "a long answer of many more words than a short one"
    metrics, why = reference_metrics([long, long, "42"])
    assert metrics == ["rouge_l"] and "long (median 11 words)" in why
    assert reference_metrics([None, None]) == ([], "no reference answers")
    # items without a reference are left out, not scored as misses
    assert score_references(["58", "x", "kite"], ["58", None, "kite kite"], ["exact_match", "rouge_l"]) == \
        {"exact_match": 0.5, "rouge_l": pytest.approx((1 + 2 / 3) / 2)}


def test_the_harness_demo_task_prompts_and_scores_as_the_evaluation_step_does(tokenizer, tmp_path, monkeypatch):
    """lm-evaluation-harness on the demo task (a YAML over a local JSONL) gives the greedy answers of our own
    generation, answer for answer, and their exact match. Beside a task of the user's own (eval.harness_include),
    the tasks are indexed once: the index `check_tasks` built serves the run. A misspelt task is one error naming
    the closest (checked on the same index: building one takes seconds)."""
    import yaml

    from gptforge.core.config import load_config
    from gptforge.model.eval import harness
    from tests.conftest import TINY

    model = policy(tokenizer, 3)
    model.generation_config.max_new_tokens = 64  # as earlier exports have it: the task's own bound must hold
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    items = [{"prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}], "answer": str(2 * i)}
             for i in range(10)]
    ours = answers(model, tokenizer, [it["prompt"] for it in items], 6, 4)
    items[4]["answer"] = ours[4]  # one right answer
    stops = [tokenizer.decode([i]) for i in stop_ids(model)]
    mine = harness.write_demo_task(items, stops, 6, tmp_path / "mine")  # the user's task: the demo's, renamed
    task = yaml.safe_load((mine / "gptforge_demo.yaml").read_text()) | {"task": "my_sums"}
    (mine / "gptforge_demo.yaml").unlink()
    (mine / "my_sums.yaml").write_text(yaml.safe_dump(task))
    cfg = load_config(TINY, ["eval.harness_tasks=[gptforge_demo,my_sums]", f"eval.harness_include=[{mine}]",
                             "eval.max_new_tokens=6", "eval.batch_size=4"])
    indexed, index = [], harness.task_manager
    monkeypatch.setattr(harness, "task_manager", lambda *a, **k: indexed.append(a) or index(*a, **k))
    manager = harness.check_tasks(cfg.eval)
    scores = run_harness(tmp_path, cfg.eval, "cpu", "float32", tmp_path / "harness", 0, items, stops, manager)
    assert len(indexed) == 1
    samples = sorted((json.loads(line) for line in (tmp_path / "harness/samples/gptforge_demo.jsonl").open()),
                     key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in samples] == ours
    expected = score_references(ours, [it["answer"] for it in items], ["exact_match"])["exact_match"]
    assert scores == {"harness/gptforge_demo/exact_match/strip": expected,
                      "harness/my_sums/exact_match/strip": expected} and expected >= 0.1
    assert (tmp_path / "harness" / "gptforge_demo.yaml").is_file()

    monkeypatch.setattr(harness, "task_manager", lambda *a, **k: manager)
    misspelt = load_config(TINY, ["eval.harness_tasks=[gptforge_demo,arc_easy,hellaswg]"])
    with pytest.raises(UserError, match="no task 'hellaswg'; closest: hellaswag"):
        harness.check_tasks(misspelt.eval)
