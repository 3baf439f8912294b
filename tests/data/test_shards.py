import numpy as np
import pytest

from gptforge.core.errors import DataError
from gptforge.data.batches import TokenWindows, eval_batches
from gptforge.data.shards import ShardWriter, TokenStream, dtype_for, entropy, read_index, write_index


def test_dtype_and_shard_rollover(tmp_path):
    assert dtype_for(65536) == np.uint16 and dtype_for(65537) == np.uint32
    w = ShardWriter(tmp_path, "train-00000", np.uint32, shard_tokens=5)
    w.write(np.arange(12, dtype=np.int64))
    assert not list(tmp_path.glob("*.bin"))  # temporary names until the unit is done
    assert [s["tokens"] for s in w.commit()] == [5, 5, 2]
    assert np.fromfile(tmp_path / "train-00000-002.bin", dtype=np.uint32).tolist() == [10, 11]
    ShardWriter(tmp_path, "train-00000", np.uint32, shard_tokens=5)  # a rerun of the unit starts clean
    assert not list(tmp_path.glob("train-00000-*"))


def shards(tmp_path, tokens: np.ndarray, shard_tokens: int) -> TokenStream:
    w = ShardWriter(tmp_path, "train-00000", np.uint16, shard_tokens)
    w.write(tokens)
    write_index(tmp_path, {"dtype": "uint16", "splits": {"train": w.commit()}})
    return TokenStream(tmp_path, "train")


def test_a_multi_shard_split_reads_as_one_stream(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    stream = shards(tmp_path, tokens, shard_tokens=97)
    assert len(stream) == 1000 and len(read_index(tmp_path)["splits"]["train"]) == 11
    for a, b in [(0, 1000), (90, 110), (96, 97), (500, 700), (999, 1000), (1000, 1000)]:
        assert stream[a:b].tolist() == tokens[a:b].tolist()


def test_a_multi_shard_split_yields_the_same_windows_as_one_array(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 300, 5000).astype(np.uint16)
    stream = shards(tmp_path, tokens, shard_tokens=333)
    for rank in range(2):
        a, b = (TokenWindows(t, seq_len=16, micro_batch=4, rank=rank, world=2, seed=3) for t in (tokens, stream))
        for _ in range(100):  # crosses epochs and shard boundaries
            (xa, ya), (xb, yb) = a.next(), b.next()
            assert (xa == xb).all() and (ya == yb).all()
        for (xa, _), (xb, _) in zip(eval_batches(tokens, 16, 4, 3, rank, 2), eval_batches(stream, 16, 4, 3, rank, 2)):
            assert (xa == xb).all()


def test_a_shard_that_is_not_what_the_index_says_is_refused(tmp_path):
    shards(tmp_path, np.arange(100, dtype=np.uint16), shard_tokens=60)
    (tmp_path / "train-00000-001.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match=r"train-00000-001.bin: 10 bytes, the index says 40 tokens of uint16"):
        TokenStream(tmp_path, "train")


def test_entropy_by_hand():
    assert entropy(np.array([2, 2])) == pytest.approx(np.log(2))
    assert entropy(np.array([0, 3, 0])) == pytest.approx(0.0)
