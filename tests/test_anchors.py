"""AnchorSet: the packed set of sampling anchors stays consistent under adds and removes, read
where the updates land (CPU storage) or through a device copy updated when read (as on CUDA;
mirrored on the CPU here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replaybuf.accel.numba_loader import compiled_kernels, kernels_unavailable_reason
from replaybuf.episodes.anchors import AnchorSet

CAPACITY = 16


def assert_consistent(anchors: AnchorSet, model: set[int]) -> None:
    count = len(anchors)
    assert count == len(model)
    packed = anchors.rows[:count].tolist()
    assert sorted(packed) == sorted(model)  # rows[:count] holds exactly the set, once each
    assert anchors.rows[count:].tolist() == [-1] * (CAPACITY - count)
    for place, row in enumerate(packed):
        assert int(anchors.pos[row]) == place
    for row in range(CAPACITY):
        assert bool(anchors.contains(torch.tensor([row]))[0]) == (row in model)
        if row not in model:
            assert int(anchors.pos[row]) == -1
    assert sorted(anchors.snapshot().tolist()) == sorted(model)


@pytest.mark.parametrize("mirror", [False, True])
def test_remove_fills_holes_from_the_tail(mirror):
    anchors = AnchorSet(CAPACITY, torch.device("cpu"), mirror=mirror)
    anchors.add(torch.tensor([5, 6, 7, 8]))
    anchors.remove(torch.tensor([5, 8]))
    assert_consistent(anchors, {6, 7})
    anchors.remove(torch.tensor([6, 7]))
    assert_consistent(anchors, set())


def as_rows(rows: list[int], numpy_rows: bool) -> torch.Tensor | np.ndarray:
    """int64 rows as a numpy array or a tensor (the update methods take either)."""
    return np.array(rows, dtype=np.int64) if numpy_rows else torch.tensor(rows, dtype=torch.long)


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove", "remove_present"]),
        st.sets(st.integers(0, CAPACITY - 1), max_size=6),
    ),
    min_size=1,
    max_size=25,
)


NO_KERNELS = kernels_unavailable_reason()
PATHS = [
    "numpy",
    "mirror",
    pytest.param(
        "compiled", marks=pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
    ),
]


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=150, deadline=None)
@given(ops=ops, seed=st.integers(0, 2**16), numpy_rows=st.booleans(), reads=st.booleans())
def test_random_adds_and_removes_keep_rows_and_pos_consistent(ops, seed, numpy_rows, reads, path):
    """Against a model set; and every path (numpy on the host, a device copy, the compiled
    removal) keeps the rows in the same order as the numpy path (the order seeded draws see)."""
    # reads=False: the device copy sees every update at once, at the end.
    mirror = path == "mirror"
    kernels = compiled_kernels() if path == "compiled" else None
    anchors = AnchorSet(CAPACITY, torch.device("cpu"), mirror=mirror, kernels=kernels)
    assert (anchors._kernels is not None) == (path == "compiled")
    twin = AnchorSet(CAPACITY, torch.device("cpu"))  # the numpy path
    if mirror:
        assert anchors.rows.data_ptr() != anchors._rows.data_ptr()  # a copy, read here
    model: set[int] = set()
    generator = torch.Generator().manual_seed(seed)
    shuffler = torch.Generator().manual_seed(seed + 1)
    for op, rows in ops:
        order = torch.randperm(CAPACITY, generator=shuffler).tolist()
        for target in (anchors, twin):
            if op == "add":
                target.add(as_rows(sorted(rows - model), numpy_rows))
            elif op == "remove":
                target.remove(as_rows(sorted(rows & model), numpy_rows))
            else:  # rows in and out of the set, in a random order
                target.remove_present(as_rows([r for r in order if r in rows], numpy_rows))
        model = model | rows if op == "add" else model - rows
        if not reads:
            continue
        assert anchors.rows.tolist() == twin.rows.tolist()
        assert_consistent(anchors, model)
        if model:
            drawn = anchors.sample(8, generator).tolist()
            assert set(drawn) <= model
            distinct = anchors.sample_distinct(CAPACITY + 1, generator).tolist()
            assert sorted(distinct) == sorted(model)
    assert anchors.rows.tolist() == twin.rows.tolist()
    assert anchors.pos.tolist() == twin.pos.tolist()
    assert_consistent(anchors, model)
