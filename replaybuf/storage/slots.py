"""The one module that knows TorchRL storages, devices, scratch folders and pinned staging.

Rows live in a ``LazyMemmapStorage`` or ``LazyTensorStorage`` behind a
``torchrl.data.TensorDictReplayBuffer`` (exposed as ``memory`` so TorchRL users keep a working
buffer). What TorchRL lacks is added here, by hand:

* a private scratch folder on disk (TorchRL's default is anonymous files in ``/dev/shm``, i.e.
  RAM) that ``close()``, garbage collection and interpreter exit remove, without TorchRL's
  process-wide SIGINT/SIGTERM handlers (we pass ``auto_cleanup=False``);
* a space check before allocation and ``posix_fallocate`` after it, so a full disk raises
  :class:`InsufficientSpaceError` instead of killing the process with SIGBUS later;
* a gather of sampled rows with ``index_select`` per leaf (TorchRL's ``storage[idx]`` uses
  advanced indexing, 2-15x slower) and pinned, non-blocking copies to a CUDA training device.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer

from replaybuf.errors import InsufficientSpaceError
from replaybuf.storage.hugepages import advise_huge_pages
from replaybuf.storage.schema import FieldSpec, Key
from replaybuf.storage.staging import row_words

StorageKind = Literal["memmap", "tensor"]
STORAGE_CHOICES = ("auto", "memmap", "tensor")
# TensorDictReplayBuffer writes its own "index" leaf into every stored row; we never return it.
_TORCHRL_INDEX_KEY = ("index",)


def resolve_device(value: torch.device | str, name: str) -> torch.device:
    """Parse a device argument, failing clearly for unknown devices and absent CUDA."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"{name} must be a torch.device or a device string, got {value!r}"
        ) from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={value!r} asks for CUDA, but no CUDA device is available")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"{name}={value!r}: CUDA device {index} does not exist "
                f"({torch.cuda.device_count()} available)"
            )
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"{name} must be 'cpu' or a CUDA device, got {value!r}")
    return device


def resolve_kind(storage: str, storing_device: torch.device) -> StorageKind:
    """``auto`` means memmap on CPU and tensor storage on CUDA."""
    if storage not in STORAGE_CHOICES:
        raise ValueError(f"storage must be one of {STORAGE_CHOICES}, got {storage!r}")
    if storage == "auto":
        return "memmap" if storing_device.type == "cpu" else "tensor"
    if storage == "memmap" and storing_device.type != "cpu":
        raise ValueError(
            f"storage='memmap' keeps rows in files on the CPU; got storing_device={storing_device}"
        )
    return storage  # type: ignore[return-value]


def free_bytes(kind: StorageKind, device: torch.device, folder: Path) -> int:
    """Bytes free where a storage of ``kind`` would allocate (disk, host RAM or GPU memory)."""
    if kind == "memmap":
        return shutil.disk_usage(folder).free
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _where(kind: StorageKind, device: torch.device, folder: Path) -> str:
    if kind == "memmap":
        return f"disk at {folder}"
    return f"{device} memory" if device.type == "cuda" else "host memory (RAM)"


def _remove_if_owner(path: Path, owner: int) -> None:
    """Remove ``path`` only in the process that created it: a forked child (a DataLoader
    worker, multiprocessing) that drops its copy of a buffer must not delete the parent's."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


# For constructors and loads, which allocate every tensor a buffer keeps: normal tensors even
# when called in inference mode (an RL collector), as later writes outside it are in place,
# which inference tensors refuse. A decorator (a fresh context per call).
NORMAL_TENSORS = torch.inference_mode(False)


class _ScratchFolder:
    """A private folder for memmap files, removed on close, garbage collection or exit."""

    def __init__(self, parent: str | os.PathLike | None) -> None:
        if parent is not None and not Path(parent).is_dir():
            raise ValueError(f"scratch_dir must be an existing directory, got {str(parent)!r}")
        # Absolute, so cleanup still finds it after the process changes directory.
        self.path = Path(tempfile.mkdtemp(prefix="replaybuf-", dir=parent)).absolute()
        # weakref.finalize also runs at interpreter exit, and never touches signal handlers.
        self._finalizer = weakref.finalize(self, _remove_if_owner, self.path, os.getpid())

    def remove(self) -> None:
        self._finalizer()


class SlotStorage:
    """Fixed-capacity rows in TorchRL storage, addressed by slot, on the storing device."""

    def __init__(
        self,
        capacity: int,
        *,
        kind: StorageKind,
        storing_device: torch.device,
        scratch_dir: str | os.PathLike | None = None,
    ) -> None:
        self.capacity = capacity
        self.kind: StorageKind = kind
        self.storing_device = storing_device
        self.spec: FieldSpec | None = None
        self._scratch_parent = scratch_dir
        self._scratch: _ScratchFolder | None = None
        self._leaves: list[tuple[Key, torch.Tensor]] = []
        self._flat_names: list[str] | None = None
        self._index_column: torch.Tensor | None = None
        # Slots [0, _index_known) of TorchRL's index column are known to hold their own slot
        # (its invariant, written on the ring's first pass); extend then skips re-writing them.
        self._index_known = 0
        self._direct = False  # set after the first write (see _after_first_write)
        self._columns: dict[Key, torch.Tensor] = {}  # the same, by key (sampling's lookups)
        # numpy views of the columns when they live on the CPU (a dtype numpy lacks: absent),
        # for the host sampling paths: np.take and numpy slices cost ~1 µs less a call each
        # than torch's index_select and slicing, and a batch makes a dozen such calls; on
        # uint8 frames np.take also copies faster (frame-stacked batches: 11-17% less time).
        # Keyed by id of the column tensor (alive in _columns while the view is here).
        self._host_views: dict[int, np.ndarray] = {}
        # A compiled row scatter (replaybuf.accel.numba_kernels.scatter_rows) that write_rows uses
        # on CPU
        # storage instead of index_copy_, set by the episode core (whose rows land all over the
        # columns); with it, each column as [slots, row words] (None: a row of no bytes).
        self.row_scatter: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None
        self._row_words: dict[Key, np.ndarray | None] | None = None
        self._stager = _PinnedStager()
        # What readers derive from the columns and keep between calls (views, key lists), by
        # name; emptied whenever the columns are allocated or released, so nothing derived
        # outlives them (nor keeps a closed storage's memory mapped).
        self.derived: dict[str, Any] = {}
        self.memory = self._new_memory()

    # ----------------------------------------------------------------- lifecycle
    def _new_memory(self) -> TensorDictReplayBuffer:
        if self.kind == "memmap":
            self._scratch = _ScratchFolder(self._scratch_parent)
            storage = LazyMemmapStorage(
                self.capacity, scratch_dir=self._scratch.path, auto_cleanup=False
            )
        else:
            storage = LazyTensorStorage(self.capacity, device=self.storing_device)
        return TensorDictReplayBuffer(storage=storage, batch_size=None)

    def reset(self, capacity: int | None = None) -> None:
        """Drop every row (and the spec); optionally change the capacity."""
        self.close()
        if capacity is not None:
            self.capacity = capacity
        self.spec = None
        self.memory = self._new_memory()

    def close(self) -> None:
        """Release storage and remove this storage's memmap files."""
        self._leaves, self._columns, self._index_column = [], {}, None
        self.derived = {}
        self._host_views = {}
        self._row_words = None
        self._index_known = 0
        self._flat_names = None
        self._direct = False
        self.memory = None  # type: ignore[assignment]
        self._stager.clear()
        if self._scratch is not None:
            self._scratch.remove()
            self._scratch = None

    @property
    def planned_bytes(self) -> int:
        """What the rows occupy once allocated (0 before the first write fixes the spec)."""
        return 0 if self.spec is None else self.capacity * self.spec.row_bytes

    @property
    def scratch_path(self) -> Path | None:
        return None if self._scratch is None else self._scratch.path

    # ----------------------------------------------------------------- writes
    def prepare(self, spec: FieldSpec) -> None:
        """Fix the spec and check the space before the first write allocates anything."""
        self.check_space(self.capacity, spec)
        self.spec = spec

    def check_space(self, capacity: int, spec: FieldSpec) -> None:
        """Raise :class:`InsufficientSpaceError` unless ``capacity`` rows of ``spec`` fit."""
        folder = self.scratch_path or Path(tempfile.gettempdir())
        needed = capacity * spec.row_bytes
        free = free_bytes(self.kind, self.storing_device, folder)
        if needed > free:
            raise InsufficientSpaceError(
                _where(self.kind, self.storing_device, folder), needed, free
            )

    def extend(self, data: TensorDictBase | dict[Key, torch.Tensor]) -> None:
        """Append rows round-robin at TorchRL's writer cursor (ring semantics); at most
        ``capacity`` rows. ``data``: a TensorDict or ``[rows, ...]`` leaves by flat key."""
        if isinstance(data, TensorDictBase):
            data = {key: data.get(key) for key, _ in self._leaves} if self._direct else data
        if not self._direct:
            first = not self._leaves
            td = data if isinstance(data, TensorDictBase) else _tensordict(data)
            cursor = self.memory.writer.state_dict().get("_cursor")  # other writers: None
            with torch.inference_mode(False):  # a first write allocates (NORMAL_TENSORS)
                self.memory.extend(td.to(self.storing_device))
            if first:
                self._after_first_write()
            self._index_written(cursor, td.shape[0])  # TorchRL's extend wrote the index
            return
        # TorchRL's TensorDictRoundRobinWriter.extend is: slots from its cursor, cursor and
        # write count advanced, an "index" column holding each row's slot, then storage.set
        # (~200 µs of TensorDict setitem per call). The same state through its public
        # state_dict / load_state_dict; the rows as slice copies (one run, or two where the
        # ring wraps) into the very tensors TorchRL holds. The index column holds the same
        # values on every pass, so it is written only where it may not yet (_index_known).
        writer = self.memory.writer
        state = writer.state_dict()
        cursor = state["_cursor"]
        values = [data[key] for key, _ in self._leaves]
        rows = values[0].shape[0]
        end = cursor + rows
        if end <= self.capacity:  # one run of slots: copy whole values, no slicing of them
            for (_, column), value in zip(self._leaves, values, strict=True):
                # Slice assignment is torch's slice + copy_ in one call (copy_ also moves
                # values to the storing device): it builds no Python view, ~0.4 µs less per
                # field than column[cursor:end].copy_(value) (~1.9 µs of a 4-field add_batch).
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
        self._record_write(written, values[0])
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
            rows = slots.shape[0]
            self._write_through_torchrl(slots, build_tensordict(keys, values, rows, _CPU))
            return
        if staged is not None and self._row_words is not None and self.row_scatter is not None:
            at = slots.numpy()
            by_key = dict(zip(keys, staged, strict=True))
            for key, column in self._row_words.items():
                if column is not None:  # a field of no bytes has nothing to write
                    rows = by_key[key]
                    if rows.dtype != column.dtype:  # words of another width (an address)
                        column, rows = column.view(np.uint8), rows.view(np.uint8)
                    self.row_scatter(column, rows, at)
            self._record_write(slots if last is None else last, slots)
            return
        # TorchRL's TensorStorage.set is its bookkeeping plus ``self._storage[cursor] = data``,
        # a TensorDict advanced-index assignment that costs ~200 µs even for one row, paid by
        # every read that follows an append: one index_copy_ per column instead.
        device = self.storing_device
        slots = to_device_async(slots, device)
        by_key = dict(zip(keys, values, strict=True))
        for key, column in self._leaves:
            column.index_copy_(0, slots, to_device_async(by_key[key], device))
        # Every TorchRL reader of the last cursor takes its last element: as an int it costs
        # TorchRL no tensor indexing and no .item() (a device sync on CUDA), ~10 µs a write.
        self._record_write(slots if last is None else last, slots)

    def _record_write(self, cursor: torch.Tensor | range | int, per_row: torch.Tensor) -> None:
        """What TorchRL's TensorStorage.set records besides the copy, through its own methods:
        the last cursor (``cursor``: the slots written, a tensor or a range, or the last of
        them), the length, and the revision that invalidates samplers' caches. ``per_row``: a
        tensor with one entry per written row along its first dimension (the slots, or a
        field's values)."""
        storage = self.memory.storage
        storage._set_last_cursor(cursor)
        # _get_new_len sets the length to min(length + rows, max_size), a no-op once the
        # storage is full (a ring's usual state): len() costs ~0.5 µs, the call ~2.5 µs.
        if len(storage) < storage.max_size:
            # It counts per_row's rows; of its cursor it only asks whether it is one int (one
            # row without a leading dimension), which per_row, a tensor, is not.
            storage._get_new_len(per_row, per_row)
        storage._bump_mutation_revision()

    def _write_through_torchrl(self, slots: torch.Tensor, td: TensorDictBase) -> None:
        first = not self._leaves
        with torch.inference_mode(False):  # TorchRL allocates at the first write (NORMAL_TENSORS)
            self.memory.storage.set(slots.to(self.storing_device), td.to(self.storing_device))
        if first:
            self._after_first_write()

    def _after_first_write(self) -> None:
        # TorchRL keeps the allocated TensorDict in a private attribute; we read it once here.
        stored: TensorDictBase = self.memory.storage._storage
        leaves = []
        for key, value in stored.items(include_nested=True, leaves_only=True):
            key = (key,) if isinstance(key, str) else tuple(key)
            if key != _TORCHRL_INDEX_KEY:
                leaves.append((key, value.as_subclass(torch.Tensor)))
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
        index = stored.get(_TORCHRL_INDEX_KEY[0], None)  # TorchRL's own column of row slots
        self._index_column = None if index is None else index.as_subclass(torch.Tensor)
        # Direct writes repeat TorchRL's bookkeeping through its own methods: only where this
        # TorchRL has them and its writer keeps no more state than a cursor and a count.
        self._direct = all(
            hasattr(self.memory.storage, name) for name in _SET_BOOKKEEPING
        ) and self.memory.writer.state_dict().keys() == {"_cursor", "_write_count"}
        # Names of a spec without nested fields: batches then skip nest() and the recursion.
        self._flat_names = (
            [k[0] for k, _ in leaves] if all(len(k) == 1 for k, _ in leaves) else None
        )
        if self.kind == "memmap":
            self._reserve_files(stored)

    def _reserve_files(self, stored: TensorDictBase) -> None:
        """Reserve disk blocks for every memmap file, so a full disk fails now, not as SIGBUS."""
        for _, value in stored.items(include_nested=True, leaves_only=True):
            filename = getattr(value, "filename", None)
            if not filename or value.numel() == 0:  # TorchRL writes no file for no bytes
                continue
            size = os.path.getsize(filename)
            fd = os.open(filename, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    folder = self.scratch_path or Path(filename).parent
                    free = shutil.disk_usage(folder).free
                    needed = self.planned_bytes
                    self.reset()  # back to empty and usable, as before this first write
                    raise InsufficientSpaceError(f"disk at {folder}", needed, free) from exc
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
            finally:
                os.close(fd)

    # ----------------------------------------------------------------- reads
    def gather(
        self,
        slots: torch.Tensor,
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
        rows = _count(slots)
        if device == self.storing_device and isinstance(slots, torch.Tensor):
            # Nothing to transfer: one gather per field, without deliver's parts (~3 µs of a
            # 40 µs W1 batch, and of every batch of an epoch); in numpy where every field has
            # a numpy view (see _host_views), with one numpy() of the slots for all fields
            # (_host_rows_of would make one per field).
            views = [self._host_views.get(id(t)) for _, t in leaves]
            if all(view is not None for view in views):
                at = slots.numpy()
                values = [torch.from_numpy(view.take(at, axis=0)) for view in views]
            else:
                values = [torch.index_select(t, 0, slots) for _, t in leaves]
        else:
            values = self.deliver([(t, slots) for _, t in leaves], device)
        if keys is None and self._flat_names is not None and _NEW_UNSAFE:
            source = dict(zip(self._flat_names, values, strict=True))
            if extra:
                if any(len(k) != 1 for k in extra):
                    return build_tensordict(
                        [*(k for k, _ in leaves), *extra], [*values, *extra.values()], rows, device
                    )
                source.update((k[0], v) for k, v in extra.items())
            return _NEW_UNSAFE(source, batch_size=torch.Size([rows]), device=device)
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
        values = [_rows_of(t, rows) for t, rows in parts]
        if device != self.storing_device:
            # Non-blocking only towards CUDA: a non-blocking copy to the CPU returns before
            # the data has arrived, and nothing here would wait for it.
            values = [v.to(device, non_blocking=device.type == "cuda") for v in values]
        return values

    def _host_rows_of(
        self, column: torch.Tensor, rows: torch.Tensor | slice | None
    ) -> torch.Tensor:
        """:func:`_rows_of`, gathered in numpy when ``column`` is a stored column with a numpy
        view (see ``_host_views``)."""
        view = self._host_views.get(id(column))
        if view is None or not isinstance(rows, torch.Tensor):
            return _rows_of(column, rows)
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
        """The column of ``key`` as a numpy view (the caller must not write into it), or None
        where the storage is not on the CPU or numpy lacks the dtype."""
        column = self._columns.get(key)
        return None if column is None else self._host_views.get(id(column))

    def stored_bytes(self) -> int:
        """Bytes the allocated rows occupy (user fields and TorchRL's own index column)."""
        if self.memory is None or not self._leaves:
            return 0
        stored: TensorDictBase = self.memory.storage._storage
        return sum(
            v.numel() * v.element_size()
            for v in stored.values(include_nested=True, leaves_only=True)
        )

    # ----------------------------------------------------------------- checkpoints
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
        if ring:  # allocate as the buffer's own first write does (ring: extend; else set)
            self.extend(self.spec.zeros(1))
        else:
            self.write(torch.zeros(1, dtype=torch.long), self.spec.zeros(1))
        for key, column in self._leaves:
            fill(key, column[:rows])  # a view: memmap rows are filled in place, never copied
        self.memory.writer.load_state_dict({"_cursor": cursor, "_write_count": writes})
        # TorchRL has no public setter for how many rows a storage holds: `_len` is the private
        # attribute its TensorStorage reads for len(), fullness and sampling bounds.
        self.memory.storage._len = rows
        # TorchRL's private allocated TensorDict (as in _after_first_write): its index column
        # holds each row's own slot, as TensorDictReplayBuffer.extend writes it.
        stored: TensorDictBase = self.memory.storage._storage
        if _TORCHRL_INDEX_KEY[0] in stored.keys():  # noqa: SIM118 (a TensorDict refuses `in`)
            index = stored.get(_TORCHRL_INDEX_KEY[0])
            index[:rows] = torch.arange(rows, dtype=index.dtype, device=index.device)
            self._index_known = max(self._index_known, rows)


def to_device_async(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` on ``device``. Host values bound for CUDA go through pinned memory without
    blocking: a copy from pageable memory waits for all the GPU's queued work first. PyTorch's
    pinned allocator keeps the block until the copy has run, and ``value`` may be reused at
    once (``pin_memory`` copied it)."""
    if device.type != "cuda" or value.device.type != "cpu":
        return value.to(device)
    return value.pin_memory().to(device, non_blocking=True)


def _tensordict(leaves: dict[Key, torch.Tensor]) -> TensorDict:
    """Flat ``[rows, ...]`` leaves as a (nested) TensorDict of batch size ``[rows]``."""
    rows = next(iter(leaves.values())).shape[0]
    return build_tensordict(list(leaves), list(leaves.values()), rows, None)


def build_tensordict(
    keys: Sequence[Key],
    values: list[torch.Tensor],
    rows: int | tuple[int, ...],
    device: torch.device | None,
) -> TensorDict:
    """A (nested) TensorDict from flat keys and ``[rows, ...]`` values on ``device`` (None:
    wherever each value lives); ``rows`` a tuple gives a batch of several dims."""
    size = torch.Size([rows] if isinstance(rows, int) else rows)
    names = _flat_names(tuple(keys))
    if _NEW_UNSAFE is not None and names is not None:  # no nesting to build
        return _NEW_UNSAFE(dict(zip(names, values, strict=True)), batch_size=size, device=device)
    return _assemble(nest(dict(zip(keys, values, strict=True))), size, device)


@functools.lru_cache(maxsize=256)
def _flat_names(keys: tuple[Key, ...]) -> tuple[str, ...] | None:
    """The keys' names when none is nested, else None; cached, as a sampler builds the same
    keys for every batch (~2 µs a batch)."""
    return tuple(key[0] for key in keys) if all(len(key) == 1 for key in keys) else None


def nest(leaves: Mapping[Key, Any]) -> dict:
    """Flat keys to a nested dict, as TensorDict's constructor takes them."""
    nested: dict = {}
    for key, value in leaves.items():
        node = nested
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return nested


def _assemble(tree: dict, batch_size: torch.Size, device: torch.device | None) -> TensorDict:
    # The public constructor re-validates every leaf (~9 µs for 4 keys); our shapes and devices
    # are known to be right, so the unchecked constructor (~2 µs) is used where tensordict has it.
    source = {
        name: _assemble(value, batch_size, device) if isinstance(value, dict) else value
        for name, value in tree.items()
    }
    if _NEW_UNSAFE is not None:
        return _NEW_UNSAFE(source, batch_size=batch_size, device=device)
    return TensorDict(source, batch_size=batch_size, device=device)


_NEW_UNSAFE = getattr(TensorDict, "_new_unsafe", None)
# What TorchRL's TensorStorage.set does besides copying (SlotStorage.write repeats it).
_CPU = torch.device("cpu")
_SET_BOOKKEEPING = ("_set_last_cursor", "_get_new_len", "_bump_mutation_revision")


# A part of a delivery: a tensor and the rows to take from it: a long tensor of rows, a slice
# of consecutive rows, or None for all of it, as is.
Part = tuple[torch.Tensor, "torch.Tensor | slice | None"]


def _count(rows: torch.Tensor | slice) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else rows.shape[0]


def _rows_of(column: torch.Tensor, rows: torch.Tensor | slice | None) -> torch.Tensor:
    """``column``'s rows as a new tensor, never a view of stored data (``rows`` None:
    ``column`` itself, a value computed for this batch)."""
    if rows is None:
        return column
    if isinstance(rows, slice):
        return column[rows].clone()
    return torch.index_select(column, 0, rows)


def _part_layout(parts: list[Part]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """The shape and dtype each part takes in a delivered batch."""
    return tuple(
        ((t.shape[0] if rows is None else _count(rows), *t.shape[1:]), t.dtype) for t, rows in parts
    )


def _views(flat: torch.Tensor, offsets: list[int], layout) -> list[torch.Tensor]:
    """Typed views of a byte buffer, one per part of ``layout`` at its byte offset."""
    out = []
    for offset, (shape, dtype) in zip(offsets, layout, strict=True):
        size = math.prod(shape) * dtype.itemsize
        out.append(flat[offset : offset + size].view(dtype).view(shape))
    return out


class _PinnedStager:
    """Gathers CPU rows into one reusable pinned buffer, then copies it to CUDA in one transfer.

    Every part of a batch (each field's rows, and small tensors computed on the host) lands in
    its own 64-byte-aligned slice of one pinned byte buffer, so a batch costs one non-blocking
    host-to-device copy instead of one per field; the batch's tensors are typed views of the
    device copy. Two buffers per batch layout alternate; before one is refilled we wait on the
    CUDA event recorded after its last copy, so a non-blocking copy is never overwritten
    mid-flight. Only the most recently used layouts keep their buffers (``sample_all`` on a
    growing buffer asks for a new shape each time); dropping one is safe, as PyTorch's pinned
    allocator holds a block until the copies recorded on it finish.
    """

    max_shapes = 8
    align = 64

    def __init__(self) -> None:
        # Per layout: up to two (pinned bytes, offsets, typed views of them, CUDA event).
        self._sets: dict[tuple, list[tuple[torch.Tensor, list[int], list[torch.Tensor], Any]]] = {}
        self._turn: dict[tuple, int] = {}

    def clear(self) -> None:
        self._sets.clear()
        self._turn.clear()

    def deliver(self, parts: list[Part], device: torch.device) -> list[torch.Tensor]:
        """Each part's rows (or the part itself) as a tensor on CUDA ``device``."""
        layout = _part_layout(parts)
        signature = (device, layout)
        sets = self._sets.pop(signature, [])
        self._sets[signature] = sets  # most recently used last
        if len(self._sets) > self.max_shapes:
            oldest = next(iter(self._sets))
            del self._sets[oldest]
            self._turn.pop(oldest, None)
        turn = self._turn.get(signature, 0)
        self._turn[signature] = turn ^ 1
        if len(sets) <= turn:
            offsets, size = [], 0
            for shape, dtype in layout:
                offsets.append(size)
                size += -(-math.prod(shape) * dtype.itemsize // self.align) * self.align
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            sets.append((host, offsets, _views(host, offsets, layout), None))
        host, offsets, views, event = sets[turn]
        if event is not None:
            event.synchronize()
        for (t, rows), view in zip(parts, views, strict=True):
            if rows is None:
                view.copy_(t)
            elif isinstance(rows, slice):
                view.copy_(t[rows])
            else:
                torch.index_select(t, 0, rows, out=view)
        with torch.cuda.device(device):
            flat = host.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        sets[turn] = (host, offsets, views, event)
        return _views(flat, offsets, layout)
