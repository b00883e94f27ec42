"""Timing, machine description and table helpers shared by ``benchmarks/suite.py``.

Timings on a shared machine are noisy, so every comparison is made *inside one run*: the
implementations of a workload are timed round-robin (``interleaved``), each number is the
median over repeats of the mean time of a call, and the JSON keeps every repeat.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib
import importlib.metadata
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Workload:
    """One implementation of a workload: ``fn()`` is one call (a coroutine if ``is_async``)."""

    fn: Callable[[], Any] | Callable[[], Awaitable[Any]]
    calls: int  # calls per timed repeat
    items: int = 1  # items per call (steps, rows, batches): rates are items / second
    is_async: bool = False


def timing(runs: list[float], items: int = 1) -> dict[str, Any]:
    """Seconds per call: median and min over repeats, every repeat kept."""
    return {"median": statistics.median(runs), "min": min(runs), "items": items, "runs": runs}


async def _timed_async(fn: Callable[[], Awaitable[Any]], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await fn()
    return time.perf_counter() - start


def _timed(w: Workload, loop: asyncio.AbstractEventLoop | None) -> float:
    if w.is_async:
        assert loop is not None, "an async workload needs an event loop"
        return loop.run_until_complete(_timed_async(w.fn, w.calls))  # type: ignore[arg-type]
    fn = w.fn
    start = time.perf_counter()
    for _ in range(w.calls):
        fn()
    return time.perf_counter() - start


def interleaved(
    workloads: dict[str, Workload],
    repeats: int,
    loop: asyncio.AbstractEventLoop | None = None,
) -> dict[str, dict[str, Any]]:
    """Seconds per call of each workload, median over ``repeats`` round-robin repeats.

    One untimed call of each first (lazy allocation, first-touch page faults, caches). Going
    round-robin means a change of machine load hits every implementation alike, so the ratios
    between them hold even when absolute times drift. The order is shuffled each repeat (seeded,
    so runs are repeatable): a workload timed right after another pays for what that one left
    behind (measured: ~15% on a per-step insert always timed right after the floor's), so no
    implementation always follows the same one. (Rotating the order would not do: it keeps
    every workload's predecessor.)
    """
    for w in workloads.values():
        if w.is_async:
            assert loop is not None, "an async workload needs an event loop"
            loop.run_until_complete(w.fn())  # type: ignore[arg-type]
        else:
            w.fn()
    names = list(workloads)
    order = random.Random(0)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        order.shuffle(names)
        for name in names:
            w = workloads[name]
            runs[name].append(_timed(w, loop) / w.calls)
    return {name: timing(r, workloads[name].items) for name, r in runs.items()}


def traced_bytes(build: Callable[[], Any]) -> tuple[Any, int]:
    """``build()`` and the bytes it allocated that are still held after it (tracemalloc).

    For peers whose storage is opaque (cpprb's Cython buffers, tianshou's Batch): NumPy
    reports its array allocations to tracemalloc, so this counts what their arrays hold.
    """
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    try:
        result = build()
        return result, tracemalloc.get_traced_memory()[0] - before
    finally:
        if not was_tracing:
            tracemalloc.stop()


def rss_bytes() -> int:
    """Resident set size of this process now (Linux), for peers whose storage is opaque."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, OS and the load average now."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "memory_bytes": memory_total(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "load_average": list(os.getloadavg()),
    }


PACKAGES = (
    "torch",
    "torchrl",
    "tensordict",
    "numpy",
    "replaybuf",
    "cpprb",
    "stable_baselines3",
    "gymnasium",
    "tianshou",
    "matplotlib",
)


def versions() -> dict[str, Any]:
    """Versions of everything measured (None where a peer is not installed) and the commit."""
    found: dict[str, Any] = {}
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
        except Exception:  # not installed, or broken: the suite skips it
            found[name] = None
            continue
        version = getattr(module, "__version__", None)
        if version is None:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                version = "?"
        found[name] = version
    found["git_commit"] = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    found["git_dirty"] = None if status is None else bool(status)
    return found


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# --------------------------------------------------------------------------- formatting
def micros(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    us = seconds * 1e6
    return f"{us:,.0f} µs" if us >= 100 else f"{us:,.1f} µs"


def secs(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s"


def rate(seconds_per_item: float | None) -> str:
    if seconds_per_item is None:
        return "-"
    per_second = 1 / seconds_per_item
    if per_second >= 1e6:
        return f"{per_second / 1e6:.2f} M/s"
    return f"{per_second / 1e3:,.1f} k/s"


def nbytes(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1e3:,.1f} KB" if value >= 1e4 else f"{value:,.0f} B"


def text_table(header: tuple[str, ...], cells: list[tuple[str, ...]], markdown: bool) -> str:
    """A plain text table (columns padded, ' | ' separated), or a Markdown one."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(lines)
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
    lines = []
    for n, c in enumerate([header, *cells]):
        lines.append(" | ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())
        if n == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)
