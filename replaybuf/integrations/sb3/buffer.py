"""``SB3ReplayBuffer``: SB3's replay buffer contract on a replaybuf episode buffer (see
:mod:`replaybuf.integrations.sb3` for how SB3's calls map onto episodes)."""

from __future__ import annotations

import math
import os
from typing import Any, cast

import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.buffers import ReplayBuffer as _SB3ReplayBuffer
from stable_baselines3.common.preprocessing import get_action_dim, get_obs_shape
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.utils import get_device
from stable_baselines3.common.vec_env import VecNormalize

from replaybuf.args import check_gamma, int_at_least, positive_int
from replaybuf.buffers import SyncEpisodeReplayBuffer
from replaybuf.errors import (
    ArgumentError,
    BufferClosedError,
    EmptyBufferError,
    UnsupportedError,
)
from replaybuf.integrations.sb3 import checks, fastadd, pickling
from replaybuf.integrations.sb3.calls import one_call
from replaybuf.integrations.sb3.held import HeldAside
from replaybuf.integrations.sb3.samples import interleave, stored_fields
from replaybuf.integrations.sb3.staged import StagedSteps

_F32 = np.dtype(np.float32)


class SB3ReplayBuffer(_SB3ReplayBuffer):
    """SB3's replay buffer contract on replaybuf episode storage (no next-observation copies).

    Args (SB3's, in SB3's order; the algorithm passes them):
        buffer_size: transitions kept, over all environments (``buffer_size // n_envs`` per
            environment, as in SB3).
        observation_space: a non-``Dict`` gymnasium space (``Dict`` needs SB3's
            ``DictReplayBuffer``); observations are stored in its dtype.
        action_space: actions are stored as ``[action_dim]`` in its dtype (float64 as float32).
        device: where sampled batches are delivered (``"auto"``: CUDA when available).
        n_envs: number of parallel environments.
        optimize_memory_usage: must be False (the default). This buffer never stores a next
            observation twice, so SB3's memory-optimised variant has nothing to add, and its
            ``learn()``-time patch writes into a ``dones`` array this buffer does not have.
        handle_timeout_termination: a ``done`` whose info says ``TimeLimit.truncated`` ends the
            episode as truncated (sampled with ``dones == 0``, so the target bootstraps);
            False: every ``done`` is a termination (``dones == 1``), as in SB3.

    Keyword-only (through ``replay_buffer_kwargs``):
        n_steps, gamma: n-step returns as SB3's ``NStepReplayBuffer`` computes them (``rewards``
            is the discounted sum up to the first end or truncation, ``discounts`` is
            ``gamma ** steps``); ``n_steps=1`` (default) returns SB3's one-step samples with
            ``discounts=None``.
        max_episodes: stored episodes at most; it also sizes the rows reserved for final
            observations. Default: replaybuf's reserve of ``buffer_size / 16`` rows, so if
            episodes average fewer than 16 steps, whole episodes are evicted before
            ``buffer_size`` transitions are stored: pass ``max_episodes`` (at most
            ``buffer_size``) to keep the full capacity. Must exceed ``n_envs``.
        segment_steps: an episode is stored in segments of at most this many steps; a segment
            ends as truncated at the observation the next one starts with (that observation
            is stored twice). Bounds what one eviction removes on long or endless episodes.
            Default ``max(1, buffer_size // n_envs // 4)``.
        storage, storing_device, scratch_dir: as for :class:`replaybuf.SyncEpisodeReplayBuffer`
            (default: memory-mapped files in a private folder of the system temp dir, removed on
            ``close()``, garbage collection or exit).
        seed: seeds sampling; None draws a seed from NumPy's global generator (which SB3's
            ``seed=`` seeds), so a seeded SB3 run samples reproducibly.

    SB3 attributes: ``buffer_size`` (per environment), ``n_envs``, ``obs_shape``,
    ``action_dim``, ``device`` (may be reassigned), ``pos`` and ``full`` (SB3's ring position and
    wrap flag for the number of ``add`` calls so far), ``size()`` (``transitions // n_envs``:
    SB3's value until the first eviction). ``reset()`` empties the buffer.

    Eviction differs from SB3's ring. SB3 overwrites the single oldest row of every environment
    once ``buffer_size`` adds were made; here, when an ``add`` would exceed
    ``buffer_size`` transitions (or the row reserve), whole oldest episodes go, finished ones
    first (oldest start first). So after eviction the buffer holds between about
    ``buffer_size - segment_steps`` and ``buffer_size`` transitions, from the most recent
    episodes, and the environments' shares may differ from SB3's exact ``buffer_size // n_envs``.

    Pickling (``model.save_replay_buffer`` / ``model.load_replay_buffer``, ``pickle``,
    ``copy.deepcopy``) round-trips everything: stored transitions, episodes in progress, the
    held-aside newest transitions, ``pos``/``full`` and the counters, and both samplers' states
    (the loaded buffer draws what the saved one would have drawn next). The pickle holds plain
    data, the stored rows copied out of storage (memmap files too: saving needs RAM for one
    copy of them), never storage objects, locks or files. Loading builds a new buffer with
    storage of the same ``storage`` choice (``"auto"`` decides again) and its own lock; its
    memmap files go to a new private folder in the saved ``scratch_dir`` if that folder exists
    on the loading machine, else in the system temp dir (with a ``RuntimeWarning``). As with
    any pickle, load only files you trust. ``episode_buffer.save_checkpoint`` saves the stored
    episodes without pickle, but not the held-aside transitions nor this adapter's state.

    Not supported: SB3's index-based ``_get_samples``, and reward normalisation by a
    ``VecNormalize`` with ``norm_reward=True`` together with ``n_steps > 1`` (SB3 normalises
    and clips each step's reward; this buffer keeps only the window's sum), which raises
    ``NotImplementedError``.
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: torch.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        n_steps: int = 1,
        gamma: float = 0.99,
        max_episodes: int | None = None,
        segment_steps: int | None = None,
        storage: str = "auto",
        storing_device: torch.device | str = "cpu",
        scratch_dir: str | os.PathLike | None = None,
        seed: int | None = None,
    ) -> None:
        # SB3's ReplayBuffer.__init__ is not called: it allocates the observation, next
        # observation and other arrays this class exists not to have. Its attributes are set here.
        buffer_size = positive_int(buffer_size, "buffer_size")
        n_envs = positive_int(n_envs, "n_envs")
        checks.check_spaces(observation_space, action_space, optimize_memory_usage)
        self.observation_space = observation_space
        self.action_space = action_space
        self.obs_shape = tuple(get_obs_shape(observation_space))  # type: ignore[arg-type]
        self.action_dim = get_action_dim(action_space)
        self.n_envs = n_envs
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.device = get_device(device)
        self.optimize_memory_usage = False
        self.handle_timeout_termination = bool(handle_timeout_termination)
        self.n_steps = positive_int(n_steps, "n_steps")
        self.gamma = check_gamma(gamma)
        self.max_steps = self.buffer_size * n_envs
        if segment_steps is None:
            segment_steps = max(1, self.buffer_size // 4)
        self.segment_steps = positive_int(segment_steps, "segment_steps")
        if self.segment_steps > self.buffer_size:
            raise ArgumentError(
                f"segment_steps must be <= buffer_size // n_envs ({self.buffer_size}), "
                f"got {self.segment_steps}"
            )
        if max_episodes is not None and int_at_least(max_episodes, "max_episodes", 1) <= n_envs:
            raise ArgumentError(
                f"max_episodes must exceed n_envs ({n_envs}): each environment keeps one episode "
                f"in progress, got {max_episodes}"
            )
        if seed is None:
            seed = int(np.random.randint(0, 2**31 - 1))
        seed = int_at_least(seed, "seed", 0)
        self._obs_dtype = np.dtype(observation_space.dtype)
        self._action_dtype = np.dtype(self._maybe_cast_dtype(action_space.dtype))
        # The episode storage delivers on the training device when it can (pinned copies to
        # CUDA); any other device (e.g. "mps") is reached with one more copy.
        deliver = self.device if self.device.type in ("cpu", "cuda") else torch.device("cpu")
        self._buffer = SyncEpisodeReplayBuffer(
            self.max_steps,
            max_episodes,
            device=deliver,
            storing_device=storing_device,
            storage=storage,
            scratch_dir=scratch_dir,
            seed=seed,
        )
        self._generator = torch.Generator().manual_seed(seed + 1)
        self._closed = False
        # What a pickle needs to build the storage again (the folder made absolute: a load may
        # run from another working directory).
        self._storage_args = (
            storage,
            None if scratch_dir is None else os.path.abspath(scratch_dir),
        )
        # add's fast path (fastadd): what it compares the arrays with; False (tests) runs every
        # add through the general path.
        self._obs_want = (n_envs, *self.obs_shape)
        self._action_want = (n_envs, self.action_dim)
        self._exact_dtypes = (self._obs_dtype, self._obs_dtype, self._action_dtype, _F32)
        discrete_obs = isinstance(observation_space, spaces.Discrete)
        self._exact_shapes, self._flat_shapes = fastadd.exact_shapes(
            n_envs, self._obs_want, self._action_want, discrete_obs
        )
        self._agent_ids = [f"env-{i}" for i in range(n_envs)]
        self._fast_add = True
        self._primed = False  # whether an add fixed the episode buffer's fields
        self._reset_state()

    def _reset_state(self) -> None:
        """No episode in progress, nothing held aside, the counters at zero."""
        n = self.n_envs
        self._episode: list[int | None] = [None] * n  # in-progress episode of each env
        self._ids: list[int] = []  # a copy of _episode once every env has one, new at each start
        self._unstarted = list(range(n))  # the envs without an episode in progress
        self._seg_start = [0] * n  # the add that began the current segment of each env's episode
        self._split_at: float = math.inf  # no segment is full before this add
        # The latest transition of each env, whose next observation is not in storage yet.
        self._held = HeldAside(
            n, self.obs_shape, self._obs_dtype, self.action_dim, self._action_dtype
        )
        # One env's steps not yet handed to the episode buffer (add's fast path; see staged).
        self._staged = (
            StagedSteps(self.obs_shape, self._obs_dtype, self.action_dim, self._action_dtype)
            if n == 1
            else None
        )
        self._adds = 0
        self._discontinuities = 0
        self._segments_split = 0

    # ----------------------------------------------------------------- SB3's counters
    # SB3's BaseBuffer declares pos and full as attributes it assigns; here they are derived
    # from the add count, read-only (its __init__, which assigns them, is not called).
    @property
    def pos(self) -> int:  # type: ignore[override]
        """Where SB3's ring would write next: ``add`` calls so far modulo ``buffer_size``."""
        return self._adds % self.buffer_size

    @property
    def full(self) -> bool:  # type: ignore[override]
        """Whether SB3's ring would have wrapped: at least ``buffer_size`` ``add`` calls."""
        return self._adds >= self.buffer_size

    def size(self) -> int:
        """Transitions per environment: ``transitions // n_envs`` (SB3's ``size()`` until the
        first eviction, at most ``buffer_size``)."""
        return self.transitions // self.n_envs

    @property
    @one_call
    def transitions(self) -> int:
        """Transitions ``sample`` draws from (stored steps, the newest of each env included)."""
        self._hand_over()
        return len(self._buffer) + self._held.count

    @property
    @one_call
    def episode_buffer(self) -> SyncEpisodeReplayBuffer:
        """The replaybuf episode buffer underneath (sequences, episodes, stats, checkpoints).

        Each environment's newest transition is held aside until the next ``add`` and is not
        in it yet. With one environment, ``add`` stages steps and hands them over in runs;
        reading this property hands them over, so read it again after later adds.
        """
        self._hand_over()
        return self._buffer

    def _hand_over(self) -> None:
        """Append the steps ``add`` staged (one env) to the episode buffer: before every read
        of it and every write by another path (none once either is closed: nothing can read
        them then, and the call that needs the buffer raises ``BufferClosedError`` itself)."""
        staged = self._staged
        if staged is None or not (staged.count or staged.held_at >= 0):
            return
        if not self._closed and not self._buffer._closed:
            with self._buffer._lock:  # add stages under it: the count and rows agree
                staged.hand_over(self._buffer, self._held)

    @one_call
    def stats(self) -> dict[str, Any]:
        """The episode buffer's stats plus this adapter's counters."""
        self._hand_over()
        return {
            **self._buffer.stats(),
            "transitions": self.transitions,
            "adds": self._adds,
            "held_aside": self._held.count,
            "discontinuities": self._discontinuities,
            "segments_split": self._segments_split,
        }

    # ----------------------------------------------------------------- writes
    # Record one vectorized step (fastadd.add, written there beside its fast path: one Python
    # call per step, not a method calling it).
    add = fastadd.add

    def _add_general(
        self,
        obs: Any,
        next_obs: Any,
        action: Any,
        reward: Any,
        done: Any,
        infos: Any,
    ) -> None:
        """:meth:`add` for any arguments: checked and converted, jumps and full segments
        ended, one episode-buffer call per env that starts or ends (the reference the fast
        path, :mod:`~replaybuf.integrations.sb3.fastadd`, is tested against)."""
        space, n = self.observation_space, self.n_envs
        shape, dtype = self.obs_shape, self._obs_dtype
        obs = checks.observations(obs, "obs", space, n, shape, dtype)
        next_obs = checks.observations(next_obs, "next_obs", space, n, shape, dtype)
        action = checks.actions(action, n, self.action_dim, self._action_dtype)
        reward = checks.per_env(reward, "reward", n).astype(np.float32)
        done = checks.per_env(done, "done", n) != 0
        truncated = checks.timeouts(infos, n, self.handle_timeout_termination)

        buf, held = self._buffer, self._held
        pending, seg_start, seg = held.pending, self._seg_start, self.segment_steps
        adds = self._adds
        # An episode continues only from the observation its last step led to (bit for bit),
        # and a segment holds at most segment_steps steps; otherwise it ends (truncated) there.
        jumped = held.jumped(obs)
        full = [
            i for i in range(n) if pending[i] and adds - seg_start[i] >= seg and i not in jumped
        ]
        # Every env with a pending step has an episode in progress (mypy cannot narrow a list).
        for i in jumped + full:
            buf.end_episode(
                self._episode[i],  # type: ignore[arg-type]
                "truncated",
                torch.from_numpy(held.next_obs[i]),
            )
            self._episode[i] = None
        self._discontinuities += len(jumped)
        self._segments_split += len(full)
        for i in range(n):
            if self._episode[i] is None:
                self._episode[i] = buf.start_episode(agent_id=f"env-{i}")
                seg_start[i] = adds
        ids = list(self._episode)  # none is None now (started just above)
        self._ids = cast(list[int], ids)
        buf.append_batch(
            ids,  # type: ignore[arg-type]
            torch.from_numpy(obs),
            torch.from_numpy(action),
            torch.from_numpy(reward),
        )
        ended = done.tolist()
        for i in range(n):
            pending[i] = not ended[i]
            if ended[i]:
                status = "truncated" if truncated[i] else "terminated"
                buf.end_episode(
                    ids[i],  # type: ignore[arg-type]
                    status,
                    torch.from_numpy(next_obs[i]),
                )
                self._episode[i] = None
        # Each env's newest transition, held aside until the next add stores its next obs.
        held.keep(obs, next_obs, action, reward, done)
        self._adds += 1
        # What the fast path reads: the envs to start at the next add, the first add at which
        # a segment may be full.
        going = [seg_start[i] for i in range(n) if self._episode[i] is not None]
        self._unstarted = [i for i in range(n) if self._episode[i] is None]
        self._split_at = min(going) + seg if going else math.inf
        self._primed = True

    # ----------------------------------------------------------------- sampling
    @one_call
    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """``batch_size`` transitions drawn uniformly with replacement over every transition
        held, as SB3's ``ReplayBufferSamples`` on ``self.device``.

        ``dones`` is 1 only for a termination; with ``env`` (a ``VecNormalize``) observations
        and rewards are normalised as SB3 does.
        """
        self._check_open()
        batch_size = positive_int(batch_size, "batch_size")
        multi = self.n_steps > 1
        if multi and env is not None and env.norm_reward:
            raise UnsupportedError(
                "n_steps > 1 with a VecNormalize that normalises rewards: SB3 normalises and "
                "clips each step's reward, and this buffer keeps only the n-step sum"
            )
        self._hand_over()
        stored = len(self._buffer)
        total = stored + self._held.count
        if total == 0:
            raise EmptyBufferError("cannot sample: the buffer holds no transition yet")
        pick = torch.randint(0, total, (batch_size,), generator=self._generator)
        # Which samples are the held-aside newest transitions (in numpy: a few small torch
        # calls cost more than the draw).
        aside_np = pick.numpy() >= stored
        n_aside = int(np.count_nonzero(aside_np))
        parts: list[dict[str, torch.Tensor]] = []
        if n_aside < batch_size:
            count = batch_size - n_aside
            parts.append(
                stored_fields(
                    self._buffer, count, self.n_steps, self.gamma, self._held, self._episode
                )
            )
        if not n_aside:
            return self._samples(parts[0], env, multi)
        aside = torch.from_numpy(aside_np)
        held = self._held.envs()
        parts.append(self._held.fields(held[(pick[aside] - stored).numpy()]))
        fields = parts[0] if len(parts) == 1 else interleave(parts, aside)
        return self._samples(fields, env, multi)

    def _samples(
        self, fields: dict[str, torch.Tensor], env: VecNormalize | None, multi: bool
    ) -> ReplayBufferSamples:
        device = self.device
        obs, next_obs, action = fields["obs"], fields["next_obs"], fields["action"]
        reward = fields["reward"].to(torch.float32).unsqueeze(1)
        if env is not None:
            obs = torch.from_numpy(self._normalize_obs(obs.cpu().numpy(), env))
            next_obs = torch.from_numpy(self._normalize_obs(next_obs.cpu().numpy(), env))
            reward = torch.from_numpy(self._normalize_reward(reward.cpu().numpy(), env))
        discounts = None
        if multi:
            steps = fields["steps"].to(torch.float64).reshape(-1, 1)
            discounts = (self.gamma**steps).to(device=device, dtype=torch.float32)
        done = fields["done"]
        if done.is_cpu:  # numpy's cast of a small batch costs less than torch's
            dones = torch.from_numpy(done.numpy().reshape(-1, 1).astype(np.float32))
        else:
            dones = done.to(torch.float32).reshape(-1, 1)
        if device.type != "cpu":  # CPU batches are where they are delivered already
            obs, action, next_obs = obs.to(device), action.to(device), next_obs.to(device)
            dones, reward = dones.to(device), reward.to(device)
        return ReplayBufferSamples(obs, action, next_obs, dones, reward, discounts)

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None):
        raise UnsupportedError(
            "SB3ReplayBuffer has no ring rows to index: use sample(batch_size, env)"
        )

    # ----------------------------------------------------------------- lifecycle
    @one_call
    def reset(self) -> None:
        """Drop every transition (SB3's ``reset``); episode ids keep counting."""
        self._check_open()
        self._hand_over()
        self._buffer.clear()
        self._reset_state()

    @one_call
    def close(self) -> None:
        """Release the storage and remove its memmap files. Idempotent.

        Garbage collection and interpreter exit remove them too; ``with SB3ReplayBuffer(...)``
        or ``model.replay_buffer.close()`` does it at a known time.
        """
        try:
            self._hand_over()  # nothing added is lost before the storage goes
        finally:
            self._closed = True
            self._buffer.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self.closed:
            raise BufferClosedError("the buffer is closed")

    def __enter__(self) -> SB3ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- pickling
    @one_call
    def __getstate__(self) -> dict[str, Any]:
        """The pickled state (``model.save_replay_buffer``): plain data, stored rows copied
        (memmap ones too), see :mod:`~replaybuf.integrations.sb3.pickling`. A closed buffer
        pickles as closed and loads closed."""
        return pickling.state_of(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Build the adapter again from its pickled arguments (new storage of the same
        ``storage`` choice, its own lock) and load the pickled state into it."""
        # Any seed: the pickled sampler states replace what it seeds.
        SB3ReplayBuffer.__init__(self, **pickling.arguments(state), seed=0)
        if state.get("closed"):
            self.close()
            return
        try:
            pickling.restore(self, state)
        except BaseException:
            self.close()  # nothing half-made stays behind
            raise
