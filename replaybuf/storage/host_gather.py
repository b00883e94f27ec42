"""How ``SlotStorage.gather`` reads every field's rows on the CPU: one numpy ``take`` per field
(a numpy call costs less than torch's ``index_select``), with one ``numpy()`` of the slots for
all fields. The values equal ``torch.index_select`` per field, bit for bit.

:func:`host_gather` chooses once per allocation of the columns (``SlotStorage`` keeps the choice
in its ``derived`` cache, emptied whenever the columns change): a batch no longer looks up every
field's numpy view to learn whether all have one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

HostGather = Callable[[torch.Tensor], list[torch.Tensor]]  # slots -> each field's rows


def host_gather(columns: Sequence[torch.Tensor], views: dict[int, np.ndarray]) -> HostGather | None:
    """The gather of ``columns`` (stored CPU columns) at slots on their device, given their numpy
    views by ``id`` (see ``SlotStorage._host_views``); None when some column has none (torch's
    ``index_select`` then)."""
    arrays = [views.get(id(column)) for column in columns]
    if any(array is None for array in arrays):
        return None
    return NumpyTakes([array for array in arrays if array is not None])  # all (for mypy)


class NumpyTakes:
    """One numpy ``take`` per field (a numpy call costs less than torch's ``index_select``)."""

    def __init__(self, views: list[np.ndarray]) -> None:
        self.views = views

    def __call__(self, slots: torch.Tensor) -> list[torch.Tensor]:
        at = slots.numpy()  # once for all fields
        return [torch.from_numpy(view.take(at, axis=0)) for view in self.views]
