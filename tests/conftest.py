"""Shared fixtures: buffers that are always closed, and a session-wide leftover-file check."""

from __future__ import annotations

import gc
import shutil
import tempfile
from pathlib import Path

import pytest

from replaybuf import ReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.accel.numba_loader import NUMBA_ENV, compiled_kernels, kernels_unavailable_reason
from replaybuf.storage.tensorguard import GUARD_ENV

# On a fresh checkout the first use of replaybuf.accel.numba_kernels compiles them (a few seconds;
# numba
# caches them next to the module after that). Do it once here, so that no timing-sensitive
# test (or the Ray actor's process, which then loads the cache) waits for the compiler.
compiled_kernels()


@pytest.fixture(scope="session", autouse=True)
def no_scratch_folder_left_behind():
    """Run the session with a private temp dir and fail if any ``replaybuf-*`` folder outlives it.

    A private temp dir keeps the check exact: folders made by other processes sharing ``/tmp``
    cannot trip it, and every buffer built with the default ``scratch_dir`` lands in it.
    """
    temp = Path(tempfile.mkdtemp(prefix="rbtests-"))
    previous = tempfile.tempdir
    tempfile.tempdir = str(temp)
    try:
        yield temp
        gc.collect()  # buffers a test forgot to close are cleaned up when collected
        left = sorted(p.name for p in temp.glob("replaybuf-*"))
        assert left == [], f"scratch folders left behind in {temp}: {left}"
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def make_buffer(tmp_path):
    """A factory for CPU buffers with scratch files under ``tmp_path``; all closed at teardown."""
    made: list[ReplayBuffer] = []

    def make(
        buffer_size: int = 8,
        *,
        storage: str = "memmap",
        device: str = "cpu",
        storing_device: str = "cpu",
        seed: int | None = 0,
    ) -> ReplayBuffer:
        buf = ReplayBuffer(
            device,
            storing_device,
            buffer_size,
            storage=storage,
            scratch_dir=tmp_path,
            seed=seed,
        )
        made.append(buf)
        return buf

    yield make
    for buf in made:
        buf.close()


@pytest.fixture(params=["memmap", "tensor"])
def storage(request) -> str:
    """Both CPU storage kinds: every test using it runs once per kind."""
    return request.param


@pytest.fixture(params=["kernels", "attributes", "numpy"])
def by_address(request, monkeypatch) -> bool:
    """Whether the per-step fast paths copy tensors from their addresses (the compiled kernels
    run) or through numpy() (``REPLAYBUF_NUMBA=0``): the buffers a test makes take that path.
    By address, tensors are checked by torch's guard first ("kernels") or by their attributes
    alone ("attributes": ``REPLAYBUF_TENSOR_GUARD=0``)."""
    if request.param == "numpy":
        monkeypatch.setenv(NUMBA_ENV, "0")
        return False
    if request.param == "attributes":
        monkeypatch.setenv(GUARD_ENV, "0")
    if compiled_kernels() is None:
        pytest.skip(f"the compiled kernels do not run: {kernels_unavailable_reason()}")
    return True


@pytest.fixture
def make_episode_buffer(tmp_path):
    """A factory for sync episode buffers with scratch files under ``tmp_path``, all closed."""
    made: list[SyncEpisodeReplayBuffer] = []

    def factory(max_steps=64, max_episodes=None, **kwargs):
        kwargs.setdefault("scratch_dir", tmp_path)
        kwargs.setdefault("seed", 0)
        buf = SyncEpisodeReplayBuffer(max_steps, max_episodes, **kwargs)
        made.append(buf)
        return buf

    yield factory
    for buf in made:
        buf.close()
