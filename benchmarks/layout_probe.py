"""Why W1 sampling cannot stay within 1.3x from 10^4 to 10^7 stored steps with one column per field.

The suite's scaling target asks for ``sample(256)`` to cost within 1.3x at every stored size.
Past the last-level cache every sampled row is a trip to DRAM, and with one tensor per field
(TorchRL's layout, and the floor's) a W1 transition lies on ~5 cache lines: obs f32[17] is 68
bytes (always two lines), action f32[6] 24 bytes (two lines a quarter of the time), reward and
done one each. This probe times, at each stored size, in one process and round-robin:

* ``floor``: ``randint`` + ``index_select`` per field (the suite's floor);
* ``columns``: ``np.take`` per field, the gather replaybuf's ``sample_batch`` makes;
* ``lines only``: a compiled loop that loads one byte of each cache line a batch's rows lie
  on, and nothing else (numba; left out without it): the memory cost alone, with every load
  independent so the core keeps as many misses in flight as it can;
* ``packed rows``: the same fields interleaved in one 104-byte row per transition (two cache
  lines), one ``np.take`` of the rows, then one copy per field out of the gathered rows.

It prints each row's median per size and its max/min ratio, and writes JSON. Not part of the
suite: it does not time replaybuf itself, it measures what any layout of these fields costs.

    python benchmarks/layout_probe.py            # 10^4 .. 10^7 (about 2 GB of RAM, ~1 min)
    python benchmarks/layout_probe.py --quick    # 10^4 and 10^6
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, Workload, interleaved, machine, now, text_table, versions

from replaybuf.storage.hugepages import advise_huge_pages

BATCH = 256
# W1's fields: name, per-row shape, dtype.
FIELDS: list[tuple[str, tuple[int, ...], torch.dtype]] = [
    ("obs", (17,), torch.float32),
    ("action", (6,), torch.float32),
    ("reward", (), torch.float32),
    ("done", (), torch.bool),
]
LINE = 64  # bytes per cache line


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def packed_offsets() -> tuple[list[int], int]:
    """Each field's byte offset in a packed row (aligned to its item size), and the row size
    rounded up to 8 bytes (so that every row starts aligned for every field)."""
    offsets, at = [], 0
    for _, shape, dtype in FIELDS:
        at = -(-at // dtype.itemsize) * dtype.itemsize
        offsets.append(at)
        at += _nbytes(shape, dtype)
    return offsets, -(-at // 8) * 8


def _huge(tensor: torch.Tensor) -> torch.Tensor:
    """Advised huge pages, then written (faulted in), as replaybuf's CPU tensor columns are."""
    advise_huge_pages(tensor)
    tensor.view(torch.uint8).view(-1).fill_(1)
    return tensor


@functools.cache
def _line_toucher() -> Callable[..., int] | None:
    """A compiled loop loading one byte of every cache line the sampled rows lie on."""
    try:
        import numba
    except ImportError:
        return None

    @numba.njit(nogil=True, cache=False)
    def touch(at: np.ndarray, columns: tuple, row_bytes: np.ndarray) -> int:  # pragma: no cover
        acc = 0
        for k in range(len(columns)):  # columns: byte views, all of one type
            column, size = columns[k], row_bytes[k]
            for i in range(at.shape[0]):
                first = at[i] * size
                line = first - first % LINE
                while line < first + size:
                    acc ^= column[line]
                    line += LINE
        return acc

    return touch


def workloads(size: int, generator: torch.Generator, calls: int) -> dict[str, Workload]:
    """The probe's gathers of ``BATCH`` random rows out of ``size`` stored rows."""
    columns = [_huge(torch.empty((size, *shape), dtype=dtype)) for _, shape, dtype in FIELDS]
    views = [c.numpy() for c in columns]
    offsets, row = packed_offsets()
    packed = _huge(torch.empty((size, row), dtype=torch.uint8)).numpy()
    spans = [
        (o, o + _nbytes(shape, dtype), dtype, shape)
        for o, (_, shape, dtype) in zip(offsets, FIELDS, strict=True)
    ]
    np_dtypes = [torch.empty(0, dtype=dtype).numpy().dtype for _, _, dtype in FIELDS]

    def draw() -> torch.Tensor:
        return torch.randint(0, size, (BATCH,), generator=generator)

    def floor() -> list[torch.Tensor]:
        at = draw()
        return [torch.index_select(c, 0, at) for c in columns]

    def take_columns() -> list[torch.Tensor]:
        at = draw().numpy()
        return [torch.from_numpy(v.take(at, axis=0)) for v in views]

    def take_packed() -> list[torch.Tensor]:
        rows = packed.take(draw().numpy(), axis=0)  # [BATCH, row]: one gather
        return [
            torch.from_numpy(np.ascontiguousarray(rows[:, a:b]).view(dt).reshape(BATCH, *shape))
            for (a, b, _, shape), dt in zip(spans, np_dtypes, strict=True)
        ]

    out = {
        "floor": Workload(floor, calls),
        "columns": Workload(take_columns, calls),
        "packed rows": Workload(take_packed, calls),
    }
    touch = _line_toucher()
    if touch is not None:
        flat = tuple(v.reshape(-1).view(np.uint8) for v in views)
        sizes = np.array([_nbytes(s, d) for _, s, d in FIELDS], dtype=np.int64)
        out["lines only"] = Workload(lambda: touch(draw().numpy(), flat, sizes), calls)
    return out


def lines_per_row() -> dict[str, float]:
    """Cache lines one random row touches, on average (columns), and exactly (packed rows)."""
    per_field = []
    for _, shape, dtype in FIELDS:
        n = _nbytes(shape, dtype)
        starts = [(i * n) % LINE for i in range(LINE)]  # row offsets repeat within 64 rows
        per_field.append(sum((s + n - 1) // LINE + 1 for s in starts) / LINE)
    _, row = packed_offsets()
    return {"columns": sum(per_field), "packed rows": (row + LINE - 1) // LINE}


def run(sizes: list[int], repeats: int, calls: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    points: dict[int, dict[str, Any]] = {}
    for size in sizes:
        print(f"  {size:,} stored rows", file=sys.stderr, flush=True)
        points[size] = interleaved(workloads(size, generator, calls), repeats)
    return {"sizes": sizes, "points": points, "lines_per_row": lines_per_row()}


def table(result: dict[str, Any]) -> str:
    sizes = result["sizes"]
    names = list(result["points"][sizes[0]])
    cells = []
    for name in names:
        med = [result["points"][s][name]["median"] * 1e6 for s in sizes]
        cells.append((name, *(f"{m:.1f}" for m in med), f"{max(med) / min(med):.2f}x"))
    header = ("sample(256) µs", *(f"{s:,}" for s in sizes), "max/min")
    lines = result["lines_per_row"]
    note = (
        f"cache lines per sampled row: {lines['columns']:.2f} (columns), "
        f"{lines['packed rows']} (packed rows)"
    )
    return text_table(header, cells, markdown=False) + "\n" + note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10^4 and 10^6 only")
    parser.add_argument("--json", type=Path, default=None, help="where to write the JSON")
    args = parser.parse_args(argv)
    sizes = [10_000, 1_000_000] if args.quick else [10_000, 100_000, 1_000_000, 10_000_000]
    result = run(sizes, repeats=7 if args.quick else 15, calls=200)
    result.update({"date": now(), "machine": machine(), "versions": versions()})
    print(table(result))
    default = REPO / "benchmarks" / "results" / "layout_probe.json"
    path = args.json or default
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"JSON: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
