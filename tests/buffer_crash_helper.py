"""Kills a buffer's ``save_checkpoint`` mid-overwrite (run as a script; imported for its data).

``python buffer_crash_helper.py KIND ROOT PHASE...``: ``KIND`` is ``ring`` (ReplayBuffer) or
``episodes`` (SyncEpisodeReplayBuffer). For each ``PHASE`` (a ``REPLAYBUF_CRASH_AT`` value) a
forked child saves buffer 1 to ``ROOT/<i>/ckpt``, then overwrites it with buffer 2 with the
crash hook armed, and is SIGKILLed at that phase. Importing torch once and forking keeps each
trial fast. Prints one JSON list: ``{"phase", "signal", "exit"}`` per trial.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

from replaybuf import ReplayBuffer, SyncEpisodeReplayBuffer

CAPACITY = 96
CHUNK_BYTES = 16 << 10  # small slices, so every row file takes several chunks


def make_source(seed: int, scratch: str | os.PathLike) -> ReplayBuffer:
    """A wrapped memmap buffer whose rows, pointer and sampler state all depend on ``seed``."""
    g = torch.Generator().manual_seed(seed)
    buf = ReplayBuffer("cpu", "cpu", CAPACITY, storage="memmap", scratch_dir=scratch, seed=seed)
    rows = CAPACITY + 17 * seed
    buf.add_batch(
        {
            "obs": torch.randn(rows, 64, generator=g),
            "pixels": torch.randint(0, 256, (rows, 8, 8), dtype=torch.uint8, generator=g),
            "action": torch.randint(0, 1 << 40, (rows,), generator=g),
            "next": {"obs": torch.randn(rows, 64, generator=g)},
        }
    )
    for _ in range(seed):
        buf.sample_batch(5)  # move the sampler's state on
    return buf


def make_episodes(seed: int, scratch: str | os.PathLike) -> SyncEpisodeReplayBuffer:
    """Interleaved episodes (some ended, some in progress, evictions) that depend on ``seed``."""
    g = torch.Generator().manual_seed(seed)
    buf = SyncEpisodeReplayBuffer(60, storage="memmap", scratch_dir=scratch, seed=seed)
    ids = [buf.start_episode(f"agent{i}") for i in range(4)]
    for t in range(12 + 5 * seed):
        for e in ids:
            if e in buf._core.episodes:  # evicted ones are replaced below
                pixels = torch.randint(0, 256, (8, 8), dtype=torch.uint8, generator=g)
                buf.append_observation_action_reward(e, {"pixels": pixels}, t, float(t % 3))
        if t % 7 == 6:
            if ids[t % 4] in buf._core.episodes:
                buf.end_episode(ids[t % 4], "truncated", final_observation={"pixels": pixels})
            ids[t % 4] = buf.start_episode("late")
    for _ in range(seed):
        buf.sample_n_step(5, n=2)  # move the sampler's state on
    return buf


SOURCES = {"ring": make_source, "episodes": make_episodes}


def _trial(kind: str, root: Path, phase: str) -> None:
    """The child: save buffer 1, then overwrite it with buffer 2 and die at ``phase``."""
    from replaybuf.persist.format import CRASH_ENV, streams

    streams.CHUNK_BYTES = CHUNK_BYTES
    scratch = root / "scratch"
    scratch.mkdir(parents=True)
    with SOURCES[kind](1, scratch) as first:
        first.save_checkpoint(root / "ckpt")
    second = SOURCES[kind](2, scratch)
    os.environ[CRASH_ENV] = phase
    second.save_checkpoint(root / "ckpt")


def main(kind: str, root: str, phases: list[str]) -> None:
    torch.set_num_threads(1)  # no thread pool before fork()
    results = []
    for i, phase in enumerate(phases):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 0
            try:
                _trial(kind, Path(root) / str(i), phase)
            except BaseException:
                traceback.print_exc()
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        results.append(
            {
                "phase": phase,
                "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            }
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
