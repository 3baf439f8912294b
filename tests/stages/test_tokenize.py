import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from gptforge.data.shards import load_split, read_index
from gptforge.pipeline.store import execute
from gptforge.stages import tokenize

MIXED = ["Hello world, 23 plus 45 is 68.", "你好，世界！中文文本。", "emoji 🙂🚀 and ünïcödé",
         "tabs\tand  double  spaces", "العربية والعبرية עברית"]


@pytest.fixture
def corpus(tmp_path):
    rows = [{"text": MIXED[i % len(MIXED)] + f" doc {i}"} for i in range(400)]
    path = tmp_path / "corpus.jsonl"
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            if i == 10:
                f.write('{"text": 5}\n')  # bad row at line 12
    return path, [r["text"] for r in rows]


def test_tokenize_stage_end_to_end(small_cfg, corpus, capsys):
    path, docs = corpus
    cfg = small_cfg(f"data.pretrain={path}", "tokenizer.shard_tokens=2000")
    manifest = execute(cfg, "tokenize")
    out_dir = path.parent / "runs" / "store" / "tokenize" / manifest["fingerprint"][:16]
    m = manifest["metrics"]
    assert m["bad_rows"] == 1 and f"{path}:12" in capsys.readouterr().err
    assert m["vocab_size"] == 320 and m["tokens"] == m["train_tokens"] + m["val_tokens"] > 0
    assert m["bytes"] == sum(len(d.encode()) for d in docs) and m["tokens_per_sec"] > 0

    tok = AutoTokenizer.from_pretrained(out_dir / "tokenizer")
    for text in MIXED:
        assert tok.decode(tok(text)["input_ids"]) == text

    index = read_index(out_dir / "shards")
    assert index["dtype"] == "uint16" and len(index["splits"]["train"]) > 1  # several shards
    train = load_split(out_dir / "shards", "train")
    eos = index["eos_id"]
    decoded, start = [], 0
    for i in np.flatnonzero(train == eos):
        decoded.append(tok.decode(train[start:i].tolist()))
        start = i + 1
    split = tokenize.split_docs(docs, cfg.tokenizer.val_fraction)
    assert decoded == split["train"]
    assert not set(split["val"]) & set(split["train"])


def test_chat_template_marks_assistant_tokens(small_cfg):
    cfg = small_cfg()
    manifest = execute(cfg, "tokenize")
    tok = AutoTokenizer.from_pretrained(
        f"{cfg.run.root}/store/tokenize/{manifest['fingerprint'][:16]}/tokenizer")
    msgs = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}]
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    marked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(marked) == "5<|im_end|>\n"


def test_a_number_is_one_token_wherever_it_stands():
    """Numbers are pre-tokenized apart from the space before them, so the answer of "Which is larger,
    89 or 3?" is the very token of the question's 89 (GPT-2's pre-tokenization makes it " 89" there)."""
    from gptforge.data.tokenizer import train_bpe

    texts = [f"Which is larger, {a} or {b}?\n{max(a, b)}" for a in range(100) for b in range(0, 100, 7)]
    tok = train_bpe(texts, 400, 2, ["<|endoftext|>"])
    question, answer = tok.encode("Which is larger, 89 or 3?"), tok.encode("89")
    assert len(answer.ids) == 1 and answer.ids[0] in question.ids
    assert tok.decode(question.ids) == "Which is larger, 89 or 3?"
    assert [w for w, _ in tok.pre_tokenizer.pre_tokenize_str("1234")] == ["123", "4"]  # 3 digits at most, as cl100k
