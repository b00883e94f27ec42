"""Prioritized replay benchmark: replaybuf's PER beside uniform sampling and TorchRL's PER.

Measures, single-threaded (``torch.set_num_threads(1)``), each
number the median over repeats that go round-robin over the implementations of a section:

1. ``ReplayBuffer.sample_batch(256)`` from ``--items`` (1,000,000) stored transitions
   (obs f32[17], action f32[6], reward f32, done bool), prioritized with each priority backend
   ("torchrl-segment-tree": TorchRL's C++ trees; "torch": replaybuf's blocks, run by the numba
   kernels of the ``fast`` extra where installed, else numpy), beside uniform
   ``sample_batch(256)`` of an identical non-prioritized buffer (target: within 3x), for memmap
   and tensor storage; and beside TorchRL's ``TensorDictPrioritizedReplayBuffer(alpha=0.6,
   beta=0.4)`` over ``LazyMemmapStorage`` / ``LazyTensorStorage`` (``.sample(256)``) holding the
   same data and priorities, and a plain ``TensorDictReplayBuffer`` over the same storage;
2. ``SyncEpisodeReplayBuffer.sample_n_step(256, n=3)`` from as many steps in 1,000-step
   episodes (filled with ``append_batch`` over 100 concurrent episodes), both backends, beside
   uniform ``sample_n_step(256, n=3)`` of an identical non-prioritized buffer (target: 3x);
3. ``update_priorities`` of 256 items (the ``index`` of a sampled batch, random priorities) on
   both replaybuf buffers and both backends, beside TorchRL's ``update_priority(index, priority)``.

Before timing, every stored item gets a random log-normal priority (the same value for the same
item in every prioritized buffer, TorchRL's included), set in chunks through the public update
API, so sampling is far from uniform; the run checks that sampled batches favour high priorities
as p^alpha predicts ("lift" in the JSON). Storages live in a temporary folder on disk, removed
at the end; every replaybuf buffer is closed. Prints one table and writes
``benchmarks/results/bench_priority.json``.

    python benchmarks/bench_priority.py            # full run (about a minute)
    python benchmarks/bench_priority.py --quick    # 100,000 items (< 1 minute)
    python benchmarks/bench_priority.py --profile  # also print cProfile top entries
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import os
import platform
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tensordict
import torch
import torchrl
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)

import replaybuf
from replaybuf import ReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.accel.numba_loader import kernels_unavailable_reason
from replaybuf.priority import segment_tree_unavailable_reason

OBS, ACT = 17, 6  # W1: obs f32[17], action f32[6], reward f32, done bool
EP_LEN = 1_000  # steps per episode
BATCH = 256
N_STEP, GAMMA = 3, 0.99
ALPHA, BETA, EPS = 0.6, 0.4, 1e-6  # replaybuf's defaults, given to TorchRL too
PRIORITY_SIGMA = 1.0  # priorities are exp(sigma * N(0, 1)): |TD errors| with a heavy tail
SET_CHUNK = 65_536  # items per update call while setting the initial priorities
FILL_CHUNK = 50_000  # rows per add_batch / extend while filling transition buffers
UPDATE_BATCHES = 32  # pre-sampled (index, priority) pairs cycled by the update workloads
TARGET = 3.0  # the target: prioritized sampling within 3x of uniform
BACKENDS = ("torchrl-segment-tree", "torch")
KINDS = ("memmap", "tensor")
RESULTS = Path(__file__).resolve().parent / "results" / "bench_priority.json"
NOTES = [
    "x uniform = time / the same call on an identical non-prioritized buffer (same storage "
    "kind, same data); for TorchRL rows, its PER buffer / a plain TensorDictReplayBuffer over "
    "the same storage. Target: prioritized sampling within 3x of uniform.",
    "x torchrl = time / TorchRL's counterpart on the same storage kind: "
    "TensorDictPrioritizedReplayBuffer.sample(256) or .update_priority(index, priority) "
    "(alpha=0.6, beta=0.4, eps=1e-6; its default float32 trees) for prioritized rows, "
    "TensorDictReplayBuffer.sample(256) for uniform ones; episode updates against memmap.",
    "replaybuf's prioritized batches carry index and weight; TorchRL's carry index and "
    "priority_weight. replaybuf's update_priorities also skips ids whose item was overwritten "
    "since sampling (TorchRL applies them to the slot's new occupant).",
    "Priorities: every item gets exp(N(0, 1)) before timing, the same per item everywhere; "
    "the updates then keep drawing from that distribution. Lift: mean priority of sampled "
    "items / mean priority (1 for uniform sampling); both replaybuf backends, seeded alike, "
    "draw the same items.",
    "Timed runs go round-robin over the implementations of a section, so load from other "
    "processes hits them alike; the JSON keeps every run and the minimum beside the median.",
]


@dataclass(frozen=True)
class Sizes:
    items: int  # stored transitions / steps in every buffer
    envs: int  # concurrent episodes while filling the episode buffers
    sample_calls: int  # calls per timed run
    update_calls: int
    repeats: int  # timed runs per workload (median)
    profile_calls: int


FULL = Sizes(
    items=1_000_000, envs=100, sample_calls=200, update_calls=200, repeats=15, profile_calls=500
)
QUICK = Sizes(
    items=100_000, envs=100, sample_calls=50, update_calls=50, repeats=5, profile_calls=100
)


# --------------------------------------------------------------------------- timing
def timing(runs: list[float]) -> dict[str, Any]:
    """``{"median": ..., "min": ..., "runs": [...]}``, seconds per call."""
    return {"median": statistics.median(runs), "min": min(runs), "runs": runs}


def interleaved(
    workloads: dict[str, Callable[[], Any]], calls: int, repeats: int
) -> dict[str, dict[str, Any]]:
    """Seconds per call of each workload: median over ``repeats`` runs of ``calls`` calls.

    One untimed call each first (allocation, caches). Runs go round-robin over the workloads,
    so a change in machine load hits them all alike and their ratios stay meaningful.
    """
    for fn in workloads.values():
        fn()
    runs: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(repeats):
        for name, fn in workloads.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            runs[name].append((time.perf_counter() - start) / calls)
    return {name: timing(r) for name, r in runs.items()}


# --------------------------------------------------------------------------- data
def priorities(count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` random priorities, log-normal (all > 0, a heavy upper tail)."""
    return (PRIORITY_SIGMA * torch.randn(count, generator=generator)).exp()  # float32


def transitions(count: int, seed: int) -> TensorDict:
    """``count`` W1 transitions, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(count, OBS, generator=gen),
            "action": torch.rand(count, ACT, generator=gen) * 2 - 1,
            "reward": torch.randn(count, generator=gen),
            "done": torch.rand(count, generator=gen) < 0.001,
        },
        batch_size=[count],
    )


def expected_lift(p: torch.Tensor) -> float:
    """E[p of a sampled item] / mean p when items are drawn ∝ (p + eps)^alpha."""
    w = (p + EPS) ** ALPHA
    return float((w * p).sum() / w.sum() / p.mean())


def observed_lift(sampled: torch.Tensor, p: torch.Tensor) -> float:
    return float(sampled.mean() / p.mean())


@dataclass
class Transitions:
    """Section 1/3 buffers: replaybuf's (uniform and both backends) and TorchRL's, per kind."""

    uniform: dict[str, ReplayBuffer] = field(default_factory=dict)  # kind -> buffer
    per: dict[tuple[str, str], ReplayBuffer] = field(default_factory=dict)  # (kind, backend)
    torchrl_per: dict[str, TensorDictPrioritizedReplayBuffer] = field(default_factory=dict)
    torchrl_uniform: dict[str, TensorDictReplayBuffer] = field(default_factory=dict)
    torchrl_dirs: list[str] = field(default_factory=list)
    priority: torch.Tensor | None = None  # [items] the priority of item (= slot = id) i
    fill_seconds: dict[str, float] = field(default_factory=dict)

    def close(self) -> None:
        for buf in [*self.uniform.values(), *self.per.values()]:
            buf.close()
        for where in self.torchrl_dirs:  # TorchRL has no close(): remove its memmap files
            shutil.rmtree(where, ignore_errors=True)
        self.uniform.clear()
        self.per.clear()
        self.torchrl_per.clear()
        self.torchrl_uniform.clear()
        gc.collect()


def fill_transitions(sizes: Sizes, scratch: Path) -> Transitions:
    items = sizes.items
    out = Transitions()
    out.priority = priorities(items, torch.Generator().manual_seed(1))
    ids = torch.arange(items)  # after items writes into capacity items: id = slot = i
    chunks = [(first, min(first + FILL_CHUNK, items)) for first in range(0, items, FILL_CHUNK)]
    data = transitions(items, seed=0)

    def fill(name: str, extend: Callable[[TensorDict], Any], data: TensorDict = data) -> None:
        start = time.perf_counter()
        for lo, hi in chunks:
            extend(data[lo:hi].clone())  # TorchRL's extend writes "index" into its input
        out.fill_seconds[name] = time.perf_counter() - start

    for kind in KINDS:
        buf = ReplayBuffer("cpu", "cpu", items, storage=kind, scratch_dir=scratch, seed=0)
        out.uniform[kind] = buf
        fill(f"replaybuf {kind} uniform", buf.add_batch)
        for backend in BACKENDS:
            buf = ReplayBuffer(
                "cpu",
                "cpu",
                items,
                storage=kind,
                scratch_dir=scratch,
                seed=0,
                prioritized=True,
                alpha=ALPHA,
                beta=BETA,
                eps=EPS,
                priority_backend=backend,
            )
            out.per[kind, backend] = buf
            assert buf.stats()["priority_backend"] == backend
            fill(f"replaybuf {kind} {backend}", buf.add_batch)
            start = time.perf_counter()
            for lo in range(0, items, SET_CHUNK):
                hi = min(lo + SET_CHUNK, items)
                assert buf.update_priorities(ids[lo:hi], out.priority[lo:hi]) == hi - lo
            out.fill_seconds[f"replaybuf {kind} {backend} set priorities"] = (
                time.perf_counter() - start
            )
        if kind == "memmap":
            where = tempfile.mkdtemp(prefix="torchrl-per-", dir=scratch)
            out.torchrl_dirs.append(where)
            storage = LazyMemmapStorage(items, scratch_dir=where, auto_cleanup=False)
        else:
            storage = LazyTensorStorage(items)
        rb = TensorDictPrioritizedReplayBuffer(
            alpha=ALPHA, beta=BETA, eps=EPS, storage=storage, batch_size=BATCH
        )
        fill(f"torchrl {kind} PER", rb.extend)
        start = time.perf_counter()
        for lo in range(0, items, SET_CHUNK):
            hi = min(lo + SET_CHUNK, items)
            rb.update_priority(ids[lo:hi], out.priority[lo:hi])
        out.fill_seconds[f"torchrl {kind} PER set priorities"] = time.perf_counter() - start
        out.torchrl_per[kind] = rb
        # TorchRL's uniform sampling: a plain buffer over the same storage (RandomSampler).
        out.torchrl_uniform[kind] = TensorDictReplayBuffer(storage=storage, batch_size=BATCH)
        assert len(rb) == items == len(out.torchrl_uniform[kind])
    for buf in [*out.uniform.values(), *out.per.values()]:
        assert len(buf) == items
    return out


@dataclass
class Episodes:
    """Section 2/3 buffers: identical episode buffers, uniform and one per backend."""

    uniform: SyncEpisodeReplayBuffer
    per: dict[str, SyncEpisodeReplayBuffer]
    ids: torch.Tensor  # [items] every valid step's id, sorted
    priority: torch.Tensor  # [items] the priority of the step with id ids[i]
    fill_seconds: dict[str, float]

    def close(self) -> None:
        for buf in [self.uniform, *self.per.values()]:
            buf.close()
        gc.collect()

    def priority_of(self, index: torch.Tensor) -> torch.Tensor:
        return self.priority[torch.searchsorted(self.ids, index)]


def fill_episode_buffer(buf: SyncEpisodeReplayBuffer, sizes: Sizes) -> None:
    """``items`` steps in EP_LEN-step episodes, ``envs`` at a time, one append_batch per step."""
    envs = sizes.envs
    for round_ in range(sizes.items // (envs * EP_LEN)):
        gen = torch.Generator().manual_seed(1_000 + round_)  # the same data in every buffer
        obs = torch.randn(EP_LEN + 1, envs, OBS, generator=gen)
        act = torch.rand(EP_LEN, envs, ACT, generator=gen) * 2 - 1
        rew = torch.randn(EP_LEN, envs, generator=gen)
        ids = [buf.start_episode() for _ in range(envs)]
        for t in range(EP_LEN):
            buf.append_batch(ids, obs[t], act[t], rew[t])
        for row, episode in enumerate(ids):
            buf.end_episode(episode, "truncated", obs[EP_LEN, row])


def fill_episodes(sizes: Sizes, scratch: Path) -> Episodes:
    items = sizes.items
    if items % (sizes.envs * EP_LEN):
        raise ValueError(f"items must be a multiple of {sizes.envs * EP_LEN}, got {items}")
    seconds: dict[str, float] = {}

    def make(name: str, **kwargs: Any) -> SyncEpisodeReplayBuffer:
        buf = SyncEpisodeReplayBuffer(items, items // EP_LEN, scratch_dir=scratch, seed=0, **kwargs)
        start = time.perf_counter()
        fill_episode_buffer(buf, sizes)
        len(buf.sample_n_step(1))  # flush staged rows inside the timed fill
        seconds[name] = time.perf_counter() - start
        assert len(buf) == items, (name, len(buf))
        return buf

    uniform = make("replaybuf episodes uniform")
    per: dict[str, SyncEpisodeReplayBuffer] = {}
    all_ids: torch.Tensor | None = None
    all_priority: torch.Tensor | None = None
    for backend in BACKENDS:
        name = f"replaybuf episodes {backend}"
        buf = per[backend] = make(
            name, prioritized=True, alpha=ALPHA, beta=BETA, eps=EPS, priority_backend=backend
        )
        assert buf.stats()["priority_backend"] == backend
        # Every valid step's id, once each, through the public API; the same ids and the same
        # priorities in both buffers (identical fills, the same generator).
        start = time.perf_counter()
        gen = torch.Generator().manual_seed(2)
        ids, values = [], []
        for batch in buf.iterate_epochs(SET_CHUNK, n=1, shuffle=False):
            index = batch["index"]
            p = priorities(index.numel(), gen)
            assert buf.update_priorities(index, p) == index.numel()
            ids.append(index)
            values.append(p)
        seconds[f"{name} set priorities"] = time.perf_counter() - start
        ids_t, values_t = torch.cat(ids), torch.cat(values)
        if all_ids is None:
            all_ids, all_priority = ids_t, values_t
        else:
            assert torch.equal(ids_t, all_ids)
            assert torch.equal(values_t, all_priority)
    assert all_ids is not None
    assert all_priority is not None
    assert all_ids.numel() == items
    order = torch.argsort(all_ids)
    return Episodes(uniform, per, all_ids[order], all_priority[order], seconds)


# --------------------------------------------------------------------------- sections
def bench_sample_batch(t: Transitions, sizes: Sizes) -> dict[str, dict[str, Any]]:
    workloads: dict[str, Callable[[], Any]] = {}
    for kind in KINDS:
        workloads[f"replaybuf {kind} uniform"] = lambda b=t.uniform[kind]: b.sample_batch(BATCH)
        for backend in BACKENDS:
            workloads[f"replaybuf {kind} {backend}"] = lambda b=t.per[kind, backend]: (
                b.sample_batch(BATCH)
            )
        workloads[f"torchrl {kind} PER"] = t.torchrl_per[kind].sample
        workloads[f"torchrl {kind} uniform"] = t.torchrl_uniform[kind].sample
    return interleaved(workloads, sizes.sample_calls, sizes.repeats)


def bench_sample_n_step(e: Episodes, sizes: Sizes) -> dict[str, dict[str, Any]]:
    workloads: dict[str, Callable[[], Any]] = {
        "replaybuf episodes uniform": lambda: e.uniform.sample_n_step(BATCH, N_STEP, GAMMA)
    }
    for backend in BACKENDS:
        workloads[f"replaybuf episodes {backend}"] = lambda b=e.per[backend]: b.sample_n_step(
            BATCH, N_STEP, GAMMA
        )
    return interleaved(workloads, sizes.sample_calls, sizes.repeats)


def cycler(calls: list[tuple[torch.Tensor, torch.Tensor]], update: Callable) -> Callable:
    """One ``update(index, priority)`` per call, cycling through pre-made pairs."""
    state = {"i": 0}

    def step() -> Any:
        i = state["i"]
        state["i"] = i + 1
        index, priority = calls[i % len(calls)]
        return update(index, priority)

    return step


def bench_updates(t: Transitions, e: Episodes, sizes: Sizes) -> dict[str, dict[str, Any]]:
    gen = torch.Generator().manual_seed(3)
    fresh = [priorities(BATCH, gen) for _ in range(UPDATE_BATCHES)]

    def pairs(sample: Callable[[], TensorDict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(sample()["index"], fresh[i]) for i in range(UPDATE_BATCHES)]

    workloads: dict[str, Callable[[], Any]] = {}
    for backend in BACKENDS:
        buf = t.per["memmap", backend]
        workloads[f"replaybuf memmap {backend}"] = cycler(
            pairs(lambda b=buf: b.sample_batch(BATCH)), buf.update_priorities
        )
    for backend in BACKENDS:
        ebuf = e.per[backend]
        workloads[f"replaybuf episodes {backend}"] = cycler(
            pairs(lambda b=ebuf: b.sample_n_step(BATCH, N_STEP, GAMMA)), ebuf.update_priorities
        )
    for kind in KINDS:
        rb = t.torchrl_per[kind]
        workloads[f"torchrl {kind} PER"] = cycler(pairs(rb.sample), rb.update_priority)
    return interleaved(workloads, sizes.update_calls, sizes.repeats)


def lifts(t: Transitions, e: Episodes, batches: int = 40) -> dict[str, dict[str, float]]:
    """Mean priority of sampled items / mean priority, observed against p^alpha's prediction."""
    out: dict[str, dict[str, float]] = {}

    def observe(name: str, sample: Callable[[], TensorDict], lookup: Callable, p: torch.Tensor):
        got = torch.cat([lookup(sample()["index"]) for _ in range(batches)])
        out[name] = {"observed": observed_lift(got, p), "expected": expected_lift(p)}

    assert t.priority is not None
    for (kind, backend), buf in t.per.items():
        observe(
            f"replaybuf {kind} {backend} sample_batch",
            lambda b=buf: b.sample_batch(BATCH),
            lambda i: t.priority[i],
            t.priority,
        )
    for kind, rb in t.torchrl_per.items():
        observe(f"torchrl {kind} PER sample", rb.sample, lambda i: t.priority[i], t.priority)
    for backend, ebuf in e.per.items():
        observe(
            f"replaybuf episodes {backend} sample_n_step",
            lambda b=ebuf: b.sample_n_step(BATCH, N_STEP, GAMMA),
            e.priority_of,
            e.priority,
        )
    return out


# --------------------------------------------------------------------------- report
def micros(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs"


def build_rows(
    batch: dict[str, Any], nstep: dict[str, Any], updates: dict[str, Any]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(
        workload: str,
        name: str,
        seconds: dict[str, Any],
        uniform: dict[str, Any] | None = None,
        torchrl: dict[str, Any] | None = None,
        target: bool = False,
    ) -> None:
        x_uniform = None if uniform is None else seconds["median"] / uniform["median"]
        x_torchrl = None if torchrl is None else seconds["median"] / torchrl["median"]
        ok = None if not target or x_uniform is None else x_uniform <= TARGET
        rows.append(
            {
                "workload": workload,
                "implementation": name,
                "median_us": seconds["median"] * 1e6,
                "x_uniform": x_uniform,
                "x_torchrl": x_torchrl,
                "target": f"<= {TARGET:g}x uniform" if target else "-",
                "pass": ok,
                "seconds": seconds,
            }
        )

    work = f"sample_batch({BATCH})"
    for kind in KINDS:
        uniform = batch[f"replaybuf {kind} uniform"]
        add(work, f"replaybuf {kind} uniform", uniform, torchrl=batch[f"torchrl {kind} uniform"])
        for backend in BACKENDS:
            add(
                work,
                f"replaybuf {kind} PER {backend}",
                batch[f"replaybuf {kind} {backend}"],
                uniform,
                batch[f"torchrl {kind} PER"],
                target=True,
            )
        add(
            work,
            f"torchrl {kind} TensorDictPrioritizedRB",
            batch[f"torchrl {kind} PER"],
            batch[f"torchrl {kind} uniform"],
        )
        add(work, f"torchrl {kind} TensorDictReplayBuffer", batch[f"torchrl {kind} uniform"])
    work = f"sample_n_step({BATCH}, n={N_STEP})"
    uniform = nstep["replaybuf episodes uniform"]
    add(work, "replaybuf episodes uniform", uniform)
    for backend in BACKENDS:
        add(
            work,
            f"replaybuf episodes PER {backend}",
            nstep[f"replaybuf episodes {backend}"],
            uniform,
            target=True,
        )
    work = f"update_priorities({BATCH})"
    for backend in BACKENDS:
        add(
            work,
            f"replaybuf memmap PER {backend}",
            updates[f"replaybuf memmap {backend}"],
            torchrl=updates["torchrl memmap PER"],
        )
    for backend in BACKENDS:
        add(
            work,
            f"replaybuf episodes PER {backend}",
            updates[f"replaybuf episodes {backend}"],
            torchrl=updates["torchrl memmap PER"],
        )
    for kind in KINDS:
        add(work, f"torchrl {kind} update_priority", updates[f"torchrl {kind} PER"])
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "workload",
        "implementation",
        "median",
        "x uniform",
        "x torchrl",
        "target",
        "pass/fail",
    )
    cells = [header]
    last = None
    for r in rows:
        if last is not None and r["workload"] != last:
            cells.append(("",) * len(header))
        last = r["workload"]
        verdict = "-" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        cells.append(
            (
                r["workload"],
                r["implementation"],
                micros(r["median_us"] / 1e6),
                "-" if r["x_uniform"] is None else f"{r['x_uniform']:.2f}x",
                "-" if r["x_torchrl"] is None else f"{r['x_torchrl']:.2f}x",
                r["target"],
                verdict,
            )
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    right = {2, 3, 4}
    lines = []
    for n, c in enumerate(cells):
        parts = [
            v.rjust(w) if i in right else v.ljust(w)
            for i, (v, w) in enumerate(zip(c, widths, strict=True))
        ]
        lines.append(" | ".join(parts).rstrip() if any(c) else "")
        if n == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------- profiles
def profile_text(fn: Callable[[], Any], calls: int, top: int = 14) -> str:
    fn()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def profiles(t: Transitions, e: Episodes, sizes: Sizes) -> str:
    calls = sizes.profile_calls
    parts = []
    for backend in BACKENDS:
        buf = t.per["memmap", backend]
        parts.append(f"== cProfile: memmap PER {backend} sample_batch({BATCH}) x {calls} ==")
        parts.append(profile_text(lambda b=buf: b.sample_batch(BATCH), calls))
    for backend in BACKENDS:
        ebuf = e.per[backend]
        parts.append(
            f"== cProfile: episodes PER {backend} sample_n_step({BATCH}, n={N_STEP}) x {calls} =="
        )
        parts.append(profile_text(lambda b=ebuf: b.sample_n_step(BATCH, N_STEP, GAMMA), calls))
    return "\n".join(parts)


# --------------------------------------------------------------------------- main
def measure(sizes: Sizes, scratch: Path, profile: bool) -> dict[str, Any]:
    phases: dict[str, float] = {}

    def done(phase: str, start: float) -> None:
        phases[phase] = time.perf_counter() - start
        print(f"  {phase}: {phases[phase]:.1f} s", flush=True)

    start = time.perf_counter()
    t = fill_transitions(sizes, scratch)
    done(f"fill {sizes.items:,} transitions x 8 buffers + priorities", start)
    try:
        start = time.perf_counter()
        e = fill_episodes(sizes, scratch)
        done(f"fill {sizes.items:,} steps x 3 episode buffers + priorities", start)
        try:
            start = time.perf_counter()
            batch = bench_sample_batch(t, sizes)
            done("sample_batch", start)
            start = time.perf_counter()
            nstep = bench_sample_n_step(e, sizes)
            done("sample_n_step", start)
            start = time.perf_counter()
            lift = lifts(t, e)  # before the updates change priorities
            done("lift check", start)
            start = time.perf_counter()
            updates = bench_updates(t, e, sizes)
            done("update_priorities", start)
            profile_out = profiles(t, e, sizes) if profile else None
            fills = {**t.fill_seconds, **e.fill_seconds}
        finally:
            e.close()
    finally:
        t.close()
    return {
        "sample_batch": batch,
        "sample_n_step": nstep,
        "update_priorities": updates,
        "lift": lift,
        "fill_seconds": fills,
        "phase_seconds": phases,
        "profile": profile_out,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100,000 items (< 1 minute)")
    parser.add_argument("--profile", action="store_true", help="print cProfile top entries")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args(argv)

    reason = segment_tree_unavailable_reason()
    if reason:
        print(f"bench_priority needs both backends: {reason}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    torch.manual_seed(0)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    sizes = QUICK if args.quick else FULL
    began = time.perf_counter()
    print(f"bench_priority: {asdict(sizes)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_priority-") as tmp:
        scratch = Path(tmp)
        result = measure(sizes, scratch, args.profile)
        leftovers = sorted(p.name for p in scratch.iterdir())  # every buffer closed: none
    wall = time.perf_counter() - began
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    rows = build_rows(result["sample_batch"], result["sample_n_step"], result["update_priorities"])
    print(
        f"bench_priority ({'quick' if args.quick else 'full'}): {sizes.items:,} stored items, "
        f"batch {BATCH}, alpha {ALPHA}, beta {BETA}, torch {torch.__version__}, "
        f"torchrl {torchrl.__version__}, 1 thread, medians of {sizes.repeats} interleaved runs"
    )
    why_numpy = kernels_unavailable_reason()
    print(f'the "torch" backend runs: {"numba" if why_numpy is None else f"numpy ({why_numpy})"}')
    print(format_table(rows))
    for note in NOTES:
        print(f"note: {note}")
    print("lift (mean sampled priority / mean priority; expected from p^alpha):")
    for name, lift in result["lift"].items():
        print(f"  {name:<52} {lift['observed']:.3f} (expected {lift['expected']:.3f})")
    if leftovers:
        print(f"WARNING: files left in the scratch folder after close(): {leftovers}")
    print(f"peak RSS {peak_rss / 2**30:.2f} GiB, total {wall:.0f} s")
    if result["profile"]:
        print(result["profile"])

    document = {
        "benchmark": "bench_priority",
        "config": {
            **asdict(sizes),
            "quick": args.quick,
            "batch": BATCH,
            "n": N_STEP,
            "gamma": GAMMA,
            "episode_len": EP_LEN,
            "alpha": ALPHA,
            "beta": BETA,
            "eps": EPS,
            "priority_sigma": PRIORITY_SIGMA,
            "target": TARGET,
            "threads": torch.get_num_threads(),
        },
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "torchrl": torchrl.__version__,
            "tensordict": tensordict.__version__,
            "replaybuf": replaybuf.__version__,
        },
        "torch_backend_kernels": "numba" if kernels_unavailable_reason() is None else "numpy",
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "rows": rows,
        "targets_pass": all(r["pass"] for r in rows if r["pass"] is not None),
        "lift": result["lift"],
        "notes": NOTES,
        "fill_seconds": result["fill_seconds"],
        "phase_seconds": result["phase_seconds"],
        "scratch_leftovers": leftovers,
        "peak_rss_bytes": peak_rss,
        "wall_seconds": wall,
        "profile": result["profile"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
