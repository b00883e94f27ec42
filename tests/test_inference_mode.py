"""Collection under ``torch.inference_mode()``, training outside it: what an RL loop does.

A tensor allocated in inference mode refuses in-place updates outside it, so every tensor a
buffer keeps (storage columns, the staging columns, the priority index) must be allocated as a
normal tensor even when the first write that allocates it runs in inference mode.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from replaybuf import ReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.accel import numba_loader as compiled


def grad_obs(value: float) -> torch.Tensor:
    """An observation the fast paths decline (it needs grad): the general path stages it."""
    return torch.full((3,), value, requires_grad=True)


@pytest.mark.parametrize("storage", ["tensor", "memmap"])
@pytest.mark.parametrize("numba", [True, False])
def test_episodes_collected_in_inference_mode_take_appends_priorities_and_loads_outside(
    tmp_path: Path, storage: str, numba: bool, monkeypatch: pytest.MonkeyPatch
):
    # Without the kernels storage rows are written by index_copy_, in place.
    monkeypatch.setenv(compiled.NUMBA_ENV, "1" if numba else "0")
    buf = SyncEpisodeReplayBuffer(
        64, 16, storage=storage, scratch_dir=tmp_path, seed=0, prioritized=True
    )
    ids = [buf.start_episode() for _ in range(2)]
    with torch.inference_mode():  # the first writes allocate storage and staging
        buf.append_batch(ids, torch.zeros(2, 3), torch.zeros(2), torch.ones(2))
        buf.append_observation_action_reward(ids[0], torch.ones(3), 0.0, 1.0)
    # Outside: every path that writes in place, general and fast, batch and single.
    buf.append_observation_action_reward(ids[0], grad_obs(2.0), 0.0, 1.0)
    buf.append_batch(ids, torch.full((2, 3), 3.0), torch.zeros(2), torch.ones(2))
    buf.append_batch(
        ids, np.full((2, 3), 4.0, np.float32), np.zeros(2, np.float32), np.ones(2, np.float32)
    )
    buf.append_batch(
        ids, torch.full((2, 3), 5.0, requires_grad=True), torch.zeros(2), torch.ones(2)
    )
    buf.end_episode(ids[1], "terminated", grad_obs(6.0))
    batch = buf.sample_n_step(8)
    buf.update_priorities(batch["index"], torch.rand(8) + 0.1)
    got = buf.get_episode(ids[0])["observation"][:, 0].tolist()
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    buf.save_checkpoint(tmp_path / "ckpt")
    with torch.inference_mode():
        loaded = SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ckpt")
    loaded.append_observation_action_reward(ids[0], grad_obs(7.0), 0.0, 1.0)
    loaded.update_priorities(loaded.sample_n_step(4)["index"], torch.ones(4))
    assert loaded.get_episode(ids[0])["observation"][:, 0].tolist() == [*got, 7.0]


@pytest.mark.parametrize("storage", ["tensor", "memmap"])
def test_transitions_collected_in_inference_mode_take_writes_and_priorities_outside(
    tmp_path: Path, storage: str
):
    buf = ReplayBuffer(
        "cpu", "cpu", 16, storage=storage, scratch_dir=tmp_path, seed=0, prioritized=True
    )
    step = {"obs": torch.zeros(3), "action": torch.zeros(()), "reward": torch.ones(())}
    with torch.inference_mode():
        buf.add(step)
        buf.add_batch({k: v.expand(4, *v.shape) for k, v in step.items()})
    buf.add({**step, "obs": grad_obs(1.0)})
    buf.add_batch({k: v.expand(20, *v.shape).clone() for k, v in step.items()})  # wraps
    batch = buf.sample_batch(4)
    buf.update_priorities(batch["index"], torch.rand(4) + 0.1)
    assert len(buf) == 16
