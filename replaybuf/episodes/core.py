"""The synchronous episode core: lifecycle, row allocation, eviction and staging.

The episode contract, stated once:

* ``start_episode`` returns a new id (unique for the buffer's life).
* ``append_observation_action_reward(id, obs_t, action_t, reward_t)`` records step t: the
  observation the action was taken in, the action, and the reward received for it.
* ``end_episode(id, status, final_observation=obs_T)`` records how the episode ended:
  ``terminated`` (no bootstrap past obs_T) or ``truncated`` (a time limit: bootstrap from obs_T).

Each observation is stored once, as one row; step t's ``next_observation`` is the row linked
after it (see :mod:`replaybuf.core.index`). Steps are staged in memory and written to TorchRL
storage
in chunks (TorchRL's per-call write costs tens of microseconds); every read flushes first, so
reads always see every completed append.

With ``frame_stack=k`` each row still holds one observation (one frame); rows also keep a
reverse link ``prev_row`` so sampling rebuilds each k-frame stack from the episode's own
previous rows (see :func:`replaybuf.core.index.stack_rows`).
"""

from __future__ import annotations

import heapq
import tempfile
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDict

from replaybuf.accel.numba_loader import compiled_kernels
from replaybuf.core import END_NONE, END_TERMINATED, END_TRUNCATED, jump_tables
from replaybuf.episodes.anchors import AnchorSet
from replaybuf.errors import EpisodeStateError, InsufficientSpaceError, ReplayBufError, SchemaError
from replaybuf.priority import Prioritizer
from replaybuf.storage import (
    DeviceMirror,
    FieldSpec,
    Key,
    RowPlan,
    RowStager,
    SlotStorage,
    build_tensordict,
    free_bytes,
    nest,
    to_device_async,
    to_leaves,
)

_CPU = torch.device("cpu")  # host bookkeeping lives here, whatever torch's default device
STATUSES = {"terminated": END_TERMINATED, "completed": END_TERMINATED, "truncated": END_TRUNCATED}
# Keys sampling and get_episode return; an extras field must not shadow one of them.
RETURNED_KEYS = frozenset(
    {
        "observation",
        "action",
        "reward",
        "next_observation",
        "terminal",
        "truncated",
        "next_discount",
        "actual_n",
        "start_step",
        "episode_id",
        "cut",
        "step",
        "mask",
        "index",
        "weight",
        "terminated",
        "length",
    }
)
_NUMBERS = (bool, int, float, np.number, np.bool_)
_EPISODE_ID_TYPES = (int, np.integer)
# Staged rows written in one storage call (a flush): _FLUSH_ROWS, or as many as fill
# _FLUSH_BYTES for small rows (up to 8x): each flush costs tens of µs on top of its rows
# (4,096 rows of 100 bytes: ~1 µs less per 64-env append_batch than 512).
_FLUSH_ROWS = 512
_FLUSH_BYTES = 1 << 19
FRAME_PADDINGS = ("reset", "zero")  # gymnasium FrameStackObservation's padding_type values


@dataclass
class Episode:
    """One episode's bookkeeping on the host."""

    episode_id: int
    agent_id: str
    seq: int  # start order
    # Rows of obs_0 .. obs_{steps-1}, as far as settled (read :attr:`rows`): int64, so that
    # freeing them is a buffer copy, not a conversion of Python ints.
    own: array = field(default_factory=lambda: array("q"))
    final_row: int | None = None
    end_kind: int = END_NONE  # END_NONE while in progress
    final_observation: TensorDict | None = None  # only for episodes ended with zero steps
    # The append_batch run this episode is in, which may hold rows not yet in ``own``.
    run: _BatchRun | None = field(default=None, repr=False, compare=False)
    # The core's flush count when the episode ended: once a flush follows, every row of it is
    # in storage (-1: restored from a checkpoint, all of it in storage).
    end_flush: int = field(default=-1, repr=False, compare=False)

    @property
    def rows(self) -> array:
        """Rows of obs_0 .. obs_{steps-1} (the batch run's pending rows settled first)."""
        if self.run is not None:
            self.run.settle_rows()
        return self.own

    @property
    def steps(self) -> int:
        return len(self.rows)

    @property
    def in_progress(self) -> bool:
        return self.end_kind == END_NONE

    @property
    def valid_steps(self) -> int:
        """Steps whose next observation exists (sampling anchors)."""
        return self.steps if not self.in_progress else max(self.steps - 1, 0)

    @property
    def status(self) -> str:
        return {END_NONE: "in_progress", END_TERMINATED: "terminated"}.get(
            self.end_kind, "truncated"
        )


class RowsPinned(ReplayBufError, RuntimeError):
    """No free row while a checkpoint snapshot pins evicted rows; retry after it finishes."""


class HostLinks(NamedTuple):
    """numpy views of :class:`RowLinks` columns on the host (``RowLinks.host`` on the CPU)."""

    succ: np.ndarray
    end_kind: np.ndarray
    step: np.ndarray
    episode: np.ndarray
    next_row: np.ndarray
    alloc: np.ndarray
    prev_row: np.ndarray | None


class _Column:
    """A :class:`RowLinks` column as readers see it: on the storing device, up to date.
    Read-only: an assignment would hide the column from later updates."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, links: RowLinks | None, owner: type | None = None) -> Any:
        if links is None:  # on the class
            return self
        return links.column(self.name)

    def __set__(self, links: RowLinks, value: object) -> None:
        raise AttributeError(f"RowLinks.{self.name} is read-only: write through place/connect")


def _int64(values: np.ndarray) -> np.ndarray:
    """Row indices as the compiled writes take them: contiguous int64 (no copy when they are)."""
    return np.ascontiguousarray(values, dtype=np.int64)


class RowLinks:
    """Per-row bookkeeping: links, owners, steps and end kinds, read on the storing device.

    Every write (:meth:`place`, :meth:`connect`, :meth:`release`, from int64 numpy arrays)
    runs on numpy columns on the host: a numpy fancy index costs ~0.8 µs, a torch one ~5 µs on
    the CPU and a launch plus a copy on CUDA, and a flush makes a dozen. On the CPU the
    columns are the tensors readers get (``host`` holds their numpy views, for the numpy
    index math). Elsewhere (``mirror``) readers get a device copy, updated when read (see
    :mod:`replaybuf.storage.mirror`); tests mirror on the CPU too.
    """

    next_row = _Column()
    # next_row with a self-loop where it is -1, so that following links is one gather per
    # step with no mask (see index.nstep_windows). Derived: every write to next_row sets it.
    succ = _Column()
    episode = _Column()
    step = _Column()
    end_kind = _Column()
    # Which allocation of the row holds it now: an id handed out with a sample stays
    # recognisable after the row is freed and reused (see EpisodeCore.row_ids).
    alloc = _Column()
    # The reverse of next_row (-1 at an episode's first row), kept only for frame stacking.
    prev_row = _Column()

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        backward: bool = False,
        mirror: bool | None = None,
        kernels: ModuleType | None = None,
    ) -> None:
        long = {"dtype": torch.long, "device": _CPU}  # host columns, whatever the default
        self._tensors: dict[str, torch.Tensor | None] = {
            "succ": torch.arange(capacity, **long),
            "end_kind": torch.zeros(capacity, dtype=torch.int8, device=_CPU),
            "step": torch.zeros(capacity, **long),
            "episode": torch.full((capacity,), -1, **long),
            "next_row": torch.full((capacity,), -1, **long),
            "alloc": torch.full((capacity,), -1, **long),
            "prev_row": torch.full((capacity,), -1, **long) if backward else None,
        }
        # The numpy views every write goes through; they share memory with the tensors, which
        # are only ever written in place.
        self._master = HostLinks(
            **{name: None if t is None else t.numpy() for name, t in self._tensors.items()}
        )
        self.version = 0  # bumped whenever succ changes: invalidates the jump tables
        self._jumps: list[torch.Tensor] = []  # index.jump_tables of succ, built on demand
        self._jumps_version = 0
        self._mirror: DeviceMirror | None = None
        self._views = self._tensors
        if mirror or (mirror is None and device.type != "cpu"):
            names = [name for name, t in self._tensors.items() if t is not None]
            self._mirror = DeviceMirror([getattr(self._master, n) for n in names], device)
            self._views = dict.fromkeys(self._tensors)
            self._views.update(zip(names, self._mirror.table, strict=True))
        # numpy views for the n-step sampler on CPU storage (None: it runs in torch, on the
        # device copy, with no host synchronisation).
        self.host: HostLinks | None = None if self._mirror is not None else self._master
        # replaybuf.accel.numba_kernels' place/connect/release loops (None: the numpy paths), with
        # prev_row as an empty column when it is not kept.
        self._kernels = kernels
        no_prev = np.empty(0, np.int64)
        self._prev = no_prev if self._master.prev_row is None else self._master.prev_row

    def column(self, name: str) -> torch.Tensor | None:
        """A column on the storing device, with every write so far."""
        if self._mirror is not None:
            self._mirror.publish()
        return self._views[name]

    def saved(self, name: str) -> torch.Tensor | None:
        """A column's host values (its stored dtype, on the CPU), for checkpoints."""
        return self._tensors[name]

    @property
    def nbytes(self) -> int:
        mirrored = 0 if self._mirror is None else self._mirror.nbytes
        host = sum(t.numel() * t.element_size() for t in self._tensors.values() if t is not None)
        return host + mirrored

    def _touched(self, *rows: np.ndarray) -> None:
        if self._mirror is not None:
            for r in rows:
                self._mirror.touched(r)

    def place(
        self,
        rows: np.ndarray,
        episodes: np.ndarray,
        steps: np.ndarray,
        ends: np.ndarray,
        allocations: np.ndarray,
    ) -> None:
        """Set up new rows (distinct): their episode, step, end kind and allocation; each gets
        no successor (and no predecessor) until :meth:`connect` links it."""
        self.version += 1
        c = self._master
        if self._kernels is not None:
            rows, episodes, steps, ends, allocations = map(
                _int64, (rows, episodes, steps, ends, allocations)
            )
            self._kernels.place_rows(
                rows, episodes, steps, ends, allocations,
                c.next_row, c.succ, c.episode, c.end_kind, c.step, c.alloc, self._prev,
            )  # fmt: skip
            self._touched(rows)
            return
        c.next_row[rows] = -1
        c.succ[rows] = rows
        c.episode[rows] = episodes
        c.step[rows] = steps
        c.end_kind[rows] = ends
        c.alloc[rows] = allocations
        if c.prev_row is not None:
            c.prev_row[rows] = -1
        self._touched(rows)

    def connect(self, sources: np.ndarray, targets: np.ndarray) -> torch.Tensor:
        """Link each of ``sources`` to the row in ``targets`` that follows it; returns
        ``sources`` as a new CPU tensor."""
        self.version += 1
        c = self._master
        if self._kernels is not None:
            sources, targets = _int64(sources), _int64(targets)
            self._kernels.connect_rows(sources, targets, c.next_row, c.succ, self._prev)
        else:
            c.next_row[sources] = targets
            c.succ[sources] = targets
            if c.prev_row is not None:
                c.prev_row[targets] = sources
        if c.prev_row is not None:
            self._touched(targets)
        self._touched(sources)
        return torch.from_numpy(sources.copy())

    @property
    def compiled(self) -> bool:
        """Whether writes run through replaybuf.accel.numba_kernels (and :meth:`place_batches` is
        there)."""
        return self._kernels is not None

    def place_batches(
        self, rows: np.ndarray, ids: np.ndarray, steps: np.ndarray, first: int, tail: np.ndarray
    ) -> torch.Tensor:
        """:meth:`place` and :meth:`connect` for a batch run's batches in one compiled pass
        (:func:`replaybuf.accel.numba_kernels.place_batches`; only when :attr:`compiled`); returns
        the
        rows linked from, the new anchors, as a CPU tensor."""
        if self._kernels is None:
            raise RuntimeError(
                "RowLinks.place_batches needs replaybuf.accel.numba_kernels (see compiled)"
            )
        self.version += 1
        c = self._master
        rows, ids, steps, tail = map(_int64, (rows, ids, steps, tail))
        sources = np.empty_like(rows)
        self._kernels.place_batches(
            rows, ids, steps, first, tail, sources,
            c.next_row, c.succ, c.episode, c.end_kind, c.step, c.alloc, self._prev,
        )  # fmt: skip
        self._touched(rows, sources)
        return torch.from_numpy(sources)

    def release(self, rows: np.ndarray) -> None:
        """Free rows (int64): no episode, successor, predecessor or end kind."""
        self.version += 1
        c = self._master
        if self._kernels is not None:
            rows = _int64(rows)
            self._kernels.release_rows(rows, c.next_row, c.succ, c.episode, c.end_kind, self._prev)
        else:
            c.next_row[rows] = -1
            c.succ[rows] = rows
            c.episode[rows] = -1
            c.end_kind[rows] = END_NONE
            if c.prev_row is not None:
                c.prev_row[rows] = -1
        self._touched(rows)

    def jumps(self, levels: int) -> list[torch.Tensor]:
        """``index.jump_tables`` of ``succ`` (succ^1, succ^2, succ^4, ...), kept until the
        links change; for walks on CUDA (8 bytes a row per level, built on first use)."""
        if self._jumps_version != self.version:
            self._jumps, self._jumps_version = [], self.version
        return jump_tables(self.succ, levels, self._jumps)

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        """Set columns from a checkpoint (host tensors of the saved names), then recompute
        ``succ`` and ``prev_row`` from ``next_row``."""
        for name, value in saved.items():
            column = self._tensors[name]
            assert column is not None, f"no column {name} to restore"
            column.copy_(value)
        c = self._master
        rows = np.arange(c.next_row.shape[0])
        c.succ[:] = np.where(c.next_row >= 0, c.next_row, rows)
        if c.prev_row is not None:
            c.prev_row.fill(-1)
            linked = np.flatnonzero(c.next_row >= 0)
            c.prev_row[c.next_row[linked]] = linked
        self.version += 1
        if self._mirror is not None:
            self._mirror.changed_all()


# Bookkeeping bytes per row on the host: next_row, succ, episode, step, alloc (int64), end_kind
# (int8), the anchor set's two int64 columns and the free list's int64 entry; prev_row adds 8.
# Storage off the CPU also keeps a device copy of the links and anchors, every column int64.
_HOST_ROW_BYTES = 8 * 5 + 1 + 16 + 8
_MIRROR_ROW_BYTES = 8 * 6 + 16


def check_bookkeeping_space(capacity: int, device: torch.device, backward: bool) -> None:
    """Raise :class:`InsufficientSpaceError` before allocating row bookkeeping that cannot fit
    (on the host, and its copy on the storing device; the allocator's own error names no
    argument)."""
    places = [(torch.device("cpu"), _HOST_ROW_BYTES)]
    if device.type != "cpu":
        places.append((device, _MIRROR_ROW_BYTES))
    for place, row_bytes in places:
        needed = capacity * (row_bytes + 8 * backward)
        free = free_bytes("tensor", place, Path(tempfile.gettempdir()))
        if needed > free:
            where = f"{place} memory" if place.type == "cuda" else "host memory (RAM)"
            raise InsufficientSpaceError(f"{where}, for the rows' bookkeeping", needed, free)


class EpisodeCore:
    """Episodes in TorchRL storage: the state every public episode method works on."""

    def __init__(
        self,
        slots: SlotStorage,
        max_steps: int,
        max_episodes: int | None,
        frame_stack: int | None = None,
        frame_padding: str = "reset",
    ) -> None:
        self.slots = slots
        self.max_steps = max_steps
        self.max_episodes = max_episodes
        self.frame_stack = frame_stack  # None: observations are returned as stored
        self.frame_padding = frame_padding  # before an episode's first frame: "reset" or "zero"
        capacity = slots.capacity
        device = slots.storing_device
        check_bookkeeping_space(capacity, device, frame_stack is not None)
        # replaybuf.accel.numba_kernels (None: numpy), chosen and loaded (on a fresh install:
        # compiled)
        # here, not at the first write or sample: the bookkeeping writes run on the host
        # whatever the storing device; the n-step index math uses them on CPU storage.
        host_kernels = compiled_kernels()
        self.kernels = host_kernels if device.type == "cpu" else None
        if self.kernels is not None:  # rows of interleaved episodes land all over the columns
            slots.row_scatter = self.kernels.scatter_rows
        self.links = RowLinks(
            capacity, device, backward=frame_stack is not None, kernels=host_kernels
        )
        self.anchors = AnchorSet(capacity, device, kernels=host_kernels)
        # The free rows, popped from the end (row 0 first); an int64 array, not a list of Python
        # ints (36 bytes a row: 360 MB at 10M rows).
        self.free = array("q", range(capacity - 1, -1, -1))
        # While a checkpoint copies rows outside the lock (pinned), rows freed by eviction wait
        # here instead of being reused, so no row the snapshot references is overwritten.
        self.pinned = False
        self.quarantine: list[int] = []
        self.episodes: dict[int, Episode] = {}  # insertion order = start order
        self.running: dict[int, Episode] = {}  # the episodes in progress (see :meth:`register`)
        # The last append_batch's episodes (see _BatchRun); dropped whenever an episode in
        # progress ends or goes.
        self._run: _BatchRun | None = None
        self.finished: list[tuple[int, int]] = []  # heap of (seq, episode_id)
        self.next_id = 0
        self.next_seq = 0
        self.steps = 0
        self.valid_steps = 0
        self.evicted = 0
        self.flushes = 0  # completed flushes (see Episode.end_flush)
        self._stager: RowStager | None = None  # created once the spec is known
        self._plan: RowPlan | None = None  # the per-step fast path, with the stager
        # Bookkeeping staged with the rows: appended per step to flat lists (``list += tuple``
        # costs a fifth of ``array.extend``), packed into int64 columns whenever the staged rows
        # are written (so at most a staging buffer's worth is ever held as Python ints); flush
        # reads each column as a numpy array through its buffer (no per-int conversion).
        self._staged_meta: list[int] = []  # 5 per row: row, episode, step, end kind, allocation
        self._staged_links: list[int] = []  # 2 per link: row, next row
        # The packed form, one int64 array per column (append_batch extends them whole).
        self._packed = _Packed()
        self.allocations = 0  # rows ever handed out
        self.priorities: Prioritizer | None = None  # set by a prioritized buffer
        self._filler: dict[Key, torch.Tensor] | None = None  # action/reward/extras zeros
        # Observation fields fixed by a zero-step episode's final observation, before any step
        # fixed the whole spec: the first step's observation must match them.
        self._first_obs_spec: FieldSpec | None = None
        # Per length, the id of the last episode found with that many valid steps (holds_steps)
        self._witness: dict[int, int] = {}

    # ----------------------------------------------------------------- lookup
    def holds_steps(self, length: int) -> bool:
        """Whether some stored episode has ``length`` valid steps, so that some anchor has
        ``length`` steps ahead (a strict sequence can start there). O(1) while the episode
        found last for this length is stored (ids are never reused, and a stored episode's
        valid steps never shrink), else a scan from the oldest episode."""
        if self._witness.get(length) in self.episodes:
            return True
        for episode in self.episodes.values():
            if episode.valid_steps >= length:
                self._witness[length] = episode.episode_id
                return True
        self._witness.pop(length, None)
        return False

    def live(self, episode_id: Any, action: str) -> Episode:
        """The stored episode ``episode_id``, or :class:`EpisodeStateError` naming why not."""
        if type(episode_id) is not int and (
            isinstance(episode_id, bool) or not isinstance(episode_id, _EPISODE_ID_TYPES)
        ):
            raise EpisodeStateError(f"episode_id must be an int, got {episode_id!r}")
        episode_id = int(episode_id)  # ids kept in numpy arrays by vectorized envs work too
        episode = self.episodes.get(episode_id)
        if episode is not None:
            return episode
        if 0 <= episode_id < self.next_id:
            raise EpisodeStateError(
                f"cannot {action} episode {episode_id}: it was evicted or cleared"
            )
        raise EpisodeStateError(f"cannot {action} episode {episode_id}: unknown episode id")

    def in_progress(self, episode_id: Any, action: str) -> Episode:
        # A plain int naming an episode in progress takes the dict hit; anything else goes
        # through live()'s checks and messages.
        episode = self.running.get(episode_id) if type(episode_id) is int else None
        if episode is not None:
            return episode
        episode = self.live(episode_id, action)
        if not episode.in_progress:
            raise EpisodeStateError(
                f"cannot {action} episode {episode_id}: it has ended ({episode.status})"
            )
        return episode

    # ----------------------------------------------------------------- input checks
    def step_row(
        self, observation: Any, action: Any, reward: Any, extras: Any, batched: bool, what: str
    ) -> dict[Key, torch.Tensor]:
        """The checked rows (``[rows, ...]`` per key) of appended steps; see :meth:`append`."""
        data: dict[str, Any] = {"observation": observation, "action": action, "reward": reward}
        if extras is not None:
            if not isinstance(extras, dict):
                raise TypeError(f"{what}: extras must be a dict, got {type(extras).__name__}")
            clash = sorted(set(extras) & RETURNED_KEYS)
            if clash:
                raise SchemaError(
                    f"{what}: extras names {clash} collide with keys sampling returns"
                )
            data["extras"] = extras
        if self.slots.spec is None and not batched and isinstance(reward, _NUMBERS):
            # A first reward of 0 must not make every later reward an int: numbers are float32.
            data["reward"] = torch.tensor(float(reward), dtype=torch.float32, device=_CPU)
        dims = 1 if batched else 0
        row = to_leaves(data, batched=batched, what=what, spec=self.slots.spec)
        if self.slots.spec is not None:
            self._check(self.slots.spec, row, dims, what)
        elif self._first_obs_spec is not None:
            self._check(self._first_obs_spec, _observation(row), dims, what)
        if not batched:
            row = {key: value.unsqueeze(0) for key, value in row.items()}
        return row

    def final_row_data(self, final_observation: Any, what: str) -> dict[Key, torch.Tensor]:
        """A final-observation row: the observation, with action/reward/extras zero-filled."""
        obs = to_leaves(
            {"observation": final_observation}, batched=False, what=what, spec=self.slots.spec
        )
        spec = self.slots.spec
        if spec is None:
            if self._first_obs_spec is not None:
                self._check(self._first_obs_spec, obs, 0, what)
            return obs
        self._check(
            FieldSpec({k: f for k, f in spec.items() if k[0] == "observation"}), obs, 0, what
        )
        if self._filler is None:
            self._filler = {
                k: torch.zeros(f.shape, dtype=f.dtype, device=_CPU)
                for k, f in spec.items()
                if k[0] != "observation"
            }
        return {**self._filler, **obs}

    def _check(
        self, spec: FieldSpec, leaves: dict[Key, torch.Tensor], dims: int, what: str
    ) -> None:
        """``spec.check``; a stacked observation given to a frame-stacking buffer says so."""
        try:
            spec.check(leaves, dims, what)
        except SchemaError as exc:
            k = self.frame_stack
            stacked = k is not None and any(
                key in spec
                and key[0] == "observation"
                and tuple(value.shape[dims:]) == (k, *spec[key].shape)
                for key, value in leaves.items()
            )
            if not stacked:
                raise
            raise SchemaError(
                f"{exc} (frame_stack={k}: append one frame per step, e.g. observation[-1] of a "
                "stacked observation; the buffer rebuilds the stack when it samples)"
            ) from None

    # ----------------------------------------------------------------- eviction
    def make_room(self, steps: int, rows: int, episodes: int, protected: set[int]) -> None:
        """Evict whole episodes so that ``steps`` steps, ``rows`` rows and ``episodes`` fit.

        Oldest finished episodes go first (by start order), then oldest in progress; episodes
        in ``protected`` (those being written) never go, and an episode holding no rows goes
        only when the episode count is over. Nothing changes if it cannot be done.
        """
        over_steps = self.steps + steps - self.max_steps
        over_rows = rows - len(self.free)
        over_eps = len(self.episodes) + episodes - self.max_episodes if self.max_episodes else 0
        frees_rows = not self.pinned  # while a snapshot is open, evicted rows stay quarantined
        if over_steps <= 0 and over_rows <= 0 and over_eps <= 0:
            return
        victims: list[Episode] = []
        candidates = self._eviction_order(protected)
        try:
            for episode in candidates:
                holds = episode.steps + (episode.final_row is not None)
                if holds == 0 and over_eps <= 0:
                    continue  # evicting it frees no step or row; only max_episodes needs it
                victims.append(episode)
                over_steps -= episode.steps
                over_rows -= holds if frees_rows else 0
                over_eps -= 1
                if over_steps <= 0 and over_rows <= 0 and over_eps <= 0:
                    break
            else:
                if self.pinned and over_rows > 0:
                    raise RowsPinned("every free row is held by an open checkpoint snapshot")
                raise ValueError(
                    f"cannot make room for {steps} step(s) and {episodes} episode(s): "
                    f"max_steps={self.max_steps}, max_episodes={self.max_episodes}, and "
                    f"episode(s) {sorted(protected)} being written cannot be evicted"
                )
        finally:
            candidates.close()
        # Rows must be written and their bookkeeping placed before they are freed; an episode
        # that ended before the last flush has none pending (a vector env's steady state: each
        # eviction's flush cost ~150 µs, 1,000 scattered rows against 4,096 at a stager's end).
        # With priorities every staged step is admitted first, at the maximum as it stands
        # before the victims' priorities leave the tree.
        if self.priorities is not None or not all(map(self._flushed, victims)):
            self.flush()
        for episode in victims:
            self._evict(episode)

    def _eviction_order(self, protected: set[int]) -> Iterator[Episode]:
        """Candidates in eviction order, popping the finished heap lazily (O(k log E) for k).

        Popped entries go back on the heap when the caller stops; entries of episodes that are
        gone by then are dropped on a later pass (lazy deletion).
        """
        popped: list[tuple[int, int]] = []
        try:
            while self.finished:
                item = heapq.heappop(self.finished)
                episode = self.episodes.get(item[1])
                if episode is None:
                    continue  # stale: evicted or cleared since it finished
                popped.append(item)
                if item[1] not in protected:
                    yield episode
            for episode in list(self.episodes.values()):
                if episode.in_progress and episode.episode_id not in protected:
                    yield episode
        finally:
            for item in popped:
                heapq.heappush(self.finished, item)

    def _flushed(self, episode: Episode) -> bool:
        """Whether every row of ``episode`` is written and placed (it ended before a flush)."""
        return not episode.in_progress and episode.end_flush < self.flushes

    def _evict(self, episode: Episode) -> None:
        self.remove_episode(episode)
        self.evicted += 1

    def remove_episode(self, episode: Episode) -> None:
        """Drop an episode and free its rows (staged writes must be flushed already)."""
        rows = array("q", episode.rows)  # a copy (one memcpy), read below and then reversed
        if episode.final_row is not None:
            rows.append(episode.final_row)
        if rows:
            held = np.frombuffer(rows, np.int64)
            self.anchors.remove_present(held)
            self.links.release(held)
            if self.priorities is not None:  # evicted steps leave the distribution at once
                device = self.slots.storing_device
                self.priorities.remove(to_device_async(torch.from_numpy(held.copy()), device))
            rows.reverse()  # the order pops hand them out again: the episode's own
            if self.pinned:
                self.quarantine.extend(rows)
            else:
                self.free.extend(rows)
        self.steps -= episode.steps
        self.valid_steps -= episode.valid_steps
        del self.episodes[episode.episode_id]  # its heap entry, if any, is dropped lazily
        if self.running.pop(episode.episode_id, None) is not None:
            self._drop_run()

    def pin(self) -> None:
        """Start a snapshot: from now on no row in use is handed out again until :meth:`unpin`."""
        self.flush()
        self.pinned = True

    def unpin(self) -> None:
        """End a snapshot: quarantined rows become free."""
        self.pinned = False
        self.free.extend(self.quarantine)
        self.quarantine = []

    # ----------------------------------------------------------------- writes
    def start(self, agent_id: str) -> int:
        self.make_room(0, 0, 1, set())
        episode_id = self.next_id
        self.register(Episode(episode_id, agent_id, self.next_seq))
        self.next_id += 1
        self.next_seq += 1
        return episode_id

    def register(self, episode: Episode) -> None:
        """Add a new or restored episode to the table (and to ``running`` if in progress)."""
        self.episodes[episode.episode_id] = episode
        if episode.end_kind == END_NONE:
            self.running[episode.episode_id] = episode

    def append(self, episodes: list[Episode], rows: dict[Key, torch.Tensor]) -> None:
        """Stage one step for each episode (``rows`` holds one row per episode)."""
        self._flush_if_full(len(episodes))
        self.make_room(len(episodes), len(episodes), 0, {e.episode_id for e in episodes})
        if self.slots.spec is None:
            # Only now, when nothing can refuse the append any more, may it fix the spec.
            self.slots.prepare(FieldSpec.of(rows, 1))
        self._stage(self._assign_rows(episodes), rows)

    def append_one(
        self, episode: Episode, observation: Any, action: Any, reward: Any, extras: Any
    ) -> bool:
        """Stage one step through the fast path (:mod:`replaybuf.storage.fastrow`) if it applies.

        Returns False, having changed nothing, when it does not (then use :meth:`step_row`
        and :meth:`append`, which convert or raise).
        """
        plan, stager = self._plan, self._stager
        if plan is None or stager is None:
            return False
        step = (observation, action, reward, extras)
        cap = self.max_episodes
        evict = self.steps >= self.max_steps or not self.free or (cap and len(self.episodes) > cap)
        if evict or len(stager.rows) >= stager.capacity:
            # Evicting or writing a full stager changes storage: the step is checked in the
            # spare row first, so that a declined value still leaves everything as it was.
            if not plan.stage(stager.capacity, step):
                return False
            self._room_to_stage(bool(evict), 1, episode)  # may refuse: nothing changed
            stager.stage_spare(self._assign_row(episode), plan.arrays)
            return True
        # The step goes straight into the next staging row, which only counts once its storage
        # row is assigned below: a declined value leaves nothing.
        if not plan.stage(len(stager.rows), step):
            return False
        stager.rows.append(self._assign_row(episode))
        return True

    def append_many(
        self, episodes: list[Episode], observations: Any, actions: Any, rewards: Any, extras: Any
    ) -> bool:
        """:meth:`append_one` for one step of each of ``episodes`` (``append_batch``): values
        of exact dtype and shape ``[len(episodes), ...]`` are sliced straight into the staging
        columns. Returns False, having changed nothing, when the values need the general path.
        """
        plan, stager = self._plan, self._stager
        count = len(episodes)
        if plan is None or stager is None:
            return False
        values = plan.batch_values(count, (observations, actions, rewards, extras))
        if values is None:
            return False
        self._flush_if_full(count)
        cap = self.max_episodes
        if (
            self.steps + count > self.max_steps
            or len(self.free) < count
            or (cap and len(self.episodes) > cap)
        ):
            self.make_room(count, count, 0, {e.episode_id for e in episodes})  # may refuse
        # Nothing can refuse from here on (the values were checked, the rows are free).
        rows = self._assign_rows(episodes)
        if count <= stager.capacity:  # the usual: one part, not sliced (~0.5 µs)
            stager.put(values, rows)
            return True
        # More environments than a stager holds (thousands, from EnvPool say) go through it in
        # parts (it is empty now: see _flush_if_full), a flush before each part after the
        # first, which places the bookkeeping of rows staged next; nothing reads in between.
        for begin in range(0, count, stager.capacity):
            if begin:
                self.flush()
            end = min(begin + stager.capacity, count)
            stager.put([value[begin:end] for value in values], rows[begin:end])
        return True

    def _assign_row(self, episode: Episode) -> int:
        """A free row for one new step of ``episode``, linked after its previous step."""
        # Not the property unless a batch run holds rows (a call less on the per-step path).
        rows = episode.own if episode.run is None else episode.rows
        row = self.free.pop()
        self._staged_meta += (row, episode.episode_id, len(rows), END_NONE, self.allocations)
        if rows:
            self._staged_links += (rows[-1], row)  # as _link, inline: once per step
            self.valid_steps += 1
        rows.append(row)
        self.allocations += 1
        self.steps += 1
        return row

    def _assign_rows(self, episodes: list[Episode]) -> array:
        """:meth:`_assign_row` for each of ``episodes``, in order, in whole-array steps: it runs
        once per ``append_batch``, and a Python loop over the episodes cost ~0.4 µs each."""
        count = len(episodes)
        free = self.free
        cut = len(free) - count
        rows = free[cut:]
        rows.reverse()  # the order count pops would hand them out in
        del free[cut:]
        run = self._run
        if run is not None and episodes is run.episodes and run.allocations == self.allocations:
            # The same episodes as the last batch, and no row handed out since: the run keeps
            # the rows; their bookkeeping and each episode's row array follow from its batches
            # later, a few numpy calls for many batches (_BatchRun.pack and settle_rows).
            run.add(rows, self.allocations + count)
            linked = count
        else:
            self._drop_run()
            self._pack_staged()  # staged bookkeeping stays in staging order
            packed = self._packed
            # Lists from C-level maps, then array.fromlist: array("q", map(...)) costs twice that.
            owns = list(map(_ROWS, episodes))
            steps = array("q", list(map(len, owns)))
            ids = array("q", list(map(_EPISODE_ID, episodes)))
            packed.add_rows(rows, ids, steps, self.allocations)
            if all(steps):  # every episode has a step to link from (all but their first calls)
                packed.sources.fromlist(list(map(_LAST, owns)))
                packed.targets.extend(rows)
                linked = count
            else:
                had = [(own[-1], row) for own, row in zip(owns, rows, strict=True) if own]
                packed.sources.fromlist([source for source, _ in had])
                packed.targets.fromlist([target for _, target in had])
                linked = len(had)
            deque(map(array.append, owns, rows), maxlen=0)  # each episode's new row, in C
            self._run = _BatchRun(episodes, ids, steps, rows, self.allocations + count)
        self.allocations += count
        self.steps += count
        self.valid_steps += linked
        return rows

    def repeat_batch(self, episode_ids: list[Any]) -> list[Episode] | None:
        """The episodes of the last ``append_batch`` if ``episode_ids`` names them again (plain
        ints, same order) and none has ended or been evicted since; else None (check them)."""
        run = self._run
        if run is None or len(episode_ids) != len(run.episode_ids):
            return None
        # Ints first (True == 1 and 1.0 == 1, and comparing arrays raises): a sum of ints is
        # an int, and a float, numpy scalar, array or tensor in it makes something else or
        # raises. A bool adds as an int, but it equals only episode 0 or 1, so a run holding
        # those checks every type (~0.8 µs for 64 ids, the sum ~0.3).
        try:
            if run.low_ids:
                ints = list(map(type, episode_ids)).count(int) == len(episode_ids)
            else:
                ints = type(sum(episode_ids)) is int
            if not ints or episode_ids != run.episode_ids:
                return None
        except Exception:  # whatever a bad id raises here, the checks of every id name it
            return None
        # The caller's int objects: the next call's comparison takes identity shortcuts.
        run.episode_ids = episode_ids
        return run.episodes

    def in_progress_all(self, episode_ids: list[Any], action: str) -> list[Episode]:
        """:meth:`in_progress` for several ids (the precise error for the first bad one)."""
        # The common case, plain ints of episodes in progress, in C-level passes (one call
        # per episode of every append_batch); anything else gets in_progress's checks.
        if set(map(type, episode_ids)) == {int}:  # a bool would find episode 0 or 1
            found = list(map(self.running.get, episode_ids))
            if all(found):  # no None: an Episode is always true
                return found
        in_progress = self.in_progress
        return [in_progress(episode_id, action) for episode_id in episode_ids]

    def end(self, episode: Episode, end_kind: int, final: dict[Key, torch.Tensor]) -> None:
        """Record the end of an episode with its final observation row."""
        if episode.rows:
            self._flush_if_full(1)
            self.make_room(0, 1, 0, {episode.episode_id})
            row = self._final_row(episode, end_kind)
            self._stage([row], {key: value.unsqueeze(0) for key, value in final.items()})
        else:
            # A copy: the caller may reuse its arrays.
            copies = {key: value.clone() for key, value in final.items()}
            episode.final_observation = TensorDict(nest(copies), batch_size=[])
            if self.slots.spec is None and self._first_obs_spec is None:
                self._first_obs_spec = FieldSpec.of(final, 0)
        self._finish(episode, end_kind)

    def end_one(self, episode: Episode, end_kind: int, observation: Any) -> bool:
        """:meth:`end` through the fast path: a final observation of the field's exact shape
        and dtype goes straight into the next staging row (zeros in the other fields).

        Returns False, having changed nothing, when it does not apply (then use
        :meth:`final_row_data` and :meth:`end`, which convert or raise).
        """
        plan, stager = self._plan, self._stager
        if plan is None or stager is None or not episode.rows:
            return False
        cap = self.max_episodes
        evict = self.steps > self.max_steps or not self.free or (cap and len(self.episodes) > cap)
        if evict or len(stager.rows) >= stager.capacity:  # as append_one: the spare row first
            if not plan.stage_final(stager.capacity, observation):
                return False
            self._room_to_stage(bool(evict), 0, episode)  # may refuse: nothing changed
            stager.stage_spare(self._final_row(episode, end_kind), plan.arrays)
        else:
            if not plan.stage_final(len(stager.rows), observation):
                return False
            stager.rows.append(self._final_row(episode, end_kind))
        self._finish(episode, end_kind)
        return True

    def _room_to_stage(self, evict: bool, steps: int, episode: Episode) -> None:
        """Make room for ``steps`` steps and a row of ``episode`` (``evict``) and for a staging
        row (a full stager is written first). Only making room may refuse, and then nothing
        stored changed."""
        self._flush_if_full(1)
        if evict:
            self.make_room(steps, 1, 0, {episode.episode_id})

    def _flush_if_full(self, rows: int) -> None:
        """Flush if the stager cannot take ``rows`` more (or, for more than it holds, a whole
        stager's worth). Every append path calls it before making room: a failed write then
        changes nothing, and flushes and evictions come in the same order on every path (the
        anchor order, so seeded draws, follows it)."""
        stager = self._stager
        if stager is not None and not stager.fits(min(rows, stager.capacity)):
            self.flush()

    def _final_row(self, episode: Episode, end_kind: int) -> int:
        """A free row for ``episode``'s final observation, linked after its last step."""
        row = self.free.pop()
        self._staged_meta += (row, episode.episode_id, episode.steps, end_kind, self._allocate())
        self._link(episode.rows[-1], row)
        episode.final_row = row
        return row

    def _finish(self, episode: Episode, end_kind: int) -> None:
        episode.end_kind = end_kind
        episode.end_flush = self.flushes
        del self.running[episode.episode_id]
        self._drop_run()
        heapq.heappush(self.finished, (episode.seq, episode.episode_id))

    def _allocate(self) -> int:
        self.allocations += 1
        return self.allocations - 1

    def row_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Ids of the rows' current contents: allocation * capacity + row (unique for life)."""
        return self.links.alloc.index_select(0, rows) * self.slots.capacity + rows

    def live_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, live)`` for ids from :meth:`row_ids`; live: still that row's anchor.

        Raises ``IndexError`` for an id no row ever had.
        """
        capacity = self.slots.capacity
        never = (ids < 0) | (ids // capacity >= self.allocations)
        if bool(never.any()):
            raise IndexError(
                f"index must hold ids of sampled steps, got {int(ids[never][0])}, which no "
                "step ever had"
            )
        rows = ids % capacity
        live = (self.links.alloc.index_select(0, rows) == ids // capacity) & (
            self.links.next_row.index_select(0, rows) >= 0
        )
        return rows, live

    def live_rows_host(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`live_rows` in numpy on the host columns, the live rows only: ``(rows[live],
        live)``; None where some id was never a row's (then live_rows raises)."""
        host = self.links.host
        assert host is not None, "the host columns: CPU storage"
        capacity = self.slots.capacity
        made = ids // capacity  # the allocation each id names
        if ids.min() < 0 or made.max() >= self.allocations:
            return None
        rows = ids % capacity
        live = (host.alloc[rows] == made) & (host.next_row[rows] >= 0)
        return rows[live], live

    def _link(self, row: int, next_row: int) -> None:
        self._staged_links += (row, next_row)
        self.valid_steps += 1

    def _stage(self, rows: Sequence[int], data: dict[Key, torch.Tensor]) -> None:
        if self._stager is None:
            row_bytes = max(self.slots.spec.row_bytes, 1)
            size = max(_FLUSH_ROWS, min(8 * _FLUSH_ROWS, _FLUSH_BYTES // row_bytes))
            self._stager = RowStager(self.slots.spec, size)
            self._plan = RowPlan.of(self.slots.spec, self._stager.arrays)
        if not self._stager.fits(len(rows)):
            self.flush()
        if self._stager.fits(len(rows)):
            self._stager.stage(rows, data)
        else:  # more rows than a staging buffer holds: write them straight through
            slots = torch.frombuffer(array("q", rows), dtype=torch.long)
            self.slots.write(
                slots,
                build_tensordict(list(data), list(data.values()), len(rows), torch.device("cpu")),
            )
            self.flush()  # their bookkeeping (the stager is empty)

    def _pack_staged(self) -> None:
        """Move the staged bookkeeping from the batch run and its lists into its int64 columns,
        in staging order (which orders the anchor set, so seeded draws): the run's batches
        come first, as the lists are packed when a run starts and a list entry hands out a
        row, which ends the run's repeats."""
        if self._run is not None:
            self._run.pack(self._packed)
        if self._staged_meta:
            self._packed.add_flat_rows(self._staged_meta)
            self._staged_meta.clear()
        if self._staged_links:
            self._packed.add_flat_links(self._staged_links)
            self._staged_links.clear()

    def _drop_run(self) -> None:
        """End the batch run (an episode of it ended or went, or another batch came): its
        pending batches go into the staged bookkeeping and their episodes' row arrays."""
        run = self._run
        if run is not None:
            self._run = None
            run.pack(self._packed)
            run.settle_rows()
            for episode in run.episodes:
                episode.run = None

    def flush(self) -> None:
        """Write staged rows to storage and apply the staged bookkeeping (on the host; a
        device copy follows when read): before every read, whenever the stager is full (so
        the pending bookkeeping stays within a stager's rows) and before an eviction of rows
        still staged."""
        stager = self._stager
        if stager is not None and len(stager):
            last = stager.rows[-1]
            slots, values = stager.drain()
            self.slots.write_rows(slots, stager.keys, values, last, stager.words)
        run = self._run
        if run is not None and self.links.compiled and self.priorities is None:
            # The run's batches straight into the columns in one compiled pass, after what was
            # packed before them (staging order), instead of packing them first (~0.5 µs less
            # per 64-env append_batch). Not with priorities: there each part's admission
            # writes the priority tree (a host copy on CUDA), so they stay one packed part.
            self._apply_packed()
            taken = run.pending()
            if taken is not None:
                starts = self.links.place_batches(*taken)
                run.commit()  # only now: a failed placement leaves the batches pending
                self._admit(starts)
        self._pack_staged()
        self._apply_packed()
        self.flushes += 1  # only now: everything staged before is in storage

    def _apply_packed(self) -> None:
        """Place and link the packed bookkeeping, and add its anchors."""
        packed = self._packed
        if packed.rows:
            self.links.place(*packed.meta())
            if packed.sources:
                self._admit(self.links.connect(*packed.links()))
            self._packed = _Packed()  # only now: a failed write keeps what it was to apply

    def _admit(self, starts: torch.Tensor) -> None:
        """Add new anchors (CPU int64) to the priorities at their maximum, and to the set.

        The priorities first: an admission that raises (a device allocation, say) leaves the
        set as it was, and the next flush, which applies the same packed bookkeeping again,
        adds each anchor once (the set would hold it twice otherwise)."""
        if self.priorities is not None:  # new steps enter at the current maximum
            self.priorities.admit(to_device_async(starts, self.slots.storing_device))
        self.anchors.add(starts)

    def clear(self) -> None:
        """Drop every episode (ids keep counting up, so old ids stay invalid)."""
        self.flush()
        for episode in list(self.episodes.values()):
            self.remove_episode(episode)


_ROWS, _EPISODE_ID, _LAST = attrgetter("rows"), attrgetter("episode_id"), itemgetter(-1)
# A batch run settles its batches' rows into its episodes' arrays once this many are packed
# (checked at each pack, at every flush), which bounds its pending list.
_SETTLE_BATCHES = 256
Ints = array | np.ndarray


class _BatchRun:
    """The episodes of the last ``append_batch`` and the rows of later batches of the same
    episodes (a vectorized env between resets), so that such a batch costs no per-episode
    work: the core checks the ids once (:meth:`EpisodeCore.repeat_batch`) and keeps the new
    rows here. Their bookkeeping (:meth:`pack`, at a flush) and each episode's row array
    (:meth:`settle_rows`, when read, or once ``_SETTLE_BATCHES`` are packed) are made later for
    many batches at once. Valid while ``allocations`` matches the core's (no row handed out
    since); the core drops it when any episode in progress ends or goes."""

    def __init__(
        self, episodes: list[Episode], ids: array, steps: array, rows: array, allocations: int
    ) -> None:
        self.episodes, self.episode_ids = episodes, ids.tolist()
        self.low_ids = min(self.episode_ids) <= 1  # ids a bool equals (see repeat_batch)
        self.ids = np.frombuffer(ids, np.int64)
        # Each episode's step number in the first batch not yet packed; the rows of the last
        # packed batch, which that batch links from.
        self.steps = np.frombuffer(steps, np.int64) + 1
        self.tail = rows
        self.batches: list[array] = []  # rows of the later batches, oldest first
        self.packed = 0  # of ``batches``, how many are in the staged bookkeeping
        self.settled = 0  # ... and in their episodes' ``own`` arrays
        self.allocations = allocations
        for episode in episodes:
            episode.run = self

    def add(self, rows: array, allocations: int) -> None:
        """One more batch of rows (one per episode, in order); ``allocations``: the core's
        count after it."""
        self.batches.append(rows)
        self.allocations = allocations

    def pending(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray] | None:
        """The batches not packed yet, or None: their rows (flat, batch-major), the episodes'
        ids, each episode's step in the first of them, the first's allocation and the rows
        the first links from (the batch before's). Nothing changes until :meth:`commit`."""
        new = self.batches[self.packed :]
        if not new:
            return None
        rows = np.frombuffer(b"".join(new), np.int64)
        # The run's batches were the last rows handed out, one allocation each, in order.
        first = self.allocations - len(new) * len(self.ids)
        return rows, self.ids, self.steps, first, np.frombuffer(self.tail, np.int64)

    def commit(self) -> None:
        """Count the :meth:`pending` batches as packed (their bookkeeping placed or packed)."""
        batches = len(self.batches) - self.packed
        if not batches:
            return
        self.steps = self.steps + batches  # a new array: a pending() result stays as it was
        self.tail, self.packed = self.batches[-1], len(self.batches)
        if self.packed >= _SETTLE_BATCHES:
            self.settle_rows()

    def pack(self, packed: _Packed) -> None:
        """Add the bookkeeping of the batches not packed yet to ``packed``: each row's
        episode, step and allocation, and the link from the previous batch's row."""
        taken = self.pending()
        if taken is None:
            return
        rows, ids, first_steps, first, tail = taken
        count = len(ids)
        batches = len(rows) // count
        steps = first_steps + np.arange(batches, dtype=np.int64)[:, None]  # [batches, count]
        episodes = np.empty_like(steps)
        episodes[:] = ids
        packed.add_rows(rows, episodes, steps, first)
        packed.sources.frombytes(_bytes(tail))
        packed.sources.frombytes(_bytes(rows[:-count]))
        packed.targets.frombytes(_bytes(rows))
        self.commit()

    def settle_rows(self) -> None:
        """Append the batches' rows to their episodes' ``own`` arrays; drop the batches that
        are packed and settled."""
        new = self.batches[self.settled :]
        if new:
            table = np.frombuffer(b"".join(new), np.int64).reshape(len(new), len(self.ids))
            for episode, rows in zip(self.episodes, table.T.copy(), strict=True):
                episode.own.frombytes(_bytes(rows))
            self.settled = len(self.batches)
        done = min(self.packed, self.settled)
        if done:
            del self.batches[:done]
            self.packed -= done
            self.settled -= done


class _Packed:
    """Staged bookkeeping as int64 columns, from the per-step lists or whole batches."""

    def __init__(self) -> None:
        # New rows: the row, its episode, step, end kind and allocation.
        self.rows, self.episodes, self.steps = array("q"), array("q"), array("q")
        self.ends, self.allocations = array("q"), array("q")
        self.sources, self.targets = array("q"), array("q")  # links: row -> next row

    def add_rows(self, rows: Ints, episodes: Ints, steps: Ints, allocation: int) -> None:
        """New rows of episodes in progress, allocated in order from ``allocation`` (int64
        arrays or contiguous numpy arrays)."""
        count = len(rows)
        self.rows.frombytes(_bytes(rows))
        self.episodes.frombytes(_bytes(episodes))
        self.steps.frombytes(_bytes(steps))
        self.ends.frombytes(bytes(8 * count))  # END_NONE
        numbers = np.arange(allocation, allocation + count, dtype=np.int64)
        self.allocations.frombytes(_bytes(numbers))

    def add_flat_rows(self, flat: list[int]) -> None:
        """New rows from the per-step list: 5 ints per row, in :class:`_Packed` column order."""
        for column, at in zip(self._meta_columns(), range(5), strict=True):
            column.fromlist(flat[at::5])

    def add_flat_links(self, flat: list[int]) -> None:
        """Links from the per-step list: row, next row."""
        self.sources.fromlist(flat[0::2])
        self.targets.fromlist(flat[1::2])

    def _meta_columns(self) -> tuple[array, ...]:
        return self.rows, self.episodes, self.steps, self.ends, self.allocations

    def meta(self) -> tuple[np.ndarray, ...]:
        """Views of the row columns (the arrays must not grow while they are in use)."""
        return tuple(np.frombuffer(column, np.int64) for column in self._meta_columns())

    def links(self) -> tuple[np.ndarray, np.ndarray]:
        return np.frombuffer(self.sources, np.int64), np.frombuffer(self.targets, np.int64)


def _bytes(values: Ints) -> memoryview:
    """The bytes of an int64 array or contiguous numpy array, as ``array.frombytes`` takes
    them (a view, no copy)."""
    return memoryview(values).cast("B")


def _observation(leaves: dict[Key, torch.Tensor]) -> dict[Key, torch.Tensor]:
    return {key: value for key, value in leaves.items() if key[0] == "observation"}
