import numpy as np
import pytest

from gptforge.data.batches import DistributedOrder, TokenWindows, eval_batches


def test_ranks_take_disjoint_slices_of_each_global_batch():
    tokens = np.arange(1001)
    a = TokenWindows(tokens, seq_len=10, micro_batch=4, rank=0, world=2, seed=1)
    b = TokenWindows(tokens, seq_len=10, micro_batch=4, rank=1, world=2, seed=1)
    single = TokenWindows(tokens, seq_len=10, micro_batch=8, rank=0, world=1, seed=1)
    for _ in range(30):  # crosses epochs (100 windows)
        xa, ya = a.next()
        xb, _ = b.next()
        xs, _ = single.next()
        assert not set(xa[:, 0].tolist()) & set(xb[:, 0].tolist())
        assert sorted(xa[:, 0].tolist() + xb[:, 0].tolist()) == sorted(xs[:, 0].tolist())
        assert (ya[:, :-1] == xa[:, 1:]).all()


def test_resume_from_state_continues_the_same_sequence():
    tokens = np.arange(5000)
    a = TokenWindows(tokens, 16, 4, seed=3)
    for _ in range(7):
        a.next()
    state = a.state_dict()
    expected = [a.next()[0] for _ in range(5)]
    b = TokenWindows(tokens, 16, 4, seed=3)
    b.load_state_dict(state)
    assert all((b.next()[0] == e).all() for e in expected)
    with pytest.raises(ValueError):
        TokenWindows(tokens, 16, 4, seed=4).load_state_dict(state)


def test_eval_batches_cover_disjoint_windows():
    tokens = np.arange(401)
    got = [x for r in range(2) for x, _ in eval_batches(tokens, 10, 2, 3, r, 2)]
    starts = sorted(int(x[i, 0]) for x in got for i in range(len(x)))
    assert starts == [10 * i for i in range(12)]


def test_ids_at_a_micro_step_depend_on_the_step_and_rank_alone():
    """How the ptx rows of an update are drawn: as a run drawing in order would get them, in any order of asking."""
    ranks = [DistributedOrder(10, 2, rank=r, world=2, seed=3) for r in range(2)]
    drawn = [[o.next_ids().tolist() for o in ranks] for _ in range(5)]  # crosses an epoch
    fresh = [DistributedOrder(10, 2, rank=r, world=2, seed=3) for r in range(2)]
    assert [[o.ids_at(s).tolist() for o in fresh] for s in (4, 0, 3, 1, 2)] == [drawn[s] for s in (4, 0, 3, 1, 2)]
    assert len({i for s in (0, 1) for ids in drawn[s] for i in ids}) == 8  # ranks and steps draw different rows


def test_too_little_data_names_the_keys_to_change():
    from gptforge.core.errors import DataError
    from gptforge.data.splits import require

    require(16, 16, "pairs", "reward.micro_batch_size", "data.preference")
    with pytest.raises(DataError, match=r"^12 pairs, fewer than the 16 that one step takes \(reward.micro_batch_size "
                                        r"over all processes\); give more data \(data.preference\), or lower "
                                        r"reward.micro_batch_size or distributed.nproc_per_node$"):
        require(12, 16, "pairs", "reward.micro_batch_size", "data.preference")
