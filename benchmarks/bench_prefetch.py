"""``prefetch=k``: learner steps per second with and without batches drawn ahead on a thread.

A training loop takes a batch of 256 Atari-sized frames (uint8 ``[4, 84, 84]``, memmap storage)
from ``ReplayBuffer.as_dataset(256)`` and runs a learner step that
lasts about as long as one ``sample_batch(B)`` (measured first). Without prefetch the loop pays
sample + step; with ``prefetch=2`` the draw overlaps the step, so the ceiling is 2x.

Two learner steps, each timed on its own:

* ``sleep``: ``time.sleep(t_sample)``. The headline: it stands for a GPU learner, whose host
  thread mostly waits for kernels, holding neither the GIL nor a core. It isolates what the
  prefetcher itself delivers (overlap minus hand-over cost) from core contention.
* ``matmul``: a single-threaded float32 matmul sized to last ``t_sample``. A CPU learner: torch
  releases the GIL inside the op, but the draw and the step now need two free cores at once,
  so on a small or shared machine the gain is lower (reported as measured, not tuned).

torch runs single-threaded (``torch.set_num_threads(1)``) so that each thread uses one core.
Repeats alternate the two loops; each reports steps per second, and the table gives the
median with the min-max spread. Writes ``benchmarks/results/bench_prefetch.json``.

    python benchmarks/bench_prefetch.py            # 7 repeats of 300 steps
    python benchmarks/bench_prefetch.py --quick    # 5 repeats of 60 steps
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, now, text_table, versions

from replaybuf import ReplayBuffer

# Atari-sized frames (4 stacked 84x84 uint8, 28 KiB a row): a draw long enough (milliseconds)
# that the thread hand-over (tens of microseconds) does not dominate.
CAPACITY, FRAME, BATCH, DEPTH = 20_000, (4, 84, 84), 256, 2
RESULTS = Path(__file__).resolve().parent / "results" / "bench_prefetch.json"


def filled(scratch: str, capacity: int) -> ReplayBuffer:
    buf = ReplayBuffer("cpu", "cpu", capacity, storage="memmap", scratch_dir=scratch, seed=0)
    g = torch.Generator().manual_seed(0)
    for start in range(0, capacity, 2_000):
        n = min(2_000, capacity - start)
        buf.add_batch(
            {
                "obs": torch.randint(0, 256, (n, *FRAME), generator=g, dtype=torch.uint8),
                "action": torch.randint(0, 6, (n,), generator=g),
                "reward": torch.randn(n, generator=g),
                "done": torch.zeros(n, dtype=torch.bool),
            }
        )
    return buf


def median_time(fn: Callable[[], Any], repeats: int = 60) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def matmul_step(target: float) -> tuple[Callable[[], Any], int]:
    """A single-threaded matmul step lasting about ``target`` seconds, and its size."""
    size = 64
    while True:
        a = torch.randn(size, size)
        took = median_time(lambda a=a: a @ a, 20)
        if took >= target or size >= 4096:
            break
        size = int(size * min(2.0, max(1.05, (target / took) ** (1 / 3))))
    a = torch.randn(size, size)
    return (lambda: a @ a), size


def steps_per_second(buf: ReplayBuffer, step: Callable[[], Any], prefetch: int, n: int) -> float:
    batches = iter(buf.as_dataset(BATCH, prefetch=prefetch))
    try:
        for _ in itertools.islice(batches, 5):  # warm up (and fill the prefetch queue)
            step()
        start = time.perf_counter()
        for batch in itertools.islice(batches, n):
            batch["reward"].sum()  # the learner reads its batch
            step()
        return n / (time.perf_counter() - start)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": values,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats of 60 steps")
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    repeats, n = (5, 60) if args.quick else (7, 300)
    capacity = 5_000 if args.quick else CAPACITY
    with tempfile.TemporaryDirectory() as scratch, filled(scratch, capacity) as buf:
        t_sample = median_time(lambda: buf.sample_batch(BATCH))
        matmul, size = matmul_step(t_sample)
        steps = {
            "sleep": lambda: time.sleep(t_sample),
            "matmul": matmul,
        }
        t_step = {name: median_time(fn, 30) for name, fn in steps.items()}
        results: dict[str, Any] = {}
        for name, step in steps.items():
            plain, ahead, ratio = [], [], []
            for _ in range(repeats):  # alternate, so drifts of a shared machine hit both
                p = steps_per_second(buf, step, 0, n)
                a = steps_per_second(buf, step, DEPTH, n)
                plain.append(p)
                ahead.append(a)
                ratio.append(a / p)
            results[name] = {
                "step_seconds": t_step[name],
                "plain_steps_per_s": spread(plain),
                "prefetch_steps_per_s": spread(ahead),
                "speedup": spread(ratio),
            }
    report = {
        "date": now(),
        "machine": machine(),
        "versions": versions(),
        "config": {
            "capacity": capacity,
            "frame": list(FRAME),
            "batch": BATCH,
            "prefetch": DEPTH,
            "steps": n,
            "repeats": repeats,
            "torch_threads": 1,
            "sample_seconds": t_sample,
            "matmul_size": size,
        },
        "results": results,
    }
    if not args.quick:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    rows = []
    for name, r in results.items():

        def cell(s: dict[str, float]) -> str:
            return f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f})"

        rows.append(
            (
                name,
                f"{r['step_seconds'] * 1e3:.2f} ms",
                cell(r["plain_steps_per_s"]),
                cell(r["prefetch_steps_per_s"]),
                f"{r['speedup']['median']:.2f}x "
                f"({r['speedup']['min']:.2f}-{r['speedup']['max']:.2f})",
            )
        )
    print(
        f"sample_batch({BATCH}) of {capacity:,} memmap transitions: {t_sample * 1e3:.2f} ms; "
        f"prefetch={DEPTH}, {repeats} repeats of {n} steps, median (min-max)"
    )
    print(
        text_table(
            ("learner step", "step", "steps/s plain", "steps/s prefetch", "speedup"), rows, False
        )
    )


if __name__ == "__main__":
    main()
