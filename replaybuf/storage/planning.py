"""What a :class:`~replaybuf.storage.slots.SlotStorage` plans: its kind (``storage="auto"``'s
choice), the bytes its rows take, the space check before allocating, and the disk blocks its
memmap files reserve ahead of the writes. Kept apart from the slot storage's reads and writes,
so that each module holds one concern.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from replaybuf.storage import space
from replaybuf.storage.devices import StorageChoice, StorageKind, auto_kind
from replaybuf.storage.schema import FieldSpec, Key
from replaybuf.storage.space import check_plan, plan, reserve_ahead
from replaybuf.storage.torchrl_state import allocated


class SlotPlanning:
    """The planning half of :class:`~replaybuf.storage.slots.SlotStorage` (a mixin)."""

    capacity: int
    requested: StorageChoice
    kind: StorageKind
    spec: FieldSpec | None
    index_column: bool
    storing_device: torch.device
    memory: Any  # the TorchRL buffer (None once closed)
    _scratch_parent: str | os.PathLike | None
    _leaves: list[tuple[Key, torch.Tensor]]
    _reserved: int

    if TYPE_CHECKING:  # declared for the type checker; SlotStorage defines them

        @property
        def scratch_path(self) -> Path | None: ...

        def reset(self, capacity: int | None = None) -> None: ...

    @property
    def decided(self) -> bool:
        """Whether the storage kind is fixed (``auto``: once a spec is prepared)."""
        return self.requested != "auto" or self.spec is not None

    @property
    def reported_kind(self) -> str:
        """The kind as ``stats()`` reports it: ``"auto"`` until it is decided."""
        return self.kind if self.decided else "auto"

    @property
    def planned_bytes(self) -> int:
        """What the rows occupy once allocated (0 before the first write fixes the spec):
        every column TorchRL allocates and the ragged fields' spans (see :func:`plan`)."""
        return 0 if self.spec is None else sum(plan(self.capacity, self.spec, self.index_column))

    def kind_for(self, capacity: int, spec: FieldSpec) -> StorageKind:
        """The kind that ``capacity`` rows of ``spec`` are stored in (``auto``: chosen by
        their planned bytes against free RAM)."""
        if self.decided:
            return self.kind
        return auto_kind(sum(plan(capacity, spec, self.index_column)), space.free_ram())

    def check_space(self, capacity: int, spec: FieldSpec) -> None:
        """Raise :class:`InsufficientSpaceError` unless ``capacity`` rows of ``spec`` fit:
        the storage's bytes where it allocates, the spans' in host RAM."""
        folder = self.scratch_path or Path(self._scratch_parent or tempfile.gettempdir())
        planned = plan(capacity, spec, self.index_column)
        check_plan(self.kind_for(capacity, spec), self.storing_device, folder, planned)

    def _reserve_slots(self, slots: torch.Tensor) -> None:
        """Reserve disk blocks up to the highest of ``slots`` (memmap files not yet whole)."""
        if self._reserved < self.capacity and slots.numel():
            self._reserve(int(slots.max()) + 1)

    def _reserve(self, stop: int) -> None:
        """Reserve the memmap files' disk blocks for rows up to ``stop`` and a slice beyond
        (InsufficientSpaceError on a full disk, before the rows are written)."""
        if min(stop, self.capacity) <= self._reserved:
            return
        if self.kind != "memmap" or self.memory is None or not self._leaves:
            self._reserved = self.capacity  # nothing on disk to reserve
            return
        # A full disk at the first write: back to empty and usable, as before it.
        release: Callable[[], None] | None = self.reset if self._reserved == 0 else None
        stored, folder, needed = allocated(self.memory), self.scratch_path, self.planned_bytes
        self._reserved = reserve_ahead(stored, self._reserved, stop, folder, needed, release)
