"""A ring's uniform batch on the host in a handful of calls: the fast path of
``ReplayBuffer.sample_batch``.

At small stored sizes a batch's gather is cheap and what surrounds it shows: the general path
(``SlotStorage.gather``) finds the rows' reader, the delivery and the TensorDict's names anew on
every call. :class:`UniformBatch` is chosen once per allocation of the columns (kept in
``SlotStorage.derived``, emptied whenever they change) and then draws the slots exactly as the
general path does (one ``torch.randint`` on the same generator, so seeded batches are the same),
takes each field's rows with numpy (fresh arrays the caller owns, as
:mod:`replaybuf.storage.host_gather`) and wraps them in a TensorDict built without re-checking
(:data:`~replaybuf.storage.tensordicts.NEW_UNSAFE`), as every value comes from the columns.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from replaybuf.storage.slots import SlotStorage
from replaybuf.storage.tensordicts import NEW_UNSAFE

_KEY = "storage.ringbatch"  # its entry in SlotStorage.derived
_CPU = torch.device("cpu")


class UniformBatch:
    """Draws ``batch_size`` slots in ``[0, size)`` and returns their rows on the CPU."""

    def __init__(self, names: list[str], views: list[np.ndarray], new: Any) -> None:
        self.fields = list(zip(names, views, strict=True))
        self.new = new  # tensordict's unchecked constructor

    def __call__(self, size: int, batch_size: int, generator: torch.Generator) -> TensorDict:
        slots = torch.randint(0, size, (batch_size,), generator=generator, device=_CPU)
        at = slots.numpy()
        from_numpy = torch.from_numpy
        source = {name: from_numpy(view.take(at, axis=0)) for name, view in self.fields}
        return self.new(source, batch_size=slots.shape, device=_CPU)


def uniform_batch(slots: SlotStorage) -> UniformBatch | None:
    """The fast uniform batch of ``slots`` as they are now (chosen once per allocation), or
    None where it does not apply: storage off the CPU or not allocated, a nested spec, a
    column numpy cannot view (bfloat16), or a tensordict without the unchecked constructor."""
    chosen = slots.derived.get(_KEY, False)
    if chosen is False:
        chosen = slots.derived[_KEY] = _choose(slots)
    return chosen


def _choose(slots: SlotStorage) -> UniformBatch | None:
    names = slots._flat_names
    leaves = slots._leaves
    if NEW_UNSAFE is None or names is None or not leaves or slots.storing_device != _CPU:
        return None
    views = [slots.host_view(key) for key, _ in leaves]
    if any(view is None for view in views):
        return None
    return UniformBatch(names, [view for view in views if view is not None], NEW_UNSAFE)
