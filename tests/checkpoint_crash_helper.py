"""A fork server for the checkpoint crash tests (run as a script; imported only for its data).

Importing torch and replaybuf takes seconds, so the server does it once and runs each trial in a
forked child: the child saves checkpoint ``first`` (when given), then overwrites it with
``second`` and is SIGKILLed, either by itself at a ``REPLAYBUF_CRASH_AT`` phase or by the server
after ``kill_after`` seconds. The test process then loads what is left.

One JSON request per stdin line, one JSON reply per stdout line::

    {"op": "save", "dir": D, "first": 1 | null, "second": 2, "crash_at": "phase" | null,
     "kill_after": 0.05 | null}
    {"op": "read", "dir": D, "crash_at": "phase" | null}
    -> {"signal": 9 | null, "exit": 0 | null, "seconds": 0.21, "started_second": true}
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import torch

KIND = "ReplayBuffer"
ROWS = 1024
CHUNK_BYTES = 4 << 20  # small slices, so the files of ~16 MiB take several chunks each


def make_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Deterministic data for ``seed`` (about 32 MiB); every value differs between seeds."""
    g = torch.Generator().manual_seed(seed)
    return {
        "obs": torch.randint(0, 256, (ROWS, 16384), dtype=torch.uint8, generator=g),
        "next/obs": torch.randn(ROWS, 4096, generator=g),
        "action": torch.randint(0, 1 << 40, (ROWS, 6), generator=g),
        "reward": torch.randn(ROWS, generator=g) + seed,
        "terminated": torch.rand(ROWS, generator=g) < 0.5,
    }


def _serve() -> None:
    from replaybuf.persist import format as checkpoint
    from replaybuf.persist.format import streams

    streams.CHUNK_BYTES = CHUNK_BYTES
    data = {seed: make_tensors(seed) for seed in (1, 2)}

    def save(directory: str, seed: int) -> None:
        checkpoint.write_checkpoint(directory, KIND, {"seed": seed, "rows": ROWS}, data[seed])

    for line in sys.stdin:
        request = json.loads(line)
        ready_r, ready_w = os.pipe()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 0
            try:
                os.close(ready_r)
                if request["op"] == "save" and request.get("first") is not None:
                    save(request["dir"], request["first"])
                if request.get("crash_at"):
                    os.environ[checkpoint.CRASH_ENV] = request["crash_at"]
                os.write(ready_w, b"1")
                if request["op"] == "save":
                    save(request["dir"], request["second"])
                else:
                    checkpoint.read_checkpoint(request["dir"], KIND).close()
            except BaseException:
                traceback.print_exc()
                code = 3
            os._exit(code)
        os.close(ready_w)
        started = os.read(ready_r, 1) == b"1"
        os.close(ready_r)
        start = time.monotonic()
        if started and request.get("kill_after") is not None:
            time.sleep(request["kill_after"])
            os.kill(pid, signal.SIGKILL)  # a child that already exited is a zombie: no error
        _, status = os.waitpid(pid, 0)
        reply = {
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "seconds": time.monotonic() - start,
            "started_second": started,
        }
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)  # no thread pool before fork()
    _serve()
