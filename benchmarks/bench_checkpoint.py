"""Checkpoint benchmark: replaybuf save_checkpoint / load_checkpoint beside torch.save and TorchRL.

One run measures, single-threaded (``torch.set_num_threads(1)``), the save and
the load of

1. a ``replaybuf.ReplayBuffer`` of ``--transitions`` W1 transitions (1,000,000 by default: obs
   f32[17], action f32[6], reward f32, done bool), in memmap and in tensor storage:
   ``buf.save_checkpoint(dir)`` (durable, and ``durable=False``) and
   ``ReplayBuffer.load_checkpoint(dir)``;
2. an Atari-shaped ``replaybuf.SyncEpisodeReplayBuffer`` of ``--atari-steps`` steps (100,000 by
   default) of 4x84x84 uint8 observations (action int64, reward f32) in 1,000-step episodes,
   ``max_episodes`` 110% of the episodes, memmap storage, filled with ``append_batch`` over all
   episodes at once: ``buf.save_checkpoint(dir)`` and ``SyncEpisodeReplayBuffer.load_checkpoint``
   (a row reads "n/a (not implemented)" while that API does not exist);

beside, in the same run, on the same data:

(a) ``torch.save`` of a dict of the stored columns, then fsync, and
    ``torch.load(weights_only=True)``;
(b) TorchRL's ``TensorDictReplayBuffer.dumps(dir)`` / ``loads(dir)`` on a buffer with the same
    storage kind (``LazyMemmapStorage`` with a ``scratch_dir``, or ``LazyTensorStorage``);
(c) the disk floor: the payload's bytes written from one 32 MB buffer then fsynced, and read
    back with a cold page cache (and sha256 of as many bytes, for scale).

Every save and every load runs in a fresh process: a ``forkserver`` child that has imported
torch, tensordict, torchrl and replaybuf and nothing else (importing tensordict takes ~5 s, so
``--start-method spawn``, which also works, makes the run several minutes longer). The child
builds and fills its buffer, fsyncs its memmap files, rests QUIET_S seconds (see there: the VM
hands freed memory back to its host), then measures the one operation:

* seconds (wall clock) and MB/s = payload bytes (the stored columns, the same for every
  implementation of a case) / seconds, MB = 10**6 bytes;
* peak RSS growth: ``ru_maxrss`` after the operation minus ``ru_maxrss`` just before it, after
  imports, buffer construction and fill (the peak is first reset to the current RSS through
  ``/proc/self/clear_refs``, so the fill's transient peak does not hide the operation's). It
  counts the pages of memory-mapped files the process touches: page cache, not its own memory.
  (A spawned child's ru_maxrss starts at its parent's peak, which exec carries over: the parent
  here imports nothing heavy and holds no data, so that floor stays below every baseline.)
* peak anonymous-memory growth: ``RssAnon`` of ``/proc/self/status`` sampled every 2 ms by a
  thread, minus its value before the operation (the process's own memory).

Loads start with a cold page cache: the checkpoint's files are fsynced and then dropped from the
cache with ``posix_fadvise(DONTNEED)`` (those files only), as when a preempted job resumes on
another machine; ``--warm-loads`` keeps them cached. Times are medians over the repeats, RSS
figures the maximum. Everything lives in a temporary folder on disk (never /dev/shm) that is
removed at the end.

Prints one table and writes ``benchmarks/results/bench_checkpoint.json``.

    python benchmarks/bench_checkpoint.py           # full run (about 5 minutes, ~6 GB of disk)
    python benchmarks/bench_checkpoint.py --quick   # small sizes (< 60 s)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import importlib.metadata
import json
import logging
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OBS, ACT = 17, 6  # W1 shapes
W1_ROW_BYTES = OBS * 4 + ACT * 4 + 4 + 1  # obs f32[17], action f32[6], reward f32, done bool
W1_CHUNK = 50_000  # rows per add_batch / extend while filling
EP_LEN = 1_000  # steps per Atari episode
PIXELS = (4, 84, 84)
ATARI_ROW_BYTES = 4 * 84 * 84 + 8 + 4  # observation u8, action int64, reward f32
N_ACTIONS = 18
POOL = 8  # distinct frame batches, cycled (bytes are bytes: nothing here compresses)
MB = 1e6
IO_CHUNK = 32 << 20  # the disk floor's write / read / hash buffer
SAMPLE_EVERY = 0.002  # seconds between RssAnon samples
# Seconds of rest before each measured operation. In a VM that hands freed memory back to the
# host (virtio free page reporting, about 2 s after the free), touching a page is several times
# faster while recently freed guest memory is still there: without a common rest, whichever
# operation happens to follow a large free (a deleted checkpoint, a dropped buffer) would look
# faster. After the rest every operation gets its memory, page cache included, the slow way.
QUIET_S = 3.0
CHILD_TIMEOUT = 600.0
PRELOAD = ["torch", "tensordict", "torchrl", "replaybuf"]
RESULTS = Path(__file__).resolve().parent / "results" / "bench_checkpoint.json"

REPLAYBUF = "replaybuf save/load_checkpoint"
REPLAYBUF_FAST = "replaybuf durable=False"
TORCHRL = "torchrl dumps/loads"
TORCH = "torch.save+fsync / torch.load"
DISK = "disk floor: write+fsync / cold read"
NOT_IMPLEMENTED = "n/a (not implemented)"


@dataclass(frozen=True)
class Sizes:
    transitions: int  # W1 transitions in the ReplayBuffer case
    atari_steps: int  # steps in the Atari episode case (EP_LEN-step episodes)
    w1_repeats: int
    atari_repeats: int


FULL = Sizes(transitions=1_000_000, atari_steps=100_000, w1_repeats=3, atari_repeats=1)
QUICK = Sizes(transitions=100_000, atari_steps=10_000, w1_repeats=1, atari_repeats=1)


# ================================================================== child side: measuring
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in kB."""
    wanted = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in wanted:
                values[name] = int(rest.split()[0])
    return values


def maxrss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux


class AnonSampler(threading.Thread):
    """Peaks of RssAnon and RssFile, sampled every SAMPLE_EVERY seconds until :meth:`stop`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = proc_status()
        self.samples = 0
        self._done = threading.Event()

    def sample(self) -> None:
        now = proc_status()
        for key, value in now.items():
            self.peak[key] = max(self.peak[key], value)
        self.samples += 1

    def run(self) -> None:
        while not self._done.wait(SAMPLE_EVERY):
            self.sample()

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.sample()


def trim_heap() -> None:
    """Give freed heap back to the OS, so the baseline is what the process really holds."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak_rss() -> bool:
    """Reset VmHWM (and so ru_maxrss) to the current RSS; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def measure(op: Callable[[], Any], quiet_s: float) -> tuple[dict[str, Any], Any]:
    """Run ``op`` once: its seconds, peak RSS growth (ru_maxrss) and peak RssAnon growth.

    Before it: free what can be freed, then wait ``quiet_s`` seconds, so that every operation
    starts from the same memory state (see QUIET_S).
    """
    trim_heap()
    time.sleep(quiet_s)
    reset = reset_peak_rss()
    base, base_maxrss = proc_status(), maxrss_kb()
    sampler = AnonSampler()
    sampler.start()
    start = time.perf_counter()
    try:
        result = op()
    finally:
        seconds = time.perf_counter() - start
        sampler.stop()
    end, end_maxrss = proc_status(), maxrss_kb()
    kb = 1024 / MB
    return {
        "seconds": seconds,
        "rss_growth_mb": (end_maxrss - base_maxrss) * kb,
        "hwm_growth_mb": (end["VmHWM"] - base["VmRSS"]) * kb,
        "anon_growth_mb": (sampler.peak["RssAnon"] - base["RssAnon"]) * kb,
        "file_growth_mb": (sampler.peak["RssFile"] - base["RssFile"]) * kb,
        "baseline_rss_mb": base["VmRSS"] * kb,
        "baseline_anon_mb": base["RssAnon"] * kb,
        "baseline_maxrss_mb": base_maxrss * kb,
        "peak_reset": reset,
        "anon_samples": sampler.samples,
    }, result


@dataclass
class Job:
    """One prepared operation: ``op`` is measured; ``check(result)`` then fingerprints the data."""

    op: Callable[[], Any]
    check: Callable[[Any], dict[str, float]]
    close: Callable[[], None] = lambda: None
    prep: dict[str, float] | None = None


def child_main(task: dict[str, Any], conn: Any) -> None:
    """Process entry point: prepare, measure the one operation, send the result back."""
    try:
        conn.send({"ok": True, **run_task(task)})
    except BaseException:
        conn.send({"ok": False, "error": traceback.format_exc()})
    finally:
        conn.close()


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    if task["job"] == "probe":
        return probe()
    start = time.perf_counter()
    job = BUILDERS[(task["case"], task["impl"], task["op"])](task)
    if job is None:
        return {"status": NOT_IMPLEMENTED}
    prep = {"prepare_s": time.perf_counter() - start, **(job.prep or {})}
    try:
        measured, result = measure(job.op, task["quiet_s"])
        fingerprint = job.check(result)
    finally:
        job.close()
    return {"status": "ok", **measured, "fingerprint": fingerprint, **prep}


def probe() -> dict[str, Any]:
    import replaybuf
    from replaybuf import SyncEpisodeReplayBuffer

    return {
        "replaybuf": replaybuf.__version__,
        "replaybuf_path": str(Path(replaybuf.__file__).parent),
        "episode_checkpoints": all(
            hasattr(SyncEpisodeReplayBuffer, name)
            for name in ("save_checkpoint", "load_checkpoint")
        ),
        "status": proc_status(),
    }


# ================================================================== child side: data
def w1_chunks(size: int) -> Iterator[dict[str, Any]]:
    """The W1 transitions, deterministic, in chunks of W1_CHUNK rows."""
    import torch

    generator = torch.Generator().manual_seed(0)
    for first in range(0, size, W1_CHUNK):
        rows = min(W1_CHUNK, size - first)
        yield {
            "obs": torch.randn(rows, OBS, generator=generator),
            "action": torch.rand(rows, ACT, generator=generator) * 2 - 1,
            "reward": torch.randn(rows, generator=generator),
            "done": torch.rand(rows, generator=generator) < 0.001,
        }


@dataclass
class Atari:
    """Atari-shaped steps: at step t episode e observes frames[t % POOL][e]."""

    episodes: int
    frames: Any  # uint8 [POOL, episodes, 4, 84, 84]
    actions: Any  # int64 [EP_LEN, episodes]
    rewards: Any  # float32 [EP_LEN, episodes]
    finals: Any  # uint8 [episodes, 4, 84, 84]

    @property
    def rows(self) -> int:  # one row per step plus one per final observation
        return self.episodes * (EP_LEN + 1)


def atari_data(steps: int) -> Atari:
    import torch

    episodes = steps // EP_LEN
    generator = torch.Generator().manual_seed(0)
    return Atari(
        episodes=episodes,
        frames=torch.randint(
            0, 256, (POOL, episodes, *PIXELS), dtype=torch.uint8, generator=generator
        ),
        actions=torch.randint(0, N_ACTIONS, (EP_LEN, episodes), generator=generator),
        rewards=torch.randn(EP_LEN, episodes, generator=generator),
        finals=torch.randint(0, 256, (episodes, *PIXELS), dtype=torch.uint8, generator=generator),
    )


def atari_columns(data: Atari) -> dict[str, Any]:
    """The stored columns as plain tensors: steps time-major, then the final observations."""
    import torch

    n = data.episodes
    observation = torch.empty((data.rows, *PIXELS), dtype=torch.uint8)
    for t in range(EP_LEN):
        observation[t * n : (t + 1) * n] = data.frames[t % POOL]
    observation[EP_LEN * n :] = data.finals
    zeros = torch.zeros(n, dtype=torch.long)
    return {
        "observation": observation,
        "action": torch.cat([data.actions.reshape(-1), zeros]),
        "reward": torch.cat([data.rewards.reshape(-1), zeros.float()]),
    }


def fingerprint(columns: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, float]:
    """Per column, a sum over its rows, in bounded chunks: floats in float64; integer columns
    exactly, as the sum of their 8-byte words modulo 2**64 where a row is whole words (fast on
    uint8 frames), else of their values."""
    import torch

    out = {}
    for key in keys:
        column = columns[key]
        if isinstance(column, torch.Tensor):
            column = column.as_subclass(torch.Tensor)
        row_bytes = max(1, column[0].numel() * column.element_size())
        step = max(1, IO_CHUNK // row_bytes)
        words = not column.dtype.is_floating_point and row_bytes % 8 == 0
        total: float = 0
        for first in range(0, column.shape[0], step):
            part = column[first : first + step]
            if words:
                total += part.contiguous().reshape(-1).view(torch.int64).sum().item()
            elif column.dtype.is_floating_point:
                total += part.double().sum().item()
            else:
                total += part.sum(dtype=torch.int64).item()
        out[key] = total % (1 << 64) if words else total
    return out


def storage_fingerprint(storage: Any, rows: int, keys: tuple[str, ...]) -> dict[str, float]:
    """Fingerprint of rows [0, rows) of a TorchRL storage (views: nothing is copied)."""
    td = storage[0:rows]
    return fingerprint({key: td.get(key) for key in keys}, keys)


W1_KEYS = ("obs", "action", "reward", "done")
ATARI_KEYS = ("observation", "action", "reward")


def sync_tree(folder: str | os.PathLike[str]) -> float:
    """fsync every file under ``folder`` (memmap storage just filled); returns the seconds."""
    start = time.perf_counter()
    for parent, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.perf_counter() - start


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ================================================================== child side: jobs
def replaybuf_w1_save(task: dict[str, Any]) -> Job:
    from replaybuf import ReplayBuffer

    size, scratch = task["size"], task["scratch"]
    buf = ReplayBuffer("cpu", "cpu", size, storage=task["kind"], scratch_dir=scratch, seed=0)
    for chunk in w1_chunks(size):
        buf.add_batch(chunk)
    source = storage_fingerprint(buf.memory.storage, size, W1_KEYS)
    synced = sync_tree(scratch)
    return Job(
        op=lambda: buf.save_checkpoint(task["ckpt"], durable=task["durable"]),
        check=lambda _: source,
        close=buf.close,
        prep={"memmap_fsync_s": synced},
    )


def replaybuf_w1_load(task: dict[str, Any]) -> Job:
    from replaybuf import ReplayBuffer

    def check(buf: ReplayBuffer) -> dict[str, float]:
        try:
            assert buf.storage_kind == task["kind"], buf.storage_kind
            assert len(buf) == task["size"], (len(buf), task["size"])
            return storage_fingerprint(buf.memory.storage, len(buf), W1_KEYS)
        finally:
            buf.close()

    return Job(
        op=lambda: ReplayBuffer.load_checkpoint(task["ckpt"], scratch_dir=task["scratch"]),
        check=check,
    )


def replaybuf_atari_save(task: dict[str, Any]) -> Job | None:
    from replaybuf import SyncEpisodeReplayBuffer

    if not hasattr(SyncEpisodeReplayBuffer, "save_checkpoint"):
        return None
    data = atari_data(task["size"])
    scratch = task["scratch"]
    buf = SyncEpisodeReplayBuffer(
        max_steps=task["size"],
        max_episodes=data.episodes + data.episodes // 10,
        storage="memmap",
        scratch_dir=scratch,
        seed=0,
    )
    start = time.perf_counter()
    ids = [buf.start_episode() for _ in range(data.episodes)]
    for t in range(EP_LEN):
        buf.append_batch(ids, data.frames[t % POOL], data.actions[t], data.rewards[t])
    for row, episode in enumerate(ids):
        buf.end_episode(episode, "truncated", data.finals[row])
    storage = buf.memory.storage  # reading it flushes the staged rows
    fill = time.perf_counter() - start
    assert len(buf) == task["size"], (len(buf), task["size"])
    source = storage_fingerprint(storage, len(storage), ATARI_KEYS)
    del data, storage
    synced = sync_tree(scratch)
    return Job(
        op=lambda: buf.save_checkpoint(task["ckpt"], durable=task["durable"]),
        check=lambda _: source,
        close=buf.close,
        prep={"fill_s": fill, "memmap_fsync_s": synced},
    )


def replaybuf_atari_load(task: dict[str, Any]) -> Job | None:
    from replaybuf import SyncEpisodeReplayBuffer

    if not hasattr(SyncEpisodeReplayBuffer, "load_checkpoint"):
        return None

    def check(buf: SyncEpisodeReplayBuffer) -> dict[str, float]:
        try:
            assert len(buf) == task["size"], (len(buf), task["size"])
            storage = buf.memory.storage
            return storage_fingerprint(storage, len(storage), ATARI_KEYS)
        finally:
            buf.close()

    return Job(
        op=lambda: SyncEpisodeReplayBuffer.load_checkpoint(
            task["ckpt"], scratch_dir=task["scratch"]
        ),
        check=check,
    )


def torchrl_storage(kind: str, rows: int, scratch: str) -> Any:
    from torchrl.data import LazyMemmapStorage, LazyTensorStorage

    if kind == "memmap":
        return LazyMemmapStorage(rows, scratch_dir=scratch, auto_cleanup=False)
    return LazyTensorStorage(rows)


def torchrl_save(task: dict[str, Any]) -> Job:
    from tensordict import TensorDict
    from torchrl.data import TensorDictReplayBuffer

    size, scratch = task["size"], task["scratch"]
    if task["case"] == "w1":
        rb = TensorDictReplayBuffer(storage=torchrl_storage(task["kind"], size, scratch))
        for chunk in w1_chunks(size):
            rb.extend(TensorDict(chunk, batch_size=[chunk["reward"].shape[0]]))
        keys, rows = W1_KEYS, size
    else:
        data = atari_data(size)
        rb = TensorDictReplayBuffer(storage=torchrl_storage(task["kind"], data.rows, scratch))
        n = data.episodes
        for t in range(EP_LEN):  # one extend per time step: every episode's step t
            step = {"observation": data.frames[t % POOL]}
            step.update(action=data.actions[t], reward=data.rewards[t])
            rb.extend(TensorDict(step, batch_size=[n]))
        finals = {"observation": data.finals, "action": data.actions[0] * 0}
        finals["reward"] = data.rewards[0] * 0
        rb.extend(TensorDict(finals, batch_size=[n]))
        keys, rows = ATARI_KEYS, data.rows
        del data
    source = storage_fingerprint(rb.storage, rows, keys)
    synced = sync_tree(scratch)
    return Job(
        op=lambda: rb.dumps(task["ckpt"]), check=lambda _: source, prep={"memmap_fsync_s": synced}
    )


def torchrl_load(task: dict[str, Any]) -> Job:
    from torchrl.data import TensorDictReplayBuffer

    if task["case"] == "w1":
        keys, rows = W1_KEYS, task["size"]
    else:
        keys, rows = ATARI_KEYS, task["size"] // EP_LEN * (EP_LEN + 1)
    rb = TensorDictReplayBuffer(storage=torchrl_storage(task["kind"], rows, task["scratch"]))

    def check(_: Any) -> dict[str, float]:
        assert len(rb) == rows, (len(rb), rows)
        return storage_fingerprint(rb.storage, rows, keys)

    return Job(op=lambda: rb.loads(task["ckpt"]), check=check)


def torch_file(task: dict[str, Any]) -> Path:
    return Path(task["ckpt"]) / "columns.pt"


def torch_save(task: dict[str, Any]) -> Job:
    import torch

    if task["case"] == "w1":
        chunks = list(w1_chunks(task["size"]))
        columns = {key: torch.cat([c[key] for c in chunks]) for key in W1_KEYS}
        del chunks
        keys = W1_KEYS
    else:
        columns, keys = atari_columns(atari_data(task["size"])), ATARI_KEYS
    source = fingerprint(columns, keys)
    path = torch_file(task)
    path.parent.mkdir()

    def save() -> None:
        torch.save(columns, path)
        fsync_path(path)
        fsync_path(path.parent)

    return Job(op=save, check=lambda _: source)


def torch_load(task: dict[str, Any]) -> Job:
    import torch

    keys = W1_KEYS if task["case"] == "w1" else ATARI_KEYS
    return Job(
        op=lambda: torch.load(torch_file(task), weights_only=True),
        check=lambda columns: fingerprint(columns, keys),
    )


BUILDERS: dict[tuple[str, str, str], Callable[[dict[str, Any]], Job | None]] = {
    ("w1", "replaybuf", "save"): replaybuf_w1_save,
    ("w1", "replaybuf", "load"): replaybuf_w1_load,
    ("atari", "replaybuf", "save"): replaybuf_atari_save,
    ("atari", "replaybuf", "load"): replaybuf_atari_load,
    ("w1", "torchrl", "save"): torchrl_save,
    ("w1", "torchrl", "load"): torchrl_load,
    ("atari", "torchrl", "save"): torchrl_save,
    ("atari", "torchrl", "load"): torchrl_load,
    ("w1", "torch", "save"): torch_save,
    ("w1", "torch", "load"): torch_load,
    ("atari", "torch", "save"): torch_save,
    ("atari", "torch", "load"): torch_load,
}


# ================================================================== parent side
def settle(path: Path, drop: bool) -> None:
    """fsync every file under ``path``; with ``drop`` also evict them from the page cache."""
    for parent, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                if drop:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def tree_bytes(path: Path) -> int:
    return sum(
        os.path.getsize(os.path.join(parent, name))
        for parent, _, files in os.walk(path)
        for name in files
    )


def check_on_disk(folder: Path) -> str:
    """The file system type of ``folder``; refuses tmpfs (/dev/shm is RAM, not disk)."""
    folder = folder.resolve()
    best, fstype = "", "?"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            parts = line.split()
            mount = parts[1].replace("\\040", " ")
            if (folder.as_posix() + "/").startswith(mount.rstrip("/") + "/") and len(mount) > len(
                best
            ):
                best, fstype = mount, parts[2]
    if fstype in ("tmpfs", "ramfs") or folder.as_posix().startswith("/dev/shm"):
        raise SystemExit(f"{folder} is on {fstype} (RAM): pass --tmp-dir on a disk")
    return fstype


class Runner:
    """Starts one fresh process per operation and collects what it sends back."""

    def __init__(self, method: str, root: Path) -> None:
        self.ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            self.ctx.set_forkserver_preload(PRELOAD)
        self.root = root
        self.count = 0

    def folder(self, name: str) -> Path:
        self.count += 1
        return self.root / f"{name}-{self.count}"

    def child(self, task: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        receive, send = self.ctx.Pipe(duplex=False)
        process = self.ctx.Process(target=child_main, args=(task, send))
        process.start()
        send.close()
        try:
            if not receive.poll(CHILD_TIMEOUT):
                process.kill()
                return {"ok": False, "error": f"timed out after {CHILD_TIMEOUT:.0f} s"}
            reply = receive.recv()
        except EOFError:
            reply = {"ok": False, "error": "the child died without an answer"}
        finally:
            receive.close()
            process.join()
        if not reply["ok"]:
            reply["error"] += f" (exit code {process.exitcode})"
        reply["process_wall_s"] = time.perf_counter() - started
        return reply


def disk_floor(folder: Path, nbytes: int, quiet_s: float) -> dict[str, float]:
    """Sequential write + fsync and cold read of ``nbytes`` through one buffer; sha256 of it."""
    block = memoryview(bytearray(os.urandom(IO_CHUNK)))
    path = folder / "floor.bin"
    time.sleep(quiet_s)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        left = nbytes
        while left:
            view = block[: min(left, IO_CHUNK)]
            while view:
                written = os.write(fd, view)
                view, left = view[written:], left - written
        os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - start
    settle(path.parent, drop=True)
    time.sleep(quiet_s)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [block]):
            pass
    finally:
        os.close(fd)
    read_s = time.perf_counter() - start
    path.unlink()
    digest = hashlib.sha256()
    start = time.perf_counter()
    for first in range(0, nbytes, IO_CHUNK):
        digest.update(block[: min(IO_CHUNK, nbytes - first)])
    sha_s = time.perf_counter() - start
    return {"write_fsync_s": write_s, "cold_read_s": read_s, "sha256_s": sha_s}


@dataclass
class Bench:
    runner: Runner
    warm_loads: bool
    quiet_s: float
    records: list[dict[str, Any]]

    def one(self, task: dict[str, Any], label: tuple[str, str, str], repeat: int) -> dict:
        reply = self.runner.child({**task, "quiet_s": self.quiet_s})
        case, storage, implementation = label
        record = {
            "case": case,
            "storage": storage,
            "implementation": implementation,
            "op": task["op"],
            "repeat": repeat,
            **{k: v for k, v in reply.items() if k != "ok"},
        }
        if not reply["ok"]:
            record["status"] = "error"
            print(f"  {task['op']} {implementation} FAILED:\n{reply['error']}", flush=True)
        self.records.append(record)
        if record.get("status") == "ok":
            print(
                f"  {case:<22} {storage:<7} {implementation:<32} {task['op']:<4}"
                f" {record['seconds']:7.3f} s  RSS+ {record['rss_growth_mb']:8.1f} MB"
                f"  anon+ {record['anon_growth_mb']:8.1f} MB",
                flush=True,
            )
        return record

    def save_load(
        self, base: dict[str, Any], label: tuple[str, str, str], repeat: int, load: bool = True
    ) -> None:
        ckpt, scratch = self.runner.folder("ckpt"), self.runner.folder("scratch")
        scratch.mkdir()
        try:
            saved = self.one(
                {**base, "op": "save", "ckpt": str(ckpt), "scratch": str(scratch)}, label, repeat
            )
            shutil.rmtree(scratch, ignore_errors=True)
            if saved.get("status") != "ok":
                return
            saved["files_bytes"] = tree_bytes(ckpt)
            if not load:
                return
            settle(ckpt, drop=not self.warm_loads)
            scratch.mkdir()
            loaded = self.one(
                {**base, "op": "load", "ckpt": str(ckpt), "scratch": str(scratch)}, label, repeat
            )
            if loaded.get("status") == "ok":
                loaded["matches_save"] = same(saved["fingerprint"], loaded["fingerprint"])
                if not loaded["matches_save"]:
                    print(f"  MISMATCH: {saved['fingerprint']} != {loaded['fingerprint']}")
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)


def same(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-9 * max(1.0, abs(a[k])) for k in a)


def run(sizes: Sizes, root: Path, method: str, warm_loads: bool, quiet_s: float) -> dict[str, Any]:
    bench = Bench(Runner(method, root), warm_loads, quiet_s, [])
    probe = bench.runner.child({"job": "probe"})
    if not probe["ok"]:
        raise SystemExit(probe["error"])
    episode_api = probe["episode_checkpoints"]
    print(f"  episode checkpoint API present: {episode_api}", flush=True)
    w1_case = f"W1 {sizes.transitions:,} transitions"
    atari_case = f"Atari {sizes.atari_steps:,} steps"
    atari_rows = sizes.atari_steps // EP_LEN * (EP_LEN + 1)
    payload = {
        w1_case: sizes.transitions * W1_ROW_BYTES,
        atari_case: atari_rows * ATARI_ROW_BYTES,
    }
    floors = {}
    for case, nbytes in payload.items():
        floors[case] = disk_floor(root, nbytes, quiet_s)
        print(f"  {case:<22} disk floor {floors[case]}", flush=True)

    for repeat in range(sizes.w1_repeats):
        for kind in ("memmap", "tensor"):
            base = {"job": "op", "case": "w1", "size": sizes.transitions, "kind": kind}
            bench.save_load(
                {**base, "impl": "replaybuf", "durable": True}, (w1_case, kind, REPLAYBUF), repeat
            )
            bench.save_load({**base, "impl": "torchrl"}, (w1_case, kind, TORCHRL), repeat)
            bench.save_load(
                {**base, "impl": "replaybuf", "durable": False},
                (w1_case, kind, REPLAYBUF_FAST),
                repeat,
                load=False,
            )
        base = {"job": "op", "case": "w1", "size": sizes.transitions, "kind": "tensor"}
        bench.save_load({**base, "impl": "torch"}, (w1_case, "-", TORCH), repeat)

    for repeat in range(sizes.atari_repeats):
        base = {"job": "op", "case": "atari", "size": sizes.atari_steps, "kind": "memmap"}
        label = (atari_case, "memmap", REPLAYBUF)
        if episode_api:
            bench.save_load({**base, "impl": "replaybuf", "durable": True}, label, repeat)
        else:
            for op in ("save", "load"):
                bench.records.append(
                    {
                        "case": atari_case,
                        "storage": "memmap",
                        "implementation": REPLAYBUF,
                        "op": op,
                        "repeat": repeat,
                        "status": NOT_IMPLEMENTED,
                    }
                )
        bench.save_load({**base, "impl": "torchrl"}, (atari_case, "memmap", TORCHRL), repeat)
        if episode_api:
            bench.save_load(
                {**base, "impl": "replaybuf", "durable": False},
                (atari_case, "memmap", REPLAYBUF_FAST),
                repeat,
                load=False,
            )
        bench.save_load({**base, "impl": "torch"}, (atari_case, "-", TORCH), repeat)

    rows = summarize(bench.records, payload, floors)
    return {
        "benchmark": "bench_checkpoint",
        "config": {
            "transitions": sizes.transitions,
            "atari_steps": sizes.atari_steps,
            "atari_episodes": sizes.atari_steps // EP_LEN,
            "atari_max_episodes": sizes.atari_steps // EP_LEN * 11 // 10,
            "w1_repeats": sizes.w1_repeats,
            "atari_repeats": sizes.atari_repeats,
            "payload_bytes": payload,
            "start_method": method,
            "loads": "warm page cache" if warm_loads else "cold page cache (fadvise DONTNEED)",
            "threads": 1,
            "quiet_s": quiet_s,
            "mb": "10**6 bytes",
            "tmp_dir_fs": check_on_disk(root),
        },
        "versions": versions(probe),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "episode_checkpoint_api": episode_api,
        "disk_floor": floors,
        "rows": rows,
        "runs": bench.records,
    }


def versions(probe: dict[str, Any]) -> dict[str, str]:
    found = {"python": platform.python_version(), "replaybuf": probe["replaybuf"]}
    found["replaybuf_path"] = probe["replaybuf_path"]
    found["replaybuf_git"] = git_state(Path(probe["replaybuf_path"]))
    for name in ("torch", "torchrl", "tensordict"):
        found[name] = importlib.metadata.version(name)
    return found


def git_state(package: Path) -> str:
    """The commit of the replaybuf sources measured, "+dirty" when they differ from it."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(package), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(package), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if changed else "")


# ================================================================== report
def summarize(
    records: list[dict[str, Any]], payload: dict[str, int], floors: dict[str, dict]
) -> list[dict[str, Any]]:
    """One row per (case, storage, implementation): medians of seconds, maxima of growth."""
    groups: dict[tuple[str, str, str], dict[str, list[dict]]] = {}
    for r in records:
        key = (r["case"], r["storage"], r["implementation"])
        groups.setdefault(key, {"save": [], "load": []})[r["op"]].append(r)
    rows = []
    for (case, storage, implementation), ops in groups.items():
        row: dict[str, Any] = {"case": case, "storage": storage, "implementation": implementation}
        for op, runs in ops.items():
            row[op] = op_summary(runs, payload[case])
        rows.append(row)
    for case, floor in floors.items():
        rows.append(
            {
                "case": case,
                "storage": "-",
                "implementation": DISK,
                "save": {"status": "ok", "seconds": floor["write_fsync_s"]},
                "load": {"status": "ok", "seconds": floor["cold_read_s"]},
                "sha256_mb_s": payload[case] / floor["sha256_s"] / MB,
            }
        )
    for row in rows:
        for op in ("save", "load"):
            summary = row.get(op)
            if summary and summary.get("seconds"):
                summary["mb_s"] = payload[row["case"]] / summary["seconds"] / MB
    for row in rows:
        torch_row = next(
            (r for r in rows if r["case"] == row["case"] and r["implementation"] == TORCH), None
        )
        for op in ("save", "load"):
            mine = (row.get(op) or {}).get("seconds")
            theirs = ((torch_row or {}).get(op) or {}).get("seconds")
            if mine and theirs:
                row[op]["ratio_to_torch"] = mine / theirs
    order = [REPLAYBUF, REPLAYBUF_FAST, TORCHRL, TORCH, DISK]
    cases = list(payload)
    kinds = ["memmap", "tensor", "-"]
    rows.sort(
        key=lambda r: (
            cases.index(r["case"]),
            kinds.index(r["storage"]),
            order.index(r["implementation"]),
        )
    )
    return rows


def op_summary(runs: list[dict[str, Any]], payload: int) -> dict[str, Any]:
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        status = runs[0].get("status", "error") if runs else "n/a"
        return {"status": status}
    out: dict[str, Any] = {
        "status": "ok",
        "seconds": statistics.median(r["seconds"] for r in ok),
        "runs_s": [r["seconds"] for r in ok],
        "rss_growth_mb": max(r["rss_growth_mb"] for r in ok),
        "hwm_growth_mb": max(r["hwm_growth_mb"] for r in ok),
        "anon_growth_mb": max(r["anon_growth_mb"] for r in ok),
        "file_growth_mb": max(r["file_growth_mb"] for r in ok),
        "payload_bytes": payload,
    }
    if any("files_bytes" in r for r in ok):
        out["files_bytes"] = max(r.get("files_bytes", 0) for r in ok)
    if any("matches_save" in r for r in ok):
        out["matches_save"] = all(r.get("matches_save", False) for r in ok)
    if len(ok) < len(runs):
        out["failed_runs"] = len(runs) - len(ok)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        "case",
        "storage",
        "implementation",
        "save s",
        "save MB/s",
        "load s",
        "load MB/s",
        "peak RSS+ MB save/load",
        "anon+ MB save/load",
        "x torch.save save/load",
    )
    cells = [header]
    for r in rows:
        save, load = r.get("save") or {}, r.get("load") or {}
        if save.get("status") == NOT_IMPLEMENTED:
            cells.append((r["case"], r["storage"], r["implementation"], NOT_IMPLEMENTED))
            continue
        cells.append(
            (
                r["case"],
                r["storage"],
                r["implementation"],
                num(save.get("seconds"), ".3f"),
                num(save.get("mb_s"), ",.0f"),
                num(load.get("seconds"), ".3f"),
                num(load.get("mb_s"), ",.0f"),
                pair(save.get("rss_growth_mb"), load.get("rss_growth_mb"), ",.0f"),
                pair(save.get("anon_growth_mb"), load.get("anon_growth_mb"), ",.0f"),
                pair(save.get("ratio_to_torch"), load.get("ratio_to_torch"), ".2f"),
            )
        )
    widths = [max(len(c[i]) for c in cells if len(c) == len(header)) for i in range(len(header))]
    right = {3, 4, 5, 6, 7, 8, 9}
    lines = []
    last_case = None
    for n, c in enumerate(cells):
        if n > 1 and c[0] != last_case:
            lines.append("")
        last_case = c[0]
        if len(c) < len(header):  # a "n/a" row: the note spans the numbers
            lines.append(" | ".join(v.ljust(w) for v, w in zip(c, widths, strict=False)).rstrip())
            continue
        padded = [
            v.rjust(w) if i in right else v.ljust(w)
            for i, (v, w) in enumerate(zip(c, widths, strict=True))
        ]
        lines.append(" | ".join(padded).rstrip())
        if n == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def pair(a: float | None, b: float | None, spec: str) -> str:
    return f"{num(a, spec)} / {num(b, spec)}"


def notes(report: dict[str, Any]) -> list[str]:
    """Derived observations: what fsync, hashing and the page cache cost in this run."""
    out = []
    rows = report["rows"]

    def find(case: str, storage: str, implementation: str) -> dict[str, Any]:
        return next(
            (
                r
                for r in rows
                if r["case"] == case
                and r["storage"] == storage
                and r["implementation"] == implementation
            ),
            {},
        )

    for case, floor in report["disk_floor"].items():
        nbytes = report["config"]["payload_bytes"][case]
        out.append(
            f"{case}: payload {nbytes / MB:,.0f} MB; disk floor write+fsync"
            f" {nbytes / floor['write_fsync_s'] / MB:,.0f} MB/s, cold read"
            f" {nbytes / floor['cold_read_s'] / MB:,.0f} MB/s, sha256 (one core)"
            f" {nbytes / floor['sha256_s'] / MB:,.0f} MB/s"
        )
        for storage in ("memmap", "tensor"):
            durable = (find(case, storage, REPLAYBUF).get("save") or {}).get("runs_s")
            fast = (find(case, storage, REPLAYBUF_FAST).get("save") or {}).get("runs_s")
            if not (durable and fast):
                continue
            a, b = statistics.median(durable), statistics.median(fast)
            spread = max(max(durable) - min(durable), max(fast) - min(fast))
            if a > b and a - b > spread / 2:
                verdict = f"fsync costs about {a - b:.2f} s ({(a - b) / a:.0%})"
            elif a > b:
                verdict = f"{a - b:.3f} s apart, within the run-to-run spread ({spread:.3f} s)"
            else:
                verdict = "durable=False was not faster: the fsync cost is lost in the noise"
            out.append(
                f"{case}, {storage}: save durable {a:.3f} s vs durable=False {b:.3f} s: {verdict}"
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under 60 seconds")
    parser.add_argument("--transitions", type=int, default=None, help="W1 transitions")
    parser.add_argument("--atari-steps", type=int, default=None, help="Atari steps (x1000)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats of every operation")
    parser.add_argument("--warm-loads", action="store_true", help="keep checkpoints cached")
    parser.add_argument(
        "--quiet-s",
        type=float,
        default=None,
        help=f"rest before each measured operation ({QUIET_S} s; --quick: 1 s)",
    )
    parser.add_argument(
        "--start-method",
        choices=("forkserver", "spawn"),
        default="forkserver",
        help="how each measured process starts",
    )
    parser.add_argument("--tmp-dir", type=Path, default=None, help="a folder on disk")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.transitions is not None or args.atari_steps is not None or args.repeats is not None:
        sizes = Sizes(
            transitions=args.transitions or sizes.transitions,
            atari_steps=args.atari_steps or sizes.atari_steps,
            w1_repeats=args.repeats or sizes.w1_repeats,
            atari_repeats=args.repeats or sizes.atari_repeats,
        )
    if sizes.atari_steps % EP_LEN or sizes.atari_steps < EP_LEN:
        parser.error(f"--atari-steps must be a positive multiple of {EP_LEN}")
    print(f"bench_checkpoint: {sizes}", flush=True)
    check_on_disk(args.tmp_dir or Path(tempfile.gettempdir()))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=args.tmp_dir) as scratch:
        quiet_s = args.quiet_s if args.quiet_s is not None else 1.0 if args.quick else QUIET_S
        report = run(sizes, Path(scratch), args.start_method, args.warm_loads, quiet_s)
    report["config"]["quick"] = args.quick
    report["wall_s"] = time.perf_counter() - started
    report["notes"] = notes(report)
    print()
    print(table(report["rows"]))
    print()
    for line in report["notes"]:
        print(f"* {line}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
