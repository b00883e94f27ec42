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

Prints a table; exits 1 if the tensor-storage reset's median is not under ``--limit-ms`` (50 by
default). The memmap reset is reported, not checked: it is the kernel unlinking and unmapping
~100 MB of freshly written file pages (27 ms on a quiet 2-core VM, up to ~200 ms on a busy
one), which no Python-side change makes cheaper and which does not grow with the objects held.
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

    results = {}
    for storage in ("memmap", "tensor"):
        with ReplayBuffer("cpu", "cpu", args.rows, storage=storage, seed=0) as buf:
            times = []
            for _ in range(args.repeats):
                _fill(buf, args.rows)
                start = time.perf_counter()
                buf.reset()
                times.append(time.perf_counter() - start)
            results[storage] = _median_ms(times)

    print(f"\n{'operation':<40} {'median ms':>10}")
    for storage, ms in results.items():
        print(f"{'reset(), ' + storage + f' storage, {args.rows:,} rows':<40} {ms:>10.2f}")
    print(f"{'gc.collect() (what reset ran before)':<40} {_median_ms(collect):>10.2f}")
    slow = {k: v for k, v in results.items() if k == "tensor" and v >= args.limit_ms}
    if slow:
        print(f"FAILED: reset over {args.limit_ms} ms: {slow}")
        return 1
    print(f"OK: the tensor-storage reset is under {args.limit_ms} ms")
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
