"""replaybuf quick start: the transition buffer, then episodes with n-step sampling.

Run it with `make demo`. Every size is a documented knob at the top; the smoke test runs it
with tiny sizes (QUICKSTART_STEPS=50).
"""

from __future__ import annotations

import asyncio
import os

import torch

from replaybuf import EpisodeReplayBuffer, ReplayBuffer

STEPS = int(os.environ.get("QUICKSTART_STEPS", "1000"))  # transitions written per demo
BUFFER_SIZE = 512  # capacity of the transition buffer (smaller than STEPS: it wraps)
BATCH = 32  # sampled batch size
N, GAMMA = 3, 0.9  # n-step return horizon and discount
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where batches are delivered


def transitions() -> None:
    """ObjectRL-style: store on CPU memmap, train on DEVICE."""
    with ReplayBuffer(DEVICE, "cpu", BUFFER_SIZE, seed=0) as buf:
        for start in range(0, STEPS, 100):
            rows = min(100, STEPS - start)
            buf.add_batch(
                {
                    "obs": torch.randn(rows, 4),
                    "action": torch.randint(0, 2, (rows,)),
                    "reward": torch.ones(rows),
                    "done": torch.zeros(rows, dtype=torch.bool),
                }
            )
        batch = buf.sample_batch(BATCH)
        print(f"ReplayBuffer: {len(buf)} stored of {buf.buffer_size}, pointer {buf.pointer}")
        print(f"  sampled obs {tuple(batch['obs'].shape)} on {batch.device}")
        epochs = sum(1 for _ in buf.create_epoch_iterator(BATCH, n_epochs=1))
        print(
            f"  one shuffled epoch = {epochs} batches (calculate_num_batches says "
            f"{buf.calculate_num_batches(BATCH)})"
        )


async def collector(buf: EpisodeReplayBuffer, length: int, seed: int) -> None:
    """One environment worker: writes an episode of ``length`` steps, then ends it."""
    episode = await buf.start_episode(agent_id=f"worker-{seed}")
    for t in range(length):
        obs = torch.full((4,), float(t))
        await buf.append_observation_action_reward(episode, obs, action=t % 2, reward=1.0)
        await asyncio.sleep(0)  # let the other workers interleave
    status = "truncated" if seed % 2 else "terminated"
    await buf.end_episode(episode, status, final_observation=torch.full((4,), float(length)))


async def episodes() -> None:
    """Several asyncio workers write episodes while the learner samples n-step windows."""
    async with EpisodeReplayBuffer(max_steps=STEPS, device=DEVICE, seed=0) as buf:
        lengths = [max(1, STEPS // 8 - 3 * i) for i in range(4)]
        await asyncio.gather(*(collector(buf, n, i) for i, n in enumerate(lengths)))
        await buf.wait_for_steps(BATCH)
        batch = await buf.sample_n_step(BATCH, n=N, gamma=GAMMA)
        print(f"EpisodeReplayBuffer: {await buf.stats()}")
        for key in ("start_step", "actual_n", "reward", "next_discount", "terminated", "truncated"):
            print(f"  {key:<13} {batch[key][:6].tolist()}")
        sequences = await buf.sample_sequences(4, seq_len=8)
        print(
            f"  sequences {tuple(sequences.batch_size)}, all real: {bool(sequences['mask'].all())}"
        )


if __name__ == "__main__":
    transitions()
    asyncio.run(episodes())
