"""DeviceMirror: the device copy of host columns equals them whenever it is read, whichever
indices were written, repeated or not, and however many were pending (mirrored on the CPU;
tests/test_cuda.py runs the episode bookkeeping through it on a GPU)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replaybuf.storage.mirror import DeviceMirror

SIZE = 12

writes = st.lists(
    st.tuples(
        st.lists(st.integers(0, SIZE - 1), max_size=6),  # indices, repeats allowed
        st.integers(-100, 100),  # value written
        st.booleans(),  # read (publish) after this write
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(writes=writes, limit=st.sampled_from([3, 10, 4096]))
def test_the_device_copy_equals_the_host_columns_whenever_it_is_read(writes, limit):
    columns = [np.arange(SIZE, dtype=np.int64), np.zeros(SIZE, dtype=np.int8)]
    mirror = DeviceMirror(columns, torch.device("cpu"))
    mirror._limit = limit  # small limits: whole-table sends
    mirror.publish()
    assert mirror.table.tolist() == [c.tolist() for c in columns]
    for at, value, read in writes:
        index = np.array(at, dtype=np.int64)
        for column in columns:
            column[index] = value
        before = mirror.table.tolist()
        mirror.touched(index)
        assert mirror.table.tolist() == before  # writers never touch the device copy
        index[:] = -1  # the caller reuses its buffer: the mirror kept its own copy
        if read:
            mirror.publish()
            assert mirror.table.tolist() == [c.tolist() for c in columns]
        assert mirror._count <= limit  # pending stays bounded without reads
    mirror.publish()
    assert mirror.table.tolist() == [c.tolist() for c in columns]
