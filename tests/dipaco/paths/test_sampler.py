import numpy as np
import pytest
import torch

from dipaco.errors import DataError
from dipaco.paths.sampler import ShardSampler


def sequences(n: int) -> torch.Tensor:
    return torch.arange(n).unsqueeze(1).repeat(1, 4)


def test_each_epoch_visits_every_sequence_once():
    s = ShardSampler(sequences(10), batch_size=3, seed=1)
    seen = torch.cat([s.next_batch()[:, 0] for _ in range(10)])  # 30 draws = 3 epochs
    for epoch in range(3):
        assert sorted(seen[epoch * 10 : (epoch + 1) * 10].tolist()) == list(range(10))
    assert s.epoch == 3 and s.position == 0


def test_resumed_cursor_draws_the_same_batches():
    a = ShardSampler(sequences(7), batch_size=4, seed=3)
    for _ in range(5):
        a.next_batch()
    b = ShardSampler(sequences(7), batch_size=4, seed=3)
    b.load_state_dict(a.state_dict())
    for _ in range(6):
        assert torch.equal(a.next_batch(), b.next_batch())


def test_batch_larger_than_shard_wraps_epochs():
    s = ShardSampler(sequences(2), batch_size=5, seed=0)
    assert s.next_batch().shape == (5, 4)


def test_seeds_give_different_orders_and_empty_shard_errors():
    a = ShardSampler(sequences(50), batch_size=50, seed=0).next_batch()
    b = ShardSampler(sequences(50), batch_size=50, seed=1).next_batch()
    assert not torch.equal(a, b)
    with pytest.raises(DataError):
        ShardSampler(torch.zeros(0, 4, dtype=torch.long), batch_size=2, seed=0)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097, 65_537])
def test_the_keyed_order_is_a_permutation_of_every_sequence(n):
    from dipaco.paths.sampler import KeyedPermutation

    for key in (0, 1, 12345):
        order = KeyedPermutation(n, key)(np.arange(n))
        assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(n))
        assert np.array_equal(order, KeyedPermutation(n, key)(np.arange(n)))  # the key decides it
    if n >= 16:
        assert not np.array_equal(KeyedPermutation(n, 0)(np.arange(n)), KeyedPermutation(n, 1)(np.arange(n)))


def test_the_keyed_order_is_close_to_uniform():
    """Where the first sequence of an epoch goes, over 3,000 epochs of a 10-sequence shard: each place
    about 300 times (a chi-square of 9 degrees of freedom stays under 27.9 with probability 0.999)."""
    from dipaco.paths.sampler import KeyedPermutation

    first = np.array([KeyedPermutation(10, key)(np.arange(1))[0] for key in range(3000)])
    counts = np.bincount(first, minlength=10)
    assert ((counts - 300) ** 2 / 300).sum() < 27.9, counts


class Huge:
    """A shard of 10^12 sequences that returns the row numbers it is asked for."""

    ndim = 2
    shape = (10**12, 4)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        return index


def test_the_order_is_not_stored():
    """torch.randperm stored 8 bytes a sequence: 192 MB of the four paths at 10M documents (here, 8 TB:
    building the sampler raised). Now the order is computed for each batch's positions."""
    s = ShardSampler(Huge(), batch_size=64, seed=0)
    rows = torch.cat([s.next_batch() for _ in range(4)])
    assert rows.unique().numel() == 256 and 0 <= int(rows.min()) and int(rows.max()) < 10**12
    s.load_state_dict({"epoch": 0, "position": 10**12 - 3})
    assert s.next_batch().numel() == 64 and s.epoch == 1 and s.position == 61  # across the epoch boundary
