"""Epochs: create_epoch_iterator, get_next_batch, calculate_num_batches, get_steps_and_iterator."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from replay_helpers import ids_of, rows

from replaybuf import BufferClosedError, ReplayBuffer


def _filled(make_buffer, capacity: int, written: int, **kwargs) -> ReplayBuffer:
    buf = make_buffer(capacity, **kwargs)
    buf.add_batch(rows(0, written))
    return buf


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 12),
    chunks=st.lists(st.integers(1, 15), min_size=1, max_size=4),
    batch_size=st.integers(1, 14),
    n_epochs=st.integers(1, 3),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    storage_kind=st.sampled_from(["memmap", "tensor"]),
)
def test_every_epoch_visits_every_stored_transition_exactly_once(
    capacity, chunks, batch_size, n_epochs, shuffle, drop_last, storage_kind
):
    with ReplayBuffer("cpu", "cpu", capacity, storage=storage_kind, seed=0) as buf:
        written = 0
        for count in chunks:
            buf.add_batch(rows(written, count))
            written += count
        stored = list(range(written))[-capacity:]  # oldest first
        per_epoch = buf.calculate_num_batches(batch_size, drop_last=drop_last)
        batches = [
            ids_of(b)
            for b in buf.create_epoch_iterator(
                batch_size, n_epochs, shuffle=shuffle, drop_last=drop_last
            )
        ]
        assert len(batches) == n_epochs * per_epoch
        for epoch in range(n_epochs):
            chunk = batches[epoch * per_epoch : (epoch + 1) * per_epoch]
            assert all(len(b) == batch_size for b in chunk[:-1])
            visited = [i for b in chunk for i in b]
            if drop_last:
                assert all(len(b) == batch_size for b in chunk)
                assert len(visited) == len(stored) // batch_size * batch_size
                assert len(set(visited)) == len(visited)
                assert set(visited) <= set(stored)
            else:
                assert sorted(visited) == stored
            if not shuffle:
                assert visited == stored[: len(visited)]


def test_unshuffled_epoch_goes_oldest_first_after_wrap(make_buffer, storage):
    buf = _filled(make_buffer, 5, 8, storage=storage)
    batches = [ids_of(b) for b in buf.create_epoch_iterator(2, shuffle=False)]
    assert batches == [[3, 4], [5, 6], [7]]


def test_unshuffled_batches_are_copies_not_views_of_the_storage(make_buffer, storage):
    # Consecutive slots are copied as a slice (one copy per field): the copy must be the
    # caller's own, as a gather's is.
    buf = _filled(make_buffer, 8, 8, storage=storage)
    for batch in buf.create_epoch_iterator(4, shuffle=False):
        for leaf in batch.values(include_nested=True, leaves_only=True):
            leaf.zero_()
    assert ids_of(buf.sample_by_index(range(8))) == list(range(8))


def test_shuffled_epochs_differ_from_each_other_and_from_stored_order(make_buffer):
    buf = _filled(make_buffer, 64, 64)
    first, second = (
        [i for b in buf.create_epoch_iterator(64, n_epochs=1) for i in ids_of(b)] for _ in range(2)
    )
    assert sorted(first) == sorted(second) == list(range(64))
    assert first != list(range(64))
    assert first != second


def test_same_seed_gives_the_same_epoch_order(make_buffer):
    a = _filled(make_buffer, 32, 32, seed=9)
    b = _filled(make_buffer, 32, 32, seed=9)
    order_a = [ids_of(x) for x in a.create_epoch_iterator(8, n_epochs=2)]
    order_b = [ids_of(x) for x in b.create_epoch_iterator(8, n_epochs=2)]
    assert order_a == order_b


def test_epoch_batches_are_on_the_serving_device(make_buffer, storage):
    buf = _filled(make_buffer, 8, 8, storage=storage)
    for batch in buf.create_epoch_iterator(3):
        assert batch.device == torch.device("cpu")


def test_calculate_num_batches_rounds_up_and_down_with_drop_last(make_buffer):
    buf = _filled(make_buffer, 16, 10)
    assert buf.calculate_num_batches(3) == 4
    assert buf.calculate_num_batches(3, drop_last=True) == 3
    assert buf.calculate_num_batches(5) == 2
    assert buf.calculate_num_batches(5, drop_last=True) == 2
    assert buf.calculate_num_batches(11) == 1
    assert buf.calculate_num_batches(11, drop_last=True) == 0


def test_calculate_num_batches_of_an_empty_buffer_is_zero(make_buffer):
    assert make_buffer(4).calculate_num_batches(2) == 0


def test_get_steps_and_iterator_with_epochs_counts_steps_and_installs_an_iterator(make_buffer):
    buf = _filled(make_buffer, 16, 10)
    steps = buf.get_steps_and_iterator(n_epochs=2, max_iter=999, batch_size=4)
    assert steps == 2 * 3
    seen = Counter(i for _ in range(steps) for i in ids_of(buf.get_next_batch(4)))
    assert seen == Counter({i: 2 for i in range(10)})


def test_get_steps_and_iterator_with_zero_epochs_returns_max_iter_and_samples_randomly(
    make_buffer,
):
    buf = _filled(make_buffer, 16, 3)
    buf.create_epoch_iterator(2)  # installed, then replaced by random sampling
    assert buf.get_steps_and_iterator(n_epochs=0, max_iter=7, batch_size=8) == 7
    batch = ids_of(buf.get_next_batch(8))
    assert len(batch) == 8  # more rows than stored: drawn with replacement, not an epoch
    assert set(batch) <= {0, 1, 2}


def test_get_next_batch_without_an_iterator_samples_randomly(make_buffer):
    buf = _filled(make_buffer, 8, 4)
    assert len(ids_of(buf.get_next_batch(6))) == 6


def test_get_next_batch_serves_the_iterator_then_falls_back_to_sample_batch(make_buffer):
    """Documented: once the installed iterator is exhausted, get_next_batch samples randomly."""
    buf = _filled(make_buffer, 8, 5)
    buf.create_epoch_iterator(2, n_epochs=1, shuffle=False)
    served = [ids_of(buf.get_next_batch(10)) for _ in range(3)]
    assert served == [[0, 1], [2, 3], [4]]  # the epoch, with the iterator's batch size
    fallback = ids_of(buf.get_next_batch(10))
    assert len(fallback) == 10  # sample_batch(10), with replacement
    assert set(fallback) <= set(range(5))
    assert len(ids_of(buf.get_next_batch(10))) == 10  # and keeps sampling


def test_get_next_batch_falls_back_to_the_same_draws_as_sample_batch(make_buffer):
    a = _filled(make_buffer, 8, 8, seed=4)
    b = _filled(make_buffer, 8, 8, seed=4)
    a.create_epoch_iterator(8, shuffle=False)
    a.get_next_batch(8)  # the only batch of the epoch; consumes no random numbers
    assert ids_of(a.get_next_batch(5)) == ids_of(b.sample_batch(5))


def test_reset_uninstalls_the_epoch_iterator(make_buffer):
    buf = _filled(make_buffer, 8, 4)
    buf.create_epoch_iterator(4, shuffle=False)
    buf.reset()
    buf.add_batch(rows(100, 2))
    assert len(ids_of(buf.get_next_batch(5))) == 5


def test_each_epoch_is_planned_from_what_is_stored_when_it_starts(make_buffer):
    buf = _filled(make_buffer, 8, 2)
    epochs = buf.create_epoch_iterator(8, n_epochs=2, shuffle=False)
    assert ids_of(next(epochs)) == [0, 1]
    buf.add_batch(rows(2, 3))
    assert ids_of(next(epochs)) == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):
        next(epochs)


def test_an_epoch_iterator_raises_after_reset_instead_of_serving_dropped_rows(make_buffer):
    buf = _filled(make_buffer, 8, 6)
    epochs = buf.create_epoch_iterator(2, shuffle=False)
    assert ids_of(next(epochs)) == [0, 1]
    buf.reset()
    buf.add_batch(rows(100, 2))
    with pytest.raises(RuntimeError, match="reset"):
        next(epochs)
    assert ids_of(buf.sample_all()) == [100, 101]


def test_an_epoch_iterator_raises_buffer_closed_after_close(make_buffer):
    buf = _filled(make_buffer, 8, 6)
    epochs = buf.create_epoch_iterator(2)
    next(epochs)
    buf.close()
    with pytest.raises(BufferClosedError, match="closed"):
        next(epochs)
