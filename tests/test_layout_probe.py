"""benchmarks/layout_probe.py: its gathers return the stored rows, and its line count is right."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def probe():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("layout_probe")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _lines_touched(nbytes: int, rows: int = 64) -> float:
    """Mean cache lines a row of ``nbytes`` at row index 0..rows-1 lies on (the slow way)."""
    total = 0
    for row in range(rows):
        first, last = row * nbytes, row * nbytes + nbytes - 1
        total += len({b // 64 for b in range(first, last + 1)})
    return total / rows


def test_lines_per_row(probe):
    expected = sum(_lines_touched(probe._nbytes(s, d)) for _, s, d in probe.FIELDS)
    offsets, row = probe.packed_offsets()
    assert probe.lines_per_row() == {"columns": pytest.approx(expected), "packed rows": 2}
    assert expected == pytest.approx(2 + 1.25 + 1 + 1)  # obs, action, reward, done
    assert row % 8 == 0
    assert row >= sum(probe._nbytes(s, d) for _, s, d in probe.FIELDS)
    for offset, (_, _, dtype) in zip(offsets, probe.FIELDS, strict=True):
        assert offset % dtype.itemsize == 0


def test_gathers_agree_and_run(probe):
    g = torch.Generator().manual_seed(0)
    work = probe.workloads(1_000, g, calls=1)
    shapes = [(probe.BATCH, *shape) for _, shape, _ in probe.FIELDS]
    for name in ("floor", "columns", "packed rows"):
        out = work[name].fn()
        assert [tuple(t.shape) for t in out] == shapes, name
        assert [t.dtype for t in out] == [d for _, _, d in probe.FIELDS], name
    result = probe.run([1_000], repeats=1, calls=2)
    assert set(result["points"][1_000]) == set(work)
    assert "max/min" in probe.table(result)


def test_line_toucher_loads_every_line(probe):
    touch = probe._line_toucher()
    if touch is None:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(0)
    columns = tuple(rng.integers(0, 256, 64 * 40, dtype=np.uint8) for _ in range(2))
    sizes = np.array([68, 24], dtype=np.int64)
    at = np.array([0, 3, 17, 31], dtype=np.int64)
    expected = 0
    for column, size in zip(columns, sizes, strict=True):
        for row in at:
            first = int(row) * int(size)
            for line in range(first // 64, (first + int(size) - 1) // 64 + 1):
                expected ^= int(column[line * 64])
    assert touch(at, columns, sizes) == expected
