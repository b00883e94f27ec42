"""``SyncEpisodeReplayBuffer``: the episode buffer's public API as plain calls.

For trainers without an event loop; :class:`replaybuf.EpisodeReplayBuffer` is a lock-guarded
asyncio facade over it. Arguments are validated here, once; the state lives in
:class:`replaybuf.episodes.core.EpisodeCore`. Every method either completes or raises with the
buffer unchanged, under the buffer's lock, so threads may share it
(:mod:`replaybuf.buffers.locking`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replaybuf.args import (
    check_min_steps,
    check_seed,
    positive_int,
    seed_or_draw,
)
from replaybuf.buffers.episode_epochs import EpisodeEpochs
from replaybuf.buffers.episode_records import EpisodeRecords
from replaybuf.buffers.episode_sampling import EpisodeSampling
from replaybuf.buffers.episode_state import EpisodePersistence
from replaybuf.buffers.locking import reentered, synchronized
from replaybuf.episodes import (
    STATUSES,
    EpisodeCore,
    check_frame_stack,
    check_stackable,
    core_stats,
    final_rows_for,
    update_priorities,
)
from replaybuf.episodes.bulk import checked_ends, checked_starts, end_many, start_many
from replaybuf.episodes.steps import append_steps, step_count
from replaybuf.errors import ArgumentError, ArgumentTypeError, BufferClosedError
from replaybuf.priority import Prioritizer, check_beta
from replaybuf.sampling import (
    DeviceDraws,
    Paths,
    check_layout,
    check_ragged_form,
    seed_key,
)
from replaybuf.storage import NORMAL_TENSORS, FieldSpec, SlotStorage, resolve_device, resolve_kind

KIND = "EpisodeReplayBuffer"
_APPEND_ONE = "append_observation_action_reward"  # what errors of the one-step append name


class SyncEpisodeReplayBuffer(EpisodeEpochs, EpisodeRecords, EpisodePersistence, EpisodeSampling):
    """Episodes written step by step, sampled as n-step transitions, sequences or episodes.

    Args:
        max_steps: stored transitions (steps with an action) at most; final observations are
            stored in extra rows (see :func:`replaybuf.episodes.config.final_rows_for`).
        max_episodes: stored episodes at most (checked at ``start_episode``).
        device: where sampled batches are delivered.
        storing_device: where rows are kept (``"cpu"`` or CUDA).
        storage: ``"auto"``, ``"memmap"`` or ``"tensor"``, as for :class:`ReplayBuffer`.
        scratch_dir: existing folder for memmap files (a private subfolder is used).
        seed: seeds sampling (the generator and, on CUDA storage, the device draws' key).
            ``None`` (the default) draws it from torch's global CPU generator (one int64), so
            ``torch.manual_seed(s)`` before the buffer is built repeats its batches; an explicit
            seed leaves the global generator untouched. ``clear()`` keeps the sampler's state.
        min_steps: sampling raises until at least this many valid steps are stored.
        prioritized, alpha, beta, eps, priority_backend: prioritized replay (see
            ``docs/prioritized.md``).
        frame_stack: k to store one frame per step and return every observation as the stack
            of its last k frames in the episode, ``[..., k, *frame]`` (``None``: as stored).
            Append single frames (not stacks); every observation leaf is stacked.
        frame_stack_padding: frames before an episode's first: ``"reset"`` repeats the first
            frame (gymnasium ``FrameStackObservation``'s default), ``"zero"`` gives zeros.
        layout: batches' default layout, ``"replaybuf"`` or ``"torchrl"``
            (:mod:`replaybuf.sampling.layout`).
        spec: fields declared up front, all or some of them (:meth:`FieldSpec.declare`): a
            dict such as ``{"observation": {"prompt": "text", "tokens": Field.ragged()},
            "extras": {"tool_call": "json"}}``. Undeclared fields take the first step's
            shapes; a ``str``, ``bytes`` or JSON-like value is inferred as text, bytes or JSON.
        ragged: how ragged fields come out of n-step batches and episodes: ``"nested"`` (a
            ``torch.nested`` jagged tensor) or ``"padded"`` (zero-padded, with a
            ``<name>_length`` entry). Sequences are always padded.
    """

    @NORMAL_TENSORS
    def __init__(
        self,
        max_steps: int,
        max_episodes: int | None = None,
        *,
        device: torch.device | str = "cpu",
        storing_device: torch.device | str = "cpu",
        storage: str = "auto",
        scratch_dir: str | os.PathLike | None = None,
        seed: int | None = None,
        min_steps: int = 0,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-6,
        priority_backend: str = "auto",
        frame_stack: int | None = None,
        frame_stack_padding: str = "reset",
        layout: str = "replaybuf",
        spec: Any = None,
        ragged: str = "nested",
    ) -> None:
        self._lock = threading.RLock()  # every public call runs under it (buffers.locking)
        self._calling = False  # a public call is running (buffers.locking)
        self.max_steps = positive_int(max_steps, "max_steps")
        self._declared = None if spec is None else FieldSpec.declare(spec)
        self.ragged = check_ragged_form(ragged)
        self.frame_stack, self.frame_stack_padding = check_frame_stack(
            frame_stack, frame_stack_padding
        )
        if self.frame_stack is not None and self._declared is not None:
            check_stackable(self._declared)
        self.max_episodes = (
            None if max_episodes is None else positive_int(max_episodes, "max_episodes")
        )
        self.min_steps = check_min_steps(min_steps, self.max_steps)
        self.layout = check_layout(layout)
        self.device = resolve_device(device, "device")
        self.storing_device = resolve_device(storing_device, "storing_device")
        kind = resolve_kind(storage, self.storing_device)
        seed = check_seed(seed)
        self._storage = (kind, scratch_dir)  # what a fresh core's storage is made of
        self._priority = (alpha, beta, eps, priority_backend) if prioritized else None
        self._core = self._new_core()
        # No seed: one drawn from torch's global generator, so torch.manual_seed repeats a run.
        seed = seed_or_draw(seed)
        self._generator = torch.Generator(device=self.storing_device)
        self._generator.manual_seed(seed)
        self._closed = False
        self._home: Path | None = None  # where open() put it: save_checkpoint()'s default
        # The device draws (CUDA storage): a key from the seed, apart from the generator's.
        self._draws = DeviceDraws(self.storing_device, seed_key(seed))
        self._paths: Paths | None = None  # how batches are built, chosen on first use
        self._nstep_checked = None  # sample_n_step's last arguments checked (EpisodeSampling)

    def _new_core(self) -> EpisodeCore:
        """An empty episode core of this buffer's configuration (storage, priorities)."""
        kind, scratch_dir = self._storage
        rows = self.max_steps + final_rows_for(self.max_steps, self.max_episodes)
        priorities = None
        if self._priority is not None:
            alpha, beta, eps, backend = self._priority
            priorities = Prioritizer(rows, self.storing_device, alpha, beta, eps, backend)
        slots = SlotStorage(
            rows,
            kind=kind,
            storing_device=self.storing_device,
            scratch_dir=scratch_dir,
            index_column=False,  # rows are written at slots, not through TorchRL's extend
        )
        core = EpisodeCore(
            slots,
            self.max_steps,
            self.max_episodes,
            self.frame_stack,
            self.frame_stack_padding,
            self._declared,
        )
        core.priorities = priorities
        return core

    # ----------------------------------------------------------------- properties
    @property
    @synchronized
    def memory(self):
        """The TorchRL ``TensorDictReplayBuffer`` holding the rows (final observations too)."""
        self._check_open()
        self._core.flush()  # staged steps are written first, as for every other read
        return self._core.slots.memory

    @property
    def spec(self) -> FieldSpec | None:
        """Stored keys (``observation``, ``action``, ``reward``, ``extras``), shapes and dtypes."""
        return self._core.slots.spec

    def __len__(self) -> int:
        """Valid steps: stored steps whose next observation exists."""
        return self._core.valid_steps

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("the buffer is closed")

    # ----------------------------------------------------------------- lifecycle
    @synchronized
    def start_episode(self, agent_id: str = "default") -> int:
        """Start an episode and return its id; may evict to respect ``max_episodes``."""
        self._check_open()
        if not isinstance(agent_id, str):
            raise ArgumentTypeError(f"agent_id must be a str, got {type(agent_id).__name__}")
        return self._core.start(agent_id)

    @synchronized
    def start_episodes(self, count: int, agent_id: str = "default") -> list[int]:
        """Start ``count`` episodes (a vector env's resets) and return their ids, in order:
        what ``count`` calls of :meth:`start_episode` do (``count`` at most ``max_episodes``),
        in one call."""
        self._check_open()
        checked_starts(count, agent_id, self.max_episodes)
        return start_many(self._core, count, agent_id)

    def append_observation_action_reward(
        self,
        episode_id: int,
        observation: Any,
        action: Any,
        reward: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        """Record one step: the observation acted in, the action, the reward it earned."""
        # The lock inline, acquired and released by hand: a `with` block or a decorator
        # costs about twice as much, once per step.
        lock = self._lock
        lock.acquire()
        if self._calling:  # called from code run inside another call (buffers.locking)
            lock.release()
            raise reentered(_APPEND_ONE)
        self._calling = True
        try:
            if self._closed:
                self._check_open()
            core = self._core
            # A plain int naming an episode in progress is a dict hit, inline (a call less per
            # step); anything else gets in_progress's checks and messages.
            episode = core.running.get(episode_id) if type(episode_id) is int else None
            if episode is None:
                episode = core.in_progress(episode_id, "append to")
            if core.append_one(episode, observation, action, reward, extras):
                return
            row = core.step_row(observation, action, reward, extras, False, _APPEND_ONE)
            core.append([episode], row)
        finally:
            self._calling = False
            lock.release()

    def append_batch(
        self,
        episode_ids: Sequence[int],
        observations: Any,
        actions: Any,
        rewards: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        """One step for each of several episodes (a vectorized env); leading dim = episodes."""
        # The lock inline, acquired and released by hand: a `with` block or a decorator
        # costs about twice as much, once per step.
        lock = self._lock
        lock.acquire()
        if self._calling:  # called from code run inside another call (buffers.locking)
            lock.release()
            raise reentered("append_batch")
        self._calling = True
        try:
            self._check_open()
            # Ids kept in an integer numpy array (a vector env's bookkeeping) as plain ints, so
            # that repeated calls take the cached run (it compares plain ints).
            ids: list[int]
            if (
                type(episode_ids) is np.ndarray
                and episode_ids.ndim == 1
                and episode_ids.dtype.kind in "iu"
            ):
                ids = episode_ids.tolist()
            else:
                ids = list(episode_ids)
            core = self._core
            episodes = core.repeat_batch(ids)  # a vectorized env's usual call: checked last time
            if episodes is None:
                if not ids:
                    raise ArgumentError("episode_ids must name at least one episode, got none")
                episodes = core.in_progress_all(ids, "append to")  # names a bad id (an array...)
                if len(set(map(id, episodes))) != len(ids):
                    raise ArgumentError(f"episode_ids must be distinct, got {ids}")
            if core.append_many(episodes, observations, actions, rewards, extras):
                return
            rows = core.step_row(observations, actions, rewards, extras, True, "append_batch")
            got = next(iter(rows.values())).shape[0]
            if got != len(ids):
                raise ArgumentError(
                    f"append_batch: leading dimension expected {len(ids)} "
                    f"(len(episode_ids)), got {got}"
                )
            core.append(episodes, rows)
        finally:
            self._calling = False
            lock.release()

    @synchronized
    def append_steps(
        self,
        episode_id: int,
        observations: Any,
        actions: Any,
        rewards: Any,
        extras: dict[str, Any] | None = None,
    ) -> None:
        """Record several consecutive steps of one episode (leading dim = steps, ``rewards``
        ``[steps]``): what that many :meth:`append_observation_action_reward` calls with rows
        0, 1, ... do, same rows, evictions and seeded draws, in one call. Everything is checked
        first (values, and room for every step); on an error nothing is appended. Ragged
        fields go step by step."""
        self._check_open()
        episode = self._core.in_progress(episode_id, "append to")
        count = step_count(rewards)
        append_steps(self._core, episode, count, observations, actions, rewards, extras)

    @synchronized
    def end_episode(
        self, episode_id: int, status: str = "terminated", final_observation: Any = None
    ) -> None:
        """End an episode: ``terminated`` (or ARES's ``COMPLETED``) or ``truncated``."""
        self._check_open()
        if not isinstance(status, str) or status.lower() not in STATUSES:
            raise ArgumentError(
                f"status must be 'terminated', 'truncated' or 'COMPLETED', got {status!r}"
            )
        core = self._core
        episode = core.in_progress(episode_id, "end")
        if final_observation is None:
            raise ArgumentError(
                f"end_episode: final_observation is required (episode {episode_id}), got None"
            )
        end_kind = STATUSES[status.lower()]
        if core.end_one(episode, end_kind, final_observation):
            return
        core.end(episode, end_kind, core.final_row_data(final_observation, "end_episode"))

    @synchronized
    def end_episodes(
        self,
        episode_ids: Sequence[int],
        statuses: str | Sequence[str] = "terminated",
        final_observations: Any = None,
    ) -> None:
        """End several episodes at once (a vector env's dones): ``statuses`` one status for
        all or one per episode, ``final_observations`` batched ``[len(episode_ids), ...]`` as
        :meth:`append_batch` takes observations.

        What a loop of :meth:`end_episode` does, except that no episode of the call is evicted
        to make room for another's final row. Everything is checked before anything is
        applied: a bad id, status or final observation raises naming the argument and the
        index, with the buffer unchanged.
        """
        self._check_open()
        checked = checked_ends(self._core, episode_ids, statuses, final_observations)
        if checked is not None:
            end_many(self._core, *checked)

    # ----------------------------------------------------------------- priorities
    @synchronized
    def update_priorities(self, index: Any, priority: Any) -> int:
        """Set the priorities of sampled steps (by a batch's ``index``); returns how many applied.

        A step evicted since it was sampled, or whose row now holds another step, is skipped.
        Raises ``IndexError`` for an id no step ever had and ``ValueError`` for a negative, NaN
        or infinite priority or a length mismatch; then nothing is applied.
        """
        self._check_open()
        if self._core.priorities is None:
            raise ArgumentError("update_priorities needs a buffer made with prioritized=True")
        return update_priorities(self._core, index, priority)

    @synchronized
    def set_beta(self, beta: float) -> None:
        """Change the importance-weight exponent (anneal it towards 1 during training)."""
        if self._core.priorities is None:
            raise ArgumentError("set_beta needs a buffer made with prioritized=True")
        self._core.priorities.beta = check_beta(beta)

    # ----------------------------------------------------------------- introspection
    @synchronized
    def stats(self) -> dict[str, Any]:
        """Counts of episodes, steps, agents and bytes."""
        self._check_open()
        config = {
            "max_steps": self.max_steps,
            "max_episodes": self.max_episodes,
            "device": str(self.device),
            "storing_device": str(self.storing_device),
            "frame_stack": self.frame_stack,
        }
        return {**core_stats(self._core), **config}

    @synchronized
    def clear(self) -> None:
        """Drop every episode; ids keep counting, so an old id is never reused."""
        self._check_open()
        self._core.clear()

    @synchronized
    def close(self) -> None:
        """Release storage and remove memmap files. Idempotent."""
        if not self._closed:
            self._closed = True
            self._draws.clear()
            self._core.slots.close()

    def __enter__(self) -> SyncEpisodeReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
