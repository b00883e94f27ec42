"""One transition written into a ring's next slot without building tensors: the fast path of
``ReplayBuffer.add``.

The general path (:func:`~replaybuf.storage.convert.to_leaves` or
:meth:`~replaybuf.storage.schema.FieldSpec.match`, a ``[1, ...]`` view per field, the spec
check, ``SlotStorage.extend`` with TorchRL's bookkeeping through its state dicts) makes a few
dozen Python and torch calls per row. Here a dict (or a TensorDict of batch size [], ObjectRL's
form, read through its entries by name) whose every value already has its field's exact shape
and dtype (CPU tensors, numpy arrays and scalars, Python numbers the field holds) is checked
whole (a tensor by torch's guard in one call where it passes it,
:mod:`replaybuf.storage.tensorguard`), then written at TorchRL's writer cursor: contiguous CPU
tensors copied from their addresses by one compiled call
(:func:`~replaybuf.accel.numba_rows.copy_row`, where the kernels run), every other value
assigned into the numpy view of its column (a bool column's bytes as uint8:
:mod:`replaybuf.storage.bools`). TorchRL's counters are then advanced as its ``extend`` of one
row would (:class:`~replaybuf.storage.torchrl_state.RowBookkeeping`). Anything else is
declined, before anything is written, and takes the general path, which converts what it can
and raises the precise error: this module never raises for a value and never writes a row it
did not check whole.

:func:`row_writer` chooses, once per allocated storage (kept in ``SlotStorage.derived``, which
is emptied whenever the columns change), between :class:`RingRow` and :func:`declined`: the
latter for a storage off the CPU, a field numpy cannot view (bfloat16), a nested spec, or a
TorchRL that keeps its counters otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from replaybuf.storage.addresses import ALWAYS, by_address, layout, row_copier
from replaybuf.storage.bools import assign_view
from replaybuf.storage.slots import SlotStorage
from replaybuf.storage.tensorguard import field_guard, row_guard
from replaybuf.storage.torchrl_state import RowBookkeeping, row_bookkeeping

_KEY = "storage.ringrow"  # its entry in SlotStorage.derived
# What Tensor.numpy() raises for tensors it cannot view: RuntimeError (grad, conj/neg bits),
# TypeError (sparse and other layouts).
_NO_VIEW = (RuntimeError, TypeError)
# Float fields a Python float goes into as numpy assigns it (float16 would warn on overflow
# where torch silently stores inf: those take the general path).
_FLOATS = (torch.float32, torch.float64)
_STRIDED = torch.strided


def _leaves_by_name() -> bool:
    """Whether a TensorDict keeps its entries in a plain dict by name (``_tensordict``, as
    tensordict has for years): then :class:`RingRow` reads a one-transition TensorDict's
    leaves there, in one attribute read, instead of a ``get`` per field (tensordict's own
    ``items()`` costs several times the whole row write). Checked on a probe at import, so
    that a tensordict that keeps them otherwise sends TensorDicts to the general path."""
    leaf = torch.zeros(())
    probe = TensorDict({"leaf": leaf}, batch_size=[])
    entries = getattr(probe, "_tensordict", None)
    return type(entries) is dict and len(entries) == 1 and entries.get("leaf") is leaf


_LEAVES_BY_NAME = _leaves_by_name()

RowWriter = Callable[[Any], int]  # one transition -> the slot written, or -1: declined


def declined(experience: Any) -> int:
    """The row writer of a storage without the fast path: every row takes the general path."""
    return -1


class RingRow:
    """Writes one transition, a flat dict of the spec's fields, at TorchRL's writer cursor."""

    def __init__(
        self,
        slots: SlotStorage,
        fields: list[tuple[str, torch.dtype, tuple[int, ...], np.ndarray]],
        index: np.ndarray | None,
        book: RowBookkeeping,
    ) -> None:
        # Per field: (its position, name, torch dtype, shape, numpy dtype, numpy scalar type,
        # the Python number type it takes (float, bool, int or None), that number's limits,
        # when a tensor's bytes go in from its address (replaybuf.storage.addresses), the
        # guard that checks such a tensor in one call (replaybuf.storage.tensorguard), and the
        # numpy view other values are assigned into: replaybuf.storage.bools).
        self.fields: list[tuple[Any, ...]] = []
        self.views = [view for *_, view in fields]
        self.targets = [assign_view(view) for view in self.views]
        # Tensors copied from their addresses in one call: the copy, the columns' layout, and
        # each call's addresses (0: none; copy_row sets them back to 0).
        self.copy_row = copy = row_copier(self.views)
        self.layout = layout(self.views)
        self.sources = np.zeros(len(fields), np.int64)
        self.busy = False  # a call is checking a row (sources holds its addresses)
        for at, (name, dtype, shape, view) in enumerate(fields):
            number: type | None = None
            limits: tuple[float, float] = (0, -1)
            if shape == ():
                if dtype in _FLOATS:
                    number = float
                    # numpy warns where a float overflows the field (torch stores inf): those
                    # beyond the largest finite value take the general path
                    limits = (0, float(np.finfo(view.dtype).max))
                elif dtype is torch.bool:
                    number = bool
                elif not dtype.is_floating_point and not dtype.is_complex:
                    number = int
                    info = np.iinfo(view.dtype)
                    limits = (int(info.min), int(info.max))
            numpy_types = (view.dtype, view.dtype.type)
            address_of = by_address(copy, dtype, shape)
            guard = field_guard(dtype, shape) if address_of else None
            tail = (number, limits, address_of, guard, self.targets[at])
            self.fields.append((at, name, dtype, shape, *numpy_types, *tail))
        self.guarded = any(field[9] is not None for field in self.fields)  # any tensor guard
        # A row of tensors only, every one copied by address: one guard call for them all, on
        # the values read in one call
        self.row_guard = (
            row_guard([(dtype, shape) for _, dtype, shape, _ in fields])
            if len(fields) > 1 and all(field[8] for field in self.fields)
            else None
        )
        self.first = fields[0][0]
        self.values_of = itemgetter(*[name for name, *_ in fields])  # a tuple: two or more
        self.count = len(fields)
        self.slots = slots
        self.index = index  # TorchRL's index column (each row's own slot), or None
        self.book = book

    def __call__(self, experience: Any) -> int:
        """Write ``experience`` at the cursor and return its slot; -1 (nothing written) when
        it is not a dict (or a TensorDict of batch size []) of exactly the spec's fields,
        each an exact match."""
        if type(experience) is not dict:
            if type(experience) is not TensorDict or not _LEAVES_BY_NAME or experience.batch_size:
                return -1
            experience = experience._tensordict  # its entries by name (see _leaves_by_name)
        if len(experience) != self.count or self.busy:
            return -1  # busy: an add nested in this one (user code run by a key's __eq__)
        assigned: list[tuple[np.ndarray, Any]] = []  # (view, value) of those not copied by address
        sources = self.sources
        addressed = checked = False
        try:
            self.busy = True
            try:
                guarded = False
                row_guard = self.row_guard
                if row_guard is not None and type(experience[self.first]) is torch.Tensor:
                    values = self.values_of(experience)
                    guarded = row_guard(*values)
                if guarded:
                    # every value a tensor torch's guard passes, in one call: their addresses
                    addressed = True
                    checked = self._note_addresses(values)
                else:
                    for field in self.fields:
                        (
                            at,
                            name,
                            dtype,
                            shape,
                            np_dtype,
                            scalar,
                            number,
                            limits,
                            address_of,
                            guard,
                            view,
                        ) = field
                        value = experience[name]
                        kind = type(value)
                        if kind is np.ndarray:
                            # `is` first: numpy's native dtypes are singletons, cheaper to compare
                            got = value.dtype
                            if (got is not np_dtype and got != np_dtype) or value.shape != shape:
                                break
                        elif kind is torch.Tensor:
                            # torch's guard passes the usual tensor (dense, on the CPU, exact dtype
                            # and shape, contiguous, no negative bit) in one call; what it refuses
                            # (every tensor, without it), the attribute checks decide: the check
                            # of RowPlan.stage (storage.fastrow), inline in both hot paths
                            if guard is None or not guard(value):
                                if (
                                    value.dtype is not dtype
                                    or value.shape != shape
                                    or not value.is_cpu
                                    or value.layout is not _STRIDED
                                ):
                                    break
                                if not (
                                    address_of
                                    and (address_of == ALWAYS or value.is_contiguous())
                                    and not value.is_neg()
                                ):
                                    # 0-d: item() is exact (a Python number holds any 0-d
                                    # value); shaped: numpy() refuses what the general path must
                                    # see (grad, conj/neg views) but views a tensor without
                                    # memory (data_ptr() 0) as it is: declined
                                    if shape == ():
                                        value = value.item()
                                    elif value.data_ptr():
                                        value = value.numpy()
                                    else:
                                        break
                                    assigned.append((view, value))
                                    continue
                            address = value.data_ptr()
                            if not address:  # no memory behind it: the general path decides
                                break
                            sources[at] = address
                            addressed = True
                            continue
                        elif kind is scalar:  # a numpy scalar of the field's dtype
                            if shape != ():
                                break
                        elif kind is not number:  # bool is no int here: type() is exact
                            break
                        elif kind is int:
                            if not limits[0] <= value <= limits[1]:
                                break
                        elif kind is float and abs(value) > limits[1]:  # NaN: not beyond
                            break
                        assigned.append((view, value))
                    else:
                        checked = True
            except KeyError:  # a name the spec lacks (as many keys as fields): the general path
                pass
            except _NO_VIEW:  # a tensor numpy cannot view: the general path detaches or refuses
                pass
            if not checked:
                if addressed:
                    sources.fill(0)  # no address of this call may stay for the next
                return -1
            slots, book = self.slots, self.book
            slot = book.cursor.value
            if slot >= slots._reserved:  # memmap files grow ahead of the rows (may raise)
                slots._reserve(slot + 1)
            if addressed:
                self.copy_row(self.layout, sources, slot)  # type: ignore[misc]
        except BaseException:  # an interrupt, or no room on disk: nothing written, and no
            sources.fill(0)  # address of this call may stay for the next
            raise
        finally:
            self.busy = False
        for view, value in assigned:
            view[slot] = value
        if slot >= slots._index_known and self.index is not None:
            self.index[slot] = slot  # TorchRL's index column, written on the ring's first pass
            if slot == slots._index_known:
                slots._index_known = slot + 1
        book.wrote(slot)
        return slot

    def _note_addresses(self, tensors: tuple[torch.Tensor, ...]) -> bool:
        """Note each tensor's address in ``sources`` (field order); False, declined, at one
        without memory behind it (the general path decides on it)."""
        sources = self.sources
        for at, tensor in enumerate(tensors):
            address = tensor.data_ptr()
            if not address:
                return False
            sources[at] = address
        return True


def row_writer(slots: SlotStorage) -> RowWriter:
    """The row writer for ``slots`` as it is now: chosen once per allocation of its columns."""
    writer = slots.derived.get(_KEY)
    if writer is None:
        writer = slots.derived[_KEY] = _choose(slots)
    return writer


def _choose(slots: SlotStorage) -> RowWriter:
    spec, memory = slots.spec, slots.memory
    leaves = slots._leaves
    if (
        spec is None
        or memory is None
        or not leaves  # not allocated yet: the first write allocates through TorchRL
        or not slots._direct
        or slots.storing_device.type != "cpu"
        or spec.ragged_keys
        or any(len(key) != 1 for key in spec)
        or len(leaves) != len(spec)
    ):
        return declined
    fields = []
    for key, column in leaves:
        view = slots.host_view(key)
        field = spec.get(key)
        if view is None or field is None or column.dtype != field.dtype:
            return declined
        fields.append((key[0], field.dtype, field.shape, view))
    index = slots._index_column
    index_view = None
    if index is not None:
        if index.dtype != torch.int64 or index.dim() != 1:
            return declined
        index_view = index.numpy()
    book = row_bookkeeping(memory)
    if book is None or book.max_size != slots.capacity:
        return declined
    return RingRow(slots, fields, index_view, book)
