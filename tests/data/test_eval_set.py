"""What the evaluation steps evaluate: the run's own held-out rows (or data.eval), with their reference answers
where the data has them; the demo's verifiable items only where the data is the demo."""

import json

import pytest

from gptforge.core.errors import DataError
from gptforge.data import demo
from gptforge.data.formats import BadRow, to_eval_item
from gptforge.data.splits import VAL_EVERY, eval_fingerprint, eval_set
from gptforge.pipeline.store import fingerprints


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def user_files(tmp_path, n=60) -> dict:
    """An Alpaca SFT file and a flat preference file, in the users' formats (demo questions, so a demo-trained
    tokenizer encodes them)."""
    d = demo.generate(seed=5, pretrain_docs=10, sft_items=n, preference_pairs=n, eval_items=5)
    return {"sft": write_jsonl(tmp_path / "chat.jsonl", [
                {"instruction": c["messages"][0]["content"], "output": c["messages"][1]["content"]} for c in d.sft]),
            "preference": write_jsonl(tmp_path / "pairs.jsonl", [
                {"prompt": p["prompt"][0]["content"], "chosen": p["chosen"], "rejected": p["rejected"]}
                for p in d.preference])}


def test_evaluation_rows_with_and_without_a_reference():
    user = [{"role": "user", "content": "Name a colour."}]
    assert to_eval_item({"prompt": "Name a colour.", "answer": "red"}) == {"prompt": user, "answer": "red"}
    assert to_eval_item({"prompt": "Name a colour."}) == {"prompt": user, "answer": None}
    assert to_eval_item({"instruction": "Name a colour."}) == {"prompt": user, "answer": None}
    assert to_eval_item({"messages": user + [{"role": "assistant", "content": "blue"}]}) == \
        {"prompt": user, "answer": "blue"}
    assert to_eval_item({"conversations": [{"from": "human", "value": "Name a colour."}]})["answer"] is None
    with pytest.raises(BadRow, match="no prompt"):
        to_eval_item({"messages": [{"role": "assistant", "content": "blue"}]})


def test_held_out_rows_of_the_users_files_are_evaluated(small_cfg, tmp_path):
    files = user_files(tmp_path)
    cfg = small_cfg(f"data.sft={files['sft']}", f"data.preference={files['preference']}", "reward.policy_samples=0")
    after_sft = eval_set(cfg.data, "sft")
    rows = [json.loads(line) for line in open(files["sft"])]
    assert not after_sft.demo and after_sft.source.startswith(f"data.sft={files['sft']}")
    assert [it["answer"] for it in after_sft.items] == [r["output"] for r in rows[::VAL_EVERY]]
    assert after_sft.items[0]["prompt"] == [{"role": "user", "content": rows[0]["instruction"]}]
    after_dpo = eval_set(cfg.data, "dpo")  # the held-out pairs' prompts; the reward model judges, no reference
    pairs = [json.loads(line) for line in open(files["preference"])]
    assert [it["prompt"][0]["content"] for it in after_dpo.items] == \
        list(dict.fromkeys(p["prompt"] for p in pairs[::VAL_EVERY]))
    assert all(it["answer"] is None for it in after_dpo.items)
    on_demo = eval_set(small_cfg().data, "dpo")
    assert on_demo.demo and on_demo.items == demo.from_settings(cfg.data.demo).eval


def test_data_eval_replaces_the_held_out_rows_and_is_fingerprinted(small_cfg, tmp_path):
    files = user_files(tmp_path)
    rows = [{"prompt": "What is 2 plus 2?"}, {"bad": 1}, {"prompt": "Repeat kite twice.", "answer": "kite kite"}]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    cfg = small_cfg(f"data.sft={files['sft']}", f"data.eval={prompts}")
    held = eval_set(cfg.data, "sft")
    assert held.source == f"data.eval={prompts}" and [it["answer"] for it in held.items] == [None, "kite kite"]
    fp = {s: eval_fingerprint(cfg.data, s) for s in ("eval-sft", "eval-dpo")}
    assert fp["eval-sft"] == fp["eval-dpo"]  # the same rows for every evaluation step
    user = small_cfg(f"data.sft={files['sft']}").data
    assert eval_fingerprint(user, "eval-sft") != fp["eval-sft"]
    assert eval_fingerprint(user, "eval-dpo") == eval_fingerprint(small_cfg().data, "eval-dpo")  # demo pairs
    changed = fingerprints(small_cfg(f"data.eval={prompts}")), fingerprints(small_cfg())
    assert {s for s in changed[0] if changed[0][s] != changed[1][s]} == {"eval-sft", "eval-dpo"}  # nothing trains
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "What is 3 plus 3?"}])
    assert eval_fingerprint(cfg.data, "eval-sft") != fp["eval-sft"]  # the file's content, not its name
    write_jsonl(tmp_path / "prompts.jsonl", [{"bad": 1}])
    with pytest.raises(DataError, match="no usable evaluation rows"):
        eval_set(cfg.data, "sft")
