"""The implementations ``benchmarks/suite.py`` times: the raw torch floor, replaybuf and peers.

Every builder fills one implementation with the same data and returns a :class:`Built`: a
zero-argument ``sample`` (one batch, as a trainer would get it: torch tensors), optionally an
``epoch`` (every stored item once, shuffled), and the bytes the implementation stores.

Peers are optional: ``cpprb``, ``stable_baselines3`` and ``tianshou`` are imported when
installed (``pip install -e ".[bench]"``) and skipped otherwise (``available()`` says which).
Peers that return NumPy arrays are converted with ``torch.from_numpy`` (zero-copy) inside the
timed call.

Workloads (the suite's W1-W5):

* W1/W5/scaling transitions: obs f32[17], action f32[6], reward f32, done bool;
* W2 n-step: episodes of ``obs [T+1, 17]``, ``action [T, 6]``, ``reward [T]``, each ended
  ``terminated`` or ``truncated`` (see :class:`Episodes`);
* W3 pixels: stacked u8[4, 84, 84] observations (sliding windows over one frame stream per
  episode), int64 actions, f32 rewards;
* W4 inserts: writers that add one step, 64 environments' steps or 1,000 rows per call.
"""

from __future__ import annotations

import asyncio
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import traced_bytes
from tensordict import TensorDict
from torchrl.data import (
    LazyTensorStorage,
    SamplerWithoutReplacement,
    TensorDictReplayBuffer,
)
from torchrl.envs import MultiStepTransform

from replaybuf import EpisodeReplayBuffer, ReplayBuffer, SyncEpisodeReplayBuffer

logging.getLogger("torchrl").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*memory.*", category=UserWarning)  # SB3's RAM check

try:
    import cpprb
except ImportError:  # optional peer
    cpprb = None
try:
    from gymnasium import spaces
    from stable_baselines3.common.buffers import NStepReplayBuffer
    from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer
except ImportError:  # optional peer
    SB3ReplayBuffer = NStepReplayBuffer = spaces = None
try:
    from tianshou.data import Batch as TianshouBatch
    from tianshou.data import ReplayBuffer as TianshouReplayBuffer
except Exception:  # optional peer; a broken install is skipped as well
    TianshouReplayBuffer = TianshouBatch = None

OBS, ACT = 17, 6
PIXELS = (4, 84, 84)
FLOOR = "floor"
RB_TENSOR, RB_MEMMAP = "replaybuf tensor", "replaybuf memmap"
RB_FRAMES = "replaybuf frame_stack=4"  # W3: one frame stored per step, stacks rebuilt
RB_LOCKSTEP = "replaybuf lockstep"  # W3: every episode written at once (a vector env's rows)
FRAME_FLOOR = "frame floor"  # W3: one frame stored per step, each window's k + 1 frames gathered
CPPRB, SB3, TIANSHOU, TORCHRL = "cpprb", "sb3", "tianshou", "torchrl"
FILL_CHUNK = 100_000


def available() -> dict[str, bool]:
    """Which optional peers are importable."""
    return {
        CPPRB: cpprb is not None,
        SB3: SB3ReplayBuffer is not None,
        TIANSHOU: TianshouReplayBuffer is not None,
    }


@dataclass
class Built:
    """A filled implementation: ``sample()`` draws one batch; ``close()`` frees it."""

    name: str
    sample: Callable[[], Any]
    epoch: Callable[[], int] | None = None
    stored_bytes: int | None = None  # what it allocated for its rows
    steps: int = 0  # transitions stored
    bytes_how: str = ""
    note: str = ""
    close: Callable[[], None] = field(default=lambda: None)

    @property
    def bytes_per_step(self) -> float | None:
        if self.stored_bytes is None or not self.steps:
            return None
        return self.stored_bytes / self.steps


def spans(total: int, step: int = FILL_CHUNK) -> Iterator[tuple[int, int]]:
    for start in range(0, total, step):
        yield start, min(total, start + step)


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def numpy_of(columns: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Zero-copy NumPy views; bool columns as float32 (cpprb and SB3 store flags as floats)."""
    return {
        k: (v.to(torch.float32) if v.dtype == torch.bool else v).numpy() for k, v in columns.items()
    }


def from_numpy(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


# =========================================================================== W1 / W5 / scaling
def transitions(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """W1 transitions: obs f32[17], action f32[6], reward f32, done bool."""
    g = torch.Generator().manual_seed(seed)
    return {
        "obs": torch.randn(size, OBS, generator=g),
        "action": torch.rand(size, ACT, generator=g) * 2 - 1,
        "reward": torch.randn(size, generator=g),
        "done": torch.rand(size, generator=g) < 0.001,
    }


def prefix(columns: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    return {k: v[:size] for k, v in columns.items()}


def floor_transitions(columns: dict[str, torch.Tensor], batch: int, seed: int = 0) -> Built:
    """The floor, as the suite defines it: ``randint`` + ``index_select`` per field."""
    g = torch.Generator().manual_seed(seed)
    names, fields = list(columns), list(columns.values())
    size = fields[0].shape[0]

    def sample() -> dict[str, torch.Tensor]:
        idx = torch.randint(0, size, (batch,), generator=g)
        return {k: torch.index_select(c, 0, idx) for k, c in zip(names, fields, strict=True)}

    def epoch() -> int:
        order = torch.randperm(size, generator=g)
        rows = 0
        for start in range(0, size, batch):
            idx = order[start : start + batch]
            out = {k: torch.index_select(c, 0, idx) for k, c in zip(names, fields, strict=True)}
            rows += out["obs"].shape[0]
        return rows

    return Built(
        FLOOR,
        sample,
        epoch,
        tensor_bytes(fields),
        size,
        "tensor sizes",
        "randint + index_select per field",
    )


def replaybuf_transitions(
    columns: dict[str, torch.Tensor], batch: int, kind: str, scratch: Path
) -> Built:
    size = columns["obs"].shape[0]
    buf = ReplayBuffer("cpu", "cpu", size, storage=kind, scratch_dir=scratch, seed=0)
    for a, b in spans(size):
        buf.add_batch({k: v[a:b] for k, v in columns.items()})
    if kind == "memmap":
        # Map every page once (a strided read), as any training run soon has: the timing
        # should not include the minor page faults of a freshly created file mapping.
        buf.sample_by_index(torch.arange(0, size, 16))
    stats = buf.stats()

    def epoch() -> int:
        return sum(b.batch_size[0] for b in buf.create_epoch_iterator(batch))

    return Built(
        RB_TENSOR if kind == "tensor" else RB_MEMMAP,
        lambda: buf.sample_batch(batch),
        epoch,
        stats["bytes"],
        size,
        f"stats()['bytes'] (planned_bytes {stats['planned_bytes']:,}; the rest is TorchRL's "
        "index column)",
        f"ReplayBuffer(storage={kind!r}).sample_batch / create_epoch_iterator",
        buf.close,
    )


def cpprb_transitions(columns: dict[str, torch.Tensor], batch: int) -> Built:
    size = columns["obs"].shape[0]
    arrays = numpy_of(columns)

    def build() -> Any:
        rb = cpprb.ReplayBuffer(
            size, {"obs": {"shape": OBS}, "act": {"shape": ACT}, "rew": {}, "done": {}}
        )
        for a, b in spans(size):
            rb.add(
                obs=arrays["obs"][a:b],
                act=arrays["action"][a:b],
                rew=arrays["reward"][a:b],
                done=arrays["done"][a:b],
            )
        return rb

    rb, held = traced_bytes(build)
    rng = np.random.default_rng(0)

    def epoch() -> int:
        order = rng.permutation(size)
        rows = 0
        for start in range(0, size, batch):
            out = from_numpy(rb._encode_sample(order[start : start + batch]))
            rows += out["obs"].shape[0]
        return rows

    return Built(
        CPPRB,
        lambda: from_numpy(rb.sample(batch)),
        epoch,
        held,
        size,
        "NumPy allocations held (tracemalloc)",
        "ReplayBuffer.sample (epoch: _encode_sample over a permutation)",
    )


def _sb3_box(shape: tuple[int, ...], dtype: Any = np.float32, low: float = -np.inf) -> Any:
    high = 255 if dtype == np.uint8 else np.inf
    low = 0 if dtype == np.uint8 else low
    return spaces.Box(low=low, high=high, shape=shape, dtype=dtype)


def _sb3_bytes(rb: Any) -> int:
    names = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")
    return sum(getattr(rb, n).nbytes for n in names if getattr(rb, n, None) is not None)


def sb3_transitions(columns: dict[str, torch.Tensor], batch: int) -> Built:
    size = columns["obs"].shape[0]
    rb = SB3ReplayBuffer(
        size,
        _sb3_box((OBS,)),
        spaces.Box(-1, 1, (ACT,), np.float32),
        device="cpu",
        handle_timeout_termination=False,
    )
    arrays = numpy_of(columns)
    for a, b in spans(size):  # what add() writes, without one Python call per row
        rb.observations[a:b, 0] = arrays["obs"][a:b]
        rb.next_observations[a:b, 0] = arrays["obs"][(np.arange(a, b) + 1) % size]
        rb.actions[a:b, 0] = arrays["action"][a:b]
        rb.rewards[a:b, 0] = arrays["reward"][a:b]
        rb.dones[a:b, 0] = arrays["done"][a:b]
    rb.timeouts[:] = 0  # touch it, as add() does
    rb.full, rb.pos = True, 0
    rng = np.random.default_rng(0)

    def epoch() -> int:
        order = rng.permutation(size)
        rows = 0
        for start in range(0, size, batch):
            rows += rb._get_samples(order[start : start + batch]).observations.shape[0]
        return rows

    return Built(
        SB3,
        lambda: rb.sample(batch),
        epoch,
        _sb3_bytes(rb),
        size,
        "array nbytes",
        "ReplayBuffer.sample (stores next_obs; epoch: _get_samples over a permutation)",
    )


def _tianshou_batch(columns: dict[str, np.ndarray], a: int, b: int) -> Any:
    done = columns["done"][a:b] > 0
    return TianshouBatch(
        obs=columns["obs"][a:b],
        act=columns["action"][a:b],
        rew=columns["reward"][a:b],
        terminated=done,
        truncated=np.zeros_like(done),
        done=done,
    )


def tianshou_transitions(columns: dict[str, torch.Tensor], batch: int) -> Built:
    size = columns["obs"].shape[0]
    arrays = numpy_of(columns)

    def build() -> Any:
        rb = TianshouReplayBuffer(size, ignore_obs_next=True)
        rb.add(_tianshou_batch(arrays, 0, 1)[0])  # allocates its arrays (size rows)
        for a, b in spans(size, 10_000):  # then what add() writes, in bulk
            for key, col in (("obs", "obs"), ("act", "action"), ("rew", "reward")):
                rb._meta[key][a:b] = arrays[col][a:b]
            done = arrays["done"][a:b] > 0
            rb._meta["terminated"][a:b] = done
            rb._meta["truncated"][a:b] = False
            rb._meta["done"][a:b] = done
        rb._insertion_idx, rb._size = 0, size  # as add() leaves them when full
        return rb

    rb, held = traced_bytes(build)

    def sample() -> dict[str, torch.Tensor]:
        out, _ = rb.sample(batch)
        return {
            "obs": torch.from_numpy(out.obs),
            "action": torch.from_numpy(out.act),
            "reward": torch.from_numpy(out.rew),
            "done": torch.from_numpy(out.done),
        }

    return Built(
        TIANSHOU,
        sample,
        None,
        held,
        size,
        "NumPy allocations held (tracemalloc)",
        "ReplayBuffer(ignore_obs_next=True).sample",
    )


def torchrl_storage_bytes(rb: TensorDictReplayBuffer) -> int:
    stored = rb.storage._storage  # the allocated TensorDict (private; read only)
    return tensor_bytes(stored.values(include_nested=True, leaves_only=True))


def torchrl_transitions(columns: dict[str, torch.Tensor], batch: int) -> Built:
    size = columns["obs"].shape[0]
    storage = LazyTensorStorage(size)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=batch)
    for a, b in spans(size):
        rb.extend(TensorDict({k: v[a:b] for k, v in columns.items()}, batch_size=[b - a]))
    epochs = TensorDictReplayBuffer(
        storage=storage, sampler=SamplerWithoutReplacement(), batch_size=batch
    )

    def epoch() -> int:
        return sum(b.batch_size[0] for b in epochs)

    return Built(
        TORCHRL,
        rb.sample,
        epoch,
        torchrl_storage_bytes(rb),
        size,
        "storage nbytes (with its index column)",
        "TensorDictReplayBuffer(LazyTensorStorage).sample; epoch: SamplerWithoutReplacement",
    )


def build_transitions(
    name: str, columns: dict[str, torch.Tensor], batch: int, scratch: Path
) -> Built:
    if name == FLOOR:
        return floor_transitions(columns, batch)
    if name == RB_TENSOR:
        return replaybuf_transitions(columns, batch, "tensor", scratch)
    if name == RB_MEMMAP:
        return replaybuf_transitions(columns, batch, "memmap", scratch)
    if name == CPPRB:
        return cpprb_transitions(columns, batch)
    if name == SB3:
        return sb3_transitions(columns, batch)
    if name == TIANSHOU:
        return tianshou_transitions(columns, batch)
    if name == TORCHRL:
        return torchrl_transitions(columns, batch)
    raise ValueError(name)


def transition_impls() -> list[str]:
    names = [FLOOR, RB_TENSOR, RB_MEMMAP]
    peers = available()
    names += [p for p in (CPPRB, SB3, TIANSHOU) if peers[p]]
    return [*names, TORCHRL]


# =========================================================================== W2: n-step
@dataclass
class Episodes:
    """Episodes padded to one length: episode e has ``length[e]`` steps, ``obs[e, :T+1]``."""

    obs: torch.Tensor  # [E, Lmax + 1, *obs]
    action: torch.Tensor  # [E, Lmax, *act]
    reward: torch.Tensor  # [E, Lmax]
    length: list[int]
    terminated: list[bool]  # else truncated

    @property
    def count(self) -> int:
        return len(self.length)

    @property
    def steps(self) -> int:
        return sum(self.length)

    @property
    def uniform(self) -> bool:
        return len(set(self.length)) == 1


def random_episodes(count: int, length: int, seed: int = 0) -> Episodes:
    """``count`` episodes of ``length`` steps; even ones terminated, odd ones truncated."""
    g = torch.Generator().manual_seed(seed)
    return Episodes(
        obs=torch.randn(count, length + 1, OBS, generator=g),
        action=torch.rand(count, length, ACT, generator=g) * 2 - 1,
        reward=torch.randn(count, length, generator=g),
        length=[length] * count,
        terminated=[e % 2 == 0 for e in range(count)],
    )


def _flat(eps: Episodes) -> dict[str, torch.Tensor]:
    """Steps of every episode back to back: the precomputed flat layout of the floor."""
    if eps.uniform:
        length = eps.length[0]
        steps = eps.count * length
        obs = eps.obs[:, :-1].reshape(steps, *eps.obs.shape[2:])
        next_obs = eps.obs[:, 1:].reshape(steps, *eps.obs.shape[2:])
        action = eps.action.reshape(steps, *eps.action.shape[2:])
        reward = eps.reward.reshape(steps)
    else:
        pick = [(e, t) for e in range(eps.count) for t in range(eps.length[e])]
        es = torch.tensor([p[0] for p in pick])
        ts = torch.tensor([p[1] for p in pick])
        obs, next_obs = eps.obs[es, ts], eps.obs[es, ts + 1]
        action, reward = eps.action[es, ts], eps.reward[es, ts]
    end = torch.zeros(eps.steps, dtype=torch.bool)
    terminated = torch.zeros(eps.steps, dtype=torch.bool)
    last = torch.tensor(eps.length).cumsum(0) - 1
    end[last] = True
    terminated[last] = torch.tensor(eps.terminated)
    return {
        "obs": obs.contiguous(),
        "next_obs": next_obs.contiguous(),
        "action": action.contiguous(),
        "reward": reward.contiguous(),
        "end": end,
        "terminated": terminated,
    }


class FlatNStep:
    """The raw n-step floor over a precomputed flat layout (steps back to back).

    ``randint`` anchors, ``n`` index_selects of reward and end-of-episode flags, then the
    obs / action / next-obs / terminated gathers at the window's two ends. With
    ``respect_ends=False`` it is the classic bug (windows run into the next episode and always
    bootstrap with gamma**n): the correctness check must catch it.
    """

    def __init__(
        self,
        eps: Episodes,
        n: int,
        gamma: float,
        seed: int = 0,
        respect_ends: bool = True,
        device: torch.device | str = "cpu",
    ) -> None:
        flat = _flat(eps)
        self.steps = eps.steps
        pad = n  # windows may look n rows past the last step: padded rows end an episode
        self.device = torch.device(device)
        self.obs, self.next_obs = flat["obs"].to(device), flat["next_obs"].to(device)
        self.action = flat["action"].to(device)
        self.reward = torch.cat([flat["reward"], torch.zeros(pad)]).to(device)
        self.end = torch.cat([flat["end"], torch.ones(pad, dtype=torch.bool)]).to(device)
        terminated = torch.cat([flat["terminated"], torch.zeros(pad, dtype=torch.bool)])
        self.terminated = terminated.to(device)
        self.n, self.gamma, self.respect_ends = n, gamma, respect_ends
        self.g = torch.Generator(device=self.device).manual_seed(seed)

    @property
    def stored_bytes(self) -> int:
        return tensor_bytes(
            [self.obs, self.next_obs, self.action, self.reward, self.end, self.terminated]
        )

    def sample(self, batch: int) -> dict[str, torch.Tensor]:
        idx = torch.randint(0, self.steps, (batch,), generator=self.g, device=self.device)
        ret = self.reward.index_select(0, idx)
        m = torch.ones(batch, dtype=torch.long, device=self.device)
        alive = None
        for k in range(1, self.n):
            if self.respect_ends:
                ended = self.end.index_select(0, idx + (k - 1))
                alive = ~ended if alive is None else alive & ~ended
                ret = ret + (self.gamma**k) * self.reward.index_select(0, idx + k) * alive
                m = m + alive
            else:
                ret = ret + (self.gamma**k) * self.reward.index_select(0, idx + k)
                m = m + 1
        last = idx + (m - 1)
        if not self.respect_ends:
            last = last.clamp(max=self.steps - 1)
        terminal = self.terminated.index_select(0, last)
        return {
            "observation": self.obs.index_select(0, idx),
            "action": self.action.index_select(0, idx),
            "reward": ret,
            "next_observation": self.next_obs.index_select(0, last),
            "discount": torch.pow(self.gamma, m) * ~terminal,
        }


def floor_nstep(eps: Episodes, n: int, gamma: float, batch: int, **kwargs: Any) -> Built:
    floor = FlatNStep(eps, n, gamma, **kwargs)
    return Built(
        FLOOR,
        lambda: floor.sample(batch),
        None,
        floor.stored_bytes,
        eps.steps,
        "tensor sizes (stores next_obs)",
        "randint + n index_selects of reward/end + obs/action/next-obs gathers",
    )


def fill_episodes(buf: SyncEpisodeReplayBuffer, eps: Episodes, envs: int) -> None:
    """Write ``eps`` through the public API, ``envs`` episodes at a time (a vectorized env)."""
    for g0 in range(0, eps.count, envs):
        group = list(range(g0, min(eps.count, g0 + envs)))
        ids = {e: buf.start_episode() for e in group}
        same = len({eps.length[e] for e in group}) == 1
        for t in range(max(eps.length[e] for e in group)):
            if same:
                sl = slice(group[0], group[-1] + 1)
                live = group
                obs, act, rew = eps.obs[sl, t], eps.action[sl, t], eps.reward[sl, t]
            else:
                live = [e for e in group if eps.length[e] > t]
                rows = torch.tensor(live)
                obs, act, rew = eps.obs[rows, t], eps.action[rows, t], eps.reward[rows, t]
            buf.append_batch([ids[e] for e in live], obs, act, rew)
            for e in live:
                if eps.length[e] == t + 1:
                    status = "terminated" if eps.terminated[e] else "truncated"
                    buf.end_episode(ids[e], status, eps.obs[e, t + 1])


def replaybuf_nstep(
    eps: Episodes, n: int, gamma: float, batch: int, scratch: Path, kind: str = "tensor"
) -> tuple[Built, SyncEpisodeReplayBuffer]:
    buf = SyncEpisodeReplayBuffer(eps.steps, eps.count, storage=kind, scratch_dir=scratch, seed=0)
    fill_episodes(buf, eps, envs=64)
    buf.sample_n_step(1)  # writes the staged rows, so that stats() counts them
    stats = buf.stats()
    built = Built(
        RB_TENSOR if kind == "tensor" else RB_MEMMAP,
        lambda: buf.sample_n_step(batch, n=n, gamma=gamma),
        None,
        stats["bytes"],
        stats["steps"],
        "stats()['bytes'] (rows incl. final observations, links, anchors)",
        f"SyncEpisodeReplayBuffer(storage={kind!r}).sample_n_step",
        buf.close,
    )
    return built, buf


def cpprb_nstep(eps: Episodes, n: int, gamma: float, batch: int) -> Built:
    def build() -> Any:
        rb = cpprb.ReplayBuffer(
            eps.steps,
            {
                "obs": {"shape": eps.obs.shape[2:]},
                "act": {"shape": eps.action.shape[2:]},
                "rew": {},
                "next_obs": {"shape": eps.obs.shape[2:]},
                "done": {},
            },
            Nstep={"size": n, "gamma": gamma, "rew": "rew", "next": "next_obs"},
        )
        for e in range(eps.count):
            length = eps.length[e]
            done = np.zeros(length, np.float32)
            done[-1] = float(eps.terminated[e])  # cpprb: done = terminal; on_episode_end() ends
            rb.add(  # copies: cpprb's Nstep rewrites the arrays it is given
                obs=eps.obs[e, :length].numpy().copy(),
                act=eps.action[e, :length].numpy().copy(),
                rew=eps.reward[e, :length].numpy().copy(),
                next_obs=eps.obs[e, 1 : length + 1].numpy().copy(),
                done=done,
            )
            rb.on_episode_end()
        return rb

    rb, held = traced_bytes(build)
    return Built(
        CPPRB,
        lambda: from_numpy(rb.sample(batch)),
        None,
        held,
        eps.steps,
        "NumPy allocations held (tracemalloc)",
        "ReplayBuffer(Nstep=...).sample (no per-sample discount: the learner uses gamma**n)",
    )


def sb3_nstep(eps: Episodes, n: int, gamma: float, batch: int, use_add: bool = False) -> Built:
    capacity = eps.steps + (1 if use_add else 0)
    rb = NStepReplayBuffer(
        capacity,
        _sb3_box(tuple(eps.obs.shape[2:])),
        _sb3_box(tuple(eps.action.shape[2:]), low=-1.0),
        device="cpu",
        n_steps=n,
        gamma=gamma,
        handle_timeout_termination=True,
    )
    if use_add:  # the public path, one add() per step
        for e in range(eps.count):
            for t in range(eps.length[e]):
                last = t == eps.length[e] - 1
                rb.add(
                    eps.obs[e, t : t + 1].numpy(),
                    eps.obs[e, t + 1 : t + 2].numpy(),
                    eps.action[e, t : t + 1].numpy(),
                    np.array([eps.reward[e, t].item()], np.float32),
                    np.array([last], np.float32),
                    [{"TimeLimit.truncated": last and not eps.terminated[e]}],
                )
    else:  # what add() writes, in bulk
        flat = _flat(eps)
        rb.observations[: eps.steps, 0] = flat["obs"].numpy()
        rb.next_observations[: eps.steps, 0] = flat["next_obs"].numpy()
        rb.actions[: eps.steps, 0] = flat["action"].numpy()
        rb.rewards[: eps.steps, 0] = flat["reward"].numpy()
        rb.dones[: eps.steps, 0] = flat["end"].numpy()
        rb.timeouts[: eps.steps, 0] = (flat["end"] & ~flat["terminated"]).numpy()
        rb.full, rb.pos = True, 0
    return Built(
        SB3,
        lambda: rb.sample(batch),
        None,
        _sb3_bytes(rb),
        eps.steps,
        "array nbytes",
        "NStepReplayBuffer.sample",
    )


def torchrl_episode_td(
    obs: torch.Tensor, action: torch.Tensor, reward: torch.Tensor, terminated: bool
) -> TensorDict:
    """One episode in TorchRL's usual layout (``obs`` has one more row than ``action``)."""
    steps = action.shape[0]
    done = torch.zeros(steps, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict(
        {
            "observation": obs[:-1],
            "action": action,
            "next": {
                "observation": obs[1:],
                "reward": reward.reshape(steps, 1),
                "done": done,
                "terminated": done & terminated,
                "truncated": done & (not terminated),
            },
        },
        batch_size=[steps],
    )


def torchrl_nstep(eps: Episodes, n: int, gamma: float, batch: int) -> Built:
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(eps.steps),
        transform=MultiStepTransform(n, gamma),
        batch_size=batch,
    )
    for e in range(eps.count):
        length = eps.length[e]
        rb.extend(
            torchrl_episode_td(
                eps.obs[e, : length + 1],
                eps.action[e, :length],
                eps.reward[e, :length],
                eps.terminated[e],
            )
        )
    return Built(
        TORCHRL,
        rb.sample,
        None,
        torchrl_storage_bytes(rb),
        len(rb),
        "storage nbytes",
        "TensorDictReplayBuffer(LazyTensorStorage, MultiStepTransform).sample",
    )


# =========================================================================== W3: pixels
class Frames:
    """Stacked u8[4, 84, 84] observations from a pool of random frames (cheap to make).

    Episode ``e`` shows frame ``(e * 7 + t) % pool`` at step t; observation t stacks frames
    t-3 .. t (the first one repeated at the episode's start), as Atari's FrameStack does.
    """

    def __init__(self, pool: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.frames = torch.randint(0, 256, (pool, *PIXELS[1:]), dtype=torch.uint8, generator=g)
        self.pool = pool

    def ids(self, episodes: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """Frame ids ``[len(episodes), t1 - t0, 4]`` of observations t0 .. t1-1."""
        t = torch.arange(t0, t1).reshape(1, -1, 1) + torch.arange(-3, 1).reshape(1, 1, 4)
        return (episodes.reshape(-1, 1, 1) * 7 + t.clamp(min=0)) % self.pool

    def obs(self, episodes: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """``[len(episodes), t1 - t0, 4, 84, 84]`` u8."""
        return self.frames[self.ids(episodes, t0, t1)]


def pixel_payload() -> int:
    """Bytes of one transition without next-obs copies: the frame stack, int64 action, reward."""
    return math.prod(PIXELS) + 8 + 4


def pixel_reward(episodes: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    return ((episodes.reshape(-1, 1) + torch.arange(t0, t1)) % 3).to(torch.float32)


def pixel_action(episodes: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    return (episodes.reshape(-1, 1) + torch.arange(t0, t1)) % 6


def floor_pixels(
    frames: Frames, count: int, length: int, batch: int, device: torch.device | str = "cpu"
) -> Built:
    """Observations stored once (T+1 rows per episode); next obs = the row after the anchor.
    Built on the CPU, then moved to ``device`` with the anchors and the generator."""
    rows = count * (length + 1)
    obs = torch.empty((rows, *PIXELS), dtype=torch.uint8)
    action = torch.zeros(rows, dtype=torch.long)
    reward = torch.zeros(rows)
    terminal = torch.zeros(rows, dtype=torch.bool)
    for e in range(count):
        first = e * (length + 1)
        es = torch.tensor([e])
        obs[first : first + length + 1] = frames.obs(es, 0, length + 1)[0]
        action[first : first + length] = pixel_action(es, 0, length)[0]
        reward[first : first + length] = pixel_reward(es, 0, length)[0]
        terminal[first + length] = True
    anchors = (torch.arange(count).reshape(-1, 1) * (length + 1) + torch.arange(length)).reshape(-1)
    obs, action, reward = obs.to(device), action.to(device), reward.to(device)
    terminal, anchors = terminal.to(device), anchors.to(device)
    steps = anchors.shape[0]
    g = torch.Generator(device=device).manual_seed(0)

    def sample() -> dict[str, torch.Tensor]:
        picks = torch.randint(0, steps, (batch,), generator=g, device=device)
        idx = anchors.index_select(0, picks)
        nxt = idx + 1
        return {
            "observation": obs.index_select(0, idx),
            "next_observation": obs.index_select(0, nxt),
            "action": action.index_select(0, idx),
            "reward": reward.index_select(0, idx),
            "terminal": terminal.index_select(0, nxt),
        }

    return Built(
        FLOOR,
        sample,
        None,
        tensor_bytes([obs, action, reward, terminal]),
        steps,
        "tensor sizes (T+1 observation rows per episode)",
        "randint + index_select per field, next obs = the next row",
    )


def floor_frames(frames: Frames, count: int, length: int, batch: int) -> Built:
    """The frame floor: one u8[84, 84] frame stored per step (T + 1 rows per episode); a batch
    gathers each window's k + 1 consecutive frames t-k+1 .. t+1 once (one ``np.take`` of a
    ``[B, k + 1]`` row array, the rows before the episode's first clamped to it: "reset"
    padding) and returns the two stacks as views of that gather, frames ``[:k]`` and
    ``[1:]``: the cheapest correct raw approach (each frame read and written once)."""
    k = PIXELS[0]
    rows = count * (length + 1)
    stored = np.empty((rows, *PIXELS[1:]), dtype=np.uint8)
    action = np.zeros(rows, dtype=np.int64)
    reward = np.zeros(rows, dtype=np.float32)
    terminal = np.zeros(rows, dtype=np.bool_)
    first = np.empty(rows, dtype=np.int64)
    for e in range(count):
        at = e * (length + 1)
        es = torch.tensor([e])
        stored[at : at + length + 1] = frames.obs(es, 0, length + 1)[0, :, -1].numpy()
        action[at : at + length] = pixel_action(es, 0, length)[0].numpy()
        reward[at : at + length] = pixel_reward(es, 0, length)[0].numpy()
        terminal[at + length] = True
        first[at : at + length + 1] = at
    anchors = (np.arange(count).reshape(-1, 1) * (length + 1) + np.arange(length)).reshape(-1)
    back = np.arange(-(k - 1), 2)  # t-k+1 .. t+1
    g = torch.Generator().manual_seed(0)

    def sample() -> dict[str, torch.Tensor]:
        picks = torch.randint(0, anchors.shape[0], (batch,), generator=g).numpy()
        idx = anchors.take(picks)
        window = np.maximum(idx[:, None] + back, first.take(idx)[:, None])  # [B, k + 1]
        gathered = stored.take(window.reshape(-1), axis=0).reshape(batch, k + 1, *PIXELS[1:])
        return {
            "observation": torch.from_numpy(gathered[:, :k]),
            "next_observation": torch.from_numpy(gathered[:, 1:]),
            "action": torch.from_numpy(action.take(idx)),
            "reward": torch.from_numpy(reward.take(idx)),
            "terminal": torch.from_numpy(terminal.take(idx + 1)),
        }

    return Built(
        FRAME_FLOOR,
        sample,
        None,
        stored.nbytes + action.nbytes + reward.nbytes + terminal.nbytes + first.nbytes,
        anchors.shape[0],
        "array sizes (T+1 frame rows per episode)",
        "randint + one np.take of each window's k+1 frames, the stacks as views",
    )


def replaybuf_pixels(
    frames: Frames,
    count: int,
    length: int,
    batch: int,
    scratch: Path,
    kind: str = "tensor",
    frame_stack: bool = False,
    device: torch.device | str = "cpu",
    storing_device: torch.device | str = "cpu",
    envs: int | None = None,
) -> Built:
    """replaybuf's episode buffer; ``frame_stack``: append each stack's newest frame only and
    let ``frame_stack=4`` rebuild the stacks (the same observations come back).

    ``envs`` episodes are written at a time, a step of each per ``append_batch``: None, all of
    them in lockstep (a vector env: an episode's rows lie ``count`` rows apart); 1, one
    episode after another, in the order the floor and the peers store them."""
    stack = PIXELS[0] if frame_stack else None
    buf = SyncEpisodeReplayBuffer(
        count * length,
        count,
        device=device,
        storing_device=storing_device,
        storage=kind,
        scratch_dir=scratch,
        seed=0,
        frame_stack=stack,
    )
    group = count if envs is None else envs
    for first in range(0, count, group):
        es = torch.arange(first, min(count, first + group))
        ids = [buf.start_episode() for _ in range(es.shape[0])]
        block = 50  # make observations 50 steps at a time (bounded memory)
        for t0 in range(0, length, block):
            t1 = min(length, t0 + block)
            obs = frames.obs(es, t0, t1)
            act, rew = pixel_action(es, t0, t1), pixel_reward(es, t0, t1)
            if frame_stack:
                obs = obs[:, :, -1]  # [envs, steps, 84, 84]: the newest frame of each stack
            for t in range(t1 - t0):
                buf.append_batch(ids, obs[:, t], act[:, t], rew[:, t])
        final = frames.obs(es, length, length + 1)[:, 0]
        if frame_stack:
            final = final[:, -1]
        for e, episode in enumerate(ids):
            buf.end_episode(episode, "terminated", final[e])
    buf.sample_n_step(1)  # writes the staged rows, so that stats() counts them
    if kind == "memmap":  # map every page once, as replaybuf_transitions does
        for episode in ids:
            buf.get_episode(episode)
    stats = buf.stats()
    if frame_stack:
        name = RB_FRAMES
    elif envs is None and count > 1:
        name = RB_LOCKSTEP
    else:
        name = RB_TENSOR if kind == "tensor" else RB_MEMMAP
    return Built(
        name,
        lambda: buf.sample_n_step(batch, n=1),
        None,
        stats["bytes"],
        stats["steps"],
        "stats()['bytes'] (rows incl. final observations, links, anchors)",
        "SyncEpisodeReplayBuffer.sample_n_step(n=1)",
        buf.close,
    )


def cpprb_pixels(frames: Frames, count: int, length: int, batch: int) -> Built:
    """cpprb with next_of='obs' and stack_compress='obs' (stack on the last axis)."""

    def build() -> Any:
        hw4 = (*PIXELS[1:], PIXELS[0])
        rb = cpprb.ReplayBuffer(
            count * length,
            {
                "obs": {"shape": hw4, "dtype": np.uint8},
                "act": {"dtype": np.int64},
                "rew": {},
                "done": {},
            },
            next_of="obs",
            stack_compress="obs",
        )
        for e in range(count):
            es = torch.tensor([e])
            obs = frames.obs(es, 0, length + 1)[0].permute(0, 2, 3, 1).contiguous().numpy()
            done = np.zeros(length, np.float32)
            done[-1] = 1.0
            rb.add(
                obs=obs[:-1],
                act=pixel_action(es, 0, length)[0].numpy(),
                rew=pixel_reward(es, 0, length)[0].numpy(),
                next_obs=obs[1:],
                done=done,
            )
            rb.on_episode_end()
        return rb

    rb, held = traced_bytes(build)
    return Built(
        CPPRB,
        lambda: from_numpy(rb.sample(batch)),
        None,
        held,
        count * length,
        "NumPy allocations held (tracemalloc)",
        "ReplayBuffer(next_of='obs', stack_compress='obs').sample",
    )


def sb3_pixels(frames: Frames, count: int, length: int, batch: int) -> Built:
    steps = count * length
    rb = SB3ReplayBuffer(
        steps,
        _sb3_box(PIXELS, np.uint8),
        spaces.Discrete(6),
        device="cpu",
        optimize_memory_usage=True,
        handle_timeout_termination=False,
    )
    for e in range(count):  # what add() writes: obs[i + 1] doubles as next obs of step i
        es = torch.tensor([e])
        rows = slice(e * length, (e + 1) * length)
        rb.observations[rows, 0] = frames.obs(es, 0, length)[0].numpy()
        rb.actions[rows, 0, 0] = pixel_action(es, 0, length)[0].numpy()
        rb.rewards[rows, 0] = pixel_reward(es, 0, length)[0].numpy()
        rb.dones[(e + 1) * length - 1, 0] = 1.0
    rb.timeouts[:] = 0
    rb.full, rb.pos = True, 0
    return Built(
        SB3,
        lambda: rb.sample(batch),
        None,
        _sb3_bytes(rb),
        steps,
        "array nbytes",
        "ReplayBuffer(optimize_memory_usage=True).sample",
    )


def torchrl_pixels(frames: Frames, count: int, length: int, batch: int) -> Built:
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(count * length), batch_size=batch)
    for e in range(count):
        es = torch.tensor([e])
        rb.extend(
            torchrl_episode_td(
                frames.obs(es, 0, length + 1)[0],
                pixel_action(es, 0, length)[0],
                pixel_reward(es, 0, length)[0],
                True,
            )
        )
    return Built(
        TORCHRL,
        rb.sample,
        None,
        torchrl_storage_bytes(rb),
        len(rb),
        "storage nbytes",
        "TensorDictReplayBuffer(LazyTensorStorage).sample (stores next obs)",
    )


# =========================================================================== W4: inserts
class StepPool:
    """Pre-made inputs (torch and NumPy), cycled, so writers time the buffers, not randn."""

    def __init__(self, rows: int, size: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        shape = (size, rows) if rows > 1 else (size,)
        self.obs = list(torch.randn(*shape, OBS, generator=g).unbind(0))
        self.action = list((torch.rand(*shape, ACT, generator=g) * 2 - 1).unbind(0))
        reward = torch.randn(*shape, generator=g)
        self.reward_t = list(reward.unbind(0))
        self.reward = reward.tolist() if rows == 1 else self.reward_t  # envs return floats
        self.done = list(torch.zeros(*shape, dtype=torch.bool).unbind(0))
        self.obs_np = [o.numpy() for o in self.obs]
        self.action_np = [a.numpy() for a in self.action]
        self.reward_np = [np.asarray(r, np.float32).reshape(-1) for r in self.reward_t]
        self.done_np = [np.zeros(rows, np.float32) for _ in range(size)]
        self.td = [
            TensorDict(
                {
                    "obs": self.obs[i],
                    "action": self.action[i],
                    "reward": self.reward_t[i],
                    "done": self.done[i],
                },
                batch_size=[rows] if rows > 1 else [],
            )
            for i in range(size)
        ]
        self.size = size
        self.rows = rows


class Turn:
    """A cycling counter."""

    def __init__(self, size: int) -> None:
        self.i, self.size = 0, size

    def __call__(self) -> int:
        i = self.i
        self.i = (i + 1) % self.size
        return i


def floor_writer(pool: StepPool, capacity: int) -> Callable[[], None]:
    """Raw torch: preallocated columns, a cursor, ``copy_`` (one row or a slice) per field.
    The columns are zero-filled (their pages faulted in): the steady state, as the buffers it
    is compared with are full when timed (untouched columns cost ~30% more per 64-row write
    while the first pass faults their pages in)."""
    rows = pool.rows
    cols = {
        "obs": torch.zeros(capacity, OBS),
        "action": torch.zeros(capacity, ACT),
        "reward": torch.zeros(capacity),
        "done": torch.zeros(capacity, dtype=torch.bool),
    }
    obs_c, act_c, rew_c, done_c = cols.values()
    turn = Turn(pool.size)
    state = {"cursor": 0}
    if rows == 1:

        def write() -> None:
            i = turn()
            c = state["cursor"]
            obs_c[c].copy_(pool.obs[i])
            act_c[c].copy_(pool.action[i])
            rew_c[c] = pool.reward[i]
            done_c[c] = False
            state["cursor"] = (c + 1) % capacity

    else:
        assert capacity % rows == 0

        def write() -> None:
            i = turn()
            c = state["cursor"]
            end = c + rows
            obs_c[c:end].copy_(pool.obs[i])
            act_c[c:end].copy_(pool.action[i])
            rew_c[c:end].copy_(pool.reward_t[i])
            done_c[c:end].copy_(pool.done[i])
            state["cursor"] = end % capacity

    return write


def steady(write: Callable[[], None], pool: StepPool, capacity: int) -> Callable[[], None]:
    """``write`` after one pass through a ``capacity``-row ring: its pages faulted in and its
    cursor wrapping, the state the buffers it is compared with are timed in (they are full)."""
    for _ in range(-(-capacity // pool.rows)):
        write()
    return write


def step_inputs(pool: StepPool, numpy: bool) -> tuple[list[Any], list[Any]]:
    """The pool's observations and actions as torch tensors, or as numpy arrays (what a
    gymnasium environment returns, and what SB3's ``add`` is given)."""
    return (pool.obs_np, pool.action_np) if numpy else (pool.obs, pool.action)


def episode_writer(
    buf: SyncEpisodeReplayBuffer, pool: StepPool, envs: int, length: int, numpy: bool = False
) -> Callable[[], None]:
    """One sync call per step (``envs`` = 1: append_observation_action_reward, else
    append_batch of ``envs`` episodes); every episode ends after ``length`` steps."""
    turn = Turn(pool.size)
    state: dict[str, Any] = {"ids": [buf.start_episode() for _ in range(envs)], "t": 0}
    obs, action = step_inputs(pool, numpy)

    def next_episodes(i: int) -> None:
        final = pool.obs[(i + 1) % pool.size]
        for row, episode in enumerate(state["ids"]):
            buf.end_episode(episode, "truncated", final if envs == 1 else final[row])
        state["ids"], state["t"] = [buf.start_episode() for _ in range(envs)], 0

    if envs == 1:

        def write() -> None:
            i = turn()
            buf.append_observation_action_reward(state["ids"][0], obs[i], action[i], pool.reward[i])
            state["t"] += 1
            if state["t"] == length:
                next_episodes(i)

    else:

        def write() -> None:
            i = turn()
            buf.append_batch(state["ids"], pool.obs[i], pool.action[i], pool.reward[i])
            state["t"] += 1
            if state["t"] == length:
                next_episodes(i)

    return write


def bulk_episode_writer(
    buf: SyncEpisodeReplayBuffer, pool: StepPool, envs: int, length: int
) -> Callable[[], None]:
    """A vector env of ``envs`` episodes of ``length`` steps: ``append_batch`` each step, and
    every ``length`` steps ``end_episodes`` of all of them and ``start_episodes`` of new ones."""
    turn = Turn(pool.size)
    state: dict[str, Any] = {"ids": buf.start_episodes(envs), "t": 0}

    def write() -> None:
        i = turn()
        buf.append_batch(state["ids"], pool.obs[i], pool.action[i], pool.reward[i])
        state["t"] += 1
        if state["t"] == length:
            buf.end_episodes(state["ids"], "truncated", pool.obs[(i + 1) % pool.size])
            state["ids"], state["t"] = buf.start_episodes(envs), 0

    return write


def async_episode_writer(
    buf: EpisodeReplayBuffer, pool: StepPool, envs: int, length: int, numpy: bool = False
) -> Callable[[], Any]:
    """As :func:`episode_writer`, through the asyncio facade (each call awaited)."""
    turn = Turn(pool.size)
    state: dict[str, Any] = {"ids": None, "t": 0}
    obs, action = step_inputs(pool, numpy)

    async def write() -> None:
        if state["ids"] is None:
            state["ids"] = [await buf.start_episode() for _ in range(envs)]
        i = turn()
        if envs == 1:
            await buf.append_observation_action_reward(
                state["ids"][0], obs[i], action[i], pool.reward[i]
            )
        else:
            await buf.append_batch(state["ids"], pool.obs[i], pool.action[i], pool.reward[i])
        state["t"] += 1
        if state["t"] == length:
            final = pool.obs[(i + 1) % pool.size]
            for row, episode in enumerate(state["ids"]):
                await buf.end_episode(episode, "truncated", final if envs == 1 else final[row])
            state["ids"], state["t"] = [await buf.start_episode() for _ in range(envs)], 0

    return write


def has_nowait(buf: EpisodeReplayBuffer) -> bool:
    """Whether this replaybuf's async facade has the ``*_nowait`` appends."""
    return hasattr(buf, "append_observation_action_reward_nowait")


def nowait_episode_writer(
    buf: EpisodeReplayBuffer, pool: StepPool, envs: int, length: int, numpy: bool = False
) -> Callable[[], None]:
    """As :func:`episode_writer`, through the async facade's ``*_nowait`` appends (plain calls
    in the caller's task); episodes start and end through the facade's sync core."""
    core = buf._sync  # the facade's own core (start/end are not what is timed)
    turn = Turn(pool.size)
    state: dict[str, Any] = {"ids": [core.start_episode() for _ in range(envs)], "t": 0}
    obs, action = step_inputs(pool, numpy)

    def write() -> None:
        i = turn()
        if envs == 1:
            buf.append_observation_action_reward_nowait(
                state["ids"][0], obs[i], action[i], pool.reward[i]
            )
        else:
            buf.append_batch_nowait(state["ids"], pool.obs[i], pool.action[i], pool.reward[i])
        state["t"] += 1
        if state["t"] == length:
            final = pool.obs[(i + 1) % pool.size]
            for row, episode in enumerate(state["ids"]):
                core.end_episode(episode, "truncated", final if envs == 1 else final[row])
            state["ids"], state["t"] = [core.start_episode() for _ in range(envs)], 0

    return write


def prefill_episodes(buf: SyncEpisodeReplayBuffer, length: int) -> None:
    """Fill to ``max_steps`` with 64-env episodes, so timed appends evict (steady state)."""
    pool = StepPool(64, size=4)
    write = episode_writer(buf, pool, 64, length)
    for _ in range(buf.max_steps // 64):
        write()


def replaybuf_batch_writer(buf: ReplayBuffer, pool: StepPool) -> Callable[[], None]:
    turn = Turn(pool.size)
    return lambda: buf.add_batch(pool.td[turn()])


def cpprb_writer(pool: StepPool, capacity: int) -> Callable[[], None]:
    """cpprb's ``add``, once through its ring first (see :func:`steady`)."""
    rb = cpprb.ReplayBuffer(
        capacity, {"obs": {"shape": OBS}, "act": {"shape": ACT}, "rew": {}, "done": {}}
    )
    turn = Turn(pool.size)
    if pool.rows == 1:

        def write() -> None:
            i = turn()
            rb.add(obs=pool.obs_np[i], act=pool.action_np[i], rew=pool.reward[i], done=0.0)

    else:

        def write() -> None:
            i = turn()
            rb.add(
                obs=pool.obs_np[i],
                act=pool.action_np[i],
                rew=pool.reward_np[i],
                done=pool.done_np[i],
            )

    return steady(write, pool, capacity)


def sb3_writer(pool: StepPool, capacity: int) -> Callable[[], None]:
    """SB3's ``add`` with ``n_envs`` = the pool's rows (its vectorized-env path), once
    through its ring first (see :func:`steady`)."""
    envs = pool.rows
    rb = SB3ReplayBuffer(
        capacity,
        _sb3_box((OBS,)),
        spaces.Box(-1, 1, (ACT,), np.float32),
        device="cpu",
        n_envs=envs,
    )
    infos = [{} for _ in range(envs)]
    turn = Turn(pool.size)
    obs = [o.reshape(envs, OBS) for o in pool.obs_np]
    act = [a.reshape(envs, ACT) for a in pool.action_np]

    def write() -> None:
        i = turn()
        rb.add(obs[i], obs[(i + 1) % pool.size], act[i], pool.reward_np[i], pool.done_np[i], infos)

    return steady(write, pool, capacity)


def torchrl_writer(pool: StepPool, capacity: int) -> Callable[[], None]:
    """``rb.add`` of a TensorDict built per call (one step), or ``rb.extend`` of a chunk,
    into a buffer filled first in one ``extend`` (full: writes wrap, in faulted-in pages)."""
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(capacity))
    row = pool.td[0] if pool.rows == 1 else pool.td[0][0]
    rb.extend(row.expand(capacity).clone())
    turn = Turn(pool.size)
    if pool.rows == 1:
        false = torch.tensor(False)

        def write() -> None:
            i = turn()
            rb.add(
                TensorDict(
                    {
                        "obs": pool.obs[i],
                        "action": pool.action[i],
                        "reward": torch.tensor(pool.reward[i]),
                        "done": false,
                    },
                    batch_size=[],
                )
            )

    else:
        own = [td.clone() for td in pool.td]  # extend writes its index into its input

        def write() -> None:
            rb.extend(own[turn()])

    return write


def run_async(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    return loop.run_until_complete(coro)
