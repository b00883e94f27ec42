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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import TensorDictReplayBuffer

from replaybuf.args import NArg, index_tensor, int_at_least, positive_int
from replaybuf.buffers.dataset import ReplayDataset, check_dataset_args, transitions_dataset
from replaybuf.buffers.locking import synchronized
from replaybuf.core import epoch_batches, num_batches
from replaybuf.errors import BufferClosedError, EmptyBufferError, MetadataError
from replaybuf.persist import metadata
from replaybuf.persist import ring as buffer_checkpoint
from replaybuf.persist.ring import RingParts
from replaybuf.persist.state import source_of
from replaybuf.priority import (
    Prioritizer,
    check_beta,
    check_priorities,
    host_update_inputs,
    parse_ids,
    priority_stats,
    ring_ids,
)
from replaybuf.storage import (
    NORMAL_TENSORS,
    FieldSpec,
    Key,
    SlotStorage,
    resolve_device,
    resolve_kind,
    to_leaves,
)

logger = logging.getLogger("replaybuf")
_NO_BATCH_SIZE = object()  # `_require()` without a batch size to check (None is a bad one)


class ReplayBuffer:
    """A fixed-size transition buffer storing on ``storing_device`` and serving on ``device``.

    Args:
        device: where sampled batches are delivered (the training device).
        storing_device: where rows are kept (``"cpu"`` or a CUDA device).
        buffer_size: capacity in transitions.
        print_gc_warning: log a warning when ``reset`` runs the garbage collector (ObjectRL).
        storage: ``"auto"`` (memmap on CPU, tensor on CUDA), ``"memmap"`` or ``"tensor"``.
        scratch_dir: existing folder for memmap files; a private subfolder is created there
            and removed by ``close()``. Defaults to the system temporary folder (on disk).
        seed: seeds the sampling generator, for reproducible batches.
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
        self._lock = (
            threading.RLock()
        )  # every public call runs under it (replaybuf.buffers.locking)
        self.device = resolve_device(device, "device")
        self.storing_device = resolve_device(storing_device, "storing_device")
        capacity = positive_int(buffer_size, "buffer_size")
        kind = resolve_kind(storage, self.storing_device)
        if seed is not None:
            seed = int_at_least(seed, "seed", 0)
        self.print_gc_warning = print_gc_warning
        self._priorities = (
            Prioritizer(capacity, self.storing_device, alpha, beta, eps, priority_backend)
            if prioritized
            else None
        )
        self._declared = None if spec is None else FieldSpec.declare(spec)
        self._slots = SlotStorage(
            capacity, kind=kind, storing_device=self.storing_device, scratch_dir=scratch_dir
        )
        if self._declared is not None:
            self._prepare_declared()
        self._generator = torch.Generator(device=self.storing_device)
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()
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
        return self._slots.kind

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
        self._slots.reset(buffer_size)
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
            self._slots.prepare(self._declared)
        gc.collect()  # release the old storage's mapped files now, as ObjectRL does
        if self.print_gc_warning:
            logger.warning("ReplayBuffer.reset ran the garbage collector")

    # ----------------------------------------------------------------- writes
    @synchronized
    def add(self, experience: TensorDictBase | dict[str, Any]) -> None:
        """Add one transition (a TensorDict with empty batch size, or a dict of values)."""
        self._check_open()
        if isinstance(experience, TensorDictBase) and experience.batch_dims:
            raise ValueError(
                "add expects one transition (batch_size []), got batch_size "
                f"{list(experience.batch_size)}; use add_batch for batches"
            )
        spec = self.spec
        leaves = None if spec is None else spec.match(experience, batched=False)
        matched = leaves is not None
        if leaves is None:
            leaves = to_leaves(experience, batched=False, what="add", spec=spec)
        self._write({key: value.unsqueeze(0) for key, value in leaves.items()}, "add", matched)

    @synchronized
    def add_batch(self, batch: TensorDictBase | dict[str, Any]) -> None:
        """Add a batch of transitions (leading dimension = rows); keeps the newest on overflow."""
        self._check_open()
        spec = self.spec
        leaves = None if spec is None else spec.match(batch, batched=True)
        if leaves is not None:  # exactly the spec's fields: nothing to convert or check
            self._write(leaves, "add_batch", checked=True)
        else:
            self._write(to_leaves(batch, batched=True, what="add_batch", spec=spec), "add_batch")

    def _write(self, leaves: dict[Key, torch.Tensor], what: str, checked: bool = False) -> None:
        """Write ``[rows, ...]`` leaves by flat key, checked against the spec unless ``checked``
        (they came from :meth:`FieldSpec.match`). No TensorDict is built for them once the
        storage writes directly: a TensorDict setitem per field costs more than the copy of a
        1,000-row chunk."""
        rows = next(iter(leaves.values())).shape[0]
        if self.spec is None:
            if rows == 0:
                return  # an empty batch must not fix the spec
            self._slots.prepare(FieldSpec.of(leaves, 1))
        elif not checked:
            self.spec.check(leaves, 1, what)
        if rows == 0:
            return
        capacity = self.buffer_size
        if rows > capacity:
            # Only the newest rows survive, in the slots writing every row would give them
            # (so the layout does not depend on chunking): writing `rows % capacity` rows
            # first moves TorchRL's cursor there; the newest `capacity` rows then cover them.
            if rows % capacity:
                self._slots.extend({k: v[: rows % capacity] for k, v in leaves.items()})
            leaves = {k: v[rows - capacity :] for k, v in leaves.items()}
        self._slots.extend(leaves)
        if self._priorities is not None:  # overwritten items leave, new ones enter at the max
            written = torch.arange(min(rows, capacity), device=self.storing_device)
            self._priorities.admit((self._pointer + rows - 1 - written) % capacity)
        self._pointer = (self._pointer + rows) % capacity
        self._size = min(self._size + rows, capacity)
        self._writes += rows

    # ----------------------------------------------------------------- reads
    def _require(self, batch_size: Any = _NO_BATCH_SIZE) -> None:
        self._check_open()
        if batch_size is not _NO_BATCH_SIZE:
            positive_int(batch_size, "batch_size")
        if self._size == 0:
            raise EmptyBufferError("cannot sample: the buffer is empty")

    def _oldest_first(self) -> torch.Tensor:
        """Slots of the stored transitions, oldest first."""
        order = torch.arange(self._size, device=self.storing_device)
        if self._size == self.buffer_size:
            order = (order + self._pointer) % self.buffer_size
        return order

    @synchronized
    def sample_batch(self, batch_size: int) -> TensorDict:
        """``batch_size`` transitions drawn uniformly with replacement, on ``device``."""
        self._require(batch_size)
        if self._priorities is not None:
            slots, weight = self._priorities.draw(batch_size, self._generator)
            return self._slots.gather(slots, self.device, extra=self._priority_keys(slots, weight))
        slots = torch.randint(
            0, self._size, (batch_size,), generator=self._generator, device=self.storing_device
        )
        return self._slots.gather(slots, self.device)

    def _priority_keys(
        self, slots: torch.Tensor, weight: torch.Tensor | None
    ) -> dict[Key, torch.Tensor]:
        """``index`` (ids for :meth:`update_priorities`) and ``weight`` of a batch's rows."""
        if weight is None:  # an exhaustive epoch is not importance-sampled
            weight = torch.ones(slots.shape, dtype=torch.float32, device=slots.device)
        return {
            ("index",): ring_ids(slots, self._writes, self.buffer_size).to(self.device),
            ("weight",): weight.to(self.device),
        }

    def as_dataset(
        self,
        batch_size: int,
        *,
        n: NArg | None = None,
        seq_len: int | None = None,
        gamma: float | None = None,
        strict: bool = True,
    ) -> ReplayDataset:
        """An endless ``torch.utils.data.IterableDataset`` of ``sample_batch(batch_size)``
        batches; ``.loader()`` gives the ``DataLoader`` (see :mod:`replaybuf.buffers.dataset`).
        ``n``, ``seq_len`` and ``gamma`` are refused: a ring of transitions has no episodes."""
        batch_size = check_dataset_args(batch_size, strict)
        return transitions_dataset(self.sample_batch, batch_size, n, seq_len, gamma)

    @synchronized
    def update_priorities(self, index: Any, priority: Any) -> int:
        """Set the priorities of sampled items; returns how many were applied.

        ``index`` holds ids from a batch's ``index``. An item overwritten since it was sampled
        is skipped (never applied to its slot's new occupant). Raises ``IndexError`` for an id
        that was never written, ``ValueError`` for a negative, NaN or infinite priority or a
        length mismatch; then nothing is applied.
        """
        self._check_open()
        if self._priorities is None:
            raise ValueError("update_priorities needs a buffer made with prioritized=True")
        if self._priorities.tree.host_writes:  # CPU storage, with the compiled kernels
            applied = self._update_host(self._priorities, index, priority)
            if applied is not None:
                return applied
        ids = parse_ids(index, self.storing_device)
        values = check_priorities(priority, ids.numel(), self.storing_device)
        if ids.numel() == 0:
            return 0
        lowest, highest = torch.stack(torch.aminmax(ids)).tolist()  # one host sync
        if lowest >= self._writes - self._size and highest < self._writes:  # all live
            self._priorities.update(ids % self.buffer_size, values)
            return ids.numel()
        never = (ids < 0) | (ids >= self._writes)
        if bool(never.any()):
            raise IndexError(
                f"index must hold ids of written items (in [0, {self._writes})), "
                f"got {int(ids[never][0])}"
            )
        live = ids >= self._writes - self._size
        self._priorities.update(ids[live] % self.buffer_size, values[live])
        return int(live.sum())

    def _update_host(self, priorities: Prioritizer, index: Any, priority: Any) -> int | None:
        """:meth:`update_priorities` in numpy on CPU storage, where the inputs are well formed
        and every id is live; None otherwise (nothing written: the checked torch path runs)."""
        host = host_update_inputs(index, priority)
        if host is None:
            return None
        ids, values = host
        if ids.min() < self._writes - self._size or ids.max() >= self._writes:
            return None
        return ids.shape[0] if priorities.update_host(ids % self.buffer_size, values) else None

    @synchronized
    def set_beta(self, beta: float) -> None:
        """Change the importance-weight exponent (anneal it towards 1 during training)."""
        if self._priorities is None:
            raise ValueError("set_beta needs a buffer made with prioritized=True")
        self._priorities.beta = check_beta(beta)

    def sample_random(self, batch_size: int) -> TensorDict:
        """Alias of :meth:`sample_batch` (ObjectRL's name)."""
        return self.sample_batch(batch_size)

    @synchronized
    def sample_by_index(self, indices: Sequence[int] | range | torch.Tensor) -> TensorDict:
        """The transitions in the given storage slots (each in ``[0, size)``), on ``device``."""
        self._require()
        slots = index_tensor(indices, "indices", self._size, self.storing_device)
        return self._slots.gather(slots, self.device)

    @synchronized
    def sample_by_index_fields(
        self, indices: Sequence[int] | range | torch.Tensor, fields: Sequence[str | Key]
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Some fields of the transitions in the given slots: a tensor, or a tuple in order."""
        self._require()
        if isinstance(fields, str) or not fields:
            raise TypeError(f"fields must be a non-empty list of field names, got {fields!r}")
        keys = [self._field_key(f) for f in fields]
        slots = index_tensor(indices, "indices", self._size, self.storing_device)
        td = self._slots.gather(slots, self.device, keys=keys)
        values = tuple(td.get(k) for k in keys)
        return values[0] if len(values) == 1 else values

    def _field_key(self, field: str | Key) -> Key:
        key = (field,) if isinstance(field, str) else tuple(field)
        spec = self.spec
        if spec is not None and isinstance(field, str) and key not in spec:
            key = tuple(field.split("."))  # "next.obs", as stats() and errors name it
        if spec is None or key not in spec:
            known = [".".join(k) for k in spec] if spec is not None else []
            raise KeyError(f"unknown field {field!r}; stored fields are {known}")
        return key

    @synchronized
    def sample_all(self) -> TensorDict:
        """Every stored transition, oldest first, on ``device``."""
        self._require()
        return self._slots.gather(self._oldest_first(), self.device)

    # ----------------------------------------------------------------- epochs
    @synchronized
    def create_epoch_iterator(
        self, batch_size: int, n_epochs: int = 1, *, shuffle: bool = True, drop_last: bool = False
    ) -> Iterator[TensorDict]:
        """Batches over ``n_epochs`` epochs; each visits every stored transition exactly once.

        Each epoch is planned from the transitions stored when it starts (a fresh permutation,
        or oldest first with ``shuffle=False``); rows written meanwhile into a planned slot are
        served with their new contents. The iterator is also installed for
        :meth:`get_next_batch`. After ``reset()`` it raises ``RuntimeError`` instead of serving
        rows that are no longer stored.
        """
        self._require(batch_size)
        n_epochs = int_at_least(n_epochs, "n_epochs", 1)
        self._iterator = self._epochs(batch_size, n_epochs, shuffle, drop_last)
        return self._iterator

    def _epochs(
        self, batch_size: int, n_epochs: int, shuffle: bool, drop_last: bool
    ) -> Iterator[TensorDict]:
        resets = self._resets
        oldest = 0
        for _ in range(n_epochs):
            with self._lock:
                order, oldest = self._epoch_plan(shuffle)
            for number, slots in enumerate(epoch_batches(order, batch_size, drop_last)):
                with self._lock:  # released before the yield: the learner holds no lock
                    batch = self._epoch_batch(resets, slots, shuffle, oldest, number, batch_size)
                yield batch

    def _epoch_plan(self, shuffle: bool) -> tuple[torch.Tensor, int]:
        """One epoch's slots, and the first of them where they are oldest first."""
        self._check_open()
        if shuffle:
            # The ring fills from slot 0, so the stored slots are always 0 .. size-1 and a
            # permutation of them is randperm itself (the same draw epoch_order makes): no
            # arange, rotation or gather of a million indices per epoch.
            order = torch.randperm(
                self._size, generator=self._generator, device=self.storing_device
            )
            return order, 0
        oldest = self._pointer if self._size == self.buffer_size else 0  # order[0]
        return self._oldest_first(), oldest

    def _epoch_batch(
        self,
        resets: int,
        slots: torch.Tensor,
        shuffle: bool,
        oldest: int,
        number: int,
        batch_size: int,
    ) -> TensorDict:
        self._check_open()
        if self._resets != resets:
            raise RuntimeError(
                "epoch iterator expected the rows it planned, got a buffer reset since; "
                "create a new iterator"
            )
        if self._priorities is not None:
            extra = self._priority_keys(slots, None)
            return self._slots.gather(slots, self.device, extra=extra)
        if shuffle:
            return self._slots.gather(slots, self.device)
        # Consecutive slots unless the batch wraps: one copy per field.
        first = (oldest + number * batch_size) % self.buffer_size
        count = slots.shape[0]
        if first + count <= self.buffer_size:
            return self._slots.gather(slice(first, first + count), self.device)
        return self._slots.gather(slots, self.device)

    @synchronized
    def get_next_batch(self, batch_size: int) -> TensorDict:
        """The next batch of the installed epoch iterator, else a uniform random batch.

        When the installed iterator is exhausted it is dropped and this falls back to
        :meth:`sample_batch`, exactly as when no iterator was ever created (ObjectRL's
        ``n_epochs=0`` mode).
        """
        positive_int(batch_size, "batch_size")
        if self._iterator is not None:
            try:
                return next(self._iterator)
            except StopIteration:
                self._iterator = None
        return self.sample_batch(batch_size)

    def calculate_num_batches(self, batch_size: int, *, drop_last: bool = False) -> int:
        """Batches in one epoch over what is stored: rounded up, or down with ``drop_last``."""
        return num_batches(self._size, positive_int(batch_size, "batch_size"), drop_last)

    @synchronized
    def get_steps_and_iterator(self, n_epochs: int, max_iter: int, batch_size: int) -> int:
        """Training steps to run, installing an epoch iterator when ``n_epochs > 0``.

        ``n_epochs=0`` means random sampling for ``max_iter`` steps (no iterator).
        """
        n_epochs = int_at_least(n_epochs, "n_epochs", 0)
        positive_int(batch_size, "batch_size")
        if n_epochs == 0:
            max_iter = int_at_least(max_iter, "max_iter", 0)
            self._iterator = None
            return max_iter
        self.create_epoch_iterator(batch_size, n_epochs)
        return n_epochs * self.calculate_num_batches(batch_size)

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

    # ----------------------------------------------------------------- metadata
    @synchronized
    def save(self, path: str | os.PathLike) -> None:
        """Write the metadata (not the rows) to ``path + ".metadata"``, atomically, as JSON."""
        self._check_open()
        metadata.write_metadata(
            path,
            "ReplayBuffer",
            {
                "buffer_size": self.buffer_size,
                "data_size": self._size,
                "pointer": self._pointer,
                "storage": self.storage_kind,
                "device": str(self.device),
                "storing_device": str(self.storing_device),
                "spec": None if self.spec is None else self.spec.to_json(),
            },
        )

    @synchronized
    @NORMAL_TENSORS
    def load(self, path: str | os.PathLike) -> dict[str, Any]:
        """Read ``path + ".metadata"``, check it against this buffer, and return it.

        Metadata holds no rows, so ``data_size`` and ``pointer`` are reported, not adopted
        (adopting them would make the buffer claim rows it does not hold). An empty buffer takes
        the file's ``buffer_size`` and field spec, so the next write is checked against it.
        Raises :class:`MetadataError` for a missing, corrupt, foreign or mismatching file.
        """
        self._check_open()
        document = metadata.read_metadata(path, "ReplayBuffer")
        buffer_size = metadata.require_int(document, "buffer_size", 1)
        metadata.require_int(document, "data_size", 0, buffer_size)
        metadata.require_int(document, "pointer", 0, buffer_size - 1)
        spec = metadata.read_spec(document)
        if self._size:
            if buffer_size != self.buffer_size:
                raise MetadataError(
                    f"buffer_size: metadata has {buffer_size}, this buffer {self.buffer_size}"
                )
            if spec is not None and spec != self.spec:
                raise MetadataError(f"spec: metadata has {spec}, this buffer {self.spec}")
            return document
        if spec is not None:
            self._slots.check_space(buffer_size, spec)  # before anything changes
        if buffer_size != self.buffer_size or self.spec is not None:
            self._slots.reset(buffer_size)
        if spec is not None:
            self._slots.prepare(spec)
        return document

    # ----------------------------------------------------------------- state
    def _parts(self) -> RingParts:
        """This buffer's configuration and components, for its state and checkpoints."""
        return RingParts(
            self.buffer_size,
            self.storage_kind,
            self.device,
            self.storing_device,
            self.print_gc_warning,
            self._slots,
            self._priorities,
            self._generator,
            self._size,
            self._pointer,
            self._writes,
        )

    @synchronized
    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """The whole buffer in memory, as a checkpoint holds it (RLlib's ``get_state``).

        ``{"kind": "ReplayBuffer", "meta": {...}, "tensors": {...}}``: rows, ring state, spec,
        config, priorities and the sampler's generator state, under the names a checkpoint
        gives them. ``copy=False`` hands out the stored rows by reference (views that later
        writes change) instead of copies.
        """
        self._check_open()
        return buffer_checkpoint.compose(self._parts(), copy)

    @synchronized
    @NORMAL_TENSORS
    def load_state_dict(self, state: Any) -> None:
        """Replace this buffer's contents by ``state`` (a :meth:`state_dict`, from a buffer of
        the same ``buffer_size`` and prioritization; RLlib's ``set_state``): rows, ring state,
        priorities and sampler state, so sampling goes on where that buffer's would.

        Everything is checked first (as a checkpoint load checks it); on a bad state the
        error names the field and this buffer is left as it was.
        """
        self._check_open()
        source = source_of(state, buffer_checkpoint.KIND)
        saved = buffer_checkpoint.check(source)
        buffer_checkpoint.check_fits(saved, source, self._parts())
        if self._declared is not None and saved.spec != self._declared:
            raise MetadataError(
                f"spec: state has {saved.spec}, this buffer declared {self._declared}"
            )
        self._slots.reset()
        if self._priorities is not None:
            p = self._priorities
            self._priorities = Prioritizer(
                self.buffer_size, self.storing_device, p.alpha, p.beta, p.eps, p.backend
            )
        buffer_checkpoint.restore(self._parts(), saved, source)
        self._size, self._pointer, self._writes = saved.size, saved.pointer, saved.writes
        self._iterator = None
        self._resets += 1  # an epoch iterator planned before must not serve the new rows

    # ----------------------------------------------------------------- checkpoints
    @synchronized
    def save_checkpoint(
        self, directory: str | os.PathLike | None = None, *, durable: bool = True
    ) -> Path:
        """Save rows, ring state, spec, config and sampler RNG state; see README "Checkpoints".

        Replaces the checkpoint at ``directory`` atomically (default: the one :meth:`open` was
        given). ``durable=False`` skips fsync: safe against a killed process, not power loss.
        """
        self._check_open()
        directory = self._home if directory is None else directory
        if directory is None:
            raise ValueError(
                "save_checkpoint() needs a directory: this buffer was not made by open(directory)"
            )
        return buffer_checkpoint.save(self, directory, durable)

    @classmethod
    @NORMAL_TENSORS
    def load_checkpoint(cls, directory: str | os.PathLike, **overrides: Any) -> ReplayBuffer:
        """A new buffer holding the checkpoint at ``directory``, sampling where it left off.

        ``overrides``: ``device``, ``storing_device``, ``storage``, ``scratch_dir`` or
        ``print_gc_warning``. Checked before a buffer is made; a failed load leaves nothing.
        """
        return buffer_checkpoint.load(cls, directory, overrides)

    @classmethod
    def open(cls, directory: str | os.PathLike, **kwargs: Any) -> ReplayBuffer:
        """Load the checkpoint at ``directory``, else ``ReplayBuffer(**kwargs)``; either way a
        later ``save_checkpoint()`` writes there. Loading, ``buffer_size`` must match, ``seed``
        is unused (the saved sampler goes on) and the other ``kwargs`` are overrides."""
        buffer = buffer_checkpoint.open_or_create(cls, directory, kwargs)
        buffer._home = Path(os.path.abspath(directory))
        return buffer
