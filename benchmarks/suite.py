"""The benchmark suite: W1-W5 and scaling, replaybuf beside the raw floor and its peers.

One command runs everything and prints ONE table (workload | floor | replaybuf | ratio to floor
| best peer | TorchRL | target | PASS/FAIL), writes JSON (machine, versions, load average,
date, every repeat) and a PNG of sampling cost against stored steps:

    python benchmarks/suite.py                # full: 1M stored, scaling to 10^7 (minutes)
    python benchmarks/suite.py --quick        # small sizes, scaling to 10^6 (< 2 minutes)
    python benchmarks/suite.py --profile      # also cProfile the replaybuf paths
    python benchmarks/suite.py --json out.json --plot out.png
    python benchmarks/suite.py --profile-only       # only the profiles (no timings)
    python benchmarks/suite.py --markdown results/suite.json   # a saved run's table, Markdown

Current results and what we know about the misses: ``docs/performance.md``.

Workloads (single-threaded, ``torch.set_num_threads(1)``; CPU; in-RAM storages unless named):

* W1  ``sample(256)`` of 1-step transitions (obs f32[17], act f32[6], reward, done), 1M stored;
* W2  n-step (n=3, gamma=0.99) ``sample(256)`` from 1,000-step episodes, 1M stored, after a
      correctness check on toy episodes for every implementation (``nstep_check.py``);
* W3  Atari-like u8[4,84,84] observations, 100k stored, ``sample(32)``; stored bytes/transition;
      written one episode after another, as the floor and the peers store them (and, for
      information, every episode at once, as a vector env writes them);
* W4  inserts: one step per call (numpy inputs, as SB3's ``add`` gets them; sync also on
      torch tensors), ``append_batch`` of 64 envs, 1,000-row chunks, and 1,000 envs of
      20-step episodes ended and started in bulk (``end_episodes``/``start_episodes``);
* W5  one shuffled epoch over 1M transitions in batches of 256;
* scaling: W1 and W2 sampling from 10^4 to 10^7 stored steps (W2: 1,000-step episodes, tensor
  and memmap), each size timed beside its floor holding the same steps; judged by the worst
  ratio to the floor over the sizes (<= 1.2x at every size: the floor's own time grows with the
  stored size on a real machine, the ratio is what replaybuf controls). And n-step sampling
  from 10 to 10^5 stored episodes (same total steps), judged by its spread.

The floor is plain torch (``randint`` + ``index_select`` per field; ``copy_`` for inserts).
Implementations of one workload are timed round-robin in the same run and compared as ratios
of medians (the machine may be shared: ``os.getloadavg()`` goes in the output). W3 keeps the
floor alive and times each implementation beside it in turn (all at once would need ~12 GB).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import logging
import math
import pstats
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import harness
import nstep_check
import numpy as np
import peers
import per_step
import torch
from harness import Workload, interleaved, micros, nbytes, rate, secs

from replaybuf import EpisodeReplayBuffer, ReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.storage import free_bytes

HERE = Path(__file__).resolve().parent
BATCH, N_STEP, GAMMA, PIXEL_BATCH = 256, 3, 0.99, 32
ENVS, CHUNK = 64, 1_000
PEERS = (peers.CPPRB, peers.SB3, peers.TIANSHOU)  # "best peer" candidates (TorchRL: own column)


@dataclass(frozen=True)
class Config:
    name: str
    repeats: int  # timed repeats (round-robin) for sampling and inserts
    w1_size: int  # W1 and W5 stored transitions
    sample_calls: int
    w2_episodes: int
    ep_len: int
    w3_episodes: int
    w3_ep_len: int
    pixel_calls: int
    one_step_calls: int
    env_calls: int
    chunk_calls: int
    w4_ep_len: int
    w4_min_capacity: int  # episode buffers and rings for inserts hold at least this many
    epoch_repeats: int
    scale_sizes: tuple[int, ...]
    scale_calls: int
    scale_repeats: int
    scale_total: int  # stored steps for the episode-count scaling
    scale_episodes: tuple[int, ...]


FULL = Config(
    name="full",
    repeats=25,
    w1_size=1_000_000,
    sample_calls=100,
    w2_episodes=1_000,
    ep_len=1_000,
    w3_episodes=100,
    w3_ep_len=1_000,
    pixel_calls=30,
    one_step_calls=1_000,
    env_calls=100,
    chunk_calls=50,
    w4_ep_len=1_000,
    w4_min_capacity=100_000,
    epoch_repeats=5,
    scale_sizes=(10_000, 100_000, 1_000_000, 10_000_000),
    scale_calls=50,
    scale_repeats=15,
    scale_total=1_000_000,
    scale_episodes=(10, 100, 1_000, 10_000, 100_000),
)
QUICK = Config(
    name="quick",
    repeats=7,
    w1_size=100_000,
    sample_calls=100,
    w2_episodes=100,
    ep_len=1_000,
    w3_episodes=10,
    w3_ep_len=500,
    pixel_calls=30,
    one_step_calls=1_000,
    env_calls=100,
    chunk_calls=50,
    w4_ep_len=1_000,
    w4_min_capacity=20_000,
    epoch_repeats=3,
    scale_sizes=(10_000, 100_000, 1_000_000),
    scale_calls=50,
    scale_repeats=5,
    scale_total=100_000,
    scale_episodes=(10, 100, 1_000, 10_000),
)
TINY = Config(  # for tests: seconds, every code path
    name="tiny",
    repeats=2,
    w1_size=3_000,
    sample_calls=3,
    w2_episodes=6,
    ep_len=100,
    w3_episodes=2,
    w3_ep_len=40,
    pixel_calls=3,
    one_step_calls=20,
    env_calls=5,
    chunk_calls=3,
    w4_ep_len=10,
    w4_min_capacity=1_000,
    epoch_repeats=1,
    scale_sizes=(1_000, 3_000),
    scale_calls=3,
    scale_repeats=2,
    scale_total=400,
    scale_episodes=(2, 20),
)
CONFIGS = {c.name: c for c in (FULL, QUICK, TINY)}


def count(n: int) -> str:
    """1M, 100k, 3,000."""
    if n >= 1_000_000 and n % 100_000 == 0:
        return f"{n / 1e6:g}M"
    if n >= 10_000 and n % 1_000 == 0:
        return f"{n // 1_000}k"
    return f"{n:,}"


def log(message: str) -> None:
    print(message, flush=True)


def close_all(built: dict[str, peers.Built]) -> None:
    for b in built.values():
        b.close()
    built.clear()
    gc.collect()


def byte_info(b: peers.Built) -> dict[str, Any]:
    return {
        "stored_bytes": b.stored_bytes,
        "steps": b.steps,
        "bytes_per_step": b.bytes_per_step,
        "how": b.bytes_how,
        "what": b.note,
    }


# =========================================================================== sections
def section_transitions(cfg: Config, scratch: Path) -> dict[str, Any]:
    """W1 sampling, W5 epochs and W1 memory, on the same filled buffers."""
    columns = peers.transitions(cfg.w1_size)
    built: dict[str, peers.Built] = {}
    fill: dict[str, float] = {}
    for name in peers.transition_impls():
        start = time.perf_counter()
        built[name] = peers.build_transitions(name, columns, BATCH, scratch)
        fill[name] = time.perf_counter() - start
    try:
        sample = interleaved(
            {n: Workload(b.sample, cfg.sample_calls) for n, b in built.items()}, cfg.repeats
        )
        epochs = {n: b for n, b in built.items() if b.epoch is not None}
        epoch = interleaved({n: Workload(b.epoch, 1) for n, b in epochs.items()}, cfg.epoch_repeats)
        memory = {n: byte_info(b) for n, b in built.items()}
    finally:
        close_all(built)
    return {"sample": sample, "epoch": epoch, "memory": memory, "fill_seconds": fill}


def section_nstep(cfg: Config, scratch: Path) -> dict[str, Any]:
    eps = peers.random_episodes(cfg.w2_episodes, cfg.ep_len)
    have = peers.available()
    makers: dict[str, Callable[[], peers.Built]] = {
        peers.FLOOR: lambda: peers.floor_nstep(eps, N_STEP, GAMMA, BATCH),
        peers.RB_TENSOR: lambda: peers.replaybuf_nstep(eps, N_STEP, GAMMA, BATCH, scratch)[0],
    }
    if have[peers.CPPRB]:
        makers[peers.CPPRB] = lambda: peers.cpprb_nstep(eps, N_STEP, GAMMA, BATCH)
    if have[peers.SB3]:
        makers[peers.SB3] = lambda: peers.sb3_nstep(eps, N_STEP, GAMMA, BATCH)
    makers[peers.TORCHRL] = lambda: peers.torchrl_nstep(eps, N_STEP, GAMMA, BATCH)
    built: dict[str, peers.Built] = {}
    fill: dict[str, float] = {}
    for name, make in makers.items():
        start = time.perf_counter()
        built[name] = make()
        fill[name] = time.perf_counter() - start
    try:
        sample = interleaved(
            {n: Workload(b.sample, cfg.sample_calls) for n, b in built.items()}, cfg.repeats
        )
        memory = {n: byte_info(b) for n, b in built.items()}
    finally:
        close_all(built)
    return {"sample": sample, "memory": memory, "fill_seconds": fill}


def section_pixels(cfg: Config, scratch: Path) -> dict[str, Any]:
    frames = peers.Frames()
    count, length = cfg.w3_episodes, cfg.w3_ep_len
    floor = peers.floor_pixels(frames, count, length, PIXEL_BATCH)
    have = peers.available()
    makers: dict[str, Callable[[], peers.Built]] = {
        # One episode after another, the order the floor and the peers store them in (an
        # episode's rows are consecutive, so its next observations are the rows after)...
        peers.RB_TENSOR: lambda: peers.replaybuf_pixels(
            frames, count, length, PIXEL_BATCH, scratch, envs=1
        ),
        peers.RB_FRAMES: lambda: peers.replaybuf_pixels(
            frames, count, length, PIXEL_BATCH, scratch, frame_stack=True, envs=1
        ),
        # ... and every episode at once, a step of each per append_batch (a vector env: an
        # episode's rows lie `count` rows apart).
        peers.RB_LOCKSTEP: lambda: peers.replaybuf_pixels(
            frames, count, length, PIXEL_BATCH, scratch
        ),
    }
    if have[peers.CPPRB]:
        makers[peers.CPPRB] = lambda: peers.cpprb_pixels(frames, count, length, PIXEL_BATCH)
    if have[peers.SB3]:
        makers[peers.SB3] = lambda: peers.sb3_pixels(frames, count, length, PIXEL_BATCH)
    makers[peers.TORCHRL] = lambda: peers.torchrl_pixels(frames, count, length, PIXEL_BATCH)
    pairs: dict[str, dict[str, Any]] = {}
    memory = {peers.FLOOR: byte_info(floor)}

    def frames_floor() -> peers.Built:
        built = peers.floor_frames(frames, count, length, PIXEL_BATCH)
        memory[peers.FRAME_FLOOR] = byte_info(built)
        return built

    fill: dict[str, float] = {}
    for name, make in makers.items():  # one at a time beside the floor (memory)
        start = time.perf_counter()
        other = make()
        fill[name] = time.perf_counter() - start
        # frame_stack=4 is also timed beside the frame floor (one frame per step stored).
        frame_floor = frames_floor() if name == peers.RB_FRAMES else None
        try:
            timed = {
                peers.FLOOR: Workload(floor.sample, cfg.pixel_calls),
                name: Workload(other.sample, cfg.pixel_calls),
            }
            if frame_floor is not None:
                timed[peers.FRAME_FLOOR] = Workload(frame_floor.sample, cfg.pixel_calls)
            pairs[name] = interleaved(timed, cfg.repeats)
            memory[name] = byte_info(other)
        finally:
            other.close()
            del other, frame_floor
            gc.collect()
    return {
        "pairs": pairs,
        "memory": memory,
        "payload": peers.pixel_payload(),
        "layouts": {
            "plain (obs + next obs)": 2 * math.prod(peers.PIXELS) + 8 + 4,
            "without next-obs copies": peers.pixel_payload(),
            "one frame per step": math.prod(peers.PIXELS[1:]) + 8 + 4,
        },
        "fill_seconds": fill,
    }


def section_inserts(cfg: Config, scratch: Path) -> dict[str, Any]:
    """W4: one step per call, 64 envs per call, 1,000-row chunks (rates in the rows)."""
    have = peers.available()
    length = cfg.w4_ep_len
    loop = asyncio.new_event_loop()
    out: dict[str, Any] = {}
    closers: list[Callable[[], Any]] = []

    def sync_buffer(envs: int) -> SyncEpisodeReplayBuffer:
        capacity = max(4 * envs * length, cfg.w4_min_capacity)
        episodes = capacity // length + 4 * max(envs, 64)  # short episodes need final rows
        buf = SyncEpisodeReplayBuffer(
            capacity, episodes, storage="tensor", scratch_dir=scratch, seed=0
        )
        peers.prefill_episodes(buf, length)  # full: timed appends evict (steady state)
        closers.append(buf.close)
        return buf

    def episode_buffers(envs: int) -> tuple[SyncEpisodeReplayBuffer, EpisodeReplayBuffer]:
        return sync_buffer(envs), EpisodeReplayBuffer._wrap(sync_buffer(envs))

    try:
        # ---- one step per call
        one = peers.StepPool(1)
        capacity = cfg.w4_min_capacity
        sync, aio = episode_buffers(1)
        calls = cfg.one_step_calls
        # replaybuf is timed on the inputs SB3's add gets (numpy arrays, what a gymnasium
        # env returns) and, sync, on torch tensors (each costs a numpy() view, ~0.7 µs here).
        sync_torch = sync_buffer(1)
        work = {
            peers.FLOOR: Workload(peers.floor_writer(one, capacity), calls),
            "replaybuf sync": Workload(peers.episode_writer(sync, one, 1, length, True), calls),
            "replaybuf sync torch": Workload(
                peers.episode_writer(sync_torch, one, 1, length), calls
            ),
            "replaybuf async": Workload(
                peers.async_episode_writer(aio, one, 1, length, True), calls, is_async=True
            ),
        }
        if peers.has_nowait(aio):
            work["replaybuf async nowait"] = Workload(
                peers.nowait_episode_writer(aio, one, 1, length, True), calls
            )
        if have[peers.SB3]:
            work[peers.SB3] = Workload(peers.sb3_writer(one, capacity), calls)
        if have[peers.CPPRB]:
            work[peers.CPPRB] = Workload(peers.cpprb_writer(one, capacity), calls)
        work[peers.TORCHRL] = Workload(peers.torchrl_writer(one, capacity), max(calls // 5, 2))
        out["one_step"] = interleaved(work, cfg.repeats, loop)

        # ---- ReplayBuffer.add of one transition, and the SB3 adapter, beside SB3's own calls
        ring = ReplayBuffer("cpu", "cpu", capacity, storage="tensor", scratch_dir=scratch, seed=0)
        closers.append(ring.close)
        work = {
            f"replaybuf add {inputs}": Workload(per_step.ring_add_writer(ring, one, inputs), calls)
            for inputs in per_step.INPUTS
        }
        if have[peers.SB3]:
            pair = per_step.sb3_pair(one, capacity)
            closers.append(pair["close"])
            work[peers.SB3] = Workload(pair["sb3 add"], calls)
            work["sb3 adapter add"] = Workload(pair["adapter add"], calls)
            samples = max(calls // 20, 2)
            work["SB3 sample"] = Workload(pair["sb3 sample"], samples)
            work["sb3 adapter sample"] = Workload(pair["adapter sample"], samples)
            work["SB3 add+sample"] = Workload(pair["sb3 add+sample"], samples)
            work["sb3 adapter add+sample"] = Workload(pair["adapter add+sample"], samples)
        out["per_step"] = interleaved(work, cfg.repeats, loop)

        # ---- append_batch of 64 envs
        many = peers.StepPool(ENVS)
        capacity = ENVS * max(cfg.w4_min_capacity // ENVS, 8)
        sync, aio = episode_buffers(ENVS)
        calls = cfg.env_calls
        work = {
            peers.FLOOR: Workload(peers.floor_writer(many, capacity), calls, ENVS),
            "replaybuf sync": Workload(peers.episode_writer(sync, many, ENVS, length), calls, ENVS),
            "replaybuf async": Workload(
                peers.async_episode_writer(aio, many, ENVS, length), calls, ENVS, True
            ),
        }
        if peers.has_nowait(aio):
            work["replaybuf async nowait"] = Workload(
                peers.nowait_episode_writer(aio, many, ENVS, length), calls, ENVS
            )
        if have[peers.SB3]:
            work[peers.SB3] = Workload(peers.sb3_writer(many, capacity), calls, ENVS)
        if have[peers.CPPRB]:
            work[peers.CPPRB] = Workload(peers.cpprb_writer(many, capacity), calls, ENVS)
        work[peers.TORCHRL] = Workload(peers.torchrl_writer(many, capacity), calls, ENVS)
        out["envs_64"] = interleaved(work, cfg.repeats, loop)

        # ---- 1,000-row chunks
        chunk = peers.StepPool(CHUNK, size=8)
        capacity = CHUNK * max(cfg.w4_min_capacity // CHUNK, 8)
        ring = ReplayBuffer("cpu", "cpu", capacity, storage="tensor", scratch_dir=scratch, seed=0)
        closers.append(ring.close)
        for _ in range(capacity // CHUNK):
            ring.add_batch(chunk.td[0])  # full: the writer wraps (steady state)
        wide = SyncEpisodeReplayBuffer(
            4 * CHUNK * 20, 8 * CHUNK, storage="tensor", scratch_dir=scratch, seed=0
        )
        closers.append(wide.close)
        bulk = SyncEpisodeReplayBuffer(
            4 * CHUNK * 20, 8 * CHUNK, storage="tensor", scratch_dir=scratch, seed=0
        )
        closers.append(bulk.close)
        calls = cfg.chunk_calls
        work = {
            peers.FLOOR: Workload(peers.floor_writer(chunk, capacity), calls, CHUNK),
            "replaybuf add_batch": Workload(
                peers.replaybuf_batch_writer(ring, chunk), calls, CHUNK
            ),
            "replaybuf append_batch 1000 envs": Workload(
                peers.episode_writer(wide, chunk, CHUNK, 20), calls, CHUNK
            ),
            # The same 20-step episodes ended and started in bulk (end_episodes and
            # start_episodes; evictions included), a vector env's resets.
            "replaybuf 1000 envs bulk ends": Workload(
                peers.bulk_episode_writer(bulk, chunk, CHUNK, 20), calls, CHUNK
            ),
        }
        if have[peers.CPPRB]:
            work[peers.CPPRB] = Workload(peers.cpprb_writer(chunk, capacity), calls, CHUNK)
        work[peers.TORCHRL] = Workload(peers.torchrl_writer(chunk, capacity), calls, CHUNK)
        out["chunk_1000"] = interleaved(work, cfg.repeats, loop)
    finally:
        for close in closers:
            close()
        loop.close()
        gc.collect()
    return out


def section_scaling_steps(cfg: Config, scratch: Path) -> dict[str, Any]:
    """W1 and W2 sampling at each stored size, each beside its floor holding the same steps.

    W1 is also timed beside a fixed small probe (the load reference of the probe-corrected
    spreads). W2 runs after W1 has freed its rows, one size at a time: ``cfg.ep_len``-step
    episodes, the n-step floor and the episode buffers (tensor, memmap) holding them.
    """
    master = peers.transitions(max(cfg.scale_sizes), seed=1)
    probe = peers.floor_transitions(peers.transitions(10_000, seed=2), BATCH)
    out: dict[str, Any] = {"sizes": list(cfg.scale_sizes), "points": {}}
    for size in cfg.scale_sizes:
        log(f"    W1, {size:,} stored steps")
        columns = peers.prefix(master, size)
        built = {
            name: peers.build_transitions(name, columns, BATCH, scratch)
            for name in peers.transition_impls()
        }
        try:
            work = {"probe": Workload(probe.sample, cfg.scale_calls)}
            work.update({n: Workload(b.sample, cfg.scale_calls) for n, b in built.items()})
            out["points"][size] = interleaved(work, cfg.scale_repeats)
        finally:
            close_all(built)
    del master, columns
    gc.collect()
    out["nstep"] = scaling_nstep(cfg, scratch)
    return out


NSTEP_KINDS = {peers.RB_TENSOR: "tensor", peers.RB_MEMMAP: "memmap"}


def memory_available() -> int:
    """Host RAM free for new tensors, as replaybuf's own preflight reads it."""
    return free_bytes("tensor", torch.device("cpu"), Path(tempfile.gettempdir()))


def nstep_bytes(count: int, length: int) -> dict[str, int]:
    """Bytes W2 at ``count`` episodes of ``length`` steps needs while it is built.

    The generated episodes (obs [E, T+1, 17], action, reward), the floor's flat layout (obs and
    next obs stored, 166 B a step) and, per replaybuf buffer, 200 B a step (153 B measured:
    the rows, final observations, links and anchors; the rest is margin). RAM holds the
    episodes, the floor and the tensor buffer; the memmap buffer's rows go to the scratch disk.
    """
    steps = count * length
    episodes = 4 * (count * (length + 1) * peers.OBS + steps * (peers.ACT + 1))
    floor = steps * (4 * (2 * peers.OBS + peers.ACT + 1) + 2)
    buffer = 200 * (steps + count)
    return {"ram": episodes + floor + buffer, "disk": buffer}


def scaling_nstep(cfg: Config, scratch: Path) -> dict[str, Any]:
    """W2 ``sample_n_step`` at each stored size, interleaved with the n-step floor.

    A size whose episodes, floor and buffer would not fit in the memory available now (or
    whose memmap rows would not fit on the scratch disk) is not built; ``skipped`` says why.
    """
    length = cfg.ep_len
    out: dict[str, Any] = {"ep_len": length, "points": {}, "skipped": {}, "needed_bytes": {}}
    for size in cfg.scale_sizes:
        count = max(1, size // length)
        need = nstep_bytes(count, length)
        out["needed_bytes"][size] = need
        free_ram = memory_available()
        free_disk = shutil.disk_usage(scratch).free
        short = []
        if need["ram"] > 0.8 * free_ram:
            short.append(f"needs ~{need['ram'] / 2**30:.1f} GiB RAM, {free_ram / 2**30:.1f} free")
        if need["disk"] > 0.8 * free_disk:
            short.append(
                f"memmap needs ~{need['disk'] / 2**30:.1f} GiB disk, {free_disk / 2**30:.1f} free"
            )
        if short:
            out["skipped"][size] = "; ".join(short)
            log(f"    W2, {size:,} stored steps: not timed ({out['skipped'][size]})")
            continue
        log(f"    W2, {size:,} stored steps ({count:,} episodes of {length:,})")
        eps = peers.random_episodes(count, length, seed=6)
        built = {peers.FLOOR: peers.floor_nstep(eps, N_STEP, GAMMA, BATCH)}
        try:
            for name, kind in NSTEP_KINDS.items():
                built[name] = peers.replaybuf_nstep(eps, N_STEP, GAMMA, BATCH, scratch, kind)[0]
            del eps
            gc.collect()
            out["points"][size] = interleaved(
                {n: Workload(b.sample, cfg.scale_calls) for n, b in built.items()},
                cfg.scale_repeats,
            )
        finally:
            close_all(built)
    return out


def section_scaling_episodes(cfg: Config, scratch: Path) -> dict[str, Any]:
    """n-step sampling of the same number of steps held in 10 .. 10^5 episodes."""
    total = cfg.scale_total
    probe_eps = peers.random_episodes(max(1, total // 1_000), min(1_000, total), seed=3)
    probe = peers.floor_nstep(probe_eps, N_STEP, GAMMA, BATCH)
    out: dict[str, Any] = {"total_steps": total, "episodes": [], "points": {}}
    for n_eps in cfg.scale_episodes:
        length = total // n_eps
        if length < 1:
            continue
        log(f"    {n_eps:,} episodes of {length:,} steps")
        eps = peers.random_episodes(n_eps, length, seed=4)
        buf = SyncEpisodeReplayBuffer(
            n_eps * length, n_eps, storage="tensor", scratch_dir=scratch, seed=0
        )
        try:
            peers.fill_episodes(buf, eps, envs=min(n_eps, 1_024))
            del eps
            out["points"][n_eps] = interleaved(
                {
                    "probe": Workload(probe.sample, cfg.scale_calls),
                    peers.RB_TENSOR: Workload(
                        lambda b=buf: b.sample_n_step(BATCH, n=N_STEP, gamma=GAMMA),
                        cfg.scale_calls,
                    ),
                },
                cfg.scale_repeats,
            )
            out["episodes"].append(n_eps)
        finally:
            buf.close()
            gc.collect()
    return out


# =========================================================================== rows
@dataclass
class Row:
    workload: str
    floor: str
    replaybuf: str
    ratio: float | None  # replaybuf cost / floor cost (time per item, or bytes)
    best_peer: str
    torchrl: str
    target: str
    ok: bool | None  # None: informational, no target
    ratio_min: float | None = None  # the same ratio from the fastest repeats (JSON)

    @property
    def verdict(self) -> str:
        return "-" if self.ok is None else ("PASS" if self.ok else "FAIL")


def med(t: dict[str, Any] | None) -> float | None:
    """Seconds per item (median seconds per call / items per call)."""
    return None if t is None else t["median"] / t["items"]


def best_of(results: dict[str, Any], names: tuple[str, ...], allowed=None) -> tuple[str, float]:
    found = [
        (n, med(results[n])) for n in names if n in results and (allowed is None or allowed(n))
    ]
    if not found:
        return "-", math.inf
    return min(found, key=lambda x: x[1])


def peer_cell(name: str, value: float, fmt: Callable[[float], str]) -> str:
    """``"cpprb 96 µs"``, or ``"-"`` when no peer ran the workload."""
    return "-" if not math.isfinite(value) else f"{name} {fmt(value)}"


def spread(values: list[float]) -> float:
    return max(values) / min(values)


def scaling_series(points: dict[Any, dict[str, Any]], name: str) -> tuple[list, list]:
    """Raw medians of ``name`` per point, and medians corrected by the probe's drift."""
    keys = [k for k in points if name in points[k]]
    raw = [med(points[k][name]) for k in keys]
    probe = [med(points[k]["probe"]) for k in keys]
    reference = float(np.median(probe))
    corrected = [r * reference / p for r, p in zip(raw, probe, strict=True)]
    return raw, corrected


def fastest(t: dict[str, Any]) -> float:
    """Seconds per item of the fastest repeat (least disturbed by other processes)."""
    return t["min"] / t["items"]


def worst_ratio(points: dict[Any, dict[str, Any]], name: str) -> tuple[float, float]:
    """The highest ratio of ``name`` to the floor over the sizes timed: from the medians, and
    from the fastest repeats."""
    keys = [k for k in points if name in points[k]]
    medians = [med(points[k][name]) / med(points[k][peers.FLOOR]) for k in keys]
    fastest_ = [fastest(points[k][name]) / fastest(points[k][peers.FLOOR]) for k in keys]
    return max(medians), max(fastest_)


SCALING_LIMIT = 1.2


def scaling_verdict(
    points: dict[Any, dict[str, Any]], name: str, sizes: list[int], skipped: dict[int, str]
) -> tuple[bool, str]:
    """PASS iff ``name`` was timed at every size and its median is within 1.2x of the floor's
    median in the same interleaved run at each; the target cell lists every size's ratio."""
    parts, ok = [], True
    for size in sizes:
        point = points.get(size)
        if point is None or name not in point:
            ok = False
            why = skipped.get(size, "not timed")
            parts.append(f"{count(size)} not timed ({why})")
            continue
        ratio = med(point[name]) / med(point[peers.FLOOR])
        ok = ok and ratio <= SCALING_LIMIT
        parts.append(f"{count(size)} {ratio:.2f}x")
    return ok, f"<={SCALING_LIMIT:g}x the floor at every size: " + ", ".join(parts)


def build_rows(res: dict[str, Any], cfg: Config) -> list[Row]:
    rows: list[Row] = []
    stored = count(cfg.w1_size)

    def mark(floor_t: dict[str, Any], ours_t: dict[str, Any]) -> None:
        rows[-1].ratio_min = fastest(ours_t) / fastest(floor_t)

    # ---- W1
    s = res["transitions"]["sample"]
    for kind in (peers.RB_TENSOR, peers.RB_MEMMAP):
        f, r = med(s[peers.FLOOR]), med(s[kind])
        bname, bval = best_of(s, PEERS)
        cp = med(s.get(peers.CPPRB))
        ok = r / f <= 1.2 and (cp is None or r < cp)
        rows.append(
            Row(
                f"W1 sample({BATCH}), {stored} stored, {kind.split()[1]}",
                micros(f),
                micros(r),
                r / f,
                peer_cell(bname, bval, micros),
                micros(med(s.get(peers.TORCHRL))),
                "<=1.2x floor, < cpprb",
                ok,
            )
        )
        mark(s[peers.FLOOR], s[kind])

    # ---- W2
    checks = res["nstep_check"]
    wrong = [n for n, c in checks.items() if c.get("correct") is False]
    right = [n for n, c in checks.items() if c.get("correct")]
    rb_ok = bool(checks["replaybuf"]["correct"])
    peer_cells = "correct: " + (", ".join(n for n in right if n in PEERS) or "none")
    peer_cells += "; wrong: " + (", ".join(n for n in wrong if n in PEERS) or "none")
    tr = checks.get(peers.TORCHRL, {})
    rows.append(
        Row(
            f"W2 n-step correctness (toy episodes, n={nstep_check.N})",
            "correct" if checks[peers.FLOOR]["correct"] else "WRONG",
            "correct" if rb_ok else "WRONG",
            None,
            peer_cells,
            "correct" if tr.get("correct") else f"WRONG ({tr.get('wrong_items')} items)",
            "right done/bootstrap at episode ends",
            rb_ok,
        )
    )
    s = res["nstep"]["sample"]
    f, r = med(s[peers.FLOOR]), med(s[peers.RB_TENSOR])
    good = set(right)
    bname, bval = best_of(s, (*PEERS, peers.TORCHRL), lambda n: n in good)
    wname, wval = best_of(s, PEERS)
    steps = count(cfg.w2_episodes * cfg.ep_len)
    tr_cell = micros(med(s.get(peers.TORCHRL))) + ("" if peers.TORCHRL in good else " (wrong)")
    rows.append(
        Row(
            f"W2 n-step sample({BATCH}), {steps} stored",
            micros(f),
            micros(r),
            r / f,
            peer_cell(bname, bval, micros)
            + ("" if wname == bname else f" (fastest: {peer_cell(wname, wval, micros)})"),
            tr_cell,
            "<=1.3x floor",
            r / f <= 1.3,
        )
    )
    mark(s[peers.FLOOR], s[peers.RB_TENSOR])
    speedup = bval / r
    have_peer = math.isfinite(bval)
    rows.append(
        Row(
            "W2 vs best correct peer",
            micros(f),
            micros(r),
            r / f,
            peer_cell(bname, bval, micros),
            tr_cell,
            f">=2x faster than {bname} (is {speedup:.2f}x)"
            if have_peer
            else ">=2x faster than the best correct peer (none installed)",
            speedup >= 2.0 if have_peer else None,
        )
    )
    mark(s[peers.FLOOR], s[peers.RB_TENSOR])

    # ---- W3
    p = res["pixels"]
    pr = p["pairs"][peers.RB_TENSOR]
    f, r = med(pr[peers.FLOOR]), med(pr[peers.RB_TENSOR])
    peer_ratios = {
        n: med(p["pairs"][n][n]) / med(p["pairs"][n][peers.FLOOR]) for n in p["pairs"] if n in PEERS
    }
    if peer_ratios:
        bname = min(peer_ratios, key=peer_ratios.get)
        bcell = f"{bname} {micros(med(p['pairs'][bname][bname]))} ({peer_ratios[bname]:.2f}x)"
    else:
        bcell = "-"
    tpair = p["pairs"].get(peers.TORCHRL)
    tcell = (
        "-"
        if tpair is None
        else f"{micros(med(tpair[peers.TORCHRL]))} "
        f"({med(tpair[peers.TORCHRL]) / med(tpair[peers.FLOOR]):.2f}x)"
    )
    n3 = cfg.w3_episodes * cfg.w3_ep_len
    rows.append(
        Row(
            f"W3 sample({PIXEL_BATCH}) u8[4,84,84], {count(n3)} stored",
            micros(f),
            micros(r),
            r / f,
            bcell,
            tcell,
            "<=1.2x floor",
            r / f <= 1.2,
        )
    )
    mark(pr[peers.FLOOR], pr[peers.RB_TENSOR])
    mem = p["memory"]
    payload = p["payload"]
    rbb = mem[peers.RB_TENSOR]["bytes_per_step"]
    peer_bytes = {n: mem[n]["bytes_per_step"] for n in mem if n in PEERS}
    bname = min(peer_bytes, key=peer_bytes.get) if peer_bytes else None
    rows.append(
        Row(
            "W3 stored bytes/transition",
            f"{nbytes(payload)} (payload w/o next obs)",
            nbytes(rbb),
            rbb / payload,
            "-" if bname is None else f"{bname} {nbytes(peer_bytes[bname])}",
            nbytes(mem.get(peers.TORCHRL, {}).get("bytes_per_step")),
            "<=1.02x payload w/o next-obs copies",
            rbb / payload <= 1.02,
        )
    )

    def info_row(name: str, label: str, note: str) -> None:
        """A replaybuf variant timed beside the floor, for information (no target)."""
        pair = p["pairs"][name]
        vf, vr = med(pair[peers.FLOOR]), med(pair[name])
        rows.append(Row(label, micros(vf), micros(vr), vr / vf, bcell, tcell, note, None))

    if peers.RB_LOCKSTEP in p["pairs"]:
        info_row(
            peers.RB_LOCKSTEP,
            f"W3 sample({PIXEL_BATCH}), {cfg.w3_episodes} episodes written in lockstep",
            "(info: a vector env's interleaved rows)",
        )
    if peers.RB_FRAMES in p["pairs"]:  # the frame-stack deduplication W3 asks for
        info_row(
            peers.RB_FRAMES,
            f"W3 sample({PIXEL_BATCH}), replaybuf frame_stack=4 (stacks rebuilt)",
            "(info: the floor reads stored stacks)",
        )
        pair = p["pairs"][peers.RB_FRAMES]
        if peers.FRAME_FLOOR in pair:  # absent in reports from before the frame floor
            vf, vr = med(pair[peers.FRAME_FLOOR]), med(pair[peers.RB_FRAMES])
            rows.append(
                Row(
                    f"W3 sample({PIXEL_BATCH}) frame_stack=4 against the frame floor",
                    micros(vf),
                    micros(vr),
                    vr / vf,
                    "-",
                    "-",
                    "<=1.2x the frame floor (each window's k+1 frames gathered once)",
                    vr / vf <= 1.2,
                )
            )
        one_frame = p["layouts"]["one frame per step"]
        fb = mem[peers.RB_FRAMES]["bytes_per_step"]
        rows.append(
            Row(
                "W3 stored bytes/transition, frame_stack=4",
                f"{nbytes(one_frame)} (one frame per step)",
                nbytes(fb),
                fb / one_frame,
                "-" if bname is None else f"{bname} {nbytes(peer_bytes[bname])}",
                nbytes(mem.get(peers.TORCHRL, {}).get("bytes_per_step")),
                "~7.1 KB, within 1.02x one frame's payload",
                fb / one_frame <= 1.02,
            )
        )

    def ratio_row(label: str, peer: dict[str, Any] | None, r: float, factor: float | None) -> None:
        """A per-call cost against SB3's own call in the same run (ratio: to SB3's); no
        ``factor``: information, no target."""
        s = med(peer)
        if s is None:
            target = "(info: no SB3)"
        else:
            target = "(info)" if factor is None else f"<= {factor:g}x SB3's"
        rows.append(
            Row(
                label + " (ratio: to SB3's)",
                "-" if s is None else f"SB3 {micros(s)}",
                micros(r),
                None if s is None else r / s,
                "-",
                "-",
                target,
                None if s is None or factor is None else r <= factor * s,
            )
        )

    # ---- W4
    w = res["inserts"]
    one = w["one_step"]
    f = med(one[peers.FLOOR])
    sb3 = med(one.get(peers.SB3))
    bname, bval = best_of(one, PEERS)
    modes = [("sync", "sync", 1.0)]
    if "replaybuf sync torch" in one:  # absent in reports from before the split by input
        modes.append(("sync torch", "sync, torch inputs,", None))
    modes.append(("async", "async (awaited)", 2.0))
    if "replaybuf async nowait" in one:
        modes.append(("async nowait", "async facade _nowait", 2.0))
    for mode, label, factor in modes:
        r = med(one[f"replaybuf {mode}"])
        need = "(info)" if factor is None else ">= SB3 add" if factor == 1 else ">= 1/2 SB3 add"
        rows.append(
            Row(
                f"W4 1 step/call, {label} append_observation_action_reward",
                rate(f),
                rate(r),
                r / f,
                peer_cell(bname, bval, rate),
                rate(med(one.get(peers.TORCHRL))),
                need + ("" if sb3 is None else f" (is {sb3 / r:.2f}x SB3)"),
                None if sb3 is None or factor is None else r <= factor * sb3,
            )
        )
        mark(one[peers.FLOOR], one[f"replaybuf {mode}"])
    if "per_step" in w:  # absent in reports from before these rows
        ps = w["per_step"]
        peer = ps.get(peers.SB3)
        for inputs in per_step.INPUTS:
            if f"replaybuf add {inputs}" not in ps:  # absent in reports from before this row
                continue
            r = med(ps[f"replaybuf add {inputs}"])
            ratio_row(f"W4 1 step/call, ReplayBuffer.add, {inputs} inputs", peer, r, 1.0)
        if peer is not None:
            r = med(ps["sb3 adapter add"])
            ratio_row("W4 1 step/call, SB3 adapter add", peer, r, 1.2)
            theirs = ps["SB3 sample"]
            ratio_row("SB3 adapter sample(256)", theirs, med(ps["sb3 adapter sample"]), 1.0)
            if "SB3 add+sample" in ps:  # absent in reports from before this row
                r = med(ps["sb3 adapter add+sample"])
                ratio_row("SB3 adapter add, then sample(256)", ps["SB3 add+sample"], r, None)
    for key, label, impl, target in (
        ("envs_64", f"W4 append_batch {ENVS} envs, sync", "replaybuf sync", True),
        ("envs_64", f"W4 append_batch {ENVS} envs, async", "replaybuf async", False),
        ("chunk_1000", f"W4 {CHUNK:,}-row chunks, ReplayBuffer.add_batch", "replaybuf add_batch",
         True),
        ("chunk_1000", f"W4 {CHUNK:,}-row chunks, append_batch {CHUNK:,} envs",
         "replaybuf append_batch 1000 envs", False),
        ("chunk_1000", f"W4 {CHUNK:,} envs, 20-step episodes, ends and evictions (bulk)",
         "replaybuf 1000 envs bulk ends", False),
    ):  # fmt: skip
        t = w[key]
        if impl not in t:  # absent in reports from before the bulk calls
            continue
        f, r = med(t[peers.FLOOR]), med(t[impl])
        bname, bval = best_of(t, PEERS)
        rows.append(
            Row(
                label,
                rate(f),
                rate(r),
                r / f,
                peer_cell(bname, bval, rate),
                rate(med(t.get(peers.TORCHRL))),
                ">= 1/2 floor rate" if target else "(info)",
                r / f <= 2.0 if target else None,
            )
        )
        mark(t[peers.FLOOR], t[impl])

    # ---- W5
    e = res["transitions"]["epoch"]
    for kind in (peers.RB_TENSOR, peers.RB_MEMMAP):
        f, r = med(e[peers.FLOOR]), med(e[kind])
        bname, bval = best_of(e, PEERS)
        rows.append(
            Row(
                f"W5 1 shuffled epoch, batch {BATCH}, {stored}, {kind.split()[1]}",
                secs(f),
                secs(r),
                r / f,
                peer_cell(bname, bval, secs),
                secs(med(e.get(peers.TORCHRL))),
                "<=1.2x floor",
                r / f <= 1.2,
            )
        )
        mark(e[peers.FLOOR], e[kind])

    # ---- scaling: replaybuf's time within 1.2x of the floor's at every stored size (the
    # floor's own time grows with the size on this VM; the ratio is what replaybuf controls).
    # The spreads (max/min over the sizes; W1's corrected by the load probe) are information.
    sc = res["scaling_steps"]
    sizes = sc["sizes"]
    span = f"{count(sizes[0])}..{count(sizes[-1])}"
    floor_raw, floor_corr = scaling_series(sc["points"], peers.FLOOR)
    _, t_corr = scaling_series(sc["points"], peers.TORCHRL)
    t_worst, _ = worst_ratio(sc["points"], peers.TORCHRL)
    peer_worst = {
        n: worst_ratio(sc["points"], n)[0]
        for n in PEERS
        if all(n in v for v in sc["points"].values())
    }
    bname = min(peer_worst, key=peer_worst.get) if peer_worst else None
    for kind in (peers.RB_TENSOR, peers.RB_MEMMAP):
        raw, corr = scaling_series(sc["points"], kind)
        worst, fast = worst_ratio(sc["points"], kind)
        ok, judged = scaling_verdict(sc["points"], kind, sizes, {})
        rows.append(
            Row(
                f"scaling: W1 sample({BATCH}), {span} stored steps, {kind.split()[1]}",
                f"{micros(min(floor_raw))}-{micros(max(floor_raw))} "
                f"(spread {spread(floor_corr):.2f}x, raw {spread(floor_raw):.2f}x)",
                f"{micros(min(raw))}-{micros(max(raw))} "
                f"(spread {spread(corr):.2f}x, raw {spread(raw):.2f}x)",
                worst,
                "-" if bname is None else f"{bname} worst {peer_worst[bname]:.2f}x",
                f"worst {t_worst:.2f}x (spread {spread(t_corr):.2f}x)",
                judged,
                ok,
                fast,
            )
        )
    ns = sc.get("nstep")  # absent in reports from before W2 was timed against stored size
    if ns is not None:
        points = ns["points"]
        skipped = {int(k): v for k, v in ns["skipped"].items()}
        for kind in NSTEP_KINDS:
            if not any(kind in v for v in points.values()) and not skipped:
                continue
            ok, judged = scaling_verdict(points, kind, sizes, skipped)
            timed = [k for k in points if kind in points[k]]
            raw = [med(points[k][kind]) for k in timed]
            fl = [med(points[k][peers.FLOOR]) for k in timed]
            worst, fast = worst_ratio(points, kind) if timed else (None, None)
            rows.append(
                Row(
                    f"scaling: W2 n-step sample({BATCH}, n={N_STEP}), {span} stored steps "
                    f"({ns['ep_len']:,}-step episodes), {kind.split()[1]}",
                    "-"
                    if not fl
                    else f"{micros(min(fl))}-{micros(max(fl))} (raw spread {spread(fl):.2f}x)",
                    "-"
                    if not raw
                    else f"{micros(min(raw))}-{micros(max(raw))} (raw spread {spread(raw):.2f}x)",
                    worst,
                    "-",
                    "-",
                    judged,
                    ok,
                    fast,
                )
            )
    se = res["scaling_episodes"]
    raw, corr = scaling_series(se["points"], peers.RB_TENSOR)
    probe_raw = [med(v["probe"]) for v in se["points"].values()]
    counts = se["episodes"]
    rows.append(
        Row(
            f"scaling: n-step sample, {counts[0]:,}..{counts[-1]:,} episodes, "
            f"{se['total_steps']:,} steps",
            f"{micros(float(np.median(probe_raw)))} (load probe)",
            f"{micros(min(raw))}-{micros(max(raw))} ({spread(corr):.2f}x)",
            None,
            "-",
            "-",
            f"max/min <=1.3x (raw {spread(raw):.2f}x)",
            spread(corr) <= 1.3,
        )
    )

    # ---- memory (bytes per stored transition; informational)
    for label, mem in (
        (f"memory W1, bytes/transition ({stored})", res["transitions"]["memory"]),
        (f"memory W2, bytes/transition ({steps})", res["nstep"]["memory"]),
    ):
        rb_key = peers.RB_TENSOR
        peer_bytes = {n: mem[n]["bytes_per_step"] for n in mem if n in PEERS}
        bname = min(peer_bytes, key=peer_bytes.get) if peer_bytes else None
        fb, rb = mem[peers.FLOOR]["bytes_per_step"], mem[rb_key]["bytes_per_step"]
        rows.append(
            Row(
                label,
                nbytes(fb),
                nbytes(rb),
                rb / fb,
                "-" if bname is None else f"{bname} {nbytes(peer_bytes[bname])}",
                nbytes(mem.get(peers.TORCHRL, {}).get("bytes_per_step")),
                "(info)",
                None,
            )
        )
    return rows


HEADER = (
    "workload",
    "floor",
    "replaybuf",
    "ratio to floor",
    "best peer",
    "TorchRL",
    "target",
    "PASS/FAIL",
)


def format_rows(rows: list[Row], markdown: bool = False) -> str:
    """The table; the Markdown one adds the ratio taken from the fastest repeats."""
    header = HEADER
    if markdown:
        header = (*HEADER[:4], "ratio, fastest repeats", *HEADER[4:])
    cells = []
    for r in rows:
        cell = [
            r.workload,
            r.floor,
            r.replaybuf,
            "-" if r.ratio is None else f"{r.ratio:.2f}x",
            r.best_peer,
            r.torchrl,
            r.target,
            r.verdict,
        ]
        if markdown:
            cell.insert(4, "-" if r.ratio_min is None else f"{r.ratio_min:.2f}x")
        cells.append(tuple(cell))
    return harness.text_table(header, cells, markdown)


# =========================================================================== plot
def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sc, se = res["scaling_steps"], res["scaling_episodes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), width_ratios=[3, 2])
    points = sc["points"]
    names = [n for n in next(iter(points.values())) if n != "probe"]
    for name in names:
        sizes = [s for s in points if name in points[s]]
        left.plot(
            sizes,
            [med(points[s][name]) * 1e6 for s in sizes],
            marker="o",
            linewidth=2.5 if name.startswith("replaybuf") else 1.5,
            linestyle="--" if name == peers.FLOOR else "-",
            label=name,
        )
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("stored transitions")
    left.set_ylabel(f"µs per sample({BATCH}) (median)")
    left.set_title("W1 sampling cost vs stored steps")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    counts = se["episodes"]
    right.plot(
        counts,
        [med(se["points"][c][peers.RB_TENSOR]) * 1e6 for c in counts],
        marker="o",
        linewidth=2.5,
        label="replaybuf sample_n_step",
    )
    right.plot(
        counts,
        [med(se["points"][c]["probe"]) * 1e6 for c in counts],
        marker="o",
        linestyle="--",
        label="raw n-step floor",
    )
    ratio = right.twinx()
    ratio.plot(
        counts,
        [med(se["points"][c][peers.RB_TENSOR]) / med(se["points"][c]["probe"]) for c in counts],
        color="gray",
        marker="x",
        linestyle=":",
        label="ratio (right axis)",
    )
    ratio.set_ylim(0, 6)
    ratio.set_ylabel("replaybuf / floor, same repeats")
    ratio.legend(fontsize=8, loc="upper right")
    right.set_xscale("log")
    tallest = max(med(se["points"][c][peers.RB_TENSOR]) for c in counts) * 1e6
    right.set_ylim(0, tallest * 1.7)  # room for the legends
    right.set_xlabel(f"stored episodes ({se['total_steps']:,} steps in all)")
    right.set_ylabel("µs per batch (median)")
    right.set_title(f"n-step sample({BATCH}, n={N_STEP}) vs episode count")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8, loc="upper left")
    m = res["machine"]
    fig.suptitle(
        f"replaybuf suite ({res['config']['name']}), {res['date']}, {m['cpu']}, "
        f"{m['cores']} cores, 1 thread, torch {res['versions']['torch']}",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# =========================================================================== profiles
def profile_calls(fn: Callable[[], Any], calls: int, top: int = 14, per: int = 1) -> dict[str, Any]:
    """cProfile ``calls`` calls of ``fn``, each doing ``per`` operations; per-function time per
    operation (µs), the heaviest first, and the unprofiled wall time per operation."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    ops = calls * per
    wall = (time.perf_counter() - start) / ops
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler)
    entries = []
    for (filename, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        short = filename.split("site-packages/")[-1].replace(str(harness.REPO) + "/", "")
        entries.append(
            {
                "function": f"{short}:{line}({func})",
                "calls_per_call": ncalls / ops,
                "self_us": tottime / ops * 1e6,
                "cumulative_us": cumtime / ops * 1e6,
            }
        )
    entries.sort(key=lambda x: -x["self_us"])
    profiled = sum(x["self_us"] for x in entries)
    text = io.StringIO()
    text.write(f"    wall {wall * 1e6:,.1f} µs/call unprofiled; {profiled:,.1f} µs profiled\n")
    text.write(f"    {'self µs':>8} {'cum µs':>8} {'calls':>6}  function\n")
    for x in entries[:top]:
        text.write(
            f"    {x['self_us']:8.1f} {x['cumulative_us']:8.1f} {x['calls_per_call']:6.1f}  "
            f"{x['function']}\n"
        )
    return {"wall_us": wall * 1e6, "entries": entries[:40], "text": text.getvalue()}


def profiles(scratch: Path, quick: bool) -> dict[str, Any]:
    """cProfile of the replaybuf paths, on modest buffers (100k steps), apart from timing."""
    out: dict[str, Any] = {}
    calls = 200 if quick else 1_000
    columns = peers.transitions(100_000)
    with ReplayBuffer("cpu", "cpu", 100_000, storage="tensor", scratch_dir=scratch) as buf:
        buf.add_batch(columns)
        out["W1 ReplayBuffer.sample_batch(256), tensor"] = profile_calls(
            lambda: buf.sample_batch(BATCH), calls
        )
        out["W5 create_epoch_iterator(256) over 100k, per batch"] = profile_calls(
            lambda: sum(1 for _ in buf.create_epoch_iterator(BATCH)),
            3,
            per=-(-100_000 // BATCH),
        )
    eps = peers.random_episodes(100, 1_000)
    built, _ = peers.replaybuf_nstep(eps, N_STEP, GAMMA, BATCH, scratch)
    try:
        out[f"W2 sample_n_step({BATCH}, n=3)"] = profile_calls(built.sample, calls)
    finally:
        built.close()
    frames = peers.Frames()
    built = peers.replaybuf_pixels(frames, 4, 500, PIXEL_BATCH, scratch)
    try:
        out[f"W3 sample_n_step({PIXEL_BATCH}, n=1), pixels"] = profile_calls(built.sample, calls)
    finally:
        built.close()
    one = peers.StepPool(1)
    with SyncEpisodeReplayBuffer(20_000, storage="tensor", scratch_dir=scratch) as sync:
        peers.prefill_episodes(sync, 1_000)
        out["W4 sync append_observation_action_reward"] = profile_calls(
            peers.episode_writer(sync, one, 1, 1_000), 5 * calls
        )
    loop = asyncio.new_event_loop()
    aio = EpisodeReplayBuffer(20_000, storage="tensor", scratch_dir=scratch)
    try:
        peers.prefill_episodes(aio._sync, 1_000)  # full, as the sync one (evicting appends)
        write = peers.async_episode_writer(aio, one, 1, 1_000)

        async def burst() -> None:  # awaited back to back inside one task, as timed
            for _ in range(100):
                await write()

        out["W4 async append_observation_action_reward"] = profile_calls(
            lambda: loop.run_until_complete(burst()), calls // 20, per=100
        )
        if peers.has_nowait(aio):
            out["W4 async facade append_observation_action_reward_nowait"] = profile_calls(
                peers.nowait_episode_writer(aio, one, 1, 1_000), 5 * calls
            )
    finally:
        aio._sync.close()
        loop.close()
    many = peers.StepPool(ENVS)
    with SyncEpisodeReplayBuffer(256_000, storage="tensor", scratch_dir=scratch) as sync:
        out[f"W4 append_batch {ENVS} envs"] = profile_calls(
            peers.episode_writer(sync, many, ENVS, 1_000), calls
        )
    chunk = peers.StepPool(CHUNK, size=8)
    with ReplayBuffer("cpu", "cpu", 200_000, storage="tensor", scratch_dir=scratch) as ring:
        write = peers.replaybuf_batch_writer(ring, chunk)
        out[f"W4 ReplayBuffer.add_batch({CHUNK})"] = profile_calls(write, calls)
    return out


# =========================================================================== main
SECTIONS = (
    ("nstep_check", "W2 correctness check (toy episodes)"),
    ("transitions", "W1 sampling + W5 epochs"),
    ("nstep", "W2 n-step sampling"),
    ("pixels", "W3 pixels"),
    ("inserts", "W4 inserts"),
    ("scaling_steps", "scaling: stored steps"),
    ("scaling_episodes", "scaling: stored episodes"),
)


def run(cfg: Config, scratch: Path, profile: bool = False) -> dict[str, Any]:
    """Every section; returns the report (results, rows, machine, versions, timings)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    began = time.perf_counter()
    report: dict[str, Any] = {
        "suite": "replaybuf benchmarks",
        "date": harness.now(),
        "config": asdict(cfg),
        "machine": harness.machine(),
        "versions": harness.versions(),
        "peers": peers.available(),
        "section_seconds": {},
    }
    load = {"start": report["machine"]["load_average"]}
    fns: dict[str, Callable[[], Any]] = {
        "nstep_check": lambda: nstep_check.check_all(scratch),
        "transitions": lambda: section_transitions(cfg, scratch),
        "nstep": lambda: section_nstep(cfg, scratch),
        "pixels": lambda: section_pixels(cfg, scratch),
        "inserts": lambda: section_inserts(cfg, scratch),
        "scaling_steps": lambda: section_scaling_steps(cfg, scratch),
        "scaling_episodes": lambda: section_scaling_episodes(cfg, scratch),
    }
    for key, title in SECTIONS:
        log(f"  {title} ...")
        start = time.perf_counter()
        report[key] = fns[key]()
        report["section_seconds"][key] = time.perf_counter() - start
        load[key] = list(harness.os.getloadavg())
        log(f"  {title}: {report['section_seconds'][key]:.1f} s, load {load[key][0]:.2f}")
    report["load_average"] = load
    report["rows"] = [asdict(r) | {"verdict": r.verdict} for r in build_rows(report, cfg)]
    report["wall_seconds"] = time.perf_counter() - began
    if profile:
        log("  profiles ...")
        report["profiles"] = profiles(scratch, cfg.name != "full")
    return report


def rows_of(report: dict[str, Any]) -> list[Row]:
    return [Row(**{k: v for k, v in r.items() if k != "verdict"}) for r in report["rows"]]


def header_text(report: dict[str, Any]) -> str:
    m, v = report["machine"], report["versions"]
    load = report["load_average"]
    peak = max(x[0] for x in load.values())
    peer_versions = ", ".join(
        f"{k} {v[k]}" for k in ("cpprb", "stable_baselines3", "tianshou") if v.get(k)
    )
    return (
        f"replaybuf suite ({report['config']['name']}), {report['date']}: {m['cpu']}, "
        f"{m['cores']} cores, {(m['memory_bytes'] or 0) / 2**30:.0f} GiB, torch threads 1; "
        f"torch {v['torch']}, torchrl {v['torchrl']}, tensordict {v['tensordict']}, "
        f"replaybuf {v['replaybuf']} ({(v['git_commit'] or '?')[:9]}"
        f"{', dirty' if v.get('git_dirty') else ''}); peers: {peer_versions or 'none'}\n"
        f"load average (1 min) at start {load['start'][0]:.2f}, highest after a section "
        f"{peak:.2f}; wall {report['wall_seconds']:.0f} s. Medians; ratios from interleaved "
        "runs in this process."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (< 2 minutes)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests
    parser.add_argument("--json", type=Path, default=None, help="where the JSON goes")
    parser.add_argument("--plot", type=Path, default=None, help="where the PNG goes")
    parser.add_argument("--profile", action="store_true", help="cProfile the replaybuf paths")
    parser.add_argument(
        "--profile-only", action="store_true", help="only the cProfile section (no timings)"
    )
    parser.add_argument(
        "--markdown", type=Path, default=None, help="print a JSON report's table as Markdown"
    )
    args = parser.parse_args(argv)
    if args.markdown:
        report = json.loads(args.markdown.read_text())
        print(header_text(report))
        print()
        print(format_rows(rows_of(report), markdown=True))
        return 0
    if args.profile_only:
        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory(prefix="replaybuf-suite-") as tmp:
            found = profiles(Path(tmp), args.quick)
        print(f"load average {harness.os.getloadavg()}")
        for name, p in found.items():
            print(f"\n  profile: {name}\n{p['text']}", end="")
        if args.json:
            args.json.write_text(json.dumps(found, indent=1) + "\n")
        return 0
    cfg = TINY if args.tiny else QUICK if args.quick else FULL
    suffix = "" if cfg is FULL else f"-{cfg.name}"
    json_path = args.json or HERE / "results" / f"suite{suffix}.json"
    plot_path = args.plot or (HERE / "scaling.png" if cfg is FULL else HERE / "results" /
                              f"scaling{suffix}.png")  # fmt: skip
    log(f"suite ({cfg.name}): load average {harness.os.getloadavg()}, peers {peers.available()}")
    with tempfile.TemporaryDirectory(prefix="replaybuf-suite-") as tmp:
        report = run(cfg, Path(tmp), profile=args.profile)
    print()
    print(header_text(report))
    print(format_rows(rows_of(report)))
    for check in report["nstep_check"].values():
        print("  W2 check: " + nstep_check.summary(check))
    if args.profile:
        for name, p in report["profiles"].items():
            print(f"\n  profile: {name}\n{p['text']}", end="")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    plot(report, plot_path)
    print(f"\nwrote {json_path} and {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
