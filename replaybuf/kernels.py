"""Compiled CPU kernels of the pure-torch priority index (numba; the ``fast`` extra).

Written by hand because neither torch, numpy nor TorchRL has them: a prioritized draw is a
search per mass, and its cost on the CPU is memory latency. numpy's ``searchsorted`` finishes
one mass before starting the next (each of its ~15 levels a dependent load and a branch the
CPU cannot predict), and TorchRL's C++ sum tree descends one mass at a time too. These
kernels take one search level across all the masses at once, so their loads are independent
and overlap: 256 draws at 1M items in ~18 µs against ~75 µs for numpy and TorchRL's tree.

They compute exactly what :func:`replaybuf.priority.locate_host` and the index's numpy
updates compute, with the same float operations in the same order: the results are equal
bit for bit (the tests check it), so the index runs either way. Importing this module compiles
both kernels (or loads them from numba's cache, next to this file or in numba's user cache).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

_F64 = types.float64[::1]
_F64_2D = types.float64[:, ::1]
_F32 = types.float32[::1]
_I64 = types.int64[::1]


@njit(types.void(_F64, _F64_2D, _F64_2D, _F64, _I64, _F64), cache=True, boundscheck=False)
def locate(
    starts: np.ndarray,
    running: np.ndarray,
    leaves: np.ndarray,
    masses: np.ndarray,
    items: np.ndarray,
    weights: np.ndarray,
) -> None:
    """:func:`replaybuf.priority.locate_host` into ``items`` and ``weights`` ([B] each)."""
    blocks, width = running.shape
    count = masses.shape[0]
    # Lower bound of every mass in starts[1:] (the first block b with starts[b + 1] >= u), one
    # halving step at a time for all masses: the answer stays in [base, base + size].
    base = np.zeros(count, np.int64)
    size = blocks
    while size > 1:
        half = size >> 1
        for k in range(count):
            probe = base[k] + half
            base[k] = probe if starts[probe + 1] < masses[k] else base[k]
        size -= half
    for k in range(count):
        mass = masses[k]
        block = base[k] + (starts[base[k] + 1] < mass)
        block = min(block, blocks - 1)
        inside = min(mass - starts[block], running[block, width - 1])  # round-off: <= its total
        column = 0  # the first running sum >= inside: the count of those below (they never fall)
        for j in range(width):
            column += running[block, j] < inside
        items[k] = block * width + column
        weights[k] = leaves[block, column]


@njit(
    types.void(_I64, _F64, _F64_2D, _F64_2D, _F64, _F32, _F32, _F64),
    cache=True,
    boundscheck=False,
)
def write(
    items: np.ndarray,
    weights: np.ndarray,
    leaves: np.ndarray,
    running: np.ndarray,
    sums: np.ndarray,
    lowest: np.ndarray,
    highest: np.ndarray,
    starts: np.ndarray,
) -> None:
    """Write ``weights`` to ``items`` in order (a duplicate's last value wins), then redo the
    touched blocks' running sums, sums and extremes, and the starts from the first of them."""
    width = leaves.shape[1]
    flat = leaves.reshape(-1)
    first = sums.shape[0]
    for k in range(items.shape[0]):
        flat[items[k]] = weights[k]
    for k in range(items.shape[0]):  # a block written twice is summarized twice, alike
        block = items[k] // width
        first = min(first, block)
        total = 0.0
        smallest = np.inf
        largest = 0.0
        for j in range(width):
            weight = leaves[block, j]
            total += weight
            running[block, j] = total
            if 0 < weight < smallest:
                smallest = weight
            largest = max(largest, weight)
        sums[block] = total
        lowest[block] = smallest
        highest[block] = largest
    start = starts[first]  # in a local: no store-to-load round trip per block
    for block in range(first, sums.shape[0]):  # the same sequential sums as torch.cumsum
        start += sums[block]
        starts[block + 1] = start


@njit(
    types.void(_F64, _F64, _F64_2D, _F64_2D, types.float64, types.float64, _I64, _F32),
    cache=True,
    boundscheck=False,
)
def draw_relative(
    uniform: np.ndarray,
    starts: np.ndarray,
    running: np.ndarray,
    leaves: np.ndarray,
    smallest: float,
    power: float,
    items: np.ndarray,
    relative: np.ndarray,
) -> None:
    """A whole draw: the masses :func:`replaybuf.priority.sample_masses` makes of ``uniform``
    (U[0, 1), [B]), their items (:func:`locate`) and float32 (weight / smallest) ** power."""
    masses = (1.0 - uniform) * starts[starts.shape[0] - 1]  # [B] in (0, total]
    weights = np.empty_like(masses)
    locate(starts, running, leaves, masses, items, weights)
    for k in range(weights.shape[0]):
        relative[k] = (weights[k] / smallest) ** power
