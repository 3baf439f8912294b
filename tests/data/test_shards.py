import numpy as np
import pytest

from gptforge.data.shards import ShardWriter, dtype_for, unigram_entropy


def test_dtype_and_shard_rollover(tmp_path):
    assert dtype_for(65536) == np.uint16 and dtype_for(65537) == np.uint32
    w = ShardWriter(tmp_path, "train", np.uint32, shard_tokens=5)
    w.write(np.arange(12, dtype=np.int64))
    w.close()
    assert [s["tokens"] for s in w.shards] == [5, 5, 2]
    assert np.fromfile(tmp_path / "train-00002.bin", dtype=np.uint32).tolist() == [10, 11]


def test_unigram_entropy_by_hand():
    assert unigram_entropy(np.array([1, 1, 2, 2])) == pytest.approx(np.log(2))
    assert unigram_entropy(np.array([5, 5, 5])) == pytest.approx(0.0)
