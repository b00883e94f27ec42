"""CUDA benchmark: replaybuf on a GPU, beside the raw CUDA floor.

Three sections, each timed round-robin inside one run (median over repeats of the mean time of
a call; every call of a repeat is followed by one ``torch.cuda.synchronize()``, so a time is
what a learner waits for a batch, launch overhead included):

1. **GPU storage** (``storing_device=device="cuda"``, tensor storage): W1 ``sample_batch(256)``
   from 1M transitions, prioritized too; W2 ``sample_n_step(256, n=3)`` from 1,000-step
   episodes, prioritized too; ``sample_sequences(32, 16)``; W3 pixels ``sample_n_step(32)``
   (u8[4, 84, 84]), plain and ``frame_stack=4``. Floors: ``torch.randint`` on the device +
   ``index_select`` per field (W2: the suite's flat n-step floor, on the device), TorchRL's
   ``TensorDictReplayBuffer(LazyTensorStorage(device="cuda"))`` beside W1. Target: 1.5x the
   floor; prioritized within 3x of uniform. Each sampler is also run once under
   ``torch.cuda.set_sync_debug_mode("error")``: "host syncs" says whether it waited on the GPU.
2. **CPU storage, GPU learner** (memmap on the host, ``device="cuda"``): W1 batches and W3
   pixel batches against gather + pageable ``.to("cuda")`` and against gather into pinned
   buffers + a non-blocking copy (the pinned floor); epochs over the memmap buffer
   (``create_epoch_iterator``) in GB/s against a plain pinned ``copy_`` of the same bytes in
   batches of the same size, and in one piece (the link's bandwidth).
3. **Inserts into GPU storage** from host tensors: ``add_batch`` of 1,000 rows and
   ``append_batch`` of 64 environments, against ``copy_`` into preallocated device columns.

    python benchmarks/bench_cuda.py                   # full (75-90 s on an H200)
    python benchmarks/bench_cuda.py --quick           # small sizes (under a minute)
    python benchmarks/bench_cuda.py --tiny --device cpu   # every code path, no GPU (tests)

Writes ``benchmarks/results/bench_cuda.json`` (``--json``) and prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import harness
import peers
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from replaybuf import ReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.accel.fused import TRITON_ENV
from replaybuf.accel.graphs import GRAPHS_ENV


@dataclass(frozen=True)
class Config:
    name: str
    w1_size: int
    w2_episodes: int
    ep_len: int
    w3_episodes: int
    w3_ep_len: int
    calls: int  # calls per timed repeat
    repeats: int
    epoch_batches: tuple[int, ...]


FULL = Config("full", 1_000_000, 1_000, 1_000, 100, 1_000, 200, 15, (256, 4_096, 65_536))
QUICK = Config("quick", 100_000, 100, 1_000, 10, 1_000, 100, 7, (256, 4_096, 65_536))
TINY = Config("tiny", 3_000, 6, 100, 2, 40, 3, 2, (256, 1_024))
CONFIGS = {c.name: c for c in (FULL, QUICK, TINY)}
BATCH, N, GAMMA = 256, 3, 0.99
SEQ_BATCH, SEQ_LEN, LONG_SEQ, PIXEL_BATCH, ENVS, CHUNK = 32, 16, 80, 32, 64, 1_000


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def round_robin(
    fns: dict[str, Callable[[], Any]], cfg: Config, device: torch.device, calls: int | None = None
) -> dict[str, dict[str, Any]]:
    """Seconds per call of each function: one untimed call each, then ``repeats`` rounds that
    time ``calls`` calls of every function in turn, each round closed by a synchronize."""
    calls = calls or cfg.calls
    for fn in fns.values():
        fn()
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(cfg.repeats):
        for name, fn in fns.items():
            synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            synchronize(device)
            runs[name].append((time.perf_counter() - start) / calls)
    return {name: harness.timing(r) for name, r in runs.items()}


def host_syncs(fn: Callable[[], Any], device: torch.device) -> str:
    """``"none"`` when one call of ``fn`` makes no host synchronisation with the GPU, else where
    in replaybuf the first one happens; ``"n/a"`` off CUDA."""
    if device.type != "cuda":
        return "n/a"
    synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as error:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "replaybuf" in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
        return f"yes ({where})"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "none"


def switched_off(variable: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with the environment ``variable`` set to "0" during its calls."""

    def call() -> Any:
        before = os.environ.get(variable)
        os.environ[variable] = "0"
        try:
            return fn()
        finally:
            if before is None:
                del os.environ[variable]
            else:
                os.environ[variable] = before

    return call


def torch_ops(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with replaybuf.accel.fused switched off (``REPLAYBUF_TRITON=0``): the torch ops its
    Triton kernels replace (and no graphs, which need the kernels), timed in the same run."""
    return switched_off(TRITON_ENV, fn)


def no_graphs(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` without captured graphs (``REPLAYBUF_CUDA_GRAPHS=0``): the kernels and ops that
    replay of a graph replaces, launched one by one."""
    return switched_off(GRAPHS_ENV, fn)


def rows_of(columns: dict[str, torch.Tensor], a: int, b: int) -> dict[str, torch.Tensor]:
    return {k: v[a:b] for k, v in columns.items()}


def fill_transitions(buf: ReplayBuffer, columns: dict[str, torch.Tensor]) -> None:
    size = columns["obs"].shape[0]
    for a, b in peers.spans(size):
        buf.add_batch(rows_of(columns, a, b))


def set_random_priorities(buf: ReplayBuffer, size: int, seed: int = 1) -> None:
    """Log-normal priorities for ids 0 .. size-1 (never wrapped: id k is slot k)."""
    g = torch.Generator().manual_seed(seed)
    for a, b in peers.spans(size):
        buf.update_priorities(torch.arange(a, b), torch.randn(b - a, generator=g).exp())


def reprioritize(buf: SyncEpisodeReplayBuffer, rounds: int = 8, seed: int = 1) -> None:
    """Random priorities on the steps a few sampled batches touch (far from uniform)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        index = buf.sample_n_step(4_096).get("index").cpu()
        buf.update_priorities(index, torch.randn(index.shape[0], generator=g).exp())


# =========================================================================== 1. GPU storage
def section_gpu_storage(cfg: Config, device: torch.device, scratch: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    columns = peers.transitions(cfg.w1_size)
    on_device = {k: v.to(device) for k, v in columns.items()}
    g = torch.Generator(device=device).manual_seed(0)

    def floor_w1() -> dict[str, torch.Tensor]:
        idx = torch.randint(0, cfg.w1_size, (BATCH,), generator=g, device=device)
        return {k: torch.index_select(v, 0, idx) for k, v in on_device.items()}

    log("W1 on the GPU: filling")
    uniform = ReplayBuffer(device, device, cfg.w1_size, storage="tensor", seed=0)
    fill_transitions(uniform, columns)
    per = ReplayBuffer(device, device, cfg.w1_size, storage="tensor", seed=0, prioritized=True)
    fill_transitions(per, columns)
    set_random_priorities(per, cfg.w1_size)
    trl = TensorDictReplayBuffer(
        storage=LazyTensorStorage(cfg.w1_size, device=device), batch_size=BATCH
    )
    for a, b in peers.spans(cfg.w1_size):
        trl.extend(TensorDict(rows_of(on_device, a, b), batch_size=[b - a]))
    fns = {
        "floor": floor_w1,
        "replaybuf": lambda: uniform.sample_batch(BATCH),
        "replaybuf prioritized": lambda: per.sample_batch(BATCH),
        "torchrl": trl.sample,
    }
    log("W1 on the GPU: timing")
    out["w1"] = round_robin(fns, cfg, device)
    out["w1_syncs"] = {name: host_syncs(fn, device) for name, fn in fns.items()}
    sampled = per.sample_batch(BATCH)
    out["update_priorities"] = round_robin(
        {
            "replaybuf prioritized": lambda: per.update_priorities(
                sampled.get("index"), sampled.get("weight") + 0.5
            )
        },
        cfg,
        device,
    )
    uniform.close()
    per.close()

    log("W2 on the GPU: filling")
    eps = peers.random_episodes(cfg.w2_episodes, cfg.ep_len)
    floor = peers.FlatNStep(eps, N, GAMMA, device=device)
    flat_obs = floor.obs
    length = cfg.ep_len
    seq_g = torch.Generator(device=device).manual_seed(0)

    def floor_sequences(seq_len: int = SEQ_LEN) -> dict[str, torch.Tensor]:
        """Anchors with ``seq_len`` steps ahead in their episode, then ``[B, L]`` gathers."""
        episode = torch.randint(0, eps.count, (SEQ_BATCH,), generator=seq_g, device=device)
        t = torch.randint(0, length - seq_len + 1, (SEQ_BATCH,), generator=seq_g, device=device)
        rows = (episode * length + t).unsqueeze(1) + torch.arange(seq_len, device=device)
        flat = rows.reshape(-1)
        return {
            "observation": flat_obs.index_select(0, flat),
            "next_observation": floor.next_obs.index_select(0, flat),
            "action": floor.action.index_select(0, flat),
            "reward": floor.reward.index_select(0, flat),
        }

    def episode_buffer(prioritized: bool) -> SyncEpisodeReplayBuffer:
        buf = SyncEpisodeReplayBuffer(
            eps.steps,
            eps.count,
            device=device,
            storing_device=device,
            storage="tensor",
            seed=0,
            prioritized=prioritized,
        )
        peers.fill_episodes(buf, eps, envs=64)
        return buf

    ours, ours_per = episode_buffer(False), episode_buffer(True)
    reprioritize(ours_per)
    fns = {
        "floor": lambda: floor.sample(BATCH),
        "replaybuf": lambda: ours.sample_n_step(BATCH, n=N, gamma=GAMMA),
        "replaybuf prioritized": lambda: ours_per.sample_n_step(BATCH, n=N, gamma=GAMMA),
        "replaybuf torch ops": torch_ops(lambda: ours.sample_n_step(BATCH, n=N, gamma=GAMMA)),
        "replaybuf no graphs": no_graphs(lambda: ours.sample_n_step(BATCH, n=N, gamma=GAMMA)),
    }
    log("W2 on the GPU: timing")
    out["w2"] = round_robin(fns, cfg, device)
    out["w2_syncs"] = {name: host_syncs(fn, device) for name, fn in fns.items()}
    fns = {
        "floor": floor_sequences,
        "replaybuf strict": lambda: ours.sample_sequences(SEQ_BATCH, SEQ_LEN),
        "replaybuf padded": lambda: ours.sample_sequences(SEQ_BATCH, SEQ_LEN, strict=False),
        "replaybuf strict torch ops": torch_ops(lambda: ours.sample_sequences(SEQ_BATCH, SEQ_LEN)),
        "replaybuf padded torch ops": torch_ops(
            lambda: ours.sample_sequences(SEQ_BATCH, SEQ_LEN, strict=False)
        ),
        "replaybuf strict no graphs": no_graphs(lambda: ours.sample_sequences(SEQ_BATCH, SEQ_LEN)),
        "replaybuf padded no graphs": no_graphs(
            lambda: ours.sample_sequences(SEQ_BATCH, SEQ_LEN, strict=False)
        ),
    }
    out["sequences"] = round_robin(fns, cfg, device)
    out["sequences_syncs"] = {name: host_syncs(fn, device) for name, fn in fns.items()}
    fns = {  # R2D2's length
        "floor": lambda: floor_sequences(LONG_SEQ),
        "replaybuf strict": lambda: ours.sample_sequences(SEQ_BATCH, LONG_SEQ),
        "replaybuf strict no graphs": no_graphs(lambda: ours.sample_sequences(SEQ_BATCH, LONG_SEQ)),
    }
    out["long_sequences"] = round_robin(fns, cfg, device)
    out["long_sequences_syncs"] = {name: host_syncs(fn, device) for name, fn in fns.items()}
    # Strict sequences of 4/5 of an episode: a fifth of the anchors qualify, so about 5 slots
    # of 32 find none among their 8 tries and every batch pays the redraw's scan
    redraw_len = 4 * length // 5
    fns = {
        "floor": lambda: floor_sequences(redraw_len),
        "replaybuf strict": lambda: ours.sample_sequences(SEQ_BATCH, redraw_len),
    }
    out["redraw_sequences"] = round_robin(fns, cfg, device)
    out["redraw_sequences_syncs"] = {name: host_syncs(fn, device) for name, fn in fns.items()}
    out["redraw_len"] = redraw_len
    ours.close()
    ours_per.close()

    log("W3 on the GPU: filling")
    frames = peers.Frames()
    count, ep_len = cfg.w3_episodes, cfg.w3_ep_len
    built = [
        peers.floor_pixels(frames, count, ep_len, PIXEL_BATCH, device=device),
        peers.replaybuf_pixels(
            frames, count, ep_len, PIXEL_BATCH, scratch, device=device, storing_device=device
        ),
        peers.replaybuf_pixels(
            frames,
            count,
            ep_len,
            PIXEL_BATCH,
            scratch,
            frame_stack=True,
            device=device,
            storing_device=device,
        ),
    ]
    fns = {
        "floor": built[0].sample,
        "replaybuf": built[1].sample,
        "replaybuf frame_stack=4": built[2].sample,
        "replaybuf torch ops": torch_ops(built[1].sample),
        "replaybuf frame_stack=4 torch ops": torch_ops(built[2].sample),
        "replaybuf no graphs": no_graphs(built[1].sample),
        "replaybuf frame_stack=4 no graphs": no_graphs(built[2].sample),
    }
    log("W3 on the GPU: timing")
    out["w3"] = round_robin(fns, cfg, device, calls=max(3, cfg.calls // 4))
    out["w3_syncs"] = {name: host_syncs(fn, device) for name, fn in fns.items()}
    out["w3_bytes_per_step"] = {name: b.bytes_per_step for name, b in zip(fns, built, strict=False)}
    for b in built:
        b.close()
    return out


# =========================================================================== 2. CPU -> GPU
class PinnedFloor:
    """Gather into pinned host buffers, then a non-blocking copy: two buffer sets alternate, and
    a set is refilled only after the copy out of it finished (its event)."""

    def __init__(self, fields: dict[str, torch.Tensor], rows: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.fields, self.device = fields, device
        self.sets = [
            {
                k: torch.empty((rows, *v.shape[1:]), dtype=v.dtype, pin_memory=pin)
                for k, v in fields.items()
            }
            for _ in range(2)
        ]
        self.events: list[Any] = [None, None]
        self.turn = 0

    def __call__(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        turn, self.turn = self.turn, self.turn ^ 1
        if self.events[turn] is not None:
            self.events[turn].synchronize()
        buffers = {k: b[: idx.shape[0]] for k, b in self.sets[turn].items()}
        for k, v in self.fields.items():
            torch.index_select(v, 0, idx, out=buffers[k])
        out = {k: b.to(self.device, non_blocking=True) for k, b in buffers.items()}
        if self.device.type == "cuda":
            self.events[turn] = torch.cuda.Event()
            self.events[turn].record()
        return out


def section_host_to_gpu(cfg: Config, device: torch.device, scratch: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    columns = peers.transitions(cfg.w1_size)
    log("CPU memmap -> GPU: filling W1")
    buf = ReplayBuffer(device, "cpu", cfg.w1_size, storage="memmap", scratch_dir=scratch, seed=0)
    fill_transitions(buf, columns)
    buf.sample_by_index(torch.arange(0, cfg.w1_size, 16))  # map every page once
    g = torch.Generator().manual_seed(0)
    pinned = PinnedFloor(columns, BATCH, device)

    def pageable() -> dict[str, torch.Tensor]:
        idx = torch.randint(0, cfg.w1_size, (BATCH,), generator=g)
        return {k: torch.index_select(v, 0, idx).to(device) for k, v in columns.items()}

    fns = {
        "floor pageable": pageable,
        "floor pinned": lambda: pinned(torch.randint(0, cfg.w1_size, (BATCH,), generator=g)),
        "replaybuf memmap": lambda: buf.sample_batch(BATCH),
    }
    log("CPU memmap -> GPU: W1 timing")
    out["w1"] = round_robin(fns, cfg, device)

    row_bytes = sum(v[0].numel() * v.element_size() for v in columns.values())
    epoch_bytes = row_bytes * cfg.w1_size
    host = torch.empty(epoch_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(epoch_bytes, dtype=torch.uint8, device=device)
    epochs: dict[str, Any] = {"bytes": epoch_bytes}
    for batch in cfg.epoch_batches:
        step = batch * row_bytes

        def chunked(step: int = step) -> None:
            for a in range(0, epoch_bytes, step):
                target[a : a + step].copy_(host[a : a + step], non_blocking=True)

        def ours(batch: int = batch, shuffle: bool = True) -> int:
            return sum(b.batch_size[0] for b in buf.create_epoch_iterator(batch, shuffle=shuffle))

        gather = PinnedFloor(columns, batch, device)

        def gathered(batch: int = batch, gather: PinnedFloor = gather) -> None:
            order = torch.randperm(cfg.w1_size, generator=g)
            for a in range(0, cfg.w1_size, batch):
                gather(order[a : a + batch])

        log(f"CPU memmap -> GPU: epoch, batch {batch}")
        epochs[str(batch)] = round_robin(
            {
                "pinned copy_": chunked,
                "gather floor": gathered,
                "replaybuf epoch": ours,
                "replaybuf in order": lambda batch=batch: ours(batch, shuffle=False),
            },
            cfg,
            device,
            calls=1,
        )
    epochs["one copy_"] = round_robin(
        {"pinned copy_": lambda: target.copy_(host, non_blocking=True)}, cfg, device, calls=1
    )
    out["epochs"] = epochs
    buf.close()

    log("CPU memmap -> GPU: W3 filling")
    frames = peers.Frames()
    count, ep_len = cfg.w3_episodes, cfg.w3_ep_len
    ours_px = peers.replaybuf_pixels(
        frames, count, ep_len, PIXEL_BATCH, scratch, kind="memmap", device=device
    )
    floor_px = peers.floor_pixels(frames, count, ep_len, PIXEL_BATCH)  # on the host
    pixel_rows = count * (ep_len + 1)
    obs = torch.empty((pixel_rows, *peers.PIXELS), dtype=torch.uint8)
    for e in range(count):
        obs[e * (ep_len + 1) : (e + 1) * (ep_len + 1)] = frames.obs(
            torch.tensor([e]), 0, ep_len + 1
        )[0]
    pixel_pinned = PinnedFloor({"obs": obs}, 2 * PIXEL_BATCH, device)
    pg = torch.Generator().manual_seed(0)

    def pixel_floor_pinned() -> dict[str, torch.Tensor]:
        e = torch.randint(0, count, (PIXEL_BATCH,), generator=pg)
        t = torch.randint(0, ep_len, (PIXEL_BATCH,), generator=pg)
        idx = e * (ep_len + 1) + t
        return pixel_pinned(torch.cat([idx, idx + 1]))  # observation and next observation

    fns = {
        "floor pageable": lambda: {k: v.to(device) for k, v in floor_px.sample().items()},
        "floor pinned": pixel_floor_pinned,
        "replaybuf memmap": ours_px.sample,
    }
    log("CPU memmap -> GPU: W3 timing")
    out["w3"] = round_robin(fns, cfg, device, calls=max(3, cfg.calls // 4))
    out["w3_batch_bytes"] = 2 * PIXEL_BATCH * obs[0].numel()
    ours_px.close()
    floor_px.close()
    return out


# =========================================================================== 3. inserts
def section_inserts(cfg: Config, device: torch.device, scratch: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    columns = peers.transitions(cfg.w1_size)
    capacity = cfg.w1_size
    buf = ReplayBuffer(device, device, capacity, storage="tensor", seed=0)
    fill_transitions(buf, columns)  # steady state: every add overwrites
    dest = {k: torch.empty_like(v, device=device) for k, v in columns.items()}
    chunks = [rows_of(columns, a, a + CHUNK) for a in range(0, capacity - CHUNK + 1, CHUNK)][:64]
    turn = {"floor": 0, "replaybuf": 0}

    def next_chunk(name: str) -> dict[str, torch.Tensor]:
        turn[name] = (turn[name] + 1) % len(chunks)
        return chunks[turn[name]]

    cursor = [0]

    def floor_add() -> None:
        chunk = next_chunk("floor")
        a = cursor[0]
        cursor[0] = (a + CHUNK) % (capacity - CHUNK + 1)
        for k, v in chunk.items():
            dest[k][a : a + CHUNK].copy_(v)

    log("inserts into GPU storage")
    out["add_batch"] = round_robin(
        {"floor": floor_add, "replaybuf": lambda: buf.add_batch(next_chunk("replaybuf"))},
        cfg,
        device,
    )
    buf.close()

    ep_len = cfg.ep_len
    episodes = SyncEpisodeReplayBuffer(
        max(ENVS * ep_len * 2, 10_000),
        device=device,
        storing_device=device,
        storage="tensor",
        seed=0,
    )
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(ENVS, peers.OBS, generator=g)
    act = torch.rand(ENVS, peers.ACT, generator=g)
    rew = torch.randn(ENVS, generator=g)
    ids = [episodes.start_episode() for _ in range(ENVS)]
    steps = [0]
    rows = max(ENVS * ep_len * 2, 10_000)
    env_dest = {
        "obs": torch.empty((rows, peers.OBS), device=device),
        "action": torch.empty((rows, peers.ACT), device=device),
        "reward": torch.empty(rows, device=device),
    }
    at = [0]

    def append() -> None:
        nonlocal ids
        episodes.append_batch(ids, obs, act, rew)
        steps[0] += 1
        if steps[0] == ep_len:  # episodes end and new ones start, as in a vectorized env
            for episode in ids:
                episodes.end_episode(episode, "truncated", obs[0])
            ids = [episodes.start_episode() for _ in range(ENVS)]
            steps[0] = 0

    def floor_append() -> None:
        a = at[0]
        at[0] = (a + ENVS) % (rows - ENVS + 1)
        env_dest["obs"][a : a + ENVS].copy_(obs)
        env_dest["action"][a : a + ENVS].copy_(act)
        env_dest["reward"][a : a + ENVS].copy_(rew)

    for _ in range(2 * ep_len):  # fill to capacity first: timed appends evict
        append()
    out["append_batch"] = round_robin({"floor": floor_append, "replaybuf": append}, cfg, device)
    episodes.close()
    return out


# =========================================================================== report
@dataclass
class Row:
    section: str
    workload: str
    ours: str
    floor: str
    ratio: float | None
    target: str
    verdict: str
    syncs: str = ""


def med(t: dict[str, Any]) -> float:
    return t["median"]


def rows(res: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    gpu, host, ins = res["gpu_storage"], res["host_to_gpu"], res["inserts"]

    def vs(
        section: str, workload: str, t: dict, name: str, ref: str, limit: float | None, syncs=None
    ) -> None:
        ratio = med(t[name]) / med(t[ref])
        verdict = "-" if limit is None else ("PASS" if ratio <= limit else "FAIL")
        target = "-" if limit is None else f"{limit}x {ref}"
        out.append(
            Row(
                section,
                workload,
                harness.micros(med(t[name])),
                harness.micros(med(t[ref])),
                ratio,
                target,
                verdict,
                "" if syncs is None else syncs.get(name, ""),
            )
        )

    g = "GPU storage"
    vs(g, "W1 sample_batch(256)", gpu["w1"], "replaybuf", "floor", 1.5, gpu["w1_syncs"])
    vs(
        g,
        "W1 prioritized vs uniform",
        gpu["w1"],
        "replaybuf prioritized",
        "replaybuf",
        3.0,
        gpu["w1_syncs"],
    )
    vs(g, "W1 TorchRL sample()", gpu["w1"], "torchrl", "floor", None, gpu["w1_syncs"])
    update = harness.micros(med(gpu["update_priorities"]["replaybuf prioritized"]))
    out.append(Row(g, "update_priorities(256)", update, "-", None, "-", "-"))
    vs(g, "W2 sample_n_step(256, n=3)", gpu["w2"], "replaybuf", "floor", 1.5, gpu["w2_syncs"])
    vs(
        g,
        "W2 prioritized vs uniform",
        gpu["w2"],
        "replaybuf prioritized",
        "replaybuf",
        3.0,
        gpu["w2_syncs"],
    )
    vs(
        g,
        "sample_sequences(32, 16)",
        gpu["sequences"],
        "replaybuf strict",
        "floor",
        1.5,
        gpu["sequences_syncs"],
    )
    vs(
        g,
        "sample_sequences strict=False",
        gpu["sequences"],
        "replaybuf padded",
        "floor",
        1.5,
        gpu["sequences_syncs"],
    )
    vs(
        g,
        "sample_sequences(32, 80)",
        gpu["long_sequences"],
        "replaybuf strict",
        "floor",
        1.5,
        gpu["long_sequences_syncs"],
    )
    vs(
        g,
        f"sample_sequences(32, {gpu['redraw_len']}), ~5 slots redrawn",
        gpu["redraw_sequences"],
        "replaybuf strict",
        "floor",
        None,
        gpu["redraw_sequences_syncs"],
    )
    vs(g, "W3 pixels sample_n_step(32)", gpu["w3"], "replaybuf", "floor", 1.5, gpu["w3_syncs"])
    vs(g, "W3 frame_stack=4", gpu["w3"], "replaybuf frame_stack=4", "floor", 1.5, gpu["w3_syncs"])
    # The fused kernels (replaybuf.accel.fused) against the torch ops they replace, in this run.
    vs(g, "W2 fused vs torch ops", gpu["w2"], "replaybuf", "replaybuf torch ops", None)
    vs(g, "W3 fused vs torch ops", gpu["w3"], "replaybuf", "replaybuf torch ops", None)
    fs = "replaybuf frame_stack=4"
    vs(g, "W3 frame_stack=4 fused vs torch ops", gpu["w3"], fs, f"{fs} torch ops", None)
    for kind in ("strict", "padded"):
        seq, name = gpu["sequences"], f"replaybuf {kind}"
        vs(g, f"sequences {kind} fused vs torch ops", seq, name, f"{name} torch ops", None)
    # Captured graphs (replaybuf.accel.graphs) against the same kernels launched one by one.
    vs(g, "W2 graphs vs none", gpu["w2"], "replaybuf", "replaybuf no graphs", None)
    vs(g, "W3 graphs vs none", gpu["w3"], "replaybuf", "replaybuf no graphs", None)
    vs(g, "W3 frame_stack=4 graphs vs none", gpu["w3"], fs, f"{fs} no graphs", None)
    for kind in ("strict", "padded"):
        seq, name = gpu["sequences"], f"replaybuf {kind}"
        vs(g, f"sequences {kind} graphs vs none", seq, name, f"{name} no graphs", None)
    long, name = gpu["long_sequences"], "replaybuf strict"
    vs(g, "sequences(32, 80) graphs vs none", long, name, f"{name} no graphs", None)
    h = "CPU memmap -> GPU"
    vs(h, "W1 sample_batch(256)", host["w1"], "replaybuf memmap", "floor pinned", None)
    vs(h, "W1 pageable floor", host["w1"], "floor pageable", "floor pinned", None)
    vs(h, "W3 pixels sample_n_step(32)", host["w3"], "replaybuf memmap", "floor pinned", None)
    link = host["epochs"]["bytes"] / med(host["epochs"]["one copy_"]["pinned copy_"]) / 1e9
    for batch, t in host["epochs"].items():
        if batch in ("bytes", "one copy_"):
            continue
        gbs = {name: host["epochs"]["bytes"] / med(v) / 1e9 for name, v in t.items()}
        out.append(
            Row(
                h,
                f"epoch, batch {batch} (GB/s)",
                f"{gbs['replaybuf epoch']:.2f}",
                f"copy_ {gbs['pinned copy_']:.2f}, gather {gbs['gather floor']:.2f} "
                f"(link {link:.1f})",
                gbs["replaybuf epoch"] / gbs["gather floor"],
                "-",
                "-",
            )
        )
        out.append(
            Row(
                h,
                f"epoch in order, batch {batch} (GB/s)",
                f"{gbs['replaybuf in order']:.2f}",
                f"copy_ {gbs['pinned copy_']:.2f}",
                gbs["replaybuf in order"] / gbs["pinned copy_"],
                "-",
                "-",
            )
        )
    i = "inserts into GPU storage"
    vs(i, "add_batch(1,000 rows)", ins["add_batch"], "replaybuf", "floor", 2.0)
    vs(i, "append_batch(64 envs)", ins["append_batch"], "replaybuf", "floor", 2.0)
    return out


def table(rs: list[Row]) -> str:
    header = (
        "section",
        "workload",
        "replaybuf",
        "reference",
        "ratio",
        "target",
        "verdict",
        "host syncs",
    )
    cells = [
        (
            r.section,
            r.workload,
            r.ours,
            r.floor,
            "-" if r.ratio is None else f"{r.ratio:.2f}x",
            r.target,
            r.verdict,
            r.syncs,
        )
        for r in rs
    ]
    return harness.text_table(header, cells, markdown=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (under a minute)")
    parser.add_argument("--tiny", action="store_true", help="seconds; every code path (tests)")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run")
    parser.add_argument("--json", type=Path, default=None, help="where the JSON goes")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_cuda: no CUDA device here (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    cfg = TINY if args.tiny else QUICK if args.quick else FULL
    torch.manual_seed(0)
    report: dict[str, Any] = {
        "date": harness.now(),
        "config": asdict(cfg),
        "machine": harness.machine(),
        "versions": harness.versions(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    # GIT_COMMIT, where set, names the code (a copy of a working tree may carry a stale .git).
    found = report["versions"]["git_commit"]
    report["versions"]["git_commit"] = os.environ.get("GIT_COMMIT") or found
    path = args.json or harness.REPO / "benchmarks" / "results" / "bench_cuda.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    sections = {"gpu_storage": section_gpu_storage, "host_to_gpu": section_host_to_gpu}
    sections["inserts"] = section_inserts
    with tempfile.TemporaryDirectory(prefix="replaybuf-bench-cuda-") as tmp:
        for name, section in sections.items():
            report[name] = section(cfg, device, Path(tmp))
            # Written after every section, so a run cut off by a time limit keeps what it measured.
            path.write_text(json.dumps(report, indent=1))
    report["rows"] = [asdict(r) for r in rows(report)]
    path.write_text(json.dumps(report, indent=1))
    print(f"{report['device']}, torch {report['versions']['torch']}, {report['date']}, {cfg.name}")
    print(table(rows(report)))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
