"""A ``ReplayBuffer``'s persistence: metadata files, ``state_dict`` and checkpoints.

A part of :class:`~replaybuf.buffers.ring.ReplayBuffer` (which inherits it), kept apart so
that each module holds one concern; its checks and formats are :mod:`replaybuf.persist`'s.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from tensordict import TensorDict

from replaybuf.buffers.locking import synchronized
from replaybuf.errors import ArgumentError, MetadataError
from replaybuf.persist import metadata
from replaybuf.persist import ring as buffer_checkpoint
from replaybuf.persist.ring import RingParts
from replaybuf.persist.state import source_of
from replaybuf.priority import Prioritizer
from replaybuf.storage import (
    NORMAL_TENSORS,
    FieldSpec,
    SlotStorage,
)

# The buffer inherits this class: imported for annotations only. Its methods take ``self``
# and ``cls`` to be the buffer (or a subclass), and say so to the type checker with ``cast``.
if TYPE_CHECKING:
    from replaybuf.buffers.ring import ReplayBuffer


class RingPersistence:
    """Metadata, state and checkpoints of a :class:`ReplayBuffer` (its base class)."""

    # What the buffer provides (set in ReplayBuffer.__init__).
    _lock: Any
    _calling: bool
    _slots: SlotStorage
    _priorities: Prioritizer | None
    _generator: torch.Generator
    _declared: FieldSpec | None
    _scratch_dir: str | os.PathLike | None
    _size: int
    _pointer: int
    _writes: int
    _resets: int
    _iterator: Iterator[TensorDict] | None
    _home: Path | None
    device: torch.device
    print_gc_warning: bool

    if TYPE_CHECKING:  # declared for the type checker; the buffer defines them

        @property
        def storing_device(self) -> torch.device: ...

        @property
        def buffer_size(self) -> int: ...

        @property
        def storage_kind(self) -> str: ...

        @property
        def spec(self) -> FieldSpec | None: ...

        def _check_open(self) -> None: ...

    # ----------------------------------------------------------------- metadata
    @synchronized
    def save(self, path: str | os.PathLike) -> metadata.SavedMetadata:
        """Write the metadata, **not the rows**, to ``path + ".metadata"``, atomically, as JSON.

        ObjectRL's meaning: capacity, ``data_size``, ``pointer``, storage, devices and field
        spec; :meth:`load` checks a buffer against them. The stored transitions are not saved:
        :meth:`save_checkpoint` saves them. Returns a
        :class:`~replaybuf.persist.metadata.SavedMetadata` (the file's ``path``,
        ``contents_saved=False``), and the first save of a process logs a warning saying so.
        """
        self._check_open()
        target = metadata.write_metadata(
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
        return metadata.saved_metadata(target)

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
        buffer_size, spec = metadata.check_ring_metadata(
            document, self._size, self.buffer_size, self.spec
        )
        if self._size:
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
            self._slots.kind,  # the kind in use (an undecided "auto": memmap's placeholder)
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

        Everything is checked first (as a checkpoint load checks it), then the state is
        restored into fresh storage that replaces this buffer's only once it is complete: on
        any error, which names the field, the buffer is left as it was.
        """
        self._check_open()
        source = source_of(state, buffer_checkpoint.KIND)
        saved = buffer_checkpoint.check(source)
        buffer_checkpoint.check_fits(saved, source, self._parts())
        if self._declared is not None and saved.spec != self._declared:
            raise MetadataError(
                f"spec: state has {saved.spec}, this buffer declared {self._declared}"
            )
        slots = SlotStorage(
            self.buffer_size,
            kind=self._slots.requested,  # "auto" chooses again for the state's spec
            storing_device=self.storing_device,
            scratch_dir=self._scratch_dir,
        )
        priorities = None
        if self._priorities is not None:
            p = self._priorities
            priorities = Prioritizer(
                self.buffer_size, self.storing_device, p.alpha, p.beta, p.eps, p.backend
            )
        generator = torch.Generator(device=self.storing_device)
        parts = dataclasses.replace(
            self._parts(), slots=slots, priorities=priorities, generator=generator
        )
        try:
            buffer_checkpoint.restore(parts, saved, source)
        except BaseException:
            slots.close()
            raise
        old, self._slots = self._slots, slots
        old.close()
        self._priorities, self._generator = priorities, generator
        self._size, self._pointer, self._writes = saved.size, saved.pointer, saved.writes
        self._iterator = None
        self._resets += 1  # an epoch iterator planned before must not serve the new rows

    # ----------------------------------------------------------------- checkpoints
    @synchronized
    def save_checkpoint(
        self, directory: str | os.PathLike | None = None, *, durable: bool = True
    ) -> Path:
        """Save rows, ring state, spec, config and sampler RNG state; see ``docs/checkpoints.md``.

        Replaces the checkpoint at ``directory`` atomically (default: the one :meth:`open` was
        given). ``durable=False`` skips fsync: safe against a killed process, not power loss.
        """
        self._check_open()
        directory = self._home if directory is None else directory
        if directory is None:
            raise ArgumentError(
                "save_checkpoint() needs a directory: this buffer was not made by open(directory)"
            )
        return buffer_checkpoint.save(cast("ReplayBuffer", self), directory, durable)

    @classmethod
    @NORMAL_TENSORS
    def load_checkpoint(cls, directory: str | os.PathLike, **overrides: Any) -> ReplayBuffer:
        """A new buffer holding the checkpoint at ``directory``, sampling where it left off.

        ``overrides``: ``device``, ``storing_device``, ``storage``, ``scratch_dir`` or
        ``print_gc_warning``. Checked before a buffer is made; a failed load leaves nothing.
        """
        return buffer_checkpoint.load(cast("type[ReplayBuffer]", cls), directory, overrides)

    @classmethod
    def open(cls, directory: str | os.PathLike, **kwargs: Any) -> ReplayBuffer:
        """Load the checkpoint at ``directory``, else ``ReplayBuffer(**kwargs)``; either way a
        later ``save_checkpoint()`` writes there. Loading, ``buffer_size`` must match, ``seed``
        is unused (the saved sampler goes on) and the other ``kwargs`` are overrides."""
        buffer = buffer_checkpoint.open_or_create(
            cast("type[ReplayBuffer]", cls), directory, kwargs
        )
        buffer._home = Path(os.path.abspath(directory))
        return buffer
