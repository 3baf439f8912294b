import random

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from gptforge.data.encoder import CHUNK_CHARS, WordCache
from gptforge.data.tokenizer import train_bpe

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Pieces that meet at the cuts in every way the pattern knows: runs of spaces, tabs, newlines and other
# whitespace (Unicode's too), digits, contractions, punctuation, accents and combining marks, other scripts,
# emoji, and the special tokens themselves inside the text.
PIECES = [" ", "  ", "   ", "\t", "\n", "\r\n", " \n", "\n\n ", "\xa0", "\u3000", "\u2009", "\x1c", "a", "the", "The",
          " dog", "'s", "'LL", "n't", "1", "23", "4567", "3.14", ",", ".", "!?", "(", ")\"", "-", "--", "é", "e\u0301",
          "naïve", "中文", "日本語", "🙂", "🚀🚀", "עברית", "x" * 70, "<|im_start|>", "<|endoftext|>", "<|", "|>"]


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40))) for _ in range(n)]


def gpt2_style(corpus: list[str]) -> Tokenizer:
    """A byte-level BPE with GPT-2's pre-tokenization (ByteLevel with its own regex)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    return tok


@pytest.fixture(scope="module")
def corpus():
    return texts(3000, seed=1)


@pytest.mark.parametrize("kind", ["llama3_pattern", "gpt2_pattern"])
def test_the_word_cache_gives_the_tokenizers_ids(corpus, kind):
    tok = train_bpe(corpus, 600, 2, SPECIALS) if kind == "llama3_pattern" else gpt2_style(corpus)
    cache = WordCache(tok, capacity=200)  # small: the cache turns over many times
    assert cache.why_not is None
    docs = texts(4000, seed=2)
    for start in range(0, len(docs), 500):
        batch = docs[start:start + 500]
        got = cache.encode(batch)
        want = [e.ids for e in tok.encode_batch_fast(batch, add_special_tokens=False)]
        for text, g, w in zip(batch, got, want):
            assert g.tolist() == w, repr(text)
        assert len(cache.new) <= 200 and len(cache.old) <= 200


def test_a_second_pass_is_served_from_the_cache(corpus):
    tok = train_bpe(corpus, 600, 2, SPECIALS)
    cache = WordCache(tok)
    docs = [d for d in texts(500, seed=3) if "<|" not in d]
    first = cache.encode(docs)
    calls = []
    plain = cache.plain
    cache.plain = lambda batch: calls.append(batch) or plain(batch)
    again = cache.encode(docs)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    encoded_again = [c for batch in calls for c in batch]  # only chunks too long to keep
    assert encoded_again and all(len(c) > CHUNK_CHARS for c in encoded_again)


@pytest.mark.parametrize("change", ["normalizer", "prefix_space", "metaspace", "special_with_space"])
def test_tokenizers_the_cut_is_not_proven_for_encode_whole_documents(corpus, change):
    tok = train_bpe(corpus, 600, 2, SPECIALS)
    if change == "normalizer":
        tok.normalizer = normalizers.NFC()
    elif change == "prefix_space":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif change == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
    else:
        tok.add_special_tokens(["<|end of turn|>"])
    cache = WordCache(tok)
    assert cache.why_not is not None
    docs = texts(300, seed=4) + ["a <|end of turn|> b"]
    want = [e.ids for e in tok.encode_batch_fast(docs, add_special_tokens=False)]
    assert [ids.tolist() for ids in cache.encode(docs)] == want and not cache.new
