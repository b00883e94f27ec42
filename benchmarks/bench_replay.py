"""Transition buffer benchmark: replaybuf's ReplayBuffer beside raw TorchRL and raw tensors.

One run times, single-threaded (``torch.set_num_threads(1)``), each number the median over
repeats, with transitions of obs f32[17], action f32[6], reward f32 and done bool:

1. ``sample_batch(256)`` from a full buffer of ``--size`` transitions (1,000,000 by default);
2. ``add_batch`` of 1,000-row chunks into that full buffer (the writer wraps: steady state);
3. one shuffled epoch in batches of 256 over every stored transition.

Each operation runs on replaybuf's ``ReplayBuffer`` (memmap and tensor storage), on a plain
``torchrl.data.TensorDictReplayBuffer`` with the same storage (``rb.sample(256)``,
``rb.extend(chunk)``, and an epoch by iterating a buffer with ``SamplerWithoutReplacement``
over the same storage), and on the floor: preallocated tensors indexed with ``torch.randint``
(or ``torch.randperm`` for the epoch) and ``index_select`` per field, written with ``copy_``.
Memmap storages live in a temporary folder on disk that is removed at the end.

Prints one table (time per operation and the ratio to the floor) and writes
``benchmarks/results/bench_replay.json``.

    python benchmarks/bench_replay.py           # full run (about a minute)
    python benchmarks/bench_replay.py --quick   # small sizes (< 30 s)
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import tensordict
import torch
import torchrl
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    SamplerWithoutReplacement,
    TensorDictReplayBuffer,
)

import replaybuf
from replaybuf import ReplayBuffer

OBS, ACT = 17, 6
BATCH = 256
CHUNK = 1_000
FIELDS = {"obs": (OBS,), "action": (ACT,), "reward": (), "done": ()}
RESULTS = Path(__file__).resolve().parent / "results" / "bench_replay.json"
FLOOR = "raw tensors (floor)"


def make_rows(count: int, generator: torch.Generator) -> TensorDict:
    return TensorDict(
        {
            "obs": torch.randn(count, OBS, generator=generator),
            "action": torch.rand(count, ACT, generator=generator) * 2 - 1,
            "reward": torch.randn(count, generator=generator),
            "done": torch.rand(count, generator=generator) < 0.001,
        },
        batch_size=[count],
    )


def median_seconds(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of one call, measured over ``calls`` calls."""
    fn()  # warm up: first-touch page faults, lazy allocations, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


class RawTensors:
    """The floor: preallocated tensors, a cursor, and index_select per field."""

    def __init__(self, size: int, generator: torch.Generator) -> None:
        self.size = size
        self.columns = {
            key: torch.empty((size, *shape), dtype=torch.bool if key == "done" else torch.float32)
            for key, shape in FIELDS.items()
        }
        self.cursor = 0
        self.generator = generator

    def extend(self, chunk: TensorDict) -> None:
        rows = chunk.shape[0]
        end = self.cursor + rows
        if end <= self.size:
            for key, column in self.columns.items():
                column[self.cursor : end].copy_(chunk[key])
        else:  # wraps: two slices
            head = self.size - self.cursor
            for key, column in self.columns.items():
                column[self.cursor :].copy_(chunk[key][:head])
                column[: rows - head].copy_(chunk[key][head:])
        self.cursor = end % self.size

    def gather(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {key: torch.index_select(col, 0, idx) for key, col in self.columns.items()}

    def sample(self, batch: int) -> dict[str, torch.Tensor]:
        return self.gather(torch.randint(0, self.size, (batch,), generator=self.generator))

    def epoch(self, batch: int) -> int:
        order = torch.randperm(self.size, generator=self.generator)
        rows = 0
        for start in range(0, self.size, batch):
            rows += self.gather(order[start : start + batch])["obs"].shape[0]
        return rows


def fill(extend: Callable[[TensorDict], None], size: int, generator: torch.Generator) -> None:
    step = min(size, 50_000)
    for start in range(0, size, step):
        extend(make_rows(min(step, size - start), generator))


def run(size: int, repeats: int, sample_calls: int, add_calls: int, epoch_repeats: int) -> dict:
    torch.set_num_threads(1)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    generator = torch.Generator().manual_seed(0)
    chunks = [make_rows(CHUNK, generator) for _ in range(8)]
    results: list[dict] = []

    def record(operation: str, implementation: str, seconds: float) -> None:
        results.append({"operation": operation, "implementation": implementation, "s": seconds})
        print(f"  {operation:<24} {implementation:<28} {fmt(seconds)}", flush=True)

    def time_all(name: str, sample, extend, epoch) -> None:
        own = [chunk.clone() for chunk in chunks]  # TorchRL's extend writes into its input
        turn = iter(range(10**9))

        def add() -> None:
            extend(own[next(turn) % len(own)])

        record(f"sample_batch({BATCH})", name, median_seconds(sample, sample_calls, repeats))
        record(f"add_batch({CHUNK} rows)", name, median_seconds(add, add_calls, repeats))
        record(f"epoch (batch {BATCH})", name, median_seconds(epoch, 1, epoch_repeats))

    def time_floor() -> None:
        raw = RawTensors(size, generator)
        fill(raw.extend, size, generator)
        time_all(FLOOR, lambda: raw.sample(BATCH), raw.extend, lambda: raw.epoch(BATCH))

    def time_replaybuf(kind: str, scratch: str) -> None:
        with ReplayBuffer("cpu", "cpu", size, storage=kind, scratch_dir=scratch, seed=0) as buf:
            fill(buf.add_batch, size, generator)
            assert len(buf) == size

            def epoch() -> int:
                return sum(b.shape[0] for b in buf.create_epoch_iterator(BATCH))

            time_all(f"replaybuf {kind}", lambda: buf.sample_batch(BATCH), buf.add_batch, epoch)

    def time_torchrl(kind: str, scratch: str) -> None:
        if kind == "memmap":
            storage = LazyMemmapStorage(size, scratch_dir=f"{scratch}/torchrl", auto_cleanup=False)
        else:
            storage = LazyTensorStorage(size)
        rb = TensorDictReplayBuffer(storage=storage)
        fill(rb.extend, size, generator)
        # An epoch: a second TorchRL buffer over the same storage, sampling without replacement.
        epochs = TensorDictReplayBuffer(
            storage=storage, sampler=SamplerWithoutReplacement(), batch_size=BATCH
        )

        def epoch() -> int:
            return sum(b.shape[0] for b in epochs)

        assert epoch() == size
        time_all(f"torchrl {kind}", lambda: rb.sample(BATCH), rb.extend, epoch)

    time_floor()
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as scratch:
        for kind in ("memmap", "tensor"):
            time_replaybuf(kind, scratch)
            time_torchrl(kind, scratch)

    floor = {r["operation"]: r["s"] for r in results if r["implementation"] == FLOOR}
    for r in results:
        r["ratio_to_floor"] = r["s"] / floor[r["operation"]]
    return {
        "benchmark": "bench_replay",
        "config": {
            "size": size,
            "batch": BATCH,
            "chunk": CHUNK,
            "repeats": repeats,
            "sample_calls": sample_calls,
            "add_calls": add_calls,
            "epoch_repeats": epoch_repeats,
            "fields": {k: list(v) for k, v in FIELDS.items()},
            "threads": torch.get_num_threads(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchrl": torchrl.__version__,
            "tensordict": tensordict.__version__,
            "replaybuf": replaybuf.__version__,
        },
        "machine": platform.platform(),
        "results": results,
    }


def fmt(seconds: float) -> str:
    return f"{seconds:8.3f} s " if seconds >= 0.01 else f"{seconds * 1e6:8.1f} µs"


def table(report: dict) -> str:
    lines = [
        f"{'operation':<24} {'implementation':<28} {'median':>11} {'x floor':>8}",
        "-" * 74,
    ]
    operations = list(dict.fromkeys(r["operation"] for r in report["results"]))
    last = None
    for r in sorted(report["results"], key=lambda r: operations.index(r["operation"])):
        if last is not None and r["operation"] != last:
            lines.append("")
        last = r["operation"]
        lines.append(
            f"{r['operation']:<24} {r['implementation']:<28} {fmt(r['s']):>11} "
            f"{r['ratio_to_floor']:8.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under 30 seconds")
    parser.add_argument("--size", type=int, default=None, help="stored transitions")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    if args.quick:
        settings = {"size": 100_000, "repeats": 5, "sample_calls": 100, "add_calls": 20}
        settings["epoch_repeats"] = 3
    else:
        settings = {"size": 1_000_000, "repeats": 7, "sample_calls": 300, "add_calls": 100}
        settings["epoch_repeats"] = 5
    if args.size is not None:
        settings["size"] = args.size
    print(f"bench_replay: {settings}", flush=True)
    report = run(**settings)
    report["config"]["quick"] = args.quick
    print()
    print(table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
