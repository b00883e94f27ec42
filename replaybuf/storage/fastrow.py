"""One appended step checked and converted without building tensors: the per-step fast path.

A step whose every value already has its field's exact shape and dtype (CPU tensors, numpy
arrays, or Python numbers the field holds) is copied straight into the staging columns through
numpy views. The general path (``to_leaves``, a 0-d tensor per number, ``unsqueeze`` and
``copy_`` per field) makes several torch calls per field, each costing far more than a numpy
item assignment. CPU tensors are checked by torch's guard (:mod:`replaybuf.storage.tensorguard`:
the observation and action in one call) and copied from their addresses. Anything else is
declined here and takes the general path, which converts what it can and raises the precise
error; so this module never raises for a value (an interrupt passes through, after the row's
noted addresses are cleared) and never changes anything stored.
``append_batch`` has the same path for ``[envs, ...]`` arrays and tensors (:meth:`batch_values`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replaybuf.storage.addresses import ALWAYS, by_address, layout, row_copier
from replaybuf.storage.bools import assign_view
from replaybuf.storage.schema import FieldSpec, has_memory
from replaybuf.storage.tensorguard import field_guard, row_guard

_STEP_KEYS = {("observation",): 0, ("action",): 1, ("reward",): 2}
# What Tensor.numpy() raises for tensors it cannot view: RuntimeError (grad, conj/neg bits),
# TypeError (sparse and other layouts).
_NO_VIEW = (RuntimeError, TypeError)
# Float fields a Python float goes into as numpy assigns it (float16 would warn on overflow
# where torch silently stores inf: those take the general path).
_FLOATS = (torch.float32, torch.float64)
# One call that copies a list of tensors into another (torch >= 2.1; a private name, so looked
# up, and without it batches take the numpy path).
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)
_STRIDED = torch.strided
_BATCH_SIZES = 64  # batch sizes whose field checks a plan keeps (see RowPlan._tensors)


class RowPlan:
    """How a spec's fields are taken from one step's (observation, action, reward, extras) and
    written into one row of the staging columns.

    Only specs whose observation and action are single tensors (not dicts) and whose extras
    are flat get a plan: the common case, kept simple.
    """

    def __init__(
        self, spec: FieldSpec, sources: list[tuple[int, str | None]], arrays: list[np.ndarray]
    ) -> None:
        # Per field: (argument 0..2 or 3 = extras, extras name, shape, dtype, numpy dtype,
        # the numpy view of its staging column values are assigned into (a bool column's as
        # uint8: replaybuf.storage.bools), whether a Python float goes straight in, its
        # position, when a tensor's bytes go in from its address: replaybuf.storage.addresses,
        # and the guard that checks such a tensor in one call: replaybuf.storage.tensorguard).
        self.fields: list[tuple[Any, ...]] = []
        # Tensors copied from their addresses in one call: the copy, the columns' layout, and
        # each call's addresses (0: none; copy_row sets them back to 0).
        self.copy_row = copy = row_copier(arrays)
        self.layout = layout(arrays)
        self.sources = np.zeros(len(arrays), np.int64)
        self.busy = False  # a call is checking a step (sources holds its addresses)
        # The views every value is assigned into, per column (here, by steps.stage_steps, and
        # for the spare row)
        self.arrays = [assign_view(array) for array in arrays]
        for at, ((arg, name), key, array) in enumerate(zip(sources, spec, arrays, strict=True)):
            shape, dtype = spec[key].shape, spec[key].dtype
            takes_float = shape == () and dtype in _FLOATS
            address = by_address(copy, dtype, shape)
            guard = field_guard(dtype, shape) if address else None
            target = self.arrays[at]
            self.fields.append(
                (arg, name, shape, dtype, array.dtype, target, takes_float, at, address, guard)
            )
        self.guarded = any(field[9] is not None for field in self.fields)  # any tensor guard
        # The observation and action, both copied by address: one guard call for the pair, the
        # other fields one by one (rewards are mostly numbers).
        pair = sorted((field for field in self.fields if field[0] < 2), key=lambda f: f[0])
        self.pair = None
        if len(pair) == 2 and all(field[8] for field in pair):
            self.pair = row_guard([(dtype, shape) for _, _, shape, dtype, *_ in pair])
        self.pair_columns = [field[7] for field in pair]
        self.rest = [field for field in self.fields if field[0] >= 2]
        # With the pair taken, a float reward (the usual) goes into this view, with no loop,
        # when the reward is the only other field and takes floats
        only = self.rest[0] if len(self.rest) == 1 else None
        self.float_reward = only[5] if only is not None and only[0] == 2 and only[6] else None
        self._columns = [torch.from_numpy(array) for array in arrays]  # put_finals' tensors
        self.extras = {name for arg, name in sources if arg == 3}
        # Per batch size: (argument, extras name, dtype, [size, *shape]) of each field.
        self._batch_fields: dict[int, list[tuple[Any, ...]]] = {}

    @classmethod
    def of(cls, spec: FieldSpec, arrays: list[np.ndarray] | None) -> RowPlan | None:
        """The plan for ``spec`` writing into ``arrays`` (numpy views of its staging columns,
        in spec order), or None when a field is nested or numpy cannot hold it."""
        if arrays is None:
            return None
        sources: list[tuple[int, str | None]] = []
        for key in spec:
            if key in _STEP_KEYS:
                sources.append((_STEP_KEYS[key], None))
            elif len(key) == 2 and key[0] == "extras":
                sources.append((3, key[1]))
            else:
                return None
        return cls(spec, sources, arrays)

    def _extras_fit(self, extras: Any) -> bool:
        """Whether ``extras`` names exactly the spec's extras (None when it has none). A key's
        ``__eq__`` that calls this buffer again is refused (replaybuf.buffers.locking)."""
        if extras is None:
            return not self.extras
        return type(extras) is dict and extras.keys() == self.extras

    def stage(self, at: int, step: tuple[Any, Any, Any, Any]) -> bool:
        """Write ``step`` (observation, action, reward, extras) into row ``at`` of the columns;
        False when a value needs the general path.

        On False some columns' row ``at`` may hold this step's values: the caller has not
        staged that row yet, so nothing it holds changed. This is the per-step hot path, so the
        exact matches the callers pass most (numpy arrays, CPU tensors, floats) are tested
        inline and the rest go through :func:`fast_value`. Contiguous CPU tensors are copied
        from their addresses, all in one call at the end (see replaybuf.storage.addresses).
        """
        extras = step[3]
        if extras is None:  # the usual: _extras_fit's first case, inline
            if self.extras or self.busy:
                return False
        elif not self._extras_fit(extras) or self.busy:
            return False  # busy: a step nested in this one (user code run by a key's __eq__)
        sources = self.sources
        addressed = checked = False
        try:
            self.busy = True
            fields = self.fields
            pair = self.pair
            observation = step[0]
            if (
                pair is not None
                and type(observation) is torch.Tensor
                and pair(observation, step[1])
            ):
                # an observation and action torch's guard passes, in one call: their addresses
                observation, action = observation.data_ptr(), step[1].data_ptr()
                if not (observation and action):  # no memory behind one: the general path
                    return False
                observation_at, action_at = self.pair_columns
                sources[observation_at], sources[action_at] = observation, action
                addressed = True
                fields = self.rest
                reward, float_reward = step[2], self.float_reward
                if float_reward is not None and type(reward) is float:
                    float_reward[at] = reward
                    fields = []  # nothing left to check
            for field in fields:
                arg, name, shape, dtype, np_dtype, array, takes_float, column, address_of, guard = (
                    field
                )
                value = step[arg] if name is None else extras[name]
                kind = type(value)
                if kind is np.ndarray:
                    # `is` first: numpy's native dtypes are singletons, cheaper to compare
                    got = value.dtype
                    if (got is not np_dtype and got != np_dtype) or value.shape != shape:
                        break
                elif kind is torch.Tensor:
                    # torch's guard passes the usual tensor in one call (as in RingRow); what it
                    # refuses (every tensor, without it), the attribute checks decide: the check
                    # of RingRow.__call__ (storage.ringrow), inline in both hot paths
                    try:  # data_ptr() and numpy() refuse tensors without storage (vmap's)
                        if guard is None or not guard(value):
                            if (
                                value.dtype is not dtype
                                or not value.is_cpu
                                or value.shape != shape
                                or value.layout is not _STRIDED
                            ):
                                break
                            if not (
                                address_of
                                and (address_of == ALWAYS or value.is_contiguous())
                                and not value.is_neg()
                            ):
                                if not value.data_ptr():  # no memory behind it (numpy() views it)
                                    break
                                array[at] = value.numpy()  # refuses grad, lazy conj/neg views
                                continue
                        address = value.data_ptr()
                    except _NO_VIEW:
                        break  # the general path detaches and copies, or refuses, those
                    if not address:  # no memory behind it: the general path decides
                        break
                    sources[column] = address
                    addressed = True
                    continue
                elif not (kind is float and takes_float):
                    value = fast_value(value, shape, dtype, np_dtype)
                    if value is None:
                        break
                array[at] = value
            else:
                checked = True
            if addressed:
                if not checked:
                    sources.fill(0)  # no address of this call may stay for the next
                    return False
                self.copy_row(self.layout, sources, at)  # type: ignore[misc]
        except BaseException:  # an interrupt: no address of this call may stay for the next
            sources.fill(0)
            raise
        finally:
            self.busy = False
        return checked

    def stage_final(self, at: int, observation: Any) -> bool:
        """Write an episode's final observation into row ``at`` and zeros into the row's other
        fields (as :meth:`stage`: False, with row ``at`` not staged, when it does not fit)."""
        for arg, _, shape, dtype, np_dtype, array, *_ in self.fields:
            if arg != 0:
                array[at] = 0
                continue
            value = fast_value(observation, shape, dtype, np_dtype)
            if value is None:
                return False
            array[at] = value
        return True

    def final_batch(self, count: int, observations: Any) -> Any:
        """``observations`` if it is ``count`` final observations as :meth:`put_finals` takes
        them (a numpy array, or a strided CPU tensor needing no grad, of the observation
        field's dtype and shape ``[count, *shape]``), else None."""
        for arg, _, shape, dtype, np_dtype, *_ in self.fields:
            if arg != 0:
                continue
            kind = type(observations)
            if kind is np.ndarray:
                fits = observations.dtype == np_dtype and observations.shape == (count, *shape)
            elif kind is torch.Tensor:
                fits = (
                    observations.dtype is dtype
                    and observations.shape == (count, *shape)
                    and observations.is_cpu
                    and not observations.requires_grad
                    and observations.layout is _STRIDED
                )
            else:
                fits = False
            return observations if fits else None
        return None

    def put_finals(self, at: int, observations: Any) -> None:
        """Final-observation rows from row ``at`` on: ``observations`` (from
        :meth:`final_batch`) in the observation field, zeros in the others."""
        end = at + len(observations)
        for (arg, _, _, _, _, array, *_), column in zip(self.fields, self._columns, strict=True):
            if arg != 0:
                array[at:end] = 0
            elif type(observations) is torch.Tensor:
                column[at:end].copy_(observations)
            else:
                array[at:end] = observations

    def batch_values(self, count: int, step: tuple[Any, Any, Any, Any]) -> list | None:
        """``step``'s values for ``count`` episodes (each ``[count, *shape]``, numpy arrays or
        CPU tensors of the exact dtype) in column order, or None: CPU tensors when every value
        is one that copies as it is (see :meth:`_tensors`), else numpy arrays.

        The caller copies them into the staging columns (one ``torch._foreach_copy_`` for
        tensors, one slice assignment per field for arrays); anything else (lists, numbers,
        other dtypes) takes the general path.
        """
        extras = step[3]
        if not self._extras_fit(extras):
            return None
        if _FOREACH_COPY is not None and type(step[0]) is torch.Tensor:
            tensors = self._tensors(count, step)
            if tensors is not None:
                return tensors
        out = []
        for arg, name, shape, dtype, np_dtype, *_ in self.fields:
            value = step[arg] if name is None else extras[name]
            value = fast_value(value, (count, *shape), dtype, np_dtype)  # no numbers: shape > 0
            if value is None:
                return None
            out.append(value)
        return out

    def _tensors(self, count: int, step: tuple[Any, Any, Any, Any]) -> list | None:
        """``step``'s values when each is a strided CPU tensor of its field's dtype and shape
        ``[count, *shape]`` that needs no grad, or None. A torch vector env's batch: one
        ``torch._foreach_copy_`` copies them all, cheaper than a ``numpy()`` view and a slice
        assignment per field. Grad would make ``copy_`` record the
        staging columns in the graph: those take the general path, which detaches."""
        fields = self._batch_fields.get(count)
        if fields is None:
            if len(self._batch_fields) >= _BATCH_SIZES:
                self._batch_fields.clear()
            fields = self._batch_fields[count] = [
                (arg, name, dtype, (count, *shape)) for arg, name, shape, dtype, *_ in self.fields
            ]
        extras, out = step[3], []
        for arg, name, dtype, shape in fields:
            value = step[arg] if name is None else extras[name]
            if (
                type(value) is not torch.Tensor
                or value.dtype is not dtype
                or value.shape != shape
                or value.requires_grad
                or not value.is_cpu
                or value.layout is not _STRIDED
            ):
                return None
            if not has_memory(value):  # a torch.func wrapper's: the general path refuses it
                return None
            out.append(value)
        return out


def fast_value(value: Any, shape: tuple[int, ...], dtype: torch.dtype, np_dtype: Any) -> Any:
    """``value`` as numpy can assign it when it matches the field exactly, else None."""
    kind = type(value)
    if kind is torch.Tensor:
        if value.dtype is not dtype or value.shape != shape or not value.is_cpu:
            return None
        try:  # numpy() refuses what it cannot view (grad, lazy conj/neg views, sparse)
            return value.numpy() if value.data_ptr() else None  # 0: no memory behind it
        except _NO_VIEW:
            return None  # the general path detaches and copies, or refuses, those
    if kind is np.ndarray:
        return value if value.dtype == np_dtype and value.shape == shape else None
    if shape != ():
        return None
    if kind is float:
        return value if dtype in _FLOATS else None  # float16 would warn on overflow: general
    if kind is bool:
        return value if dtype is torch.bool else None
    if kind is int and not dtype.is_floating_point and dtype is not torch.bool:
        limits = np.iinfo(np_dtype)
        return value if limits.min <= value <= limits.max else None
    return None
