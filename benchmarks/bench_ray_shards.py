"""The sharded Ray buffer beside the single buffer actor and the in-process buffer, in one run.

On a local Ray cluster (``ray.init(num_cpus=2)``) builds, side by side, an in-process
``EpisodeReplayBuffer``, one ``RemoteEpisodeReplayBuffer`` actor and
``ShardedEpisodeReplayBuffer`` with K = 1, 2 and 4 shards, each filled with the same episodes
(100-step episodes, obs f32[17], action f32[6], reward f32). Then times, per call, with the
calls of the buffers interleaved round-robin (so machine noise hits them alike):

1. ``sample_n_step(256, n=3)``;
2. ``append_batch`` of one step of 16 environments (a vector collector's call);
3. ``append_observation_action_reward`` of one step.

Prints the median and the 10th-90th percentile spread of each, and the ratios of the medians
to the single actor's and to the in-process buffer's; writes
``benchmarks/results/bench_ray_shards.json``.

    python benchmarks/bench_ray_shards.py            # 20,000 steps, 300 calls each
    python benchmarks/bench_ray_shards.py --quick    # 4,000 steps, 60 calls each
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's replaybuf

import ray
from harness import machine, now, text_table, versions

from replaybuf import EpisodeReplayBuffer
from replaybuf.integrations.ray import (
    RemoteEpisodeReplayBuffer,
    ShardedEpisodeReplayBuffer,
)

ENVS = 16
EPISODE = 100
SHARDS = (1, 2, 4)


def step_batch(envs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(envs, 17), torch.randn(envs, 6), torch.randn(envs)


async def fill(buf: Any, steps: int) -> None:
    """``steps`` steps: rounds of ``ENVS`` episodes of ``EPISODE`` steps, ended truncated."""
    for _ in range(steps // (ENVS * EPISODE)):
        ids = [await buf.start_episode() for _ in range(ENVS)]
        for _ in range(EPISODE):
            await buf.append_batch(ids, *step_batch(ENVS))
        for eid in ids:
            await buf.end_episode(eid, "truncated", torch.randn(17))


def spread(runs: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(runs, n=10)
    return {"median": statistics.median(runs), "p10": cuts[0], "p90": cuts[-1]}


async def interleaved(
    calls: dict[str, Callable[[], Awaitable[Any]]], repeats: int, warmup: int
) -> dict[str, dict[str, float]]:
    """Per-call seconds of each callable, called round-robin ``repeats`` times."""
    runs: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(warmup + repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            await call()
            if r >= warmup:
                runs[name].append(time.perf_counter() - start)
    return {name: spread(times) for name, times in runs.items()}


async def run(steps: int, repeats: int) -> dict[str, Any]:
    scratch = tempfile.mkdtemp(prefix="bench-shards-")
    options = {"seed": 0, "scratch_dir": scratch}
    buffers: dict[str, Any] = {"in-process": EpisodeReplayBuffer(steps * 2, **options)}
    made = await asyncio.gather(
        RemoteEpisodeReplayBuffer.create(steps * 2, num_cpus=0, **options),
        *(
            ShardedEpisodeReplayBuffer.create(k, steps * 2 // k, num_cpus=0, **options)
            for k in SHARDS
        ),
    )
    buffers["actor"] = made[0]
    buffers.update({f"sharded K={k}": b for k, b in zip(SHARDS, made[1:], strict=True)})
    try:
        for buf in buffers.values():
            await fill(buf, steps)
        results: dict[str, Any] = {}
        results["sample_n_step(256, n=3)"] = await interleaved(
            {n: (lambda b=b: b.sample_n_step(256, n=3)) for n, b in buffers.items()},
            repeats,
            warmup=10,
        )
        open_ids = {n: [await b.start_episode() for _ in range(ENVS)] for n, b in buffers.items()}
        obs, act, rew = step_batch(ENVS)
        results[f"append_batch({ENVS} envs)"] = await interleaved(
            {
                n: (lambda b=b, i=open_ids[n]: b.append_batch(i, obs, act, rew))
                for n, b in buffers.items()
            },
            repeats,
            warmup=10,
        )
        one = (obs[0], act[0], rew[0])
        results["append one step"] = await interleaved(
            {
                n: (lambda b=b, i=open_ids[n][0]: b.append_observation_action_reward(i, *one))
                for n, b in buffers.items()
            },
            repeats,
            warmup=10,
        )
        return results
    finally:
        for buf in buffers.values():
            await buf.close()
        shutil.rmtree(scratch, ignore_errors=True)  # the buffers' own folders went with close


def table(results: dict[str, Any]) -> str:
    header = ("call", "buffer", "median", "p10-p90", "/ actor", "/ in-process")
    rows = []
    for call, by_buffer in results.items():
        actor, local = by_buffer["actor"]["median"], by_buffer["in-process"]["median"]
        for name, t in by_buffer.items():
            rows.append(
                (
                    call,
                    name,
                    f"{t['median'] * 1e3:.2f} ms",
                    f"{t['p10'] * 1e3:.2f}-{t['p90'] * 1e3:.2f} ms",
                    f"{t['median'] / actor:.2f}x",
                    f"{t['median'] / local:.1f}x",
                )
            )
    return text_table(header, rows, markdown=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few calls")
    args = parser.parse_args()
    steps, repeats = (4_000, 60) if args.quick else (20_000, 300)
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        results = asyncio.run(run(steps, repeats))
    finally:
        ray.shutdown()
    print(f"{now()}  steps={steps} calls={repeats}  {machine()['cpu']}")
    print(table(results))
    out = Path(__file__).resolve().parent / "results" / "bench_ray_shards.json"
    out.parent.mkdir(exist_ok=True)
    record = {"date": now(), "machine": machine(), "versions": versions(), "steps": steps}
    out.write_text(json.dumps({**record, "results": results}, indent=1))


if __name__ == "__main__":
    main()
