"""The synchronous episode core: the episode table, row allocation, staging and flushes.

The episode contract, stated once:

* ``start_episode`` returns a new id (unique for the buffer's life).
* ``append_observation_action_reward(id, obs_t, action_t, reward_t)`` records step t: the
  observation the action was taken in, the action, and the reward received for it.
* ``end_episode(id, status, final_observation=obs_T)`` records how the episode ended:
  ``terminated`` (no bootstrap past obs_T) or ``truncated`` (a time limit: bootstrap from obs_T).

Each observation is stored once, as one row; step t's ``next_observation`` is the row linked
after it (see :mod:`replaybuf.core.index`). Steps are staged in memory and written to TorchRL
storage in chunks (each TorchRL write call has a large fixed cost); every read flushes first,
so reads always see every completed append.

With ``frame_stack=k`` each row still holds one observation (one frame); rows also keep a
reverse link ``prev_row`` so sampling rebuilds each k-frame stack from the episode's own
previous rows (see :func:`replaybuf.core.index.stack_rows`).

:class:`EpisodeCore` holds the state and the write paths; each part of the work lives in its
own module beside it:

* :mod:`~replaybuf.episodes.episode`: one episode's bookkeeping, the statuses;
* :mod:`~replaybuf.episodes.links`: the per-row columns (links, owners, steps, end kinds);
* :mod:`~replaybuf.episodes.anchors`: the rows a sample may start at;
* :mod:`~replaybuf.episodes.checks`: converting and checking appended steps and final
  observations;
* :mod:`~replaybuf.episodes.assign`: handing free rows to new steps, their bookkeeping staged;
* :mod:`~replaybuf.episodes.batch_run`: ``append_batch``'s lockstep bookkeeping;
* :mod:`~replaybuf.episodes.staging`: staged rows and bookkeeping, applied at a flush;
* :mod:`~replaybuf.episodes.eviction`: which episodes go to make room, and freeing their rows.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from replaybuf.accel.numba_loader import compiled_kernels
from replaybuf.core import END_NONE
from replaybuf.episodes.anchors import AnchorSet
from replaybuf.episodes.assign import assign_row, assign_rows, final_row
from replaybuf.episodes.batch_run import BatchRun, Packed
from replaybuf.episodes.checks import final_observation_leaves, step_rows, zero_fields
from replaybuf.episodes.episode import Episode
from replaybuf.episodes.eviction import make_room, remove_episode
from replaybuf.episodes.finished import FinishedOrder
from replaybuf.episodes.links import RowLinks, check_bookkeeping_space
from replaybuf.episodes.spares import Spares
from replaybuf.episodes.staging import (
    admit,
    apply_packed,
    apply_staged,
    drop_run,
    flush_if_full,
    stage,
)
from replaybuf.errors import EpisodeStateError
from replaybuf.priority import Prioritizer
from replaybuf.storage import (
    Field,
    FieldSpec,
    Key,
    Leaf,
    Ragged,
    RowPlan,
    RowStager,
    SlotStorage,
    nest,
)

_EPISODE_ID_TYPES = (int, np.integer)


class EpisodeCore:
    """Episodes in TorchRL storage: the state every public episode method works on."""

    def __init__(
        self,
        slots: SlotStorage,
        max_steps: int,
        max_episodes: int | None,
        frame_stack: int | None = None,
        frame_padding: str = "reset",
        declared: FieldSpec | None = None,
    ) -> None:
        self.slots = slots
        self.declared = declared  # fields declared up front (spec=), all or some of them
        self.max_steps = max_steps
        self.max_episodes = max_episodes
        self.frame_stack = frame_stack  # None: observations are returned as stored
        self.frame_padding = frame_padding  # before an episode's first frame: "reset" or "zero"
        capacity = slots.capacity
        device = slots.storing_device
        check_bookkeeping_space(capacity, device, frame_stack is not None)
        # replaybuf.accel.numba_kernels (None: numpy), chosen and loaded (on a fresh install:
        # compiled) here, not at the first write or sample: the bookkeeping writes run on the
        # host whatever the storing device; the n-step index math uses them on CPU storage.
        host_kernels = compiled_kernels()
        self.kernels = host_kernels if device.type == "cpu" else None
        if self.kernels is not None:  # rows of interleaved episodes land all over the columns
            slots.row_scatter = self.kernels.scatter_rows
        slots.rows_hint = self.rows_when_full
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
        # The last append_batch's episodes (see BatchRun); dropped whenever an episode in
        # progress ends or goes.
        self._run: BatchRun | None = None
        self.finished = FinishedOrder()  # (seq, episode_id) of finished episodes
        self.spares = Spares()  # evicted records that starts reuse
        self.next_id = 0
        self.next_seq = 0
        self.steps = 0
        self.valid_steps = 0
        self.evicted = 0
        self.flushes = 0  # completed flushes (see Episode.end_flush)
        self._stager: RowStager | None = None  # created once the spec is known
        self._plan: RowPlan | None = None  # the per-step fast path, with the stager
        # Bookkeeping staged with the rows: appended per step to flat lists (``list += tuple``
        # is far cheaper per step than ``array.extend``), packed into int64 columns whenever the
        # staged rows are written (so at most a staging buffer's worth is ever held as Python
        # ints); flush reads each column as a numpy array through its buffer (no per-int
        # conversion).
        self._staged_meta: list[int] = []  # 5 per row: row, episode, step, end kind, allocation
        self._staged_links: list[int] = []  # 2 per link: row, next row
        # The packed form, one int64 array per column (append_batch extends them whole).
        self._packed = Packed()
        self.allocations = 0  # rows ever handed out
        self.priorities: Prioritizer | None = None  # set by a prioritized buffer
        self._filler: dict[Key, torch.Tensor] | None = None  # action/reward/extras zeros
        # Observation fields fixed by a zero-step episode's final observation, before any step
        # fixed the whole spec: the first step's observation must match them.
        self._first_obs_spec: FieldSpec | None = None
        # Per length, the id of the last episode found with that many valid steps (holds_steps)
        self._witness: dict[int, int] = {}
        # Whether the bulk paths (end_many's batched final rows, evictions of several episodes
        # in one pass) run; False runs them one episode at a time, the reference the tests
        # compare them with (the results are the same).
        self.batched = True

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
        """The stored episode ``episode_id`` if in progress, or :class:`EpisodeStateError`."""
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
        data = {"observation": observation, "action": action, "reward": reward}
        spec, first, k = self.slots.spec, self._first_obs_spec, self.frame_stack
        return step_rows(data, extras, batched, what, spec, first, k, self.declared)

    def final_row_data(self, final_observation: Any, what: str) -> dict[Key, Leaf]:
        """A final-observation row: the observation, with action/reward/extras zero-filled."""
        spec = self.slots.spec
        obs = final_observation_leaves(
            final_observation, what, spec, self._first_obs_spec, self.frame_stack, self.declared
        )
        if spec is None:
            return obs
        if self._filler is None:
            self._filler = zero_fields(spec)
        return {**self._filler, **obs}

    # ----------------------------------------------------------------- removal and pinning
    def remove_episode(self, episode: Episode) -> None:
        """Drop an episode and free its rows (staged writes must be flushed already)."""
        remove_episode(self, episode)

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
        """Start a new episode (evicting to stay within ``max_episodes``); returns its id."""
        make_room(self, 0, 0, 1, set())
        episode_id = self.next_id
        self.register(
            self.spares.episodes(range(episode_id, episode_id + 1), agent_id, self.next_seq)[0]
        )
        self.next_id += 1
        self.next_seq += 1
        return episode_id

    def rows_when_full(self) -> int:
        """The rows a full buffer holds: ``max_steps`` steps and a final row for each episode
        that ended, at the mean length of the episodes stored now (at most the rows kept)."""
        holding = sum(1 for e in self.episodes.values() if e.steps)
        mean = self.steps / holding if holding else 1.0
        finals = math.ceil(self.max_steps / max(mean, 1.0))
        return min(self.slots.capacity, self.max_steps + finals)

    def register(self, episode: Episode) -> None:
        """Add a new or restored episode to the table (and to ``running`` if in progress)."""
        self.episodes[episode.episode_id] = episode
        if episode.end_kind == END_NONE:
            self.running[episode.episode_id] = episode

    def append(self, episodes: list[Episode], rows: dict[Key, torch.Tensor]) -> None:
        """Stage one step for each episode (``rows`` holds one row per episode)."""
        flush_if_full(self, len(episodes))
        make_room(self, len(episodes), len(episodes), 0, {e.episode_id for e in episodes})
        if self.slots.spec is None:
            # Only now, when nothing can refuse the append any more, may it fix the spec: the
            # first step's fields, with what was declared up front (a ragged field's reserve).
            found = FieldSpec.of(rows, 1)
            declared: Mapping[Key, Field] = self.declared or {}
            reserved = {k: declared[k] for k in declared if k in found}
            self.slots.prepare(FieldSpec({**found, **reserved}))
        stage(self, assign_rows(self, episodes), rows)

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
        if evict or stager.pending >= stager.capacity:
            # Evicting or writing a full stager changes storage: the step is checked in the
            # spare row first, so that a declined value still leaves everything as it was.
            if not plan.stage(stager.capacity, step):
                return False
            self._room_to_stage(bool(evict), 1, episode)  # may refuse: nothing changed
            stager.stage_spare(assign_row(self, episode), plan.arrays)
            return True
        # The step goes straight into the next staging row, which only counts once its storage
        # row is assigned below: a declined value leaves nothing.
        if not plan.stage(len(stager.rows), step):
            return False
        stager.rows.append(assign_row(self, episode))
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
        flush_if_full(self, count)
        cap = self.max_episodes
        if (
            self.steps + count > self.max_steps
            or len(self.free) < count
            or (cap and len(self.episodes) > cap)
        ):
            make_room(self, count, count, 0, self._protected(episodes))  # may refuse
        # Nothing can refuse from here on (the values were checked, the rows are free).
        rows = assign_rows(self, episodes)
        if count <= stager.capacity:  # the usual: one part, not sliced
            # Straight into storage where the values allow it (one pass over memory, where
            # staging makes three); their bookkeeping waits for the flush as staged rows' does.
            if self.slots.write_batch(rows, stager.keys, values):
                stager.direct += count
            else:
                stager.put(values, rows)
            return True
        # More environments than a stager holds (thousands, from EnvPool say) go through it in
        # parts (it is empty now: see flush_if_full), a flush before each part after the
        # first, which places the bookkeeping of rows staged next; nothing reads in between.
        for begin in range(0, count, stager.capacity):
            if begin:
                self.flush()
            end = min(begin + stager.capacity, count)
            stager.put([value[begin:end] for value in values], rows[begin:end])
        return True

    def _protected(self, episodes: list[Episode]) -> set[int]:
        """The ids of ``episodes``, which an eviction for their own steps must spare (kept by
        the batch run while they are its episodes: a vector env's every step)."""
        run = self._run
        if run is not None and episodes is run.episodes:
            if run.protected is None:
                run.protected = set(run.episode_ids)
            return run.protected
        return {episode.episode_id for episode in episodes}

    def repeat_batch(self, episode_ids: list[Any]) -> list[Episode] | None:
        """The episodes of the last ``append_batch`` if ``episode_ids`` names them again
        (:meth:`BatchRun.repeated`); else None (check them)."""
        return None if self._run is None else self._run.repeated(episode_ids)

    def in_progress_all(self, episode_ids: list[Any], action: str) -> list[Episode]:
        """:meth:`in_progress` for several ids (the precise error for the first bad one)."""
        # The common case, plain ints of episodes in progress, in C-level passes (one call
        # per episode of every append_batch); anything else gets in_progress's checks.
        if set(map(type, episode_ids)) == {int}:  # a bool would find episode 0 or 1
            found = list(map(self.running.get, episode_ids))
            if all(found):  # no None: an Episode is always true (mypy cannot narrow a list)
                return found  # type: ignore[return-value]
        in_progress = self.in_progress
        return [in_progress(episode_id, action) for episode_id in episode_ids]

    def end(self, episode: Episode, end_kind: int, final: dict[Key, Leaf]) -> None:
        """Record the end of an episode with its final observation row."""
        if episode.rows:
            flush_if_full(self, 1)
            make_room(self, 0, 1, 0, {episode.episode_id})
            row = final_row(self, episode, end_kind)
            stage(self, [row], {key: value.unsqueeze(0) for key, value in final.items()})
        else:
            # A copy: the caller may reuse its arrays.
            copies = {k: v.clone() for k, v in final.items() if not isinstance(v, Ragged)}
            episode.final_observation = TensorDict(nest(copies), batch_size=[])
            kept = {k: v for k, v in final.items() if isinstance(v, Ragged)}
            episode.final_ragged = kept or None  # Ragged values are already copies
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
        if evict or stager.pending >= stager.capacity:  # as append_one: the spare row first
            if not plan.stage_final(stager.capacity, observation):
                return False
            self._room_to_stage(bool(evict), 0, episode)  # may refuse: nothing changed
            stager.stage_spare(final_row(self, episode, end_kind), plan.arrays)
        else:
            if not plan.stage_final(len(stager.rows), observation):
                return False
            stager.rows.append(final_row(self, episode, end_kind))
        self._finish(episode, end_kind)
        return True

    def _room_to_stage(self, evict: bool, steps: int, episode: Episode) -> None:
        """Make room for ``steps`` steps and a row of ``episode`` (``evict``) and for a staging
        row (a full stager is written first). Only making room may refuse, and then nothing
        stored changed."""
        flush_if_full(self, 1)
        if evict:
            make_room(self, steps, 1, 0, {episode.episode_id})

    def _finish(self, episode: Episode, end_kind: int) -> None:
        """Mark ``episode`` ended: out of ``running`` and the batch run, onto the finished heap."""
        episode.end_kind = end_kind
        episode.end_flush = self.flushes
        del self.running[episode.episode_id]
        drop_run(self)
        self.finished.push((episode.seq, episode.episode_id))

    # ----------------------------------------------------------------- row ids
    def row_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Ids of the rows' current contents, unique for life (see :meth:`RowLinks.ids`)."""
        return self.links.ids(rows)

    def live_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, live)`` for ids from :meth:`row_ids` (see :meth:`RowLinks.live`)."""
        return self.links.live(ids, self.allocations)

    def live_rows_host(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`live_rows` on the host columns (see :meth:`RowLinks.live_host`)."""
        return self.links.live_host(ids, self.allocations)

    def flush(self) -> None:
        """Write staged rows to storage and apply the staged bookkeeping (on the host; a
        device copy follows when read): before every read, whenever the stager is full (so
        the pending bookkeeping stays within a stager's rows) and before an eviction of rows
        still staged."""
        stager, run = self._stager, self._run
        if (
            (run is None or run.packed == len(run.batches))  # no batch of the run pending
            and not self._staged_meta
            and not self._staged_links
            and not self._packed.rows
            and (stager is None or not len(stager))
        ):
            # Nothing staged (a read after a read, the usual case when sampling): every row is
            # written and placed, so this counts as a flush as any other does. Eviction reads
            # the count (``flushed``), and a restored buffer evicts as the saved one would only
            # if an episode that ended staging nothing (no steps) reads as flushed after it.
            if stager is not None:
                stager.direct = 0  # (rows written straight come with a batch run's pending)
            self.flushes += 1
            return
        if stager is not None and len(stager):
            last = stager.rows[-1]
            slots, values = stager.drain()
            self.slots.write_rows(slots, stager.keys, values, last, stager.words)
        if run is not None and self.links.compiled and self.priorities is None:
            # The run's batches straight into the columns in one compiled pass, after what was
            # packed before them (staging order), which saves packing them first. Not with
            # priorities: there each part's admission writes the priority tree (a host copy on
            # CUDA), so they stay one packed part.
            apply_packed(self)
            taken = run.pending()
            if taken is not None:
                starts = self.links.place_batches(*taken)
                run.commit()  # only now: a failed placement leaves the batches pending
                admit(self, starts)
        apply_staged(self)
        if stager is not None:
            stager.direct = 0  # their rows' bookkeeping is placed now too
        self.flushes += 1  # only now: everything staged before is in storage

    def clear(self) -> None:
        """Drop every episode (ids keep counting up, so old ids stay invalid)."""
        self.flush()
        for episode in list(self.episodes.values()):
            self.remove_episode(episode)
