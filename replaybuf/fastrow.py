"""One appended step checked and converted without building tensors: the per-step fast path.

A step whose every value already has its field's exact shape and dtype (CPU tensors, numpy
arrays, or Python numbers the field holds) is copied straight into the staging columns through
numpy views. The general path (``to_leaves``, a 0-d tensor per number, ``unsqueeze`` and
``copy_`` per field) costs tens of microseconds a step; numpy item assignment about one per
field. Anything else gets ``None`` here and takes the general path, which converts what it can
and raises the precise error; so this module never raises and never changes anything.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replaybuf.schema import FieldSpec

_STEP_KEYS = {("observation",): 0, ("action",): 1, ("reward",): 2}


def numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """numpy's dtype for ``dtype``, or None where numpy has none (bfloat16, ...)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None


class RowPlan:
    """How a spec's fields are taken from one step's (observation, action, reward, extras).

    Only specs whose observation and action are single tensors (not dicts) and whose extras
    are flat get a plan: the common case, kept simple.
    """

    def __init__(self, spec: FieldSpec, sources: list[tuple[int, str | None]]) -> None:
        # Per field: (argument 0..2 or 3 = extras, extras name, shape, dtype, numpy dtype).
        self.fields = [
            (arg, name, spec[key].shape, spec[key].dtype, numpy_dtype(spec[key].dtype))
            for (arg, name), key in zip(sources, spec, strict=True)
        ]
        self.extras = {name for arg, name in sources if arg == 3}

    @classmethod
    def of(cls, spec: FieldSpec) -> RowPlan | None:
        """The plan for ``spec``, or None when a field is nested or numpy cannot hold it."""
        sources: list[tuple[int, str | None]] = []
        for key in spec:
            if key in _STEP_KEYS:
                sources.append((_STEP_KEYS[key], None))
            elif len(key) == 2 and key[0] == "extras":
                sources.append((3, key[1]))
            else:
                return None
            if numpy_dtype(spec[key].dtype) is None:
                return None
        return cls(spec, sources)

    def values(self, observation: Any, action: Any, reward: Any, extras: Any) -> list | None:
        """The step's values in spec order, ready for numpy assignment, or None."""
        if extras is None:
            if self.extras:
                return None
        elif type(extras) is not dict or extras.keys() != self.extras:
            return None
        step = (observation, action, reward, extras)
        out = []
        for arg, name, shape, dtype, np_dtype in self.fields:
            value = fast_value(step[arg] if name is None else extras[name], shape, dtype, np_dtype)
            if value is None:
                return None
            out.append(value)
        return out


def fast_value(value: Any, shape: tuple[int, ...], dtype: torch.dtype, np_dtype: Any) -> Any:
    """``value`` as numpy can assign it when it matches the field exactly, else None."""
    kind = type(value)
    if kind is torch.Tensor:
        if value.dtype is not dtype or value.shape != shape or not value.is_cpu:
            return None
        try:  # one call: numpy() refuses what it cannot view (grad, lazy conj/neg views)
            return value.numpy()
        except RuntimeError:
            return None  # the general path detaches and copies those
    if kind is np.ndarray:
        return value if value.dtype == np_dtype and value.shape == shape else None
    if shape != ():
        return None
    if kind is float:
        return value if dtype.is_floating_point else None
    if kind is bool:
        return value if dtype is torch.bool else None
    if kind is int and not dtype.is_floating_point and dtype is not torch.bool:
        limits = np.iinfo(np_dtype)
        return value if limits.min <= value <= limits.max else None
    return None
