import json
import random

from gptforge.data.corpus import Encoding, Reading, Sample, encode_unit, is_val, key
from gptforge.data.tokenizer import train_bpe


def test_the_sample_is_the_same_whatever_the_order_and_merges_from_parts():
    docs = [f"document {i} " + "x" * (i % 37) for i in range(2000)]
    budget = sum(len(d) for d in docs) // 10
    whole = Sample(budget)
    for d in docs:
        whole.add(key(d, 0), d)
    shuffled = Sample(budget)
    for d in random.Random(1).sample(docs, len(docs)):
        shuffled.add(key(d, 0), d)
    parts = [Sample(budget) for _ in range(4)]  # four units, then merged as the driver merges them
    for i, d in enumerate(docs):
        parts[i % 4].add(key(d, 0), d)
    merged = Sample(budget)
    for part in parts:
        for neg, _, d in part.heap:
            merged.add(-neg, d)
    assert whole.texts() == shuffled.texts() == merged.texts()
    assert budget - 60 <= whole.size <= budget  # full up to the next document
    keys = sorted(key(d, 0) for d in docs)
    assert max(key(d, 0) for d in whole.texts()) == keys[len(whole.texts()) - 1]  # the smallest keys
    assert Sample(budget).texts() == [] and whole.texts() != [
        d for d in docs if key(d, 1) <= sorted(key(x, 1) for x in docs)[len(whole.texts()) - 1]]  # seeded


def test_the_split_follows_the_text():
    docs = [f"doc {i}" for i in range(5000)]
    val = [d for d in docs if is_val(d, 0.05, 0)]
    assert 0.04 < len(val) / len(docs) < 0.06 and val == [d for d in docs if is_val(d, 0.05, 0)]


def test_the_shards_are_the_same_with_and_without_the_word_cache(tmp_path):
    from gptforge.core.config import SourceSection
    from gptforge.data.sources import Unit
    from tests.data.test_encoder import SPECIALS, texts

    docs = [t for t in texts(3000, seed=5) if t.strip()]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = train_bpe(docs, 600, 2, SPECIALS)
    reading = Reading(SourceSection(path=str(path)), "text", None)
    shards = {}
    for cached in (True, False):
        encoding = Encoding(tok.to_str(), 0, 600, "uint16", 5000, 0.1, 0, word_cache=cached)
        out = tmp_path / f"cache-{cached}"
        out.mkdir()
        result = encode_unit((0, Unit("text", str(path), 0, path.stat().st_size)), reading, encoding, out)
        assert result["documents"] == len(docs) and len(result["shards"]["train"]) > 1
        shards[cached] = {f.name: f.read_bytes() for f in sorted(out.iterdir())}
    assert shards[True] == shards[False]
