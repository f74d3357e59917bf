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
