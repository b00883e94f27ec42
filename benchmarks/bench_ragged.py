"""Ragged token fields: n-step sampling and stored bytes, beside the raw floor and TorchRL.

One run, single-threaded, every number the median over interleaved repeats:

* ``sample_n_step(256, n=3)`` of a ragged token field (int64 ids, 100-300 a step, mean 200;
  1,000,000 stored tokens in 100-step episodes), as ``torch.nested`` jagged tensors of both
  window ends;
* the raw floor: the same 512 rows gathered from one flat values tensor plus offsets (window
  ends precomputed, so only the gather and the nested tensors are timed);
* TorchRL's own answer for heterogeneous data, ``LazyStackStorage`` (a Python list of
  TensorDicts, stacked lazily, not memory-mapped), holding the same steps with their 3-step
  next observation as ``MultiStepTransform`` writes it, sampled 256 at a time with both ends
  read as nested tensors.

And bytes per stored step: replaybuf's storage (arena, spans and its fixed columns), the raw
values plus an 8-byte offset, and the tensors TorchRL's list holds (its per-TensorDict Python
overhead not counted). Writes ``benchmarks/results/bench_ragged.json``.

    python benchmarks/bench_ragged.py            # full run
    python benchmarks/bench_ragged.py --quick    # 100,000 tokens
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import LazyStackStorage, ReplayBuffer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Workload, interleaved, machine, micros, nbytes, now, text_table, versions

from replaybuf import Field, SyncEpisodeReplayBuffer

BATCH, N, GAMMA, EP_LEN = 256, 3, 0.99, 100
RESULTS = Path(__file__).resolve().parent / "results" / "bench_ragged.json"


def episodes(tokens: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Episodes of ``EP_LEN`` observations (the last one final), about ``tokens`` in all."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        lengths = rng.integers(100, 301, EP_LEN + 1)
        out.append([torch.from_numpy(rng.integers(0, 50_000, n)) for n in lengths])
        total += int(lengths.sum())
    return out


def fill_replaybuf(data: list[list[torch.Tensor]], storage: str, scratch: str) -> Any:
    steps = len(data) * EP_LEN
    spec = {"observation": {"tokens": Field.ragged(torch.int64)}}
    buf = SyncEpisodeReplayBuffer(steps, spec=spec, storage=storage, scratch_dir=scratch, seed=0)
    for episode in data:
        e = buf.start_episode()
        for t, tokens in enumerate(episode[:-1]):
            buf.append_observation_action_reward(e, {"tokens": tokens}, t % 4, 1.0)
        buf.end_episode(e, "truncated", {"tokens": episode[-1]})
    return buf


class Floor:
    """The same rows gathered from flat values plus offsets: window ends precomputed."""

    def __init__(self, data: list[list[torch.Tensor]]) -> None:
        rows = [t for episode in data for t in episode]
        self.values = torch.cat(rows)
        lengths = torch.tensor([t.shape[0] for t in rows])
        self.offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=self.offsets[1:])
        starts = [e * (EP_LEN + 1) + t for e in range(len(data)) for t in range(EP_LEN)]
        self.anchors = torch.tensor(starts)
        ends = [
            e * (EP_LEN + 1) + min(t + N, EP_LEN) for e in range(len(data)) for t in range(EP_LEN)
        ]
        self.ends = torch.tensor(ends)
        self.generator = torch.Generator().manual_seed(0)

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        begin, end = self.offsets[rows], self.offsets[rows + 1]
        lengths = end - begin
        at = torch.repeat_interleave(begin - (torch.cumsum(lengths, 0) - lengths), lengths)
        values = self.values[at + torch.arange(int(lengths.sum()))]
        offsets = torch.zeros(rows.shape[0] + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return torch.nested.nested_tensor_from_jagged(values, offsets)

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        pick = torch.randint(0, self.anchors.shape[0], (BATCH,), generator=self.generator)
        return self.take(self.anchors[pick]), self.take(self.ends[pick])


def fill_torchrl(data: list[list[torch.Tensor]]) -> tuple[ReplayBuffer, int]:
    steps = len(data) * EP_LEN
    rb = ReplayBuffer(storage=LazyStackStorage(steps), batch_size=BATCH)
    held = 0
    for episode in data:
        tds = []
        for t in range(EP_LEN):
            td = TensorDict(
                {
                    "observation": episode[t],
                    "action": torch.tensor(t % 4),
                    ("next", "observation"): episode[min(t + N, EP_LEN)],
                    ("next", "reward"): torch.ones(1),
                    ("next", "done"): torch.zeros(1, dtype=torch.bool),
                    "steps_to_next_obs": torch.tensor(min(N, EP_LEN - t)),
                },
                batch_size=[],
            )
            held += sum(v.numel() * v.element_size() for v in td.values(True, True))
            tds.append(td)
        rb.extend(tds)
    return rb, held


def torchrl_sample(rb: ReplayBuffer) -> tuple[torch.Tensor, torch.Tensor]:
    batch = rb.sample()
    obs = batch.get("observation", as_nested_tensor=True, layout=torch.jagged)
    nxt = batch.get(("next", "observation"), as_nested_tensor=True, layout=torch.jagged)
    return obs, nxt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    tokens = 100_000 if args.quick else 1_000_000
    data = episodes(tokens)
    steps = len(data) * EP_LEN
    stored = sum(int(t.shape[0]) for episode in data for t in episode)
    with tempfile.TemporaryDirectory() as scratch:
        memmap = fill_replaybuf(data, "memmap", scratch)
        tensor = fill_replaybuf(data, "tensor", scratch)
        floor = Floor(data)
        rb, torchrl_bytes = fill_torchrl(data)
        for name, out in (("replaybuf", memmap.sample_n_step(8, n=N)), ("floor", floor.sample())):
            assert out is not None, name
        runs = interleaved(
            {
                "replaybuf memmap": Workload(lambda: memmap.sample_n_step(BATCH, n=N), 20),
                "replaybuf tensor": Workload(lambda: tensor.sample_n_step(BATCH, n=N), 20),
                "raw floor": Workload(floor.sample, 20),
                "TorchRL LazyStackStorage": Workload(lambda: torchrl_sample(rb), 20),
            },
            args.repeats,
        )
        column = memmap._core.slots.ragged[("observation", "tokens")]
        arena = column.nbytes - column.spans.nbytes
        sizes = {
            "replaybuf (all fields)": memmap.stats()["bytes"] / steps,
            "replaybuf tokens (arena + spans)": column.nbytes / column.rows_live,
            "raw values + 8-byte offset": (stored * 8 + 8 * (steps + len(data))) / steps,
            "TorchRL LazyStackStorage tensors": torchrl_bytes / steps,
        }
        memmap.close()
        tensor.close()
    floor_time = runs["raw floor"]["median"]
    cells = []
    for name, r in runs.items():
        spread = f"{micros(min(r['runs']))}-{micros(max(r['runs']))}"
        cells.append((name, micros(r["median"]), spread, f"{r['median'] / floor_time:.2f}x"))
    print(f"n-step batches ({BATCH}, n={N}) of ragged tokens, {stored:,} stored in {steps:,} steps")
    print(text_table(("implementation", "median/batch", "range", "vs floor"), cells, False))
    print()
    print(
        text_table(("stored bytes", "per step"), [(k, nbytes(v)) for k, v in sizes.items()], False)
    )
    print(f"arena / values: {arena / (column.live * 8):.3f}x (target: within 1.1x)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "date": now(),
                "machine": machine(),
                "versions": versions(),
                "tokens": stored,
                "steps": steps,
                "timings": runs,
                "bytes_per_step": sizes,
                "arena_over_values": arena / (column.live * 8),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
