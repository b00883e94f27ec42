"""Compiled CPU kernels (numba; the ``fast`` extra): prioritized draws and writes of the
pure-torch priority index, n-step windows and frame-stack rows over CPU episode storage, the
scattered row writes of episode storage, and the row bookkeeping (links, anchors) a flush and
an eviction write, on the host whatever the storing device.

Written by hand because neither torch, numpy nor TorchRL has them. Both jobs are a few hundred
independent walks through large tables (a search per mass, a chain of links per anchor), and
on the CPU their cost is memory latency and the numpy calls between steps: numpy's
``searchsorted`` finishes one search before it starts the next, TorchRL's C++ sum tree
descends one mass at a time, and the numpy n-step path makes ~25 numpy calls. These kernels
take one step for all the walks at once, so their loads are independent and overlap, and do all
the steps in one call.

The frame-stack and n-step window kernels live in :mod:`replaybuf.accel.numba_nstep`, the copy
of a row from tensors' addresses in :mod:`replaybuf.accel.numba_rows`; both are members here
too.
Callers load this module through :mod:`replaybuf.accel.numba_loader`, and run their numpy paths
where it does not load. The kernels compute what those paths compute, with the same float
operations in the same order (the tests check them against each other; the one exception is
noted where it occurs). Importing this module compiles the kernels for their declared
signatures (or loads them from numba's cache, next to this file or in numba's user cache).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from replaybuf.accel.numba_groups import release
from replaybuf.accel.numba_nstep import END_NONE
from replaybuf.accel.numba_nstep import frame_nstep as frame_nstep
from replaybuf.accel.numba_nstep import nstep_windows as nstep_windows
from replaybuf.accel.numba_nstep import stack_rows as stack_rows
from replaybuf.accel.numba_nstep import window_stacks as window_stacks
from replaybuf.accel.numba_rows import copy_row as copy_row
from replaybuf.accel.numba_rows import scatter_from as scatter_from

_F64 = types.float64[::1]
_F64_2D = types.float64[:, ::1]
_F32 = types.float32[::1]
_I64 = types.int64[::1]
_I8 = types.int8[::1]
_I64_IN = types.Array(types.int64, 1, "C", readonly=True)  # read only: writable ones convert


@njit(types.void(_F64, _F64_2D, _F64_2D, _F64, _I64, _F64), cache=True, boundscheck=False)
def locate(
    starts: np.ndarray,
    running: np.ndarray,
    leaves: np.ndarray,
    masses: np.ndarray,
    items: np.ndarray,
    weights: np.ndarray,
) -> None:
    """:func:`replaybuf.priority.draws.locate_host` into ``items`` and ``weights`` ([B] each)."""
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
    for k in range(items.shape[0]):  # checked before anything is written (no bounds checks)
        if not 0 <= items[k] < flat.shape[0]:
            raise IndexError("priority index write: an item out of range")
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
    """A whole draw: the masses :func:`replaybuf.priority.draws.sample_masses` makes of
    ``uniform``
    (U[0, 1), [B]), their items (:func:`locate`) and float32 (weight / smallest) ** power."""
    masses = (1.0 - uniform) * starts[starts.shape[0] - 1]  # [B] in (0, total]
    weights = np.empty_like(masses)
    locate(starts, running, leaves, masses, items, weights)
    for k in range(weights.shape[0]):
        relative[k] = (weights[k] / smallest) ** power


_WORDS_2D = [word[:, ::1] for word in (types.uint8, types.uint16, types.uint32, types.uint64)]


@njit([types.void(w, w, _I64) for w in _WORDS_2D], cache=True, boundscheck=False)
def scatter_rows(column: np.ndarray, staged: np.ndarray, rows: np.ndarray) -> None:
    """``column[rows[i]] = staged[i]`` for each i, on the rows' words (``[slots, row words]``
    views of any dtype, see :func:`replaybuf.storage.staging.row_words`). The episode core's flush:
    rows of interleaved episodes land all over the column, and torch's ``index_copy_`` spends
    most of its time there on per-call set-up, repeated for each field."""
    if staged.shape[1] != column.shape[1] or staged.shape[0] < rows.shape[0]:
        raise ValueError("row write: staged rows of another width, or fewer than the slots")
    slots = column.shape[0]
    for i in range(rows.shape[0]):  # checked before anything is written (no bounds checks)
        if not 0 <= rows[i] < slots:
            raise IndexError("row write: a slot out of range")
    width = staged.shape[1]
    for i in range(rows.shape[0]):
        row = rows[i]
        for j in range(width):
            column[row, j] = staged[i, j]


# ---- episode bookkeeping: the RowLinks and AnchorSet writes of a flush and of an eviction.
# A flush places a stager's worth of rows (4,096 for the W4 fields) and an eviction frees a
# whole episode's; in a vector env's steady state those rows lie one per cache line, and the
# numpy paths make a dozen fancy-index calls, each a pass with its own temporaries, where one
# loop makes the same writes. A column that is not kept (``prev_row`` without frame stacking)
# comes as an empty array.


@njit(cache=True)
def _check_rows(rows: np.ndarray, size: int) -> None:
    """Refuse a row outside ``[0, size)`` before anything is written (no bounds checks)."""
    for i in range(rows.shape[0]):
        if not 0 <= rows[i] < size:
            raise IndexError("bookkeeping write: a row out of range")


@njit(cache=True)
def _kept(column: np.ndarray, size: int) -> bool:
    """Whether an optional column is kept (``size`` rows) or not (empty); refuses other
    lengths, which the unchecked writes would run past."""
    if column.shape[0] != 0 and column.shape[0] != size:
        raise ValueError("bookkeeping write: the columns differ in length")
    return column.shape[0] == size


@njit(cache=True)
def _placed_columns(
    size: int,
    succ: np.ndarray,
    episode: np.ndarray,
    end_kind: np.ndarray,
    step: np.ndarray,
    alloc: np.ndarray,
    prev_row: np.ndarray,
) -> bool:
    """Refuse the columns a placement writes unless each holds ``size`` rows (``prev_row``:
    or none); returns whether ``prev_row`` is kept."""
    if not succ.shape[0] == episode.shape[0] == end_kind.shape[0] == size:
        raise ValueError("bookkeeping write: the columns differ in length")
    if not step.shape[0] == alloc.shape[0] == size:
        raise ValueError("bookkeeping write: the columns differ in length")
    return _kept(prev_row, size)


@njit(cache=True)
def _place(
    row: int,
    owner: int,
    end: int,
    number: int,
    allocation: int,
    next_row: np.ndarray,
    succ: np.ndarray,
    episode: np.ndarray,
    end_kind: np.ndarray,
    step: np.ndarray,
    alloc: np.ndarray,
) -> None:
    """One placed row: its episode, end kind, step and allocation, and no successor."""
    next_row[row] = -1
    succ[row] = row
    episode[row] = owner
    end_kind[row] = end
    step[row] = number
    alloc[row] = allocation


@njit(
    types.void(*([_I64_IN] * 5), *([_I64] * 3), _I8, _I64, _I64, _I64),
    cache=True,
    boundscheck=False,
)
def place_rows(
    rows: np.ndarray,
    episodes: np.ndarray,
    steps: np.ndarray,
    ends: np.ndarray,
    allocations: np.ndarray,
    next_row: np.ndarray,
    succ: np.ndarray,
    episode: np.ndarray,
    end_kind: np.ndarray,
    step: np.ndarray,
    alloc: np.ndarray,
    prev_row: np.ndarray,
) -> None:
    """``RowLinks.place``: row ``rows[i]`` gets ``episodes[i]``, ``steps[i]``, ``ends[i]`` and
    ``allocations[i]``, and no successor or predecessor."""
    size = next_row.shape[0]
    count = rows.shape[0]
    if not episodes.shape[0] == steps.shape[0] == ends.shape[0] == allocations.shape[0] == count:
        raise ValueError("place: the row columns differ in length")
    backward = _placed_columns(size, succ, episode, end_kind, step, alloc, prev_row)
    _check_rows(rows, size)
    for i in range(count):
        row = rows[i]
        _place(
            row, episodes[i], ends[i], steps[i], allocations[i],
            next_row, succ, episode, end_kind, step, alloc,
        )  # fmt: skip
        if backward:
            prev_row[row] = -1


@njit(types.void(_I64_IN, _I64_IN, _I64, _I64, _I64), cache=True, boundscheck=False)
def connect_rows(
    sources: np.ndarray,
    targets: np.ndarray,
    next_row: np.ndarray,
    succ: np.ndarray,
    prev_row: np.ndarray,
) -> None:
    """``RowLinks.connect``: row ``sources[i]`` links to ``targets[i]`` (and back)."""
    size = next_row.shape[0]
    if sources.shape[0] != targets.shape[0]:
        raise ValueError("connect: sources and targets differ in length")
    if succ.shape[0] != size:
        raise ValueError("bookkeeping write: the columns differ in length")
    backward = _kept(prev_row, size)
    _check_rows(sources, size)
    _check_rows(targets, size)
    for i in range(sources.shape[0]):
        source, target = sources[i], targets[i]
        next_row[source] = target
        succ[source] = target
        if backward:
            prev_row[target] = source


@njit(
    types.void(_I64_IN, _I64_IN, *([_I64] * 3), _I8, _I64, _I64, _I64),
    cache=True,
    boundscheck=False,
)
def place_steps(
    meta: np.ndarray,
    pairs: np.ndarray,
    next_row: np.ndarray,
    succ: np.ndarray,
    episode: np.ndarray,
    end_kind: np.ndarray,
    step: np.ndarray,
    alloc: np.ndarray,
    prev_row: np.ndarray,
) -> None:
    """:func:`place_rows` then :func:`connect_rows` from the per-step lists as they are staged,
    in one call (a flush of a few appended steps, each read after an append, pays its calls
    more than its writes): ``meta`` five ints a row (row, episode, step, end kind,
    allocation), ``pairs`` two a link (source, target). Every row is checked first."""
    size = next_row.shape[0]
    if meta.shape[0] % 5 != 0 or pairs.shape[0] % 2 != 0:
        raise ValueError("place_steps: meta or pairs of a wrong length")
    backward = _placed_columns(size, succ, episode, end_kind, step, alloc, prev_row)
    for i in range(0, meta.shape[0], 5):
        if not 0 <= meta[i] < size:
            raise IndexError("bookkeeping write: a row out of range")
    _check_rows(pairs, size)
    for i in range(0, meta.shape[0], 5):
        row = meta[i]
        _place(
            row, meta[i + 1], meta[i + 3], meta[i + 2], meta[i + 4],
            next_row, succ, episode, end_kind, step, alloc,
        )  # fmt: skip
        if backward:
            prev_row[row] = -1
    for i in range(0, pairs.shape[0], 2):
        source, target = pairs[i], pairs[i + 1]
        next_row[source] = target
        succ[source] = target
        if backward:
            prev_row[target] = source


@njit(types.void(_I64_IN, _I64, _I64, _I64, _I8, _I64), cache=True, boundscheck=False)
def release_rows(
    rows: np.ndarray,
    next_row: np.ndarray,
    succ: np.ndarray,
    episode: np.ndarray,
    end_kind: np.ndarray,
    prev_row: np.ndarray,
) -> None:
    """``RowLinks.release``: rows get no episode, successor, predecessor or end kind."""
    size = next_row.shape[0]
    if not succ.shape[0] == episode.shape[0] == end_kind.shape[0] == size:
        raise ValueError("bookkeeping write: the columns differ in length")
    backward = _kept(prev_row, size)
    _check_rows(rows, size)
    release(rows, next_row, succ, episode, end_kind, prev_row, backward)


@njit(types.int64(_I64_IN, _I64, _I64, types.int64), cache=True, boundscheck=False)
def remove_anchors(old: np.ndarray, rows: np.ndarray, pos: np.ndarray, count: int) -> int:
    """``AnchorSet.remove_present`` on its columns (``rows[:count]`` packed, ``pos`` each
    row's place or -1); returns the new count. The same moves as the numpy path, in the same
    order: holes inside the kept prefix, in the order of ``old``, take the surviving tail rows
    in tail order (the anchor order orders seeded draws)."""
    size = pos.shape[0]
    if not 0 <= count <= rows.shape[0] == size:
        raise ValueError("remove: count or columns out of shape")
    _check_rows(old, size)
    places = np.empty(old.shape[0], np.int64)
    removed = 0
    for i in range(old.shape[0]):
        row = old[i]
        if pos[row] >= 0:  # present (a row listed twice goes once)
            places[removed] = pos[row]
            pos[row] = -1
            removed += 1
    kept = count - removed
    hole = 0
    for at in range(kept, count):
        row = rows[at]
        if pos[row] >= 0:  # a survivor in the tail: into the next hole inside the prefix
            while places[hole] >= kept:
                hole += 1
            rows[places[hole]] = row
            pos[row] = places[hole]
            hole += 1
        rows[at] = -1
    return kept


@njit(
    types.void(*([_I64_IN] * 3), types.int64, _I64_IN, *([_I64] * 4), _I8, _I64, _I64, _I64),
    cache=True,
    boundscheck=False,
)
def place_batches(
    rows: np.ndarray,
    ids: np.ndarray,
    steps: np.ndarray,
    first: int,
    tail: np.ndarray,
    sources: np.ndarray,
    next_row: np.ndarray,
    succ: np.ndarray,
    episode: np.ndarray,
    end_kind: np.ndarray,
    step: np.ndarray,
    alloc: np.ndarray,
    prev_row: np.ndarray,
) -> None:
    """``place_rows`` then ``connect_rows`` for a batch run's batches (``rows``: one row per
    episode of ``ids`` per batch, batch-major), without the per-row columns a flush would
    pack first: row ``i`` (batch ``b``, episode ``c``) gets episode ``ids[c]``, step
    ``steps[c] + b`` and allocation ``first + i``, and is linked from ``tail[c]`` (``b`` = 0)
    or from the batch before's row; ``sources[i]`` gets that row (the new anchors, in the
    order a packed flush adds them)."""
    size = next_row.shape[0]
    count = ids.shape[0]
    if count == 0 or rows.shape[0] % count or sources.shape[0] != rows.shape[0]:
        raise ValueError("place batches: rows are not whole batches, or sources differ")
    if steps.shape[0] != count or tail.shape[0] != count:
        raise ValueError("place batches: steps or tail differ from the episodes in length")
    backward = _placed_columns(size, succ, episode, end_kind, step, alloc, prev_row)
    _check_rows(rows, size)
    _check_rows(tail, size)
    for i in range(rows.shape[0]):
        b, c = divmod(i, count)
        row = rows[i]
        source = tail[c] if b == 0 else rows[i - count]
        _place(
            row, ids[c], END_NONE, steps[c] + b, first + i,
            next_row, succ, episode, end_kind, step, alloc,
        )  # fmt: skip
        next_row[source] = row
        succ[source] = row
        if backward:
            prev_row[row] = source
        sources[i] = source


# Exported with the other kernels (their own module keeps these under the line limit).
from replaybuf.accel.numba_groups import evict_rows as evict_rows  # noqa: E402
from replaybuf.accel.numba_groups import remove_anchor_groups as remove_anchor_groups  # noqa: E402
