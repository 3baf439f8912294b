from gptforge.core.config import DemoSection
from gptforge.data.demo import TASKS, from_settings, generate, is_held_out, make_item


def test_deterministic():
    a, b = generate(seed=3, pretrain_docs=500), generate(seed=3, pretrain_docs=500)
    assert a.pretrain == b.pretrain and a.sft == b.sft and a.preference == b.preference and a.eval == b.eval
    assert generate(seed=4, pretrain_docs=500).pretrain != a.pretrain


def test_a_part_is_the_same_whichever_others_are_generated():
    settings = DemoSection(pretrain_docs=300, sft_items=200, preference_pairs=100, eval_items=40, sft_flaws=0.25)
    whole = from_settings(settings)
    assert whole.pretrain and whole.sft and whole.preference and whole.eval
    for part in ("pretrain", "sft", "preference", "eval"):
        alone = from_settings(settings, part)
        assert getattr(alone, part) == getattr(whole, part) and alone.eval == whole.eval
        assert alone.preference_eval == whole.preference_eval
        assert all(not getattr(alone, other) for other in ("pretrain", "sft", "preference") if other != part)


def test_held_out_items_never_in_training_data():
    data = generate(seed=0, pretrain_docs=20000, sft_items=3000, preference_pairs=2000, eval_items=200)
    assert len(data.eval) == 200
    assert {it["task"] for it in data.eval} == set(TASKS)
    questions = {it["prompt"][0]["content"] for it in data.eval}
    train_questions = {c["messages"][0]["content"] for c in data.sft}
    train_questions |= {p["prompt"][0]["content"] for p in data.preference}
    assert not questions & train_questions
    corpus = "\n".join(data.pretrain)
    # Every phrasing of a training document contains the question or the operands of its item;
    # the question texts of held-out items never occur.
    assert not any(q in corpus for q in questions)


def test_items_have_verifiable_answers_and_wrong_rejections():
    assert make_item("add2", (23, 45)).answer == "68"
    assert make_item("max", (37, 52)).answer == "52"
    data = generate(seed=0, preference_pairs=300)
    assert all(p["chosen"] != p["rejected"] for p in data.preference)
    # max/min: the other operand or a near miss of the right one, both kinds present
    kinds = set()
    for p in data.preference:
        question = p["prompt"][0]["content"]
        if question.startswith("Which is"):
            a, b = (int(w.strip("?,")) for w in question.split()[-3::2])
            right, wrong = int(p["chosen"]), int(p["rejected"])
            kinds.add("other" if wrong == a + b - right else "near" if 0 < abs(wrong - right) <= 2 else "bad")
    assert kinds == {"other", "near"}, kinds
    assert sum(is_held_out(make_item("add2", (a, b))) for a in range(10, 100) for b in range(10, 100)) > 500
