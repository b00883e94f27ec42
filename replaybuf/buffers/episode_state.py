"""A ``SyncEpisodeReplayBuffer``'s persistence: ``state_dict``, checkpoints, metadata files.

A part of :class:`~replaybuf.buffers.episodes.SyncEpisodeReplayBuffer` (which inherits it),
kept apart so that each module holds one concern; its checks and formats are
:mod:`replaybuf.persist`'s.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from replaybuf.buffers.locking import synchronized
from replaybuf.episodes import (
    EpisodeCore,
)
from replaybuf.errors import ArgumentError
from replaybuf.persist import episodes as episode_checkpoint
from replaybuf.persist import metadata
from replaybuf.persist.episodes import EpisodeParts
from replaybuf.persist.state import source_of
from replaybuf.sampling import (
    DeviceDraws,
    Paths,
)
from replaybuf.storage import NORMAL_TENSORS, FieldSpec

# The buffer inherits this class: imported for annotations only. Its classmethods take ``cls``
# to be the buffer (or a subclass), and say so to the type checker with ``cast``.
if TYPE_CHECKING:
    from replaybuf.buffers.episodes import SyncEpisodeReplayBuffer


KIND = "EpisodeReplayBuffer"


class EpisodePersistence:
    """State, checkpoints and metadata of a :class:`SyncEpisodeReplayBuffer` (its base)."""

    # What the buffer provides (set in SyncEpisodeReplayBuffer.__init__).
    _lock: Any
    _calling: bool
    _core: EpisodeCore
    _generator: torch.Generator
    _draws: DeviceDraws
    _paths: Paths | None
    _home: Path | None
    max_steps: int
    max_episodes: int | None
    min_steps: int
    frame_stack: int | None
    frame_stack_padding: str
    layout: str
    ragged: str
    device: torch.device
    storing_device: torch.device

    if TYPE_CHECKING:  # declared for the type checker; the buffer defines them

        @property
        def spec(self) -> FieldSpec | None: ...

        def _check_open(self) -> None: ...

        def _new_core(self) -> EpisodeCore: ...

    # ----------------------------------------------------------------- state
    def _parts(self, core: EpisodeCore | None = None) -> EpisodeParts:
        """This buffer's configuration and components (with ``core`` instead of its own)."""
        return EpisodeParts(
            self.max_steps,
            self.max_episodes,
            self.min_steps,
            self.frame_stack,
            self.frame_stack_padding,
            self.layout,
            self.ragged,
            self.device,
            self.storing_device,
            self._core if core is None else core,
            self._generator,
            self._draws,
        )

    @synchronized
    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """The whole buffer in memory, as a checkpoint holds it (RLlib's ``get_state``).

        ``{"kind": "EpisodeReplayBuffer", "meta": {...}, "tensors": {...}}``: stored rows,
        episodes (in progress too), row links, anchors, free rows, priorities, counters,
        config and sampler state, under the names a checkpoint gives them. ``copy=False``
        hands out the stored rows by reference (views that later writes change).
        """
        self._check_open()
        return episode_checkpoint.compose(self._parts(), copy)

    @synchronized
    @NORMAL_TENSORS
    def load_state_dict(self, state: Any) -> None:
        """Replace this buffer's contents by ``state`` (a :meth:`state_dict` of a buffer with
        the same ``max_steps``, ``max_episodes``, frame stacking and prioritization; RLlib's
        ``set_state``): episodes in progress continue, sampling draws what that buffer would.

        Everything is checked first, and the state is restored into fresh storage that
        replaces this buffer's only once it is complete: on any error, which names the field,
        the buffer is left as it was.
        """
        self._check_open()
        source = source_of(state, episode_checkpoint.KIND)
        where = f"checkpoint {str(source.directory)!r}"
        saved = episode_checkpoint.check(source, where)
        episode_checkpoint.check_fits(saved, self._parts(), where)
        core = self._core
        pristine = core.allocations == 0 and core.next_id == 0 and not core.episodes
        if not pristine:
            core = self._new_core()
        generator = torch.Generator(device=self.storing_device)
        draws = DeviceDraws(self.storing_device, self._draws.seed)
        parts = dataclasses.replace(self._parts(core), generator=generator, draws=draws)
        try:
            episode_checkpoint.restore(parts, saved, source)
        except BaseException:
            core.slots.close()
            if pristine:  # as it was: empty, with storage of its own
                self._core = self._new_core()
            raise
        if not pristine:
            self._core.slots.close()
        self._draws.clear()
        self._core, self._generator, self._draws = core, generator, draws
        self._paths = None

    # ----------------------------------------------------------------- checkpoints
    @synchronized
    def save_checkpoint(
        self, directory: str | os.PathLike | None = None, *, durable: bool = True
    ) -> Path:
        """Save everything (rows, episodes in progress, counters, sampler state) atomically.

        Replaces the checkpoint at ``directory`` (default: the one :meth:`open` was given);
        ``durable=False`` skips fsync: safe against a killed process, not against power loss.
        """
        target, state = self.begin_checkpoint(directory)
        try:
            return episode_checkpoint.write(target, state, durable)
        finally:
            self.end_checkpoint()

    @synchronized
    def begin_checkpoint(self, directory: str | os.PathLike | None) -> tuple[Path, Any]:
        """Pin the rows and take the state (index copies, row views) a checkpoint writes;
        :meth:`end_checkpoint` must follow once it is written."""
        self._check_open()
        target = self._home if directory is None else Path(directory)
        if target is None:
            raise ArgumentError(
                "save_checkpoint() needs a directory: this buffer was not made by open(directory)"
            )
        self._core.pin()
        try:
            return target, self.state_dict(copy=False)
        except BaseException:
            self._core.unpin()
            raise

    @synchronized
    def end_checkpoint(self) -> None:
        """Release the rows pinned by :meth:`begin_checkpoint`."""
        self._core.unpin()

    @classmethod
    @NORMAL_TENSORS
    def load_checkpoint(
        cls, directory: str | os.PathLike, **overrides: Any
    ) -> SyncEpisodeReplayBuffer:
        """A new buffer holding the checkpoint at ``directory``: episodes in progress continue,
        sampling draws what the saved one would have. ``overrides``: ``device``,
        ``storing_device``, ``storage``, ``scratch_dir``, ``min_steps``."""
        return episode_checkpoint.load(
            cast("type[SyncEpisodeReplayBuffer]", cls), directory, overrides
        )

    @classmethod
    def open(cls, directory: str | os.PathLike, **kwargs: Any) -> SyncEpisodeReplayBuffer:
        """Load the checkpoint at ``directory``, else create ``cls(**kwargs)``; either way a
        later ``save_checkpoint()`` writes there (the Reverb manager's create-or-load)."""
        buffer = episode_checkpoint.open_or_create(
            cast("type[SyncEpisodeReplayBuffer]", cls), directory, kwargs
        )
        buffer._home = Path(os.path.abspath(directory))
        return buffer

    # ----------------------------------------------------------------- metadata
    @synchronized
    def save(self, path: str | os.PathLike) -> metadata.SavedMetadata:
        """Write metadata, **not the rows**, to ``path + ".metadata"``, atomically, as JSON.

        Counters, capacity, storage, devices, field spec and frame stacking; the episodes are
        not saved (:meth:`save_checkpoint` saves them). Returns a
        :class:`~replaybuf.persist.metadata.SavedMetadata` (``contents_saved=False``), and the
        first save of a process logs a warning saying so.
        """
        self._check_open()
        core = self._core
        target = metadata.write_metadata(
            path,
            KIND,
            {
                "max_steps": self.max_steps,
                "max_episodes": self.max_episodes,
                "rows": core.slots.capacity,
                "storage": core.slots.reported_kind,
                "device": str(self.device),
                "storing_device": str(self.storing_device),
                "spec": None if self.spec is None else self.spec.to_json(),
                "episodes": len(core.episodes),
                "steps": core.steps,
                "valid_steps": core.valid_steps,
                "next_episode_id": core.next_id,
                "evicted_episodes": core.evicted,
                "frame_stack": self.frame_stack,
                "frame_stack_padding": self.frame_stack_padding,
            },
        )
        return metadata.saved_metadata(target)

    @synchronized
    @NORMAL_TENSORS
    def load(self, path: str | os.PathLike) -> dict[str, Any]:
        """Read and check metadata; an empty buffer adopts its field spec. Returns it.

        As for :meth:`ReplayBuffer.load`, counters describe rows the file does not hold, so they
        are reported, not adopted. A mismatching ``max_steps`` or spec raises MetadataError.
        """
        self._check_open()
        document = metadata.read_metadata(path, KIND)
        stacking = (self.frame_stack, self.frame_stack_padding)
        spec = metadata.check_episode_metadata(document, self.max_steps, stacking, self.spec)
        if spec is not None and self.spec is None:
            self._core.slots.prepare(spec)
        return document
