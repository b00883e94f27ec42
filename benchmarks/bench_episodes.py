"""Episode buffer benchmarks: replaybuf's EpisodeReplayBuffer beside raw TorchRL, in one run.

Measures, single-threaded (``torch.set_num_threads(1)``), each
number the median over repeats:

1. append throughput: one step per call through the async API and through the sync core,
   and ``append_batch`` of 64 environments, beside ``TensorDictReplayBuffer.add`` of one step
   per call (a fresh TensorDict each call) and ``extend`` of 64-row chunks;
2. ``sample_n_step(256, n=3)``, ``sample_n_step(256, n=1)`` and ``sample_sequences(32, 16)``
   from 1,000,000 stored steps in 1,000-step episodes (obs f32[17], action f32[6], reward f32),
   beside a ``TensorDictReplayBuffer`` in TorchRL's usual ``("next", ...)`` layout (plain random
   sampling, ``MultiStepTransform(n_steps=3)``, ``SliceSampler(slice_len=16, traj_key=...)``)
   and ``replaybuf.ReplayBuffer.sample_batch(256)`` over 1,000,000 transitions;
3. one epoch of ``iterate_epochs(256, n=3)`` through the async API beside iterating a
   ``SamplerWithoutReplacement`` over the same items (TorchRL's n-step rows);
4. stored bytes per transition for 4x84x84 uint8 observations in 1,000-step episodes, against
   the raw payload and TorchRL's layout (which stores every next observation a second time).

Every storage is memory-mapped (replaybuf's default on CPU; ``LazyMemmapStorage`` for TorchRL)
in a temporary scratch folder that is removed at the end. Prints one table and writes
``benchmarks/results/bench_episodes.json``.

    python benchmarks/bench_episodes.py            # full run (a few minutes)
    python benchmarks/bench_episodes.py --quick    # small sizes (< 1 minute)
    python benchmarks/bench_episodes.py --profile  # also print cProfile top entries
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import logging
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tensordict
import torch
import torchrl
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    SamplerWithoutReplacement,
    SliceSampler,
    TensorDictReplayBuffer,
)
from torchrl.envs import MultiStepTransform

import replaybuf
from replaybuf import EpisodeReplayBuffer, ReplayBuffer, SyncEpisodeReplayBuffer

OBS, ACT = 17, 6  # W1 shapes: obs f32[17], action f32[6], reward f32
EP_LEN = 1_000  # steps per episode everywhere
ENVS = 64  # vectorized environments for append_batch / extend
BATCH = 256  # n-step / transition batch size
N_STEP, GAMMA = 3, 0.99
SEQ_BATCH, SEQ_LEN = 32, 16
PIXELS = (4, 84, 84)  # uint8 frames for the bytes-per-transition workload
RESULTS = Path(__file__).resolve().parent / "results" / "bench_episodes.json"
NOTES = [
    "ratio = replaybuf cost / baseline cost (time per step, time per batch or bytes per "
    "transition): below 1 replaybuf is cheaper.",
    "TorchRL baselines use its usual layout: observation, action, episode and "
    "('next', observation / reward / done / terminated / truncated). It stores every next "
    "observation a second time; replaybuf stores each observation once and gathers "
    "next_observation at sampling time.",
    "TorchRL's MultiStepTransform computes n-step rows at extend time, so its n-step sampling "
    "is plain 1-step sampling of precomputed rows; replaybuf follows row links at sampling "
    "time (any n, per call).",
    "replaybuf's sampling buffer is filled with every episode in progress at once (one "
    "append_batch per time step), so episodes interleave in storage; TorchRL's episodes are "
    "contiguous (SliceSampler and MultiStepTransform need contiguous time).",
    "Targets: n-step sampling within 2x of 1-step transition sampling, read as (a) "
    "sample_n_step n=3 vs n=1 and (b) vs ReplayBuffer.sample_batch; bytes per transition "
    "within 1.1x of the payload. '< 1x (implied)': appends should cost less than "
    "TorchRL's per-call add.",
    "Timed runs go round-robin over the workloads of a section, so load from other processes "
    "hits them alike; the JSON keeps every run and the minimum beside the median.",
    "All storages are memory-mapped files in a temporary folder (replaybuf's CPU default; "
    "TorchRL LazyMemmapStorage); torch.set_num_threads(1).",
]


@dataclass(frozen=True)
class Sizes:
    append_steps: int  # one-step appends per timed repeat
    batch_calls: int  # append_batch / extend calls of ENVS rows per timed repeat
    append_repeats: int
    sample_steps: int  # stored steps for the sampling workloads (EP_LEN-step episodes)
    sample_calls: int  # calls per timed repeat
    sample_repeats: int
    epoch_repeats: int
    pixel_episodes: int  # EP_LEN-step episodes of 4x84x84 uint8 frames


FULL = Sizes(
    append_steps=5_000,
    batch_calls=500,
    append_repeats=9,
    sample_steps=1_000_000,
    sample_calls=100,
    sample_repeats=15,
    epoch_repeats=5,
    pixel_episodes=20,
)
QUICK = Sizes(
    append_steps=1_000,
    batch_calls=50,
    append_repeats=5,
    sample_steps=50_000,
    sample_calls=20,
    sample_repeats=5,
    epoch_repeats=1,
    pixel_episodes=2,
)


# --------------------------------------------------------------------------- timing helpers
def timing(runs: list[float]) -> dict[str, Any]:
    """``{"median": ..., "min": ..., "runs": [...]}``, in seconds (the table uses medians)."""
    return {"median": statistics.median(runs), "min": min(runs), "runs": runs}


@dataclass(frozen=True)
class Workload:
    fn: Callable[[], Any]  # one call; returns an awaitable when is_async
    calls: int  # calls per timed run
    is_async: bool = False


async def interleaved(workloads: dict[str, Workload], repeats: int) -> dict[str, dict[str, Any]]:
    """Seconds per call of each workload: median over ``repeats`` timed runs.

    One untimed call each first (allocation, caches). Runs go round-robin over the workloads,
    so a change in machine load (other processes on a shared machine) hits them all alike and
    ratios between them stay meaningful.
    """
    for w in workloads.values():
        if w.is_async:
            await w.fn()
        else:
            w.fn()
    runs: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(repeats):
        for name, w in workloads.items():
            start = time.perf_counter()
            if w.is_async:
                for _ in range(w.calls):
                    await w.fn()
            else:
                for _ in range(w.calls):
                    w.fn()
            runs[name].append((time.perf_counter() - start) / w.calls)
    return {name: timing(r) for name, r in runs.items()}


# --------------------------------------------------------------------------- data
def torchrl_steps(
    obs: torch.Tensor, action: torch.Tensor, reward: torch.Tensor, episode: int, ended: bool
) -> TensorDict:
    """Consecutive steps of one episode in TorchRL's layout (``obs`` has one more row)."""
    steps = action.shape[0]
    done = torch.zeros(steps, 1, dtype=torch.bool)
    if ended:
        done[-1] = True
    return TensorDict(
        {
            "observation": obs[:-1],
            "action": action,
            "episode": torch.full((steps,), episode, dtype=torch.long),
            "next": {
                "observation": obs[1:],
                "reward": reward.reshape(steps, 1),
                "done": done,
                "terminated": done.clone(),
                "truncated": torch.zeros(steps, 1, dtype=torch.bool),
            },
        },
        batch_size=[steps],
    )


def memmap_rb(capacity: int, folder: Path, name: str, **kwargs: Any) -> TensorDictReplayBuffer:
    """A TorchRL buffer over ``LazyMemmapStorage`` in a fresh subfolder (see :func:`drop_rb`)."""
    where = tempfile.mkdtemp(prefix=f"{name}-", dir=folder)
    storage = LazyMemmapStorage(capacity, scratch_dir=where, auto_cleanup=False)
    return TensorDictReplayBuffer(storage=storage, **kwargs)


def drop_rb(*buffers: TensorDictReplayBuffer) -> None:
    """TorchRL has no close(): remove the memmap files of buffers made by :func:`memmap_rb`."""
    for rb in buffers:
        shutil.rmtree(rb.storage.scratch_dir, ignore_errors=True)


def torchrl_bytes_per_row(rb: TensorDictReplayBuffer) -> float:
    stored = rb.storage._storage  # the allocated TensorDict (private, read only)
    total = sum(
        v.numel() * v.element_size() for v in stored.values(include_nested=True, leaves_only=True)
    )
    return total / rb.storage.max_size


# --------------------------------------------------------------------------- 1. appends
class Pool:
    """Pre-made step data, cycled, so that timing covers the buffers and not torch.randn."""

    def __init__(self, rows: int, size: int = 64) -> None:
        self.obs = list(torch.randn(size, rows, OBS).squeeze(1).unbind(0))
        self.action = list(torch.randn(size, rows, ACT).squeeze(1).unbind(0))
        if rows == 1:
            self.reward = torch.randn(size).tolist()  # Python floats, as envs return them
        else:
            self.reward = list(torch.randn(size, rows).unbind(0))
        self.size = size


def one_step_writer(buf: SyncEpisodeReplayBuffer, pool: Pool) -> Callable[[], None]:
    """One sync ``append_observation_action_reward`` per call; episodes of EP_LEN steps."""
    state = {"episode": buf.start_episode(), "t": 0}

    def step() -> None:
        t = state["t"]
        i = t % pool.size
        buf.append_observation_action_reward(
            state["episode"], pool.obs[i], pool.action[i], pool.reward[i]
        )
        t += 1
        if t == EP_LEN:
            buf.end_episode(state["episode"], "truncated", pool.obs[(i + 1) % pool.size])
            state["episode"], t = buf.start_episode(), 0
        state["t"] = t

    return step


def async_one_step_writer(buf: EpisodeReplayBuffer, pool: Pool) -> Callable[[], Awaitable[None]]:
    state: dict[str, Any] = {"episode": None, "t": 0}

    async def step() -> None:
        if state["episode"] is None:
            state["episode"] = await buf.start_episode()
        t = state["t"]
        i = t % pool.size
        await buf.append_observation_action_reward(
            state["episode"], pool.obs[i], pool.action[i], pool.reward[i]
        )
        t += 1
        if t == EP_LEN:
            await buf.end_episode(state["episode"], "truncated", pool.obs[(i + 1) % pool.size])
            state["episode"], t = await buf.start_episode(), 0
        state["t"] = t

    return step


def batch_writer(buf: SyncEpisodeReplayBuffer, pool: Pool) -> Callable[[], None]:
    """One sync ``append_batch`` of ENVS episodes per call; all end every EP_LEN calls."""
    state = {"ids": [buf.start_episode() for _ in range(ENVS)], "t": 0}

    def step() -> None:
        t = state["t"]
        i = t % pool.size
        buf.append_batch(state["ids"], pool.obs[i], pool.action[i], pool.reward[i])
        t += 1
        if t == EP_LEN:
            final = pool.obs[(i + 1) % pool.size]
            for row, episode in enumerate(state["ids"]):
                buf.end_episode(episode, "truncated", final[row])
            state["ids"], t = [buf.start_episode() for _ in range(ENVS)], 0
        state["t"] = t

    return step


def async_batch_writer(buf: EpisodeReplayBuffer, pool: Pool) -> Callable[[], Awaitable[None]]:
    state: dict[str, Any] = {"ids": None, "t": 0}

    async def step() -> None:
        if state["ids"] is None:
            state["ids"] = [await buf.start_episode() for _ in range(ENVS)]
        t = state["t"]
        i = t % pool.size
        await buf.append_batch(state["ids"], pool.obs[i], pool.action[i], pool.reward[i])
        t += 1
        if t == EP_LEN:
            final = pool.obs[(i + 1) % pool.size]
            for row, episode in enumerate(state["ids"]):
                await buf.end_episode(episode, "truncated", final[row])
            state["ids"], t = [await buf.start_episode() for _ in range(ENVS)], 0
        state["t"] = t

    return step


def torchrl_add_writer(rb: TensorDictReplayBuffer, pool: Pool) -> Callable[[], None]:
    """``rb.add`` of one step per call, the TensorDict built per call (as a collector loop)."""
    state = {"t": 0}
    false = torch.zeros(1, dtype=torch.bool)

    def step() -> None:
        t = state["t"]
        i = t % pool.size
        j = (i + 1) % pool.size
        done = torch.tensor([t % EP_LEN == EP_LEN - 1])
        rb.add(
            TensorDict(
                {
                    "observation": pool.obs[i],
                    "action": pool.action[i],
                    "episode": torch.tensor(t // EP_LEN),
                    "next": {
                        "observation": pool.obs[j],
                        "reward": torch.tensor([pool.reward[i]]),
                        "done": done,
                        "terminated": false,
                        "truncated": done,
                    },
                },
                batch_size=[],
            )
        )
        state["t"] = t + 1

    return step


def torchrl_extend_writer(rb: TensorDictReplayBuffer, pool: Pool) -> Callable[[], None]:
    """``rb.extend`` of ENVS rows per call, the TensorDict built per call."""
    state = {"t": 0}
    false = torch.zeros(ENVS, 1, dtype=torch.bool)
    episodes = torch.arange(ENVS)

    def step() -> None:
        t = state["t"]
        i = t % pool.size
        j = (i + 1) % pool.size
        done = torch.full((ENVS, 1), t % EP_LEN == EP_LEN - 1)
        rb.extend(
            TensorDict(
                {
                    "observation": pool.obs[i],
                    "action": pool.action[i],
                    "episode": episodes + (t // EP_LEN) * ENVS,
                    "next": {
                        "observation": pool.obs[j],
                        "reward": pool.reward[i].unsqueeze(-1),
                        "done": done,
                        "terminated": false,
                        "truncated": done,
                    },
                },
                batch_size=[ENVS],
            )
        )
        state["t"] = t + 1

    return step


async def bench_appends(sizes: Sizes, scratch: Path) -> dict[str, Any]:
    one, many = Pool(1), Pool(ENVS)
    steps, calls, repeats = sizes.append_steps, sizes.batch_calls, sizes.append_repeats
    one_cap = steps * (repeats + 1) + 2 * EP_LEN
    many_cap = calls * ENVS * (repeats + 1) + 2 * EP_LEN * ENVS
    async_one = EpisodeReplayBuffer(one_cap, scratch_dir=scratch)
    sync_one = SyncEpisodeReplayBuffer(one_cap, scratch_dir=scratch)
    async_many = EpisodeReplayBuffer(many_cap, scratch_dir=scratch)
    sync_many = SyncEpisodeReplayBuffer(many_cap, scratch_dir=scratch)
    add_rb = memmap_rb(one_cap, scratch, "torchrl-add")
    extend_rb = memmap_rb(many_cap, scratch, "torchrl-extend")
    try:
        return await interleaved(
            {
                "async_one": Workload(async_one_step_writer(async_one, one), steps, True),
                "sync_one": Workload(one_step_writer(sync_one, one), steps),
                "torchrl_add": Workload(torchrl_add_writer(add_rb, one), steps),
                "async_batch": Workload(async_batch_writer(async_many, many), calls, True),
                "sync_batch": Workload(batch_writer(sync_many, many), calls),
                "torchrl_extend": Workload(torchrl_extend_writer(extend_rb, many), calls),
            },
            repeats,
        )
    finally:
        await async_one.close()
        await async_many.close()
        sync_one.close()
        sync_many.close()
        drop_rb(add_rb, extend_rb)
        gc.collect()


# --------------------------------------------------------------------------- 2./3. sampling
@dataclass
class Filled:
    episodes: EpisodeReplayBuffer  # replaybuf, sample_steps steps in EP_LEN-step episodes
    plain: TensorDictReplayBuffer  # TorchRL layout, random sampling
    slices: TensorDictReplayBuffer  # same storage, SliceSampler
    slices_cached: TensorDictReplayBuffer  # same storage, SliceSampler(cache_values=True)
    multistep: TensorDictReplayBuffer  # MultiStepTransform rows, random sampling
    epoch: TensorDictReplayBuffer  # same storage as multistep, SamplerWithoutReplacement
    transitions: ReplayBuffer  # replaybuf's transition ring buffer
    fill_seconds: dict[str, float]


def fill_all(sizes: Sizes, scratch: Path) -> Filled:
    total = sizes.sample_steps
    n_episodes = total // EP_LEN
    gen = torch.Generator().manual_seed(0)
    seconds: dict[str, float] = {}

    # replaybuf: every episode in progress at once, one append_batch per time step.
    buf = EpisodeReplayBuffer(total, n_episodes, scratch_dir=scratch, seed=0)
    core = buf.sync
    start = time.perf_counter()
    ids = [core.start_episode() for _ in range(n_episodes)]
    for _ in range(EP_LEN):
        core.append_batch(
            ids,
            torch.randn(n_episodes, OBS, generator=gen),
            torch.randn(n_episodes, ACT, generator=gen),
            torch.randn(n_episodes, generator=gen),
        )
    finals = torch.randn(n_episodes, OBS, generator=gen)
    for row, episode in enumerate(ids):
        core.end_episode(episode, "terminated", finals[row])
    len(core.sample_n_step(1))  # flush staged rows inside the timed fill
    seconds["replaybuf"] = time.perf_counter() - start

    # TorchRL: contiguous episodes, one extend per episode.
    plain = memmap_rb(total, scratch, "torchrl-plain", batch_size=BATCH)
    multistep = memmap_rb(
        total,
        scratch,
        "torchrl-multistep",
        batch_size=BATCH,
        transform=MultiStepTransform(N_STEP, GAMMA),
    )
    episodes = []
    for e in range(n_episodes):
        obs = torch.randn(EP_LEN + 1, OBS, generator=gen)
        act = torch.randn(EP_LEN, ACT, generator=gen)
        rew = torch.randn(EP_LEN, generator=gen)
        episodes.append(torchrl_steps(obs, act, rew, e, ended=True))
    start = time.perf_counter()
    for td in episodes:
        plain.extend(td)
    seconds["torchrl_plain"] = time.perf_counter() - start
    start = time.perf_counter()
    for td in episodes:
        multistep.extend(td)
    seconds["torchrl_multistep"] = time.perf_counter() - start

    slices = TensorDictReplayBuffer(
        storage=plain.storage,
        sampler=SliceSampler(slice_len=SEQ_LEN, traj_key="episode"),
        batch_size=SEQ_BATCH * SEQ_LEN,
    )
    slices_cached = TensorDictReplayBuffer(
        storage=plain.storage,
        sampler=SliceSampler(slice_len=SEQ_LEN, traj_key="episode", cache_values=True),
        batch_size=SEQ_BATCH * SEQ_LEN,
    )
    epoch = TensorDictReplayBuffer(
        storage=multistep.storage, sampler=SamplerWithoutReplacement(), batch_size=BATCH
    )

    # replaybuf's transition buffer: 1-step transitions with next observations stored.
    transitions = ReplayBuffer("cpu", "cpu", total, scratch_dir=scratch, seed=0)
    chunk = 50_000
    start = time.perf_counter()
    for first in range(0, total, chunk):
        rows = min(chunk, total - first)
        transitions.add_batch(
            {
                "observation": torch.randn(rows, OBS, generator=gen),
                "action": torch.randn(rows, ACT, generator=gen),
                "reward": torch.randn(rows, generator=gen),
                "next_observation": torch.randn(rows, OBS, generator=gen),
                "done": torch.zeros(rows, dtype=torch.bool),
            }
        )
    seconds["transitions"] = time.perf_counter() - start
    del episodes
    gc.collect()
    return Filled(buf, plain, slices, slices_cached, multistep, epoch, transitions, seconds)


async def bench_sampling(filled: Filled, sizes: Sizes) -> dict[str, Any]:
    core, buf = filled.episodes.sync, filled.episodes
    calls = sizes.sample_calls
    # SliceSampler without a cache rescans the trajectory key of the whole storage per call.
    slow_calls = max(3, calls // 20)
    return await interleaved(
        {
            "n1": Workload(lambda: core.sample_n_step(BATCH, n=1), calls),
            "n3": Workload(lambda: core.sample_n_step(BATCH, n=N_STEP, gamma=GAMMA), calls),
            "n3_async": Workload(
                lambda: buf.sample_n_step(BATCH, n=N_STEP, gamma=GAMMA), calls, True
            ),
            "seq": Workload(lambda: core.sample_sequences(SEQ_BATCH, SEQ_LEN), calls),
            "transitions": Workload(lambda: filled.transitions.sample_batch(BATCH), calls),
            "torchrl_1step": Workload(filled.plain.sample, calls),
            "torchrl_multistep": Workload(filled.multistep.sample, calls),
            "torchrl_slice": Workload(filled.slices.sample, slow_calls),
            "torchrl_slice_cached": Workload(filled.slices_cached.sample, calls),
        },
        sizes.sample_repeats,
    )


async def bench_epoch(filled: Filled, sizes: Sizes) -> dict[str, Any]:
    buf = filled.episodes
    counts: dict[str, int] = {}

    async def replaybuf_epoch() -> float:
        items = 0
        start = time.perf_counter()
        async for batch in buf.iterate_epochs(BATCH, n=N_STEP, gamma=GAMMA):
            items += batch.batch_size[0]
        seconds = time.perf_counter() - start
        counts["replaybuf"] = items
        return seconds

    def torchrl_epoch() -> float:
        items = 0
        start = time.perf_counter()
        for batch in filled.epoch:
            items += batch.batch_size[0]
        seconds = time.perf_counter() - start
        counts["torchrl"] = items
        return seconds

    runs: dict[str, list[float]] = {"replaybuf": [], "torchrl": []}
    for _ in range(sizes.epoch_repeats):  # alternating, as interleaved() does
        runs["replaybuf"].append(await replaybuf_epoch())
        runs["torchrl"].append(torchrl_epoch())
    return {
        "replaybuf": timing(runs["replaybuf"]),
        "torchrl": timing(runs["torchrl"]),
        "items": counts,
    }


def close_filled(filled: Filled) -> None:
    filled.episodes.sync.close()  # no event loop needed: the async close only adds the lock
    filled.transitions.close()
    drop_rb(filled.plain, filled.multistep)
    del filled.plain, filled.slices, filled.slices_cached, filled.multistep, filled.epoch
    gc.collect()


# --------------------------------------------------------------------------- 4. bytes
def bench_bytes(sizes: Sizes, scratch: Path) -> dict[str, Any]:
    n_episodes = sizes.pixel_episodes
    frames = [torch.randint(0, 256, (n_episodes, *PIXELS), dtype=torch.uint8) for _ in range(8)]
    payload = (
        torch.Size(PIXELS).numel() * 1  # uint8 frame
        + 8  # discrete action, int64
        + 4  # reward, float32
    )
    with SyncEpisodeReplayBuffer(n_episodes * EP_LEN, n_episodes, scratch_dir=scratch) as buf:
        ids = [buf.start_episode() for _ in range(n_episodes)]
        actions = torch.zeros(n_episodes, dtype=torch.long)
        rewards = torch.zeros(n_episodes)
        for t in range(EP_LEN):
            buf.append_batch(ids, frames[t % 8], actions, rewards)
        for row, episode in enumerate(ids):
            buf.end_episode(episode, "terminated", frames[0][row])
        stats = buf.stats()

    # TorchRL's layout: the same step, with the next frame stored again under "next".
    obs = torch.randint(0, 256, (EP_LEN + 1, *PIXELS), dtype=torch.uint8)
    td = torchrl_steps(obs, torch.zeros(EP_LEN, dtype=torch.long), torch.zeros(EP_LEN), 0, True)
    rb = memmap_rb(EP_LEN, scratch, "torchrl-pixels")
    rb.extend(td)
    torchrl_row = torchrl_bytes_per_row(rb)
    drop_rb(rb)
    del rb, td
    gc.collect()
    return {
        "payload": payload,
        "replaybuf_bytes": stats["bytes"],
        "replaybuf_steps": stats["steps"],
        "replaybuf_rows": stats["rows"],
        "replaybuf_per_step": stats["bytes"] / stats["steps"],
        "torchrl_per_step": torchrl_row,
    }


# --------------------------------------------------------------------------- report
def row(
    workload: str,
    ours: str,
    base: str,
    ratio: float,
    target: str = "-",
    ok: bool | None = None,
    **raw: Any,
) -> dict[str, Any]:
    return {
        "workload": workload,
        "replaybuf": ours,
        "baseline": base,
        "ratio": ratio,
        "target": target,
        "pass": ok,
        "raw": raw,
    }


def rate(seconds_per_step: float) -> str:
    return f"{1 / seconds_per_step / 1e3:,.0f}k steps/s"


def micros(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} µs"


def build_rows(
    appends: dict[str, Any], sampling: dict[str, Any], epoch: dict[str, Any], nbytes: dict
) -> list[dict[str, Any]]:
    a, s = appends, sampling
    per_step = {
        k: v["median"] / (ENVS if "batch" in k or "extend" in k else 1) for k, v in a.items()
    }
    rows = [
        row(
            "append 1 step/call, async API",
            rate(per_step["async_one"]),
            "add: " + rate(per_step["torchrl_add"]),
            per_step["async_one"] / per_step["torchrl_add"],
            "< 1x (implied)",
            per_step["async_one"] < per_step["torchrl_add"],
            seconds_per_step=per_step["async_one"],
            baseline_seconds_per_step=per_step["torchrl_add"],
        ),
        row(
            "append 1 step/call, sync core",
            rate(per_step["sync_one"]),
            "add: " + rate(per_step["torchrl_add"]),
            per_step["sync_one"] / per_step["torchrl_add"],
            seconds_per_step=per_step["sync_one"],
            baseline_seconds_per_step=per_step["torchrl_add"],
        ),
        row(
            f"append_batch {ENVS} envs, async API",
            rate(per_step["async_batch"]),
            f"extend {ENVS}: " + rate(per_step["torchrl_extend"]),
            per_step["async_batch"] / per_step["torchrl_extend"],
            seconds_per_step=per_step["async_batch"],
            baseline_seconds_per_step=per_step["torchrl_extend"],
        ),
        row(
            f"append_batch {ENVS} envs, sync core",
            rate(per_step["sync_batch"]),
            f"extend {ENVS}: " + rate(per_step["torchrl_extend"]),
            per_step["sync_batch"] / per_step["torchrl_extend"],
            seconds_per_step=per_step["sync_batch"],
            baseline_seconds_per_step=per_step["torchrl_extend"],
        ),
        row(
            f"sample_n_step({BATCH}, n=1), sync",
            micros(s["n1"]["median"]),
            "1-step sample: " + micros(s["torchrl_1step"]["median"]),
            s["n1"]["median"] / s["torchrl_1step"]["median"],
            seconds=s["n1"],
            baseline_seconds=s["torchrl_1step"],
        ),
        row(
            f"sample_n_step({BATCH}, n={N_STEP}), sync",
            micros(s["n3"]["median"]),
            "MultiStepTransform: " + micros(s["torchrl_multistep"]["median"]),
            s["n3"]["median"] / s["torchrl_multistep"]["median"],
            seconds=s["n3"],
            baseline_seconds=s["torchrl_multistep"],
        ),
        row(
            f"sample_n_step({BATCH}, n={N_STEP}), async",
            micros(s["n3_async"]["median"]),
            "MultiStepTransform: " + micros(s["torchrl_multistep"]["median"]),
            s["n3_async"]["median"] / s["torchrl_multistep"]["median"],
            seconds=s["n3_async"],
            baseline_seconds=s["torchrl_multistep"],
        ),
        row(
            f"n-step target (a): n={N_STEP} vs n=1, sync",
            micros(s["n3"]["median"]),
            "n=1: " + micros(s["n1"]["median"]),
            s["n3"]["median"] / s["n1"]["median"],
            "<= 2x",
            s["n3"]["median"] / s["n1"]["median"] <= 2.0,
        ),
        row(
            f"n-step target (b): n={N_STEP} vs ReplayBuffer",
            micros(s["n3"]["median"]),
            "sample_batch: " + micros(s["transitions"]["median"]),
            s["n3"]["median"] / s["transitions"]["median"],
            "<= 2x",
            s["n3"]["median"] / s["transitions"]["median"] <= 2.0,
            baseline_seconds=s["transitions"],
        ),
        row(
            f"sample_sequences({SEQ_BATCH}, {SEQ_LEN}), sync",
            micros(s["seq"]["median"]),
            "SliceSampler: " + micros(s["torchrl_slice"]["median"]),
            s["seq"]["median"] / s["torchrl_slice"]["median"],
            seconds=s["seq"],
            baseline_seconds=s["torchrl_slice"],
        ),
        row(
            f"sample_sequences({SEQ_BATCH}, {SEQ_LEN}), sync",
            micros(s["seq"]["median"]),
            "SliceSampler cached: " + micros(s["torchrl_slice_cached"]["median"]),
            s["seq"]["median"] / s["torchrl_slice_cached"]["median"],
            baseline_seconds=s["torchrl_slice_cached"],
        ),
    ]
    ours_rate = epoch["items"]["replaybuf"] / epoch["replaybuf"]["median"]
    base_rate = epoch["items"]["torchrl"] / epoch["torchrl"]["median"]
    rows.append(
        row(
            f"1 epoch iterate_epochs({BATCH}, n={N_STEP}), async",
            f"{epoch['replaybuf']['median']:.2f} s",
            f"w/o replacement: {epoch['torchrl']['median']:.2f} s",
            base_rate / ours_rate,
            seconds=epoch["replaybuf"],
            baseline_seconds=epoch["torchrl"],
            items=epoch["items"],
        )
    )
    per_step = nbytes["replaybuf_per_step"]
    rows.append(
        row(
            "bytes/transition 4x84x84 u8 vs payload",
            f"{per_step:,.0f} B",
            f"payload: {nbytes['payload']:,} B",
            per_step / nbytes["payload"],
            "<= 1.1x",
            per_step / nbytes["payload"] <= 1.1,
            **nbytes,
        )
    )
    rows.append(
        row(
            "bytes/transition 4x84x84 u8 vs TorchRL",
            f"{per_step:,.0f} B",
            f"next-obs copies: {nbytes['torchrl_per_step']:,.0f} B",
            per_step / nbytes["torchrl_per_step"],
        )
    )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("workload", "replaybuf", "torchrl baseline", "ratio", "target", "pass/fail")
    cells = [header]
    for r in rows:
        verdict = "-" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        cells.append(
            (
                r["workload"],
                r["replaybuf"],
                r["baseline"],
                f"{r['ratio']:.2f}x",
                r["target"],
                verdict,
            )
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = []
    for n, c in enumerate(cells):
        lines.append(" | ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())
        if n == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------- profiles
def profile_text(fn: Callable[[], Any], calls: int, top: int = 12) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def profiles(filled: Filled, scratch: Path) -> str:
    core = filled.episodes.sync
    parts = [f"== cProfile: sample_n_step({BATCH}, n={N_STEP}) x 500, by tottime =="]
    parts.append(profile_text(lambda: core.sample_n_step(BATCH, n=N_STEP, gamma=GAMMA), 500))

    async def appends() -> str:
        async with EpisodeReplayBuffer(30_000, scratch_dir=scratch) as buf:
            step = async_one_step_writer(buf, Pool(1))
            await step()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(20_000):
                await step()
            profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(16)
        return text.getvalue()

    parts.append("== cProfile: async append_observation_action_reward x 20000, by tottime ==")
    parts.append(asyncio.run(appends()))
    return "\n".join(parts)


# --------------------------------------------------------------------------- main
async def measure(sizes: Sizes, scratch: Path) -> dict[str, Any]:
    phases: dict[str, float] = {}

    def done(phase: str, start: float) -> None:
        phases[phase] = time.perf_counter() - start
        print(f"  {phase}: {phases[phase]:.1f} s", flush=True)

    start = time.perf_counter()
    appends = await bench_appends(sizes, scratch)
    done("appends", start)
    start = time.perf_counter()
    filled = fill_all(sizes, scratch)
    done(f"fill {sizes.sample_steps:,} steps x 4 buffers", start)
    try:
        start = time.perf_counter()
        sampling = await bench_sampling(filled, sizes)
        done("sampling", start)
        start = time.perf_counter()
        epoch = await bench_epoch(filled, sizes)
        done("epochs", start)
    finally:
        close_filled(filled)
    start = time.perf_counter()
    nbytes = bench_bytes(sizes, scratch)
    done("bytes", start)
    return {
        "appends": appends,
        "sampling": sampling,
        "epoch": epoch,
        "bytes": nbytes,
        "fill_seconds": filled.fill_seconds,
        "phase_seconds": phases,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (< 1 minute)")
    parser.add_argument("--profile", action="store_true", help="print cProfile top entries")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    sizes = QUICK if args.quick else FULL
    began = time.perf_counter()
    print(f"bench_episodes: {asdict(sizes)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_episodes-") as tmp:
        scratch = Path(tmp)
        result = asyncio.run(measure(sizes, scratch))
        # Profiles run apart from the timed run, on a freshly filled buffer.
        profile = profile_run(sizes, scratch) if args.profile else None
        leftovers = sorted(p.name for p in scratch.iterdir())  # every buffer closed: none
    wall = time.perf_counter() - began

    rows = build_rows(result["appends"], result["sampling"], result["epoch"], result["bytes"])
    stored_m = sizes.sample_steps / 1e6
    print(
        f"bench_episodes ({'quick' if args.quick else 'full'}): {stored_m:g}M stored steps in "
        f"{EP_LEN}-step episodes, torch {torch.__version__}, torchrl {torchrl.__version__}, "
        f"1 thread, medians over repeats"
    )
    print(format_table(rows))
    for note in NOTES:
        print(f"note: {note}")
    fills = ", ".join(f"{k} {v:.1f} s" for k, v in result["fill_seconds"].items())
    print(f"fill of {stored_m:g}M steps (1 run): {fills}")
    if leftovers:
        print(f"WARNING: files left in the scratch folder after close(): {leftovers}")
    print(f"total {wall:.0f} s")
    if profile:
        print(profile)

    document = {
        "benchmark": "bench_episodes",
        "config": {
            **asdict(sizes),
            "quick": args.quick,
            "episode_len": EP_LEN,
            "envs": ENVS,
            "batch": BATCH,
            "n": N_STEP,
            "gamma": GAMMA,
            "seq": [SEQ_BATCH, SEQ_LEN],
            "pixels": list(PIXELS),
            "threads": torch.get_num_threads(),
        },
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "torchrl": torchrl.__version__,
            "tensordict": tensordict.__version__,
            "replaybuf": replaybuf.__version__,
        },
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "rows": rows,
        "targets_pass": all(r["pass"] for r in rows if r["pass"] is not None),
        "notes": NOTES,
        "fill_seconds": result["fill_seconds"],
        "phase_seconds": result["phase_seconds"],
        "scratch_leftovers": leftovers,
        "wall_seconds": wall,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def profile_run(sizes: Sizes, scratch: Path) -> str:
    filled = fill_all(sizes, scratch)
    try:
        return profiles(filled, scratch)
    finally:
        close_filled(filled)


if __name__ == "__main__":
    sys.exit(main())
