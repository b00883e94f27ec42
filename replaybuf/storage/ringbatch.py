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
from replaybuf.storage.tensordicts import NEW_UNSAFE, shared_attributes, with_attributes

_KEY = "storage.ringbatch"  # its entry in SlotStorage.derived
_CPU = torch.device("cpu")


class UniformBatch:
    """Draws ``batch_size`` slots in ``[0, size)`` and returns their rows on the CPU."""

    def __init__(self, names: list[str], views: list[np.ndarray], new: Any) -> None:
        self.fields = list(zip(names, views, strict=True))
        # tensordict's unchecked constructor, and whether the batch's device may be set as
        # _new_unsafe sets it (see _device_settable): where shared_attributes finds none
        self.new = new
        self.set_device = _device_settable(new)
        # The last batch size's attributes for with_attributes (None: build through ``new``).
        self.size = -1
        self.attributes: dict[str, Any] | None = None

    def __call__(self, size: int, batch_size: int, generator: torch.Generator) -> TensorDict:
        slots = torch.randint(0, size, (batch_size,), generator=generator, device=_CPU)
        at = slots.numpy()
        from_numpy = torch.from_numpy
        source = {name: from_numpy(view.take(at, axis=0)) for name, view in self.fields}
        if batch_size != self.size:
            self.size, self.attributes = batch_size, shared_attributes(slots.shape, _CPU)
        if self.attributes is not None:
            return with_attributes(source, self.attributes)
        if not self.set_device:
            return self.new(source, batch_size=slots.shape, device=_CPU)
        batch = self.new(source, batch_size=slots.shape, device=None)
        batch._device = _CPU
        return batch


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


def _device_settable(new: Any) -> bool:
    """Whether a flat TensorDict built by ``new`` (``_new_unsafe``) without a device and then
    given ``_device``, the attribute that constructor sets, is on the CPU like one built with
    ``device="cpu"``. Given a device, ``_new_unsafe`` builds a ``torch.device`` and asks whether
    MPS exists on every call, which only its nested values use; a tensordict that keeps the
    device otherwise gets the device argument."""
    try:
        probe = new({"x": torch.zeros(1)}, batch_size=torch.Size([1]), device=None)
        probe._device = _CPU
        return type(probe) is TensorDict and probe.device == _CPU and probe["x"].device == _CPU
    except Exception:  # an attribute this tensordict does not let be set
        return False
