"""Staged writes: rows in the stager, their bookkeeping packed into int64 columns, then applied.

The write paths stage each step's row and bookkeeping; :meth:`EpisodeCore.flush` writes the
rows to storage and, through the functions here, packs the bookkeeping (from the per-step
lists and the batch run) and applies it to the row columns, the anchor set and the
priorities. Plain functions over the :class:`~replaybuf.episodes.core.EpisodeCore` state.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from replaybuf.episodes.batch_run import Packed
from replaybuf.storage import (
    Key,
    Ragged,
    RowPlan,
    RowStager,
    build_tensordict,
    to_device_async,
)

if TYPE_CHECKING:
    from replaybuf.episodes.core import EpisodeCore

# Staged rows written in one storage call (a flush): _FLUSH_ROWS, or as many as fill
# _FLUSH_BYTES for small rows (up to _FLUSH_SCALE times as many): each flush has a fixed cost
# on top of its rows, which larger flushes of small rows spread thinner (a vector env of
# thousands of envs fills a few of its batches' worth per flush).
_FLUSH_ROWS = 512
_FLUSH_BYTES = 1 << 21
_FLUSH_SCALE = 32


def stage(core: EpisodeCore, rows: Sequence[int], data: dict[Key, Any]) -> None:
    """Stage ``data`` (``[len(rows), ...]`` per key) for storage ``rows``; the first call, once
    the spec is fixed, makes the stager and the per-step fast path's plan. Ragged fields'
    values go straight to their arenas (only their rows' spans wait for nothing)."""
    if core._stager is None:
        spec = core.slots.spec
        assert spec is not None  # fixed by the first write, before anything is staged
        fixed = spec.fixed
        row_bytes = max(fixed.row_bytes, 1)
        size = max(_FLUSH_ROWS, min(_FLUSH_SCALE * _FLUSH_ROWS, _FLUSH_BYTES // row_bytes))
        core._stager = RowStager(fixed, size)
        # The per-step fast path writes fixed fields only: a spec with ragged ones has none.
        core._plan = None if spec.ragged_keys else RowPlan.of(fixed, core._stager.arrays)
    if core.slots.ragged:
        ragged = {k: v for k, v in data.items() if isinstance(v, Ragged)}
        data = {k: v for k, v in data.items() if not isinstance(v, Ragged)}
        core.slots.ragged.write(np.asarray(rows, dtype=np.int64), ragged)
    if not core._stager.fits(len(rows)):
        core.flush()
    if core._stager.fits(len(rows)):
        core._stager.stage(rows, data)
    else:  # more rows than a staging buffer holds: write them straight through
        slots = torch.frombuffer(array("q", rows), dtype=torch.long)
        core.slots.write(
            slots,
            build_tensordict(list(data), list(data.values()), len(rows), torch.device("cpu")),
        )
        core.flush()  # their bookkeeping (the stager is empty)


def flush_if_full(core: EpisodeCore, rows: int) -> None:
    """Flush if the stager cannot take ``rows`` more (or, for more than it holds, a whole
    stager's worth).

    Every append path calls it before making room: a failed write then changes nothing, and
    flushes and evictions come in the same order on every path (the anchor order, so seeded
    draws, follows it).
    """
    stager = core._stager
    if stager is not None and not stager.fits(min(rows, stager.capacity)):
        core.flush()


def pack_staged(core: EpisodeCore) -> None:
    """Move the staged bookkeeping from the batch run and the lists into int64 columns.

    In staging order (which orders the anchor set, so seeded draws): the run's batches come
    first, as the lists are packed when a run starts and a list entry hands out a row, which
    ends the run's repeats.
    """
    if core._run is not None:
        core._run.pack(core._packed)
    if core._staged_meta:
        core._packed.add_flat_rows(core._staged_meta)
        core._staged_meta.clear()
    if core._staged_links:
        core._packed.add_flat_links(core._staged_links)
        core._staged_links.clear()


def drop_run(core: EpisodeCore) -> None:
    """End the batch run (an episode of it ended or went, or another batch came): its
    pending batches go into the staged bookkeeping and their episodes' row arrays."""
    run = core._run
    if run is not None:
        core._run = None
        run.pack(core._packed)
        run.settle_rows()
        for episode in run.episodes:
            episode.run = None


def apply_staged(core: EpisodeCore) -> None:
    """:func:`pack_staged` then :func:`apply_packed`. With nothing packed and no batch run
    (per-step appends and final rows only) and the compiled kernels, the lists are placed and
    linked in one call (:meth:`RowLinks.place_steps`) and their anchors admitted: a trainer
    that samples after each append (SB3's SAC and TD3 by default) flushes a row or two each
    time, where the packed columns' calls cost more than the writes. The one-by-one
    reference (``core.batched`` False) takes the general path, which the tests compare."""
    if core._run is not None or core._packed.rows or not core.links.compiled or not core.batched:
        pack_staged(core)
        apply_packed(core)
        return
    meta, pairs = core._staged_meta, core._staged_links
    if not meta and not pairs:
        return
    sources = core.links.place_steps(np.array(meta, np.int64), np.array(pairs, np.int64))
    if sources.shape[0]:
        admit(core, torch.from_numpy(sources.copy()))
    meta.clear()  # only now: a failed admission applies them again at the next flush
    pairs.clear()


def apply_packed(core: EpisodeCore) -> None:
    """Place and link the packed bookkeeping, and add its anchors."""
    packed = core._packed
    if packed.rows:
        core.links.place(*packed.meta())
        if packed.sources:
            admit(core, core.links.connect(*packed.links()))
        core._packed = Packed()  # only now: a failed write keeps what it was to apply


def admit(core: EpisodeCore, starts: torch.Tensor) -> None:
    """Add new anchors (CPU int64) to the priorities at their maximum, and to the set.

    The priorities first: an admission that raises (a device allocation, say) leaves the
    set as it was, and the next flush, which applies the same packed bookkeeping again,
    adds each anchor once (the set would hold it twice otherwise).
    """
    if core.priorities is not None:  # new steps enter at the current maximum
        core.priorities.admit(to_device_async(starts, core.slots.storing_device))
    core.anchors.add(starts)
