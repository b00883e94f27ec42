"""``collect``: fill an episode buffer from a gymnasium vector environment.

Each vector step becomes one ``append_batch`` (one step per sub-environment that produced a
transition) and each finished episode an ``end_episode`` with its true final observation::

    import gymnasium as gym
    from replaybuf import SyncEpisodeReplayBuffer
    from replaybuf.collecting import collect

    envs = gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="sync")
    with SyncEpisodeReplayBuffer(100_000, seed=0) as buf:
        stats = collect(envs, lambda obs: envs.action_space.sample(), buf, 10_000, seed=0)
        print(stats["episodes"], sum(stats["returns"]) / max(1, len(stats["returns"])))

Autoreset modes (gymnasium 1.x, ``envs.metadata["autoreset_mode"]``):

* ``NEXT_STEP`` (the default): the step after an episode ends returns the reset observation and
  its action and reward are ignored, so that step stores nothing for that sub-environment;
* ``SAME_STEP``: the step that ends an episode returns the reset observation; the final one is
  ``info["final_obs"][i]``;
* ``DISABLED``: finished sub-environments are reset here with ``reset(options={"reset_mask":
  ...})``.

``steps`` counts stored transitions: exactly that many are written (the last vector step may
store fewer than ``num_envs``; sub-environments left out end their episode at the observation
they stood in). Episodes still running at the end are ended ``truncated`` (bootstrapping from
their last observation), so every stored step is sampleable; the same happens, best effort,
when ``collect`` is interrupted. Rewards are stored as float32. Each call starts with
``envs.reset(seed=seed)``.

Actions are taken as gymnasium's spaces take them and stored in the action space's dtype: a
numpy array, a tensor (on any device) or a list of numbers, 0-d arrays or 0-d tensors. For a
``Box`` any dtype that casts to the space's ``same_kind`` (float64 or integers for a float32
Box) is cast, where every value is representable; values outside the bounds pass, as the env
gets them (most clip). For ``Discrete`` and ``MultiDiscrete`` any integer dtype is cast to the
space's; floats and bools are refused, as gymnasium refuses them. Other spaces' actions are
stored as the policy gives them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
import torch

from replaybuf.args import int_at_least, positive_int
from replaybuf.buffers import EpisodeReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.errors import ArgumentError, ArgumentTypeError, InvalidStateError, ReplayBufError
from replaybuf.storage import to_leaves

Observation = np.ndarray | dict[str, Any]  # a batch: [num_envs, ...], or a dict of those
NEXT_STEP, SAME_STEP, DISABLED = "NextStep", "SameStep", "Disabled"
WHAT = "collect"


def collect(
    envs: Any,
    policy: Callable[[Any], Any],
    buffer: SyncEpisodeReplayBuffer | EpisodeReplayBuffer,
    steps: int,
    *,
    seed: int | None = None,
    progress: bool | None = None,
    torch_policy: bool = False,
    agent_id: str = "env",
) -> dict[str, Any]:
    """Run ``policy`` in ``envs`` until ``steps`` transitions are stored in ``buffer``.

    Args:
        envs: a gymnasium vector environment (``gymnasium.make_vec(...)``).
        policy: observation batch -> action batch (``[num_envs, ...]``, array or tensor).
        buffer: a :class:`SyncEpisodeReplayBuffer`, or an :class:`EpisodeReplayBuffer`
            written through its ``.sync`` core (call ``collect`` on its event loop's thread,
            never in a worker thread while tasks use the buffer).
        steps: transitions to store.
        seed: passed to ``envs.reset``.
        progress: show a tqdm bar on stderr; ``None``: when stderr is a terminal and tqdm is
            installed.
        torch_policy: give the policy ``torch.Tensor`` observations instead of numpy arrays.
        agent_id: sub-environment i writes its episodes as ``f"{agent_id}-{i}"``.

    Returns:
        ``steps`` stored, ``episodes`` the environments finished (``terminated`` +
        ``truncated``), their ``returns`` (undiscounted, in order of ending), ``cut``
        (episodes ended by the end of collection), ``vector_steps`` and ``seconds``.

    Before anything is written, the first action batch and the observations are checked
    against the environment's spaces and the spec the buffer already stores; a mismatch
    raises (``ValueError`` / :class:`replaybuf.SchemaError`) naming the field.
    """
    sync = _sync_buffer(buffer)
    steps = positive_int(steps, "steps")
    if seed is not None:
        seed = int_at_least(seed, "seed", 0)
    if not isinstance(agent_id, str):
        raise ArgumentTypeError(f"agent_id must be a str, got {type(agent_id).__name__}")
    num_envs, mode = _vector_env(envs)
    run = _Run(envs, policy, sync, num_envs, mode, torch_policy, agent_id)
    started = time.perf_counter()
    observations, _ = envs.reset(seed=seed)
    run.start(observations)
    bar = _progress_bar(progress, steps)
    try:
        while run.stored < steps:
            finished = len(run.returns)
            stored = run.step(steps - run.stored)
            if bar is not None:
                bar.update(stored)
                if len(run.returns) > finished:
                    recent = run.returns[-100:]
                    mean = sum(recent) / len(recent)
                    bar.set_postfix(episodes=len(run.returns), ret=f"{mean:.3g}", refresh=False)
        run.finish()
    except BaseException:
        run.abandon()
        raise
    finally:
        if bar is not None:
            bar.close()
    return run.stats(time.perf_counter() - started)


class _Run:
    """The state of one ``collect`` call: open episodes, last observations, counters."""

    def __init__(
        self,
        envs: Any,
        policy: Callable[[Any], Any],
        buffer: SyncEpisodeReplayBuffer,
        num_envs: int,
        mode: str,
        torch_policy: bool,
        agent_id: str,
    ) -> None:
        self.envs, self.policy, self.buffer = envs, policy, buffer
        self.num_envs, self.mode, self.torch_policy = num_envs, mode, torch_policy
        self.agents = [f"{agent_id}-{i}" for i in range(num_envs)]
        self.episode: list[int | None] = [None] * num_envs  # the open episode of each env
        self.tail: list[Any] = [None] * num_envs  # where each open episode stands now
        self.running_return = np.zeros(num_envs)
        self.resetting = np.zeros(num_envs, dtype=bool)  # NEXT_STEP: this step is a reset
        self.observations: Observation = {}
        self.actions: Any = None
        self.stored = self.vector_steps = self.cut = 0
        self.returns: list[float] = []
        self.ends = {"terminated": 0, "truncated": 0}

    # ----------------------------------------------------------------- checks
    def start(self, observations: Observation) -> None:
        """Check the first observations and actions against the spaces and the buffer."""
        _check_observations(observations, self.num_envs)
        self.observations = observations
        self.actions = self._act(first=True)
        rows = _step_rows(observations, self.actions, np.zeros(self.num_envs), np.arange(1))
        spec = self.buffer.spec
        leaves = to_leaves(rows, batched=True, what=WHAT, spec=spec)  # types, one row
        if spec is not None:
            spec.check(leaves, 1, f"{WHAT} (the buffer's stored spec against this env)")

    def _act(self, first: bool = False) -> Any:
        """The policy's actions for the current observations, checked."""
        inputs = _as_torch(self.observations) if self.torch_policy else self.observations
        space = self.envs.single_action_space
        actions = _as_space_dtype(_host_array(self.policy(inputs)), space)
        _check_actions(actions, space, self.num_envs, first)
        return actions

    # ----------------------------------------------------------------- the loop
    def step(self, room: int) -> int:
        """One vector step; stores at most ``room`` transitions and returns how many."""
        actions = self.actions if self.actions is not None else self._act()
        self.actions = None
        observations, rewards, terminated, truncated, infos = self.envs.step(actions)
        self.vector_steps += 1
        real = ~self.resetting
        keep = real & (np.cumsum(real) <= room)
        done = terminated | truncated
        reached = _reached(observations, infos, done, self.mode)
        kept = np.flatnonzero(keep)
        if kept.size:
            self._append(kept, actions, rewards, reached)
        for i in np.flatnonzero(keep & done):
            self._end(int(i), "terminated" if terminated[i] else "truncated", _row(reached, i))
        if self.mode == NEXT_STEP:
            self.resetting = done.copy()
        elif self.mode == DISABLED and done.any():
            fresh, _ = self.envs.reset(options={"reset_mask": done.copy()})
            observations = _map(np.copy, observations)
            for i in np.flatnonzero(done).tolist():  # only the reset rows are taken
                _put(observations, i, _row(fresh, i))
        self.observations = observations
        return int(kept.size)

    def _append(self, kept: np.ndarray, actions: Any, rewards: np.ndarray, reached: Any) -> None:
        for i in kept.tolist():
            if self.episode[i] is None:
                self.episode[i] = self.buffer.start_episode(self.agents[i])
        ids = [self.episode[i] for i in kept.tolist()]
        rows = _step_rows(self.observations, actions, rewards, kept)
        self.buffer.append_batch(ids, rows["observation"], rows["action"], rows["reward"])
        self.stored += kept.size
        self.running_return[kept] += rewards[kept]
        for i in kept.tolist():
            self.tail[i] = _row(reached, i)

    def _end(self, i: int, status: str, final: Any) -> None:
        # Set while the episode runs; end_episode itself refuses anything else.
        self.buffer.end_episode(cast(int, self.episode[i]), status, final)
        self.ends[status] += 1
        self.returns.append(float(self.running_return[i]))
        self.running_return[i] = 0.0
        self.episode[i] = self.tail[i] = None

    def finish(self) -> None:
        """End every episode still running as truncated at the observation it reached."""
        for i in range(self.num_envs):
            if self.tail[i] is not None:  # None: no step stored yet (an append failed)
                self.buffer.end_episode(cast(int, self.episode[i]), "truncated", self.tail[i])
                self.cut += 1
            self.episode[i] = self.tail[i] = None

    def abandon(self) -> None:
        """After an error or an interrupt: end what can be ended, so stored steps stay valid."""
        with contextlib.suppress(ReplayBufError, ValueError):  # the buffer itself failed
            self.finish()

    def stats(self, seconds: float) -> dict[str, Any]:
        return {
            "steps": self.stored,
            "episodes": len(self.returns),
            **self.ends,
            "returns": self.returns,
            "cut": self.cut,
            "vector_steps": self.vector_steps,
            "seconds": seconds,
        }


# ----------------------------------------------------------------- helpers
def _sync_buffer(buffer: Any) -> SyncEpisodeReplayBuffer:
    if isinstance(buffer, EpisodeReplayBuffer):
        return buffer.sync
    if isinstance(buffer, SyncEpisodeReplayBuffer):
        return buffer
    raise ArgumentTypeError(
        "buffer must be a SyncEpisodeReplayBuffer or an EpisodeReplayBuffer (collect writes "
        f"episodes), got {type(buffer).__name__}"
    )


def _vector_env(envs: Any) -> tuple[int, str]:
    """``(num_envs, autoreset mode)`` of a gymnasium vector env, or ``TypeError``."""
    needed = ("num_envs", "single_action_space", "single_observation_space", "step", "reset")
    missing = [name for name in needed if not hasattr(envs, name)]
    if missing:
        raise ArgumentTypeError(
            "envs must be a gymnasium vector environment (gymnasium.make_vec(...)), got "
            f"{type(envs).__name__} without {', '.join(missing)}"
        )
    mode = getattr(envs, "metadata", {}).get("autoreset_mode", NEXT_STEP)
    mode = getattr(mode, "value", mode)  # gymnasium.vector.AutoresetMode or its value
    if mode not in (NEXT_STEP, SAME_STEP, DISABLED):
        raise ArgumentError(f"envs: unknown autoreset mode {mode!r}")
    return positive_int(envs.num_envs, "envs.num_envs"), mode


def _progress_bar(progress: bool | None, total: int) -> Any:
    """A tqdm bar on stderr, or None (``progress=None``: only on a terminal)."""
    if progress is False:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if progress:
            raise ImportError("progress=True needs tqdm: pip install tqdm") from None
        return None
    if progress is None and not sys.stderr.isatty():
        return None
    return tqdm(total=total, unit="step", desc="collect", file=sys.stderr, dynamic_ncols=True)


def _check_observations(observations: Any, num_envs: int) -> None:
    for name, value in _leaves(observations, "observation"):
        if not isinstance(value, np.ndarray) or value.ndim == 0 or value.shape[0] != num_envs:
            got = getattr(value, "shape", type(value).__name__)
            raise ArgumentError(
                f"{WHAT}: envs returned {name} expected an array with leading dimension "
                f"{num_envs} (num_envs), got {got}"
            )


def _host_array(actions: Any) -> np.ndarray:
    """A policy's action batch as a numpy array: tensors (also inside a list) on the host."""
    if isinstance(actions, torch.Tensor):
        return _tensor_array(actions)
    if isinstance(actions, (list, tuple)):
        actions = [_tensor_array(a) if isinstance(a, torch.Tensor) else a for a in actions]
    try:
        return np.asarray(actions)
    except (TypeError, ValueError) as error:  # a ragged list, say
        raise ArgumentError(
            f"{WHAT}: policy actions expected an array, a tensor or a list of numbers, got "
            f"{type(actions).__name__} ({error})"
        ) from None


def _tensor_array(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        tensor = tensor.float()  # dtypes numpy has not
    return tensor.numpy()


def _as_space_dtype(actions: np.ndarray, space: Any) -> np.ndarray:
    """``actions`` in ``space``'s dtype, cast as its gymnasium space takes them (see the module
    docstring), else :class:`ArgumentError` naming the actions' dtype and the space."""
    kind = _space_kind(space)
    if kind is None or actions.dtype == space.dtype:
        return actions
    if kind == "box":
        castable = np.can_cast(actions.dtype, space.dtype, "same_kind")
        need = f"a dtype that casts to {space.dtype} (same kind)"
    else:
        castable = actions.dtype.kind in "iu"
        need = "an integer dtype (gymnasium refuses other actions for it)"
    if not castable:
        raise ArgumentError(
            f"{WHAT}: policy actions for the action space {space} expected {need}, got "
            f"dtype {actions.dtype}"
        )
    with np.errstate(over="ignore"):  # an overflow is refused below
        cast = actions.astype(space.dtype)
    if not _represented(actions, cast):
        raise ArgumentError(
            f"{WHAT}: policy actions for the action space {space} hold values that "
            f"{space.dtype} cannot represent, got {actions!r} (dtype {actions.dtype})"
        )
    return cast


def _space_kind(space: Any) -> str | None:
    """``"box"`` or ``"discrete"`` (Discrete, MultiDiscrete) for the spaces whose actions are
    cast; None for others (and without gymnasium)."""
    try:
        from gymnasium import spaces
    except ImportError:
        return None
    if isinstance(space, spaces.Box):
        return "box"
    return "discrete" if isinstance(space, (spaces.Discrete, spaces.MultiDiscrete)) else None


def _represented(values: np.ndarray, cast: np.ndarray) -> bool:
    """Whether a same-kind cast kept every value: no finite value became infinite (floats),
    none wrapped around (integers)."""
    if cast.dtype.kind == "f":
        return bool(np.all(np.isfinite(cast) | ~np.isfinite(values)))
    if cast.dtype.kind in "iu" and values.size:
        info = np.iinfo(cast.dtype)
        return info.min <= int(values.min()) and int(values.max()) <= info.max
    return True


def _check_actions(actions: np.ndarray, space: Any, num_envs: int, first: bool) -> None:
    """Actions ``[num_envs, *space.shape]``; on the first call each must lie in ``space``
    (a Box's bounds excepted: the env gets them as they are, as gymnasium passes them)."""
    shape = tuple(actions.shape)
    expected = (num_envs, *(space.shape or ()))
    if shape != expected:
        raise ArgumentError(
            f"{WHAT}: policy actions expected shape {list(expected)} (num_envs and the "
            f"action space {space}), got {list(shape)}"
        )
    if not first or _space_kind(space) == "box":
        return
    for i in range(num_envs):
        if not space.contains(actions[i]):
            raise ArgumentError(
                f"{WHAT}: policy action for env {i} expected to lie in the action space "
                f"{space}, got {actions[i]!r} (dtype {actions.dtype})"
            )


def _leaves(tree: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(tree, Mapping):
        out = []
        for key, value in tree.items():
            out += _leaves(value, f"{prefix}.{key}")
        return out
    if isinstance(tree, tuple):
        raise ArgumentTypeError(
            f"{WHAT}: {prefix} expected arrays or dicts of arrays, got a tuple (Tuple spaces "
            "are not supported)"
        )
    return [(prefix, tree)]


def _map(fn: Callable[[Any], Any], tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {key: _map(fn, value) for key, value in tree.items()}
    return fn(tree)


def _row(tree: Any, i: int | np.integer) -> Any:
    """Sub-environment ``i``'s observation (copied: env arrays may be reused)."""
    return _map(lambda a: np.array(a[i]), tree)


def _as_torch(tree: Any) -> Any:
    return _map(torch.from_numpy, tree)


def _step_rows(observations: Any, actions: Any, rewards: np.ndarray, rows: np.ndarray) -> dict:
    """The ``append_batch`` fields of sub-environments ``rows``."""
    return {
        "observation": _map(lambda a: a[rows], observations),
        "action": actions[rows],
        "reward": np.asarray(rewards, dtype=np.float32)[rows],
    }


def _reached(observations: Any, infos: Mapping[str, Any], done: np.ndarray, mode: str) -> Any:
    """The observation each sub-environment's transition led to: the returned one, except
    for a finished episode under SAME_STEP, whose final one is in ``infos["final_obs"]``."""
    if mode != SAME_STEP or not done.any():
        return observations
    finals = infos.get("final_obs")
    if finals is None:
        raise InvalidStateError(f"{WHAT}: SAME_STEP autoreset expected info['final_obs'], got none")
    reached = _map(np.copy, observations)
    for i in np.flatnonzero(done).tolist():
        _put(reached, i, finals[i])
    return reached


def _put(tree: Any, i: int, value: Any) -> None:
    if isinstance(tree, Mapping):
        for key in tree:
            _put(tree[key], i, value[key])
    else:
        tree[i] = value
