"""Reset benchmark: ``ReplayBuffer.reset()`` of a full buffer in a process that holds many Python
objects.

A reset used to run ``gc.collect()`` (as ObjectRL's did), whose cost grows with every object
the process holds, not with the buffer: a trainer holding a gigabyte of Python objects paid
for a full collection at each reset. Now a reset only frees the old storage (its columns, and
memmap files with their folder) and makes an empty one; the collector runs only if creating
storage raises ``OSError``.

One run fills a ``ReplayBuffer`` of ``--rows`` transitions (1,000,000 by default: obs f32[17],
action f32[6], reward f32, done bool, ~100 MB) in memmap and in tensor storage, while the
process holds ``--objects`` small tuples (15,000,000 by default, about 1.1 GB of Python
objects), then times (median of ``--repeats``, wall clock, ms):

* ``reset()``, refilling the buffer between repeats (outside the timing);
* ``gc.collect()`` alone, in the same process: what each reset cost before.

* the background removal of the old memmap folder that each memmap reset hands off
  (``replaybuf.storage.scratch.drain()`` right after the reset: the kernel unlinking and
  unmapping ~100 MB of freshly written file pages, which ``reset()`` no longer waits for).

Prints a table (median and min-max); exits 1 if either reset's median is not under
``--limit-ms`` (50 by default). A memmap reset's time includes whatever the background removal
of the previous folder, running meanwhile, takes from it (the GIL, a core).
Not part of the Makefile's ``BENCHES`` (it needs ~1.5 GB of RAM and a minute to build the
objects); run it directly::

    python benchmarks/bench_reset.py [--rows N] [--objects K] [--repeats R] [--limit-ms MS]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from replaybuf import ReplayBuffer
from replaybuf.storage import scratch


def _fill(buf: ReplayBuffer, rows: int) -> None:
    chunk = 100_000
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        buf.add_batch(
            {
                "obs": torch.randn(n, 17),
                "action": torch.randn(n, 6),
                "reward": torch.randn(n),
                "done": torch.zeros(n, dtype=torch.bool),
            }
        )


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--objects", type=int, default=15_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--limit-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    start = time.perf_counter()
    held = [(i, str(i)) for i in range(args.objects)]  # tracked containers the collector walks
    print(
        f"holding {len(held):,} tuples (built in {time.perf_counter() - start:.1f} s), "
        f"{gc.get_count()} gc counts"
    )

    collect = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        gc.collect()
        collect.append(time.perf_counter() - start)

    results, removal = {}, []
    for storage in ("memmap", "tensor"):
        with ReplayBuffer("cpu", "cpu", args.rows, storage=storage, seed=0) as buf:
            times = []
            for _ in range(args.repeats):
                _fill(buf, args.rows)
                start = time.perf_counter()
                buf.reset()
                times.append(time.perf_counter() - start)
                start = time.perf_counter()
                scratch.drain()
                if storage == "memmap":
                    removal.append(time.perf_counter() - start)
            results[storage] = times

    def row(name: str, samples: list[float]) -> None:
        spread = f"{min(samples) * 1e3:.2f}-{max(samples) * 1e3:.2f}"
        print(f"{name:<48} {_median_ms(samples):>10.2f} {spread:>16}")

    print(f"\n{'operation':<48} {'median ms':>10} {'min-max ms':>16}")
    for storage, samples in results.items():
        row(f"reset(), {storage} storage, {args.rows:,} rows", samples)
    row("memmap folder removal, in the background", removal)
    row("gc.collect() (what reset ran before)", collect)
    slow = {
        k: round(_median_ms(v), 2) for k, v in results.items() if _median_ms(v) >= args.limit_ms
    }
    if slow:
        print(f"FAILED: reset over {args.limit_ms} ms: {slow}")
        return 1
    print(f"OK: memmap and tensor resets are under {args.limit_ms} ms")
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
