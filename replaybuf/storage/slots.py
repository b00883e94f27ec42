"""Fixed-capacity rows in TorchRL storage, addressed by slot: allocation, writes and reads.

Rows live in a ``LazyMemmapStorage`` or ``LazyTensorStorage`` behind a
``torchrl.data.TensorDictReplayBuffer`` (exposed as ``memory`` so TorchRL users keep a working
buffer). What TorchRL lacks is added around it:

* a private scratch folder on disk (:mod:`replaybuf.storage.scratch`);
* ``kind="auto"``'s choice, a space check before allocation and disk blocks reserved just
  ahead of the writes, so files grow with the data (:mod:`replaybuf.storage.planning`);
* TorchRL's INFO line on allocating kept off the console (:mod:`replaybuf.storage.quiet`);
* writes as slice or ``index_copy_`` copies into the very columns TorchRL holds, with its
  bookkeeping repeated through its own methods (:mod:`replaybuf.storage.torchrl_state`), as a
  TensorDict setitem costs far more than the copies;
* a gather of sampled rows with ``index_select`` per leaf (TorchRL's ``storage[idx]`` uses
  advanced indexing, several times slower), numpy gathers on the CPU, and pinned,
  non-blocking copies to a CUDA training device (:mod:`replaybuf.storage.delivery`).
"""

from __future__ import annotations

import contextlib
import os
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import TensorDictReplayBuffer

from replaybuf.storage.batchwrite import BatchWriter
from replaybuf.storage.delivery import Part, PinnedStager, count_rows, rows_of, to_device_async
from replaybuf.storage.devices import StorageChoice, StorageKind
from replaybuf.storage.host_gather import host_gather
from replaybuf.storage.hugepages import advise_huge_pages
from replaybuf.storage.planning import SlotPlanning
from replaybuf.storage.quiet import quiet_allocation
from replaybuf.storage.ragged import RaggedColumn, RaggedFields
from replaybuf.storage.schema import FieldSpec, Key
from replaybuf.storage.scratch import ScratchFolder, check_scratch_dir
from replaybuf.storage.staging import row_words
from replaybuf.storage.tensordicts import NEW_UNSAFE, build_tensordict, tensordict_of
from replaybuf.storage.torchrl_state import (
    allocated,
    allocated_bytes,
    new_memory,
    record_slots,
    record_write,
    release,
    restore_state,
    stored_columns,
    takes_direct_writes,
)

_CPU = torch.device("cpu")
_GATHER = "storage.host_gather"  # its entry in derived: how gather reads every field on the host
_BATCH = "storage.batch_writer"  # its entry in derived: (keys, BatchWriter or None)


class SlotStorage(SlotPlanning):
    """Fixed-capacity rows in TorchRL storage, addressed by slot, on the storing device."""

    def __init__(
        self,
        capacity: int,
        *,
        kind: StorageChoice,
        storing_device: torch.device,
        scratch_dir: str | os.PathLike | None = None,
        index_column: bool = True,
    ) -> None:
        """``kind``: ``"auto"``, ``"memmap"`` or ``"tensor"`` (auto on CUDA: tensor).
        ``index_column``: whether rows are written through TorchRL's ``extend`` (a ring),
        which stores an int64 index column beside them, rather than at slots (``write``)."""
        self.capacity = capacity
        if kind == "auto" and storing_device.type != "cpu":
            kind = "tensor"
        self.requested: StorageChoice = kind
        # The kind of the storage that exists: "auto" is decided in prepare(), once the spec
        # gives the size; until then memmap, the kind of a size not yet known.
        self.kind: StorageKind = "memmap" if kind == "auto" else kind
        self.index_column, self.storing_device = index_column, storing_device
        if kind == "auto":  # memmap may be chosen at the first write: its folder is checked now
            check_scratch_dir(scratch_dir)
        self.spec: FieldSpec | None = None
        # Each ragged field's arena and row spans (see replaybuf.storage.ragged), by key.
        self.ragged = RaggedFields()
        # The rows a full buffer holds, for the ragged arenas' size (None: every slot).
        self.rows_hint: Callable[[], int] | None = None
        self._scratch_parent = scratch_dir
        self._scratch: ScratchFolder | None = None
        self._leaves: list[tuple[Key, torch.Tensor]] = []
        self._flat_names: list[str] | None = None
        self._index_column: torch.Tensor | None = None
        # Slots [0, _index_known) of TorchRL's index column are known to hold their own slot
        # (its invariant, written on the ring's first pass); extend then skips re-writing them.
        self._index_known = 0
        self._direct = False  # set after the first write (see _after_first_write)
        self._reserved = 0  # rows whose disk blocks are reserved (see _reserve)
        self._columns: dict[Key, torch.Tensor] = {}  # the same, by key (sampling's lookups)
        # numpy views of the columns when they live on the CPU (a dtype numpy lacks: absent),
        # for the host sampling paths: a numpy call costs less than torch's index_select or
        # slicing, a batch makes a dozen such calls, and on uint8 frames np.take also copies
        # faster. Keyed by id of the column tensor (alive in _columns while the view is here).
        self._host_views: dict[int, np.ndarray] = {}
        # The compiled row scatter (accel.numba_kernels.scatter_rows) write_rows uses on CPU
        # storage, set by the episode core (rows land all over the columns); with it, each
        # column as [slots, row words] (None: a row of no bytes).
        self.row_scatter: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None
        self._row_words: dict[Key, np.ndarray | None] | None = None
        self._stager = PinnedStager()
        # What readers derive from the columns and keep between calls (views, key lists), by
        # name; emptied whenever the columns are allocated or released, so nothing derived
        # outlives them (nor keeps a closed storage's memory mapped).
        self.derived: dict[str, Any] = {}
        self.memory = self._new_memory()

    # ----------------------------------------------------------------- lifecycle
    def _new_memory(self) -> TensorDictReplayBuffer:
        """An empty TorchRL buffer (memmap: in a new scratch folder; an undecided ``auto``
        one: a placeholder, replaced once the kind is chosen, before it allocates)."""
        if not self.decided:
            self.kind = "memmap"
            return new_memory("memmap", self.capacity, self.storing_device, None)
        if self.kind == "memmap":
            self._scratch = ScratchFolder(self._scratch_parent)
        scratch = None if self._scratch is None else self._scratch.path
        return new_memory(self.kind, self.capacity, self.storing_device, scratch)

    def reset(self, capacity: int | None = None) -> None:
        """Drop every row (and the spec); optionally change the capacity."""
        self.close(wait=False)
        if capacity is not None:
            self.capacity = capacity
        self.spec = None
        self.ragged.close()
        self.memory = self._new_memory()

    def close(self, wait: bool = True) -> None:
        """Release storage and remove this storage's memmap files: before returning, or, with
        ``wait=False`` (a reset), on a background thread (see storage.scratch)."""
        self._leaves, self._columns, self._index_column = [], {}, None
        self.derived, self._host_views, self._row_words = {}, {}, None
        self._index_known, self._flat_names, self._direct, self._reserved = 0, None, False, 0
        # Its rows go now, not at the next garbage collection; memmap columns with the files.
        held = [] if self.memory is None else release(self.memory)
        self.memory = None
        self.ragged.close()
        self._stager.clear()
        if self._scratch is not None:
            self._scratch.remove(held, wait=wait)
            self._scratch = None

    @property
    def scratch_path(self) -> Path | None:
        """The memmap files' folder (None for tensor storage, or once closed)."""
        return None if self._scratch is None else self._scratch.path

    # ----------------------------------------------------------------- writes
    def prepare(self, spec: FieldSpec) -> None:
        """Fix the spec (and an ``auto`` storage's kind) and check the space before the first
        write allocates anything; each ragged field gets its arena (allocated at its first
        values)."""
        self.check_space(self.capacity, spec)
        if not self.decided:  # the placeholder holds nothing: replaced by the chosen storage
            self.kind = self.kind_for(self.capacity, spec)
            self.spec = spec
            self.memory = self._new_memory()
        self.spec = spec
        fields = {
            key: RaggedColumn(
                self.capacity,
                spec[key].shape,
                spec[key].dtype,
                self.kind,
                self.storing_device,
                self.scratch_path,
                str(i),
                spec[key].reserve,
            )
            for i, key in enumerate(spec.ragged_keys)
        }
        self.ragged = RaggedFields(fields)
        for column in self.ragged.values():
            column.rows_hint = self.rows_hint

    def extend(self, data: TensorDictBase | dict[Key, torch.Tensor]) -> None:
        """Append rows round-robin at TorchRL's writer cursor (ring semantics); at most
        ``capacity`` rows. ``data``: a TensorDict or ``[rows, ...]`` leaves by flat key."""
        if isinstance(data, TensorDictBase):
            data = {key: data.get(key) for key, _ in self._leaves} if self._direct else data
        if not self._direct:
            first = not self._leaves
            td = data if isinstance(data, TensorDictBase) else tensordict_of(data)
            cursor = self.memory.writer.state_dict().get("_cursor")  # other writers: None
            rows = td.shape[0]
            if not first:  # other writers: no cursor known, so every row
                self._reserve(self.capacity if cursor is None else cursor + rows)
            # A first write allocates (NORMAL_TENSORS), and TorchRL logs that it did.
            with torch.inference_mode(False), quiet_allocation():
                self.memory.extend(td.to(self.storing_device))
            if first:
                self._after_first_write(self.capacity if cursor is None else cursor + rows)
            self._index_written(cursor, td.shape[0])  # TorchRL's extend wrote the index
            return
        # TorchRL's TensorDictRoundRobinWriter.extend is: slots from its cursor, cursor and
        # write count advanced, an "index" column holding each row's slot, then storage.set
        # (a TensorDict setitem, costly per call). The same state through its public
        # state_dict / load_state_dict; the rows as slice copies (one run, or two where the
        # ring wraps) into the very tensors TorchRL holds. The index column holds the same
        # values on every pass, so it is written only where it may not yet (_index_known).
        writer = self.memory.writer
        state = writer.state_dict()
        cursor = state["_cursor"]
        values = [data[key] for key, _ in self._leaves]
        rows = values[0].shape[0]
        end = cursor + rows
        if end > self._reserved:  # files grow ahead of the rows (a no-op once all reserved)
            self._reserve(end)
        if end <= self.capacity:  # one run of slots: copy whole values, no slicing of them
            for (_, column), value in zip(self._leaves, values, strict=True):
                # Slice assignment is torch's slice + copy_ in one call (copy_ also moves
                # values to the storing device): unlike column[cursor:end].copy_(value), it
                # builds no Python view.
                column[cursor:end] = value
            if end > self._index_known and self._index_column is not None:
                slots = torch.arange(cursor, end, device=self.storing_device)
                self._index_column[cursor:end].copy_(slots)
                self._index_written(cursor, rows)
            # TorchRL's storage takes a range as the cursor (as a tensor of slots, the same
            # last slot); no tensor to build, nor a device sync to read its last element.
            written: range | int = range(cursor, end)
        else:
            head = self.capacity - cursor
            slots = torch.arange(cursor, end, device=self.storing_device) % self.capacity
            columns = [(c, v) for (_, c), v in zip(self._leaves, values, strict=True)]
            if self._index_column is not None:
                columns.append((self._index_column, slots))
            for column, value in columns:
                column[cursor:].copy_(value[:head])
                column[: rows - head].copy_(value[head:])
            self._index_written(cursor, rows)
            written = (end - 1) % self.capacity  # the last slot, which TorchRL's readers take
        record_write(self.memory.storage, written, values[0])
        writer.load_state_dict(
            {"_cursor": end % self.capacity, "_write_count": state["_write_count"] + rows}
        )

    def _index_written(self, cursor: int | None, rows: int) -> None:
        """Note that TorchRL's index column now holds the slots of ``rows`` rows written from
        ``cursor`` (wrapping), so that later passes of the ring need not write it again
        (``cursor`` None: a writer without one, whose writes never take the direct path)."""
        if cursor is None:
            return
        if self._index_column is not None and cursor <= self._index_known:
            self._index_known = max(self._index_known, min(cursor + rows, self.capacity))

    def write(self, slots: torch.Tensor, td: TensorDictBase) -> None:
        """Write rows at explicit slots, leaving TorchRL's ring cursor alone."""
        if not self._direct:
            self._write_through_torchrl(slots, td)
            return
        keys = [k for k, _ in self._leaves]
        self.write_rows(slots, keys, [td.get(k) for k in keys])

    def write_rows(
        self,
        slots: torch.Tensor,
        keys: list[Key],
        values: list[torch.Tensor],
        last: int | None = None,
        staged: list[np.ndarray | None] | None = None,
    ) -> None:
        """:meth:`write` from flat keys and ``[rows, ...]`` values (every stored key); ``last``:
        the last slot, when the caller knows it on the host; ``staged``: the values' host
        buffers as :func:`row_words` views (``[slots.shape[0]`` or more rows, row words]), for
        the compiled scatter (:attr:`row_scatter`)."""
        if not self._direct:
            count = slots.shape[0]
            self._write_through_torchrl(slots, build_tensordict(keys, values, count, _CPU))
            return
        self._reserve_slots(slots)
        if staged is not None and self._row_words is not None and self.row_scatter is not None:
            at = slots.numpy()
            staged_by_key = dict(zip(keys, staged, strict=True))
            for key, words in self._row_words.items():
                if words is not None:  # a field of no bytes has nothing to write
                    rows = staged_by_key[key]
                    assert rows is not None  # staged as a view whenever the column has one
                    if rows.dtype != words.dtype:  # words of another width (an address)
                        words, rows = words.view(np.uint8), rows.view(np.uint8)
                    self.row_scatter(words, rows, at)
            record_slots(self.derived, self.memory, slots, last)
            return
        # TorchRL's TensorStorage.set is its bookkeeping plus ``self._storage[cursor] = data``,
        # a TensorDict advanced-index assignment that is costly even for one row, paid by
        # every read that follows an append: one index_copy_ per column instead.
        device = self.storing_device
        slots = to_device_async(slots, device)
        by_key = dict(zip(keys, values, strict=True))
        for key, column in self._leaves:
            column.index_copy_(0, slots, to_device_async(by_key[key], device))
        # Every TorchRL reader of the last cursor takes its last element: as an int it costs
        # TorchRL no tensor indexing and no .item() (a device sync on CUDA).
        record_write(self.memory.storage, slots if last is None else last, slots)

    def write_batch(self, rows: array, keys: list[Key], values: list[Any]) -> bool:
        """:meth:`write_rows` of ``[len(rows), ...]`` values straight from the caller's memory
        (:mod:`replaybuf.storage.batchwrite`); False, nothing written, where it does not run."""
        # Not before the memmap files are reserved whole (write_rows reserves first).
        if not self._direct or self.row_scatter is None or self._reserved < self.capacity:
            return False
        made = self.derived.get(_BATCH)
        if made is None or made[0] is not keys:
            views = [self._host_views.get(id(self._columns.get(k))) for k in keys]
            whole = len(keys) == len(self._leaves)  # every stored key
            made = self.derived[_BATCH] = (keys, BatchWriter.of(views) if whole else None)
        if made[1] is None or not made[1].write(rows, values):
            return False
        record_slots(self.derived, self.memory, torch.frombuffer(rows, dtype=torch.long), rows[-1])
        return True

    def _write_through_torchrl(self, slots: torch.Tensor, td: TensorDictBase) -> None:
        """Write rows at ``slots`` through TorchRL's own ``set`` (a first write allocates)."""
        first = not self._leaves
        if not first:
            self._reserve_slots(slots)
        # TorchRL allocates at the first write (NORMAL_TENSORS), and logs that it did.
        with torch.inference_mode(False), quiet_allocation():
            self.memory.storage.set(slots.to(self.storing_device), td.to(self.storing_device))
        if first:
            self._after_first_write(int(slots.max()) + 1 if slots.numel() else 0)

    def _after_first_write(self, written: int = 1) -> None:
        """Take hold of the columns TorchRL allocated (the first ``written`` slots written):
        views, row words, write paths and the disk blocks ahead."""
        stored = allocated(self.memory)
        leaves, self._index_column = stored_columns(stored)
        self._leaves = leaves
        self._columns = dict(leaves)
        self.derived = {}
        self._host_views = {}
        self._row_words = None
        if self.storing_device.type == "cpu":
            for _, value in leaves:
                if self.kind == "tensor":
                    advise_huge_pages(value)
                with contextlib.suppress(TypeError):  # bfloat16 and others numpy lacks
                    self._host_views[id(value)] = value.numpy()
            if self.row_scatter is not None and all(v.is_contiguous() for _, v in leaves):
                self._row_words = {key: row_words(value) for key, value in leaves}
        self._direct = takes_direct_writes(self.memory)
        # Names of a spec without nested fields: batches then skip nest() and the recursion.
        self._flat_names = (
            [k[0] for k, _ in leaves] if all(len(k) == 1 for k, _ in leaves) else None
        )
        self._reserve(max(written, 1))

    # ----------------------------------------------------------------- reads
    def gather(
        self,
        slots: torch.Tensor | slice,
        device: torch.device,
        keys: Sequence[Key] | None = None,
        extra: dict[Key, torch.Tensor] | None = None,
    ) -> TensorDict:
        """Rows at ``slots`` (a long tensor on the storing device, or a ``slice`` of
        consecutive slots: one copy per field instead of a gather) as a TensorDict on ``device``.

        ``extra`` maps further keys to ``[rows, ...]`` tensors already on ``device``; they join
        the same TensorDict construction (cheaper than setting them afterwards).
        """
        leaves = self._leaves if keys is None else [(k, t) for k, t in self._leaves if k in keys]
        rows = count_rows(slots)
        if device == self.storing_device and isinstance(slots, torch.Tensor):
            # Nothing to transfer: without building deliver's parts (paid by every batch of an
            # epoch), on the host where every field has a numpy view (see _host_views): a numpy
            # take each (see host_gather); for every field, as a batch reads, chosen once per
            # allocation.
            if keys is None:
                take = self.derived.get(_GATHER, False)
                if take is False:
                    take = self.derived[_GATHER] = host_gather(self.columns(), self._host_views)
            else:
                take = host_gather([t for _, t in leaves], self._host_views)
            if take is not None:
                values = take(slots)
            else:
                values = [torch.index_select(t, 0, slots) for _, t in leaves]
        else:
            values = self.deliver([(t, slots) for _, t in leaves], device)
        if keys is None and self._flat_names is not None and NEW_UNSAFE:
            source = dict(zip(self._flat_names, values, strict=True))
            if extra:
                if any(len(k) != 1 for k in extra):
                    return build_tensordict(
                        [*(k for k, _ in leaves), *extra], [*values, *extra.values()], rows, device
                    )
                source.update((k[0], v) for k, v in extra.items())
            return NEW_UNSAFE(source, batch_size=torch.Size([rows]), device=device)
        names = [k for k, _ in leaves]
        if extra:
            names = names + list(extra)
            values = [*values, *extra.values()]
        return build_tensordict(names, values, rows, device)

    def deliver(self, parts: list[Part], device: torch.device) -> list[torch.Tensor]:
        """Each part's rows (``(tensor, rows)``; ``rows`` None: the whole tensor, computed on
        the storing device) as a tensor on ``device``. From CPU storage to CUDA every part goes
        through one pinned buffer and one non-blocking copy."""
        if self.storing_device.type == "cpu" and device.type == "cuda":
            return self._stager.deliver(parts, device)
        if device == self.storing_device and self._host_views:
            return [self._host_rows_of(t, rows) for t, rows in parts]
        values = [rows_of(t, rows) for t, rows in parts]
        if device != self.storing_device:
            # Non-blocking only towards CUDA: a non-blocking copy to the CPU returns before
            # the data has arrived, and nothing here would wait for it.
            values = [v.to(device, non_blocking=device.type == "cuda") for v in values]
        return values

    def _host_rows_of(
        self, column: torch.Tensor, rows: torch.Tensor | slice | None
    ) -> torch.Tensor:
        """:func:`rows_of`, in numpy for a stored column with a numpy view (``_host_views``)."""
        view = self._host_views.get(id(column))
        if view is None or not isinstance(rows, torch.Tensor):
            return rows_of(column, rows)
        return torch.from_numpy(view.take(rows.numpy(), axis=0))

    def take(self, slots: torch.Tensor, keys: Sequence[Key]) -> list[torch.Tensor]:
        """The rows at ``slots`` of each field in ``keys``, on the storing device, in order."""
        return [self._host_rows_of(self._columns[key], slots) for key in keys]

    def column(self, key: Key) -> torch.Tensor:
        """The whole stored column of one field (a view; the caller must not write into it)."""
        return self._columns[key]

    def columns(self) -> list[torch.Tensor]:
        """Every stored field's column (what a captured graph reads; see replaybuf.accel.graphs)."""
        return [column for _, column in self._leaves]

    def host_view(self, key: Key) -> np.ndarray | None:
        """``key``'s column as a numpy view (not to be written), or None (not CPU, no dtype)."""
        column = self._columns.get(key)
        return None if column is None else self._host_views.get(id(column))

    def stored_bytes(self) -> int:
        """Bytes the allocated rows take (fields, TorchRL's index column, ragged arenas)."""
        ragged = sum(column.nbytes for column in self.ragged.values())
        if self.memory is None or not self._leaves:
            return ragged
        return allocated_bytes(self.memory) + ragged

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self, rows: int) -> dict[str, Any]:
        """The spec, TorchRL's write count and slots ``[0, rows)`` of each field: views of
        the stored columns (empty tensors of the field's shape when ``rows`` is 0)."""
        spec = self.spec
        columns: dict[Key, torch.Tensor] = {}
        for key, field in (spec.fixed if spec is not None else {}).items():
            if rows:
                columns[key] = self.column(key)[:rows]  # a view: streamed, never copied whole
            else:
                columns[key] = torch.empty((0, *field.shape), dtype=field.dtype)
        write_count = 0 if self.memory is None else self.memory.writer.state_dict()["_write_count"]
        ragged = {key: column.state_rows(rows) for key, column in self.ragged.items()}
        return {"spec": spec, "write_count": int(write_count), "columns": columns, "ragged": ragged}

    def restore(
        self,
        rows: int,
        cursor: int,
        writes: int,
        fill: Callable[[Key, torch.Tensor], None],
        *,
        ring: bool = True,
    ) -> None:
        """Allocate, let ``fill(key, out)`` write slots ``[0, rows)`` of each field, then make
        TorchRL's writer and storage agree with them (loading a checkpoint; spec prepared).

        Allocation takes the path of the buffer's own first write (one zero row through
        ``extend`` for a ring, ``set`` otherwise), so the files, the space reservation and
        TorchRL's own columns are exactly as usual.
        """
        if rows == 0:
            return  # nothing stored: the storage stays lazy, as in a buffer never written to
        assert self.spec is not None  # prepared by the caller
        first = self.spec.fixed.zeros(1)
        if ring:  # allocate as the buffer's own first write does (ring: extend; else set)
            self.extend(first)
        else:
            self.write(torch.zeros(1, dtype=torch.long), first)
        self._reserve(rows)
        for key, column in self._leaves:
            fill(key, column[:rows])  # a view: memmap rows are filled in place, never copied
        if restore_state(self.memory, rows, cursor, writes):  # TorchRL's index column too
            self._index_known = max(self._index_known, rows)
