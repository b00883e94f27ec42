"""``ReplayBuffer``: a transition ring buffer with ObjectRL's API on TorchRL storage.

Rows are written round-robin into ``buffer_size`` slots; once full, slot ``pointer`` holds the
oldest transition and is the next one overwritten. Every write is converted and checked against
the field spec fixed by the first write before TorchRL sees it, so a bad write raises and leaves
the buffer exactly as it was. Every public call runs under the buffer's lock, so threads may
share it (:mod:`replaybuf.buffers.locking`).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import TensorDictReplayBuffer

from replaybuf.args import check_seed, positive_int, seed_or_draw
from replaybuf.buffers.locking import reentered, synchronized
from replaybuf.buffers.ring_epochs import RingEpochs
from replaybuf.buffers.ring_priorities import RingPriorities
from replaybuf.buffers.ring_reads import RingReads
from replaybuf.buffers.ring_state import RingPersistence
from replaybuf.errors import (
    ArgumentError,
    BufferClosedError,
    SchemaError,
)
from replaybuf.priority import Prioritizer, priority_stats
from replaybuf.storage import (
    NORMAL_TENSORS,
    FieldSpec,
    Key,
    SlotStorage,
    chunk_writer,
    key_name,
    resolve_device,
    resolve_kind,
    row_writer,
    to_leaves,
)

logger = logging.getLogger("replaybuf")


class ReplayBuffer(RingEpochs, RingPriorities, RingPersistence, RingReads):
    """A fixed-size transition buffer storing on ``storing_device`` and serving on ``device``.

    Args:
        device: where sampled batches are delivered (the training device).
        storing_device: where rows are kept (``"cpu"`` or a CUDA device).
        buffer_size: capacity in transitions.
        print_gc_warning: log a warning when the garbage collector is run (ObjectRL's flag):
            only after creating storage raised ``OSError``, before the one retry.
        storage: ``"auto"``, ``"memmap"`` or ``"tensor"``. ``"auto"`` on the CPU keeps rows
            that plan at most 256 MiB in RAM (tensor storage) and larger ones in memmap
            files, chosen at the first write (or at once from ``spec``); on CUDA, tensor.
        scratch_dir: existing folder for memmap files; a private subfolder is created there
            and removed by ``close()``. Defaults to the system temporary folder (on disk).
        seed: seeds the sampling generator, for reproducible batches. ``None`` (the default)
            draws the seed from torch's global CPU generator (one int64), so that
            ``torch.manual_seed(s)`` before the buffer is built repeats its batches, as with
            TorchRL's samplers; an explicit seed leaves the global generator untouched.
            ``reset()`` keeps the generator's state (it is not reseeded).
        prioritized: sample ∝ priority^alpha with importance weights (see
            :mod:`replaybuf.priority.policy`); batches then carry ``index`` and ``weight``.
        alpha, beta, eps: PER's exponent, importance-weight exponent and priority offset.
        priority_backend: ``"auto"``, ``"torchrl-segment-tree"`` or ``"torch"``.
        spec: the fields up front (``FieldSpec.declare`` forms, e.g. ``{"obs": ((17,),
            torch.float32), ...}``) instead of from the first write: ``stats()["planned_bytes"]``
            is known at once and a buffer the disk, RAM or GPU cannot hold fails here with
            :class:`~replaybuf.errors.InsufficientSpaceError`, before anything is allocated.
    """

    @NORMAL_TENSORS
    def __init__(
        self,
        device: torch.device | str,
        storing_device: torch.device | str,
        buffer_size: int,
        print_gc_warning: bool = False,
        *,
        storage: str = "auto",
        scratch_dir: str | os.PathLike | None = None,
        seed: int | None = None,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-6,
        priority_backend: str = "auto",
        spec: Any = None,
    ) -> None:
        # Every public call runs under it (replaybuf.buffers.locking).
        self._lock = threading.RLock()
        self._calling = False  # a public call is running (buffers.locking)
        self._device = resolve_device(device, "device")
        self._storing_device = resolve_device(storing_device, "storing_device")
        capacity = positive_int(buffer_size, "buffer_size")
        kind = resolve_kind(storage, self.storing_device)
        seed = check_seed(seed)
        self.print_gc_warning = print_gc_warning
        self._priorities = (
            Prioritizer(capacity, self.storing_device, alpha, beta, eps, priority_backend)
            if prioritized
            else None
        )
        self._declared = None if spec is None else FieldSpec.declare(spec)
        if self._declared is not None and self._declared.ragged_keys:
            key = key_name(self._declared.ragged_keys[0])
            raise SchemaError(
                f"spec field {key!r} expected a fixed-shape field, got "
                f"{self._declared[self._declared.ragged_keys[0]].describe()}: ragged and "
                "non-tensor fields are stored by the episode buffers"
            )
        self._scratch_dir = scratch_dir  # where this buffer's storage keeps its memmap files
        self._slots = SlotStorage(
            capacity, kind=kind, storing_device=self.storing_device, scratch_dir=scratch_dir
        )
        if self._declared is not None:
            self._prepare_declared()
        # No seed: one drawn from torch's global generator, so torch.manual_seed repeats a run.
        self._generator = torch.Generator(device=self.storing_device)
        self._generator.manual_seed(seed_or_draw(seed))
        self._pointer = 0
        self._size = 0
        self._writes = 0  # rows ever written: row k's id is k, its slot k % capacity
        self._closed = False
        self._resets = 0  # lets an epoch iterator notice that its planned slots were dropped
        self._iterator: Iterator[TensorDict] | None = None
        self._home: Path | None = None  # where save_checkpoint() writes; set by open()

    # ----------------------------------------------------------------- properties
    @property
    @synchronized
    def memory(self) -> TensorDictReplayBuffer:
        """The TorchRL ``TensorDictReplayBuffer`` that holds the rows."""
        self._check_open()
        return self._slots.memory

    @property
    def device(self) -> torch.device:
        """Where sampled batches are delivered. Assignable, as ObjectRL's attribute: later
        batches go to the new device (an iterator or dataset already made keeps its own)."""
        return self._device

    @device.setter
    def device(self, value: torch.device | str) -> None:
        device = resolve_device(value, "device")
        with self._lock:
            self._device = device

    @property
    def storing_device(self) -> torch.device:
        """Where rows are kept; fixed at construction (the rows and the sampler live there)."""
        return self._storing_device

    @property
    def buffer_size(self) -> int:
        return self._slots.capacity

    @property
    def size(self) -> int:
        """Transitions stored now."""
        return self._size

    data_size = size

    @property
    def pointer(self) -> int:
        """The slot the next transition goes to (the oldest one once the buffer is full)."""
        return self._pointer

    @property
    def spec(self) -> FieldSpec | None:
        """Keys, shapes and dtypes fixed by the first write (``None`` before it)."""
        return self._slots.spec

    @property
    def storage_kind(self) -> str:
        """``"memmap"`` or ``"tensor"``; ``"auto"`` until the first write (or a declared spec)
        lets ``storage="auto"`` choose."""
        return self._slots.reported_kind

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer(size={self._size}, buffer_size={self.buffer_size}, "
            f"storage={self.storage_kind!r}, storing_device={self.storing_device}, "
            f"device={self.device})"
        )

    # ----------------------------------------------------------------- lifecycle
    @synchronized
    def close(self) -> None:
        """Release storage and remove its memmap files. Idempotent."""
        if not self._closed:
            self._closed = True
            self._iterator = None
            self._slots.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("the buffer is closed")

    def _prepare_declared(self) -> None:
        """Fix the declared spec and check the space now (closing the storage if it fails)."""
        assert self._declared is not None  # called only once a spec is declared
        try:
            self._slots.prepare(self._declared)
        except BaseException:
            self._slots.close()
            raise

    @synchronized
    def reset(self, buffer_size: int | None = None) -> None:
        """Empty the buffer (the field spec too, unless declared), optionally with a new
        capacity."""
        self._check_open()
        if buffer_size is not None:
            buffer_size = positive_int(buffer_size, "buffer_size")
            if self._declared is not None:  # refuse before dropping anything
                self._slots.check_space(buffer_size, self._declared)
        self._retry_after_collect(self._slots.reset, buffer_size)
        if self._priorities is not None:
            p = self._priorities
            self._priorities = Prioritizer(
                self.buffer_size, self.storing_device, p.alpha, p.beta, p.eps, p.backend
            )
        self._pointer = 0
        self._size = 0
        # Ids keep counting (an id from before the reset is never live again), from a multiple
        # of the capacity so that id % capacity stays the slot.
        self._writes = -(-self._writes // self.buffer_size) * self.buffer_size
        self._iterator = None
        self._resets += 1
        if self._declared is not None:
            self._retry_after_collect(self._slots.prepare, self._declared)

    def _retry_after_collect(
        self, make: Callable[..., None], *args: Any, undo: Callable[[], None] | None = None
    ) -> None:
        """``make(*args)``, and once more after a garbage collection if it raised ``OSError``.

        Dropping storage releases it at once (its files are removed and, with no reference
        cycle holding them, its tensors freed), so a reset costs what freeing the storage
        costs. Only a failure to get memory, files or mappings (ENOMEM, EMFILE, a failed
        mmap) shows that unreachable objects may still hold some: then the collector runs,
        as ObjectRL runs it after an ``OSError`` in ``add``, and ``print_gc_warning`` logs it.
        ``undo`` puts back what the failed call changed before the retry.
        """
        try:
            make(*args)
        except OSError as exc:
            if undo is not None:
                undo()
            gc.collect()
            if self.print_gc_warning:
                logger.warning("ReplayBuffer ran the garbage collector after: %s", exc)
            make(*args)

    # ----------------------------------------------------------------- writes
    def add(self, experience: TensorDictBase | dict[str, Any]) -> None:
        """Add one transition (a TensorDict with empty batch size, or a dict of values)."""
        lock = self._lock  # inline, as the per-step appends: the per-step hot path
        lock.acquire()
        if self._calling:  # called from code run inside another call (buffers.locking)
            lock.release()
            raise reentered("add")
        self._calling = True
        try:
            if self._closed:
                self._check_open()  # raises
            # The row writer chosen for this storage (replaybuf.storage.ringrow): a dict of
            # exact matches goes straight into the columns; -1, nothing written: the general path.
            if row_writer(self._slots)(experience) < 0:
                self._add(experience)
            elif self._priorities is None:  # _advance(1), inline: a call costs as much
                capacity = self._slots.capacity
                self._pointer = (self._pointer + 1) % capacity
                if self._size < capacity:
                    self._size += 1
                self._writes += 1
            else:
                self._advance(1)
        finally:
            self._calling = False
            lock.release()

    def _add(self, experience: TensorDictBase | dict[str, Any]) -> None:
        """:meth:`add`'s general path: convert, check against the spec, write."""
        if isinstance(experience, TensorDictBase) and experience.batch_dims:
            raise ArgumentError(
                "add expects one transition (batch_size []), got batch_size "
                f"{list(experience.batch_size)}; use add_batch for batches"
            )
        spec = self.spec
        leaves = None if spec is None else spec.match(experience, batched=False)
        matched = leaves is not None
        if leaves is None:
            leaves = to_leaves(experience, batched=False, what="add", spec=spec)
        self._write({key: value.unsqueeze(0) for key, value in leaves.items()}, "add", matched)

    def add_batch(self, batch: TensorDictBase | dict[str, Any]) -> None:
        """Add a batch of transitions (leading dimension = rows); keeps the newest on overflow."""
        # The lock by hand, as the per-step appends take it: a chunk insert is a hot path.
        lock = self._lock
        lock.acquire()
        if self._calling:  # called from code run inside another call (buffers.locking)
            lock.release()
            raise reentered("add_batch")
        self._calling = True
        try:
            self._check_open()
            # The chunk writer chosen for this storage (replaybuf.storage.ringchunk): the spec's
            # exact fields go straight into the columns; -1, nothing written: the general path.
            rows = chunk_writer(self._slots)(batch)
            if rows > 0:
                self._advance(rows)
            else:
                self._add_batch(batch)
        finally:
            self._calling = False
            lock.release()

    def _add_batch(self, batch: TensorDictBase | dict[str, Any]) -> None:
        """:meth:`add_batch`'s general path: convert, check against the spec, write."""
        spec = self._slots.spec
        leaves = None if spec is None else spec.match(batch, batched=True)
        if leaves is None:
            leaves = to_leaves(batch, batched=True, what="add_batch", spec=spec)
            self._write(leaves, "add_batch")
        elif self._size:  # the spec's fields exactly, into allocated storage
            self._write_rows(leaves, "add_batch", checked=True)
        else:
            self._write(leaves, "add_batch", checked=True)

    def _write(self, leaves: dict[Key, torch.Tensor], what: str, checked: bool = False) -> None:
        """:meth:`_write_rows`; the first write into empty storage, which allocates it, is
        retried once after a garbage collection if it raises ``OSError`` (nothing was stored:
        the storage is made afresh, keeping its spec, before the retry)."""
        if self._size:
            self._write_rows(leaves, what, checked)
            return
        spec = self._slots.spec  # declared, or taken by load(): kept for the retry

        def afresh() -> None:
            self._slots.reset()
            if spec is not None:
                self._slots.prepare(spec)

        self._retry_after_collect(self._write_rows, leaves, what, checked, undo=afresh)

    def _write_rows(
        self, leaves: dict[Key, torch.Tensor], what: str, checked: bool = False
    ) -> None:
        """Write ``[rows, ...]`` leaves by flat key, checked against the spec unless ``checked``
        (they came from :meth:`FieldSpec.match`); no TensorDict is built for them, as a setitem
        per field would cost more than copying a 1,000-row chunk."""
        rows = next(iter(leaves.values())).shape[0]
        slots = self._slots
        spec = slots.spec
        if spec is None:
            if rows == 0:
                return  # an empty batch must not fix the spec
            slots.prepare(FieldSpec.of(leaves, 1))
        elif not checked:
            spec.check(leaves, 1, what)
        if rows == 0:
            return
        capacity = slots.capacity
        if rows > capacity:
            # Only the newest rows survive, in the slots writing every row would give them
            # (so the layout does not depend on chunking): writing `rows % capacity` rows
            # first moves TorchRL's cursor there; the newest `capacity` rows then cover them.
            if rows % capacity:
                slots.extend({k: v[: rows % capacity] for k, v in leaves.items()})
            leaves = {k: v[rows - capacity :] for k, v in leaves.items()}
        slots.extend(leaves)
        if self._priorities is None:  # _advance's counts, without its call on this hot path
            self._pointer = (self._pointer + rows) % capacity
            self._size = min(self._size + rows, capacity)
            self._writes += rows
        else:
            self._advance(rows)

    def _advance(self, rows: int) -> None:
        """Count ``rows`` rows written at the pointer (TorchRL's cursor advanced with them)."""
        capacity = self._slots.capacity
        if self._priorities is not None:  # overwritten items leave, new ones enter at the max
            written = torch.arange(min(rows, capacity), device=self.storing_device)
            self._priorities.admit((self._pointer + rows - 1 - written) % capacity)
        self._pointer = (self._pointer + rows) % capacity
        self._size = min(self._size + rows, capacity)
        self._writes += rows

    # ----------------------------------------------------------------- introspection
    @synchronized
    def stats(self) -> dict[str, Any]:
        """Size, capacity, pointer, storage kind, devices, bytes and the field spec."""
        self._check_open()
        return {
            "size": self._size,
            "capacity": self.buffer_size,
            "pointer": self._pointer,
            "storage": self.storage_kind,
            "device": str(self.device),
            "storing_device": str(self.storing_device),
            "bytes": self._slots.stored_bytes(),
            "planned_bytes": self._slots.planned_bytes,
            "scratch_dir": None
            if self._slots.scratch_path is None
            else str(self._slots.scratch_path),
            "spec": None if self.spec is None else self.spec.to_json(),
            **priority_stats(self._priorities),
        }
