"""The fields of an SB3 sample: stored transitions (n-step windows of the episode buffer, a cut
window finished with the held-aside newest step) and held-aside ones, merged in draw order."""

from __future__ import annotations

import torch

from replaybuf.buffers import SyncEpisodeReplayBuffer
from replaybuf.integrations.sb3.held import HeldAside


def stored_fields(
    buffer: SyncEpisodeReplayBuffer,
    count: int,
    n_steps: int,
    gamma: float,
    held: HeldAside,
    episodes: list[int | None],
) -> dict[str, torch.Tensor]:
    """``count`` transitions drawn from ``buffer``, as sample fields (``episodes``: each
    environment's episode in progress)."""
    batch = buffer.sample_n_step(count, n=n_steps, gamma=gamma)
    obs = batch.get("observation")
    fields = {
        "obs": obs,
        "action": batch.get("action"),
        "next_obs": batch.get("next_observation"),
        "done": batch.get("terminated"),
        "reward": batch.get("reward"),
        "steps": batch.get("actual_n"),
    }
    if n_steps > 1:
        finish_cut_windows(fields, batch.get("cut"), batch.get("episode_id"), held, episodes, gamma)
    return fields


def finish_cut_windows(
    fields: dict[str, torch.Tensor],
    cut: torch.Tensor,
    episode_id: torch.Tensor,
    held: HeldAside,
    episodes: list[int | None],
    gamma: float,
) -> None:
    """A window cut short at an episode's newest stored observation continues, as in SB3,
    with that env's held-aside transition (SB3 ends it there: its next observation is
    known, the one after it not yet)."""
    if not bool(cut.any()):
        return
    envs = [i for i in range(held.n_envs) if held.pending[i]]
    if not envs:
        return
    device = cut.device
    ids = torch.tensor([episodes[i] for i in envs], device=device)
    match = episode_id.unsqueeze(1) == ids.unsqueeze(0)  # [B, envs]
    extend = cut & match.any(1)
    rows = torch.nonzero(extend).squeeze(1)
    if rows.numel() == 0:
        return
    env = torch.tensor(envs)[match[rows].float().argmax(1).cpu()].numpy()
    steps = fields["steps"]
    scale = gamma ** steps[rows].to(torch.float64)
    add = torch.from_numpy(held.reward[env]).to(device, torch.float64) * scale
    reward = fields["reward"]
    reward[rows] = (reward[rows].to(torch.float64) + add).to(reward.dtype)
    fields["next_obs"][rows] = torch.from_numpy(held.next_obs[env]).to(device)
    steps[rows] += 1


def interleave(
    parts: list[dict[str, torch.Tensor]], aside: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Stored samples where ``aside`` is False and held-aside ones where it is True, in order."""
    stored, held = parts
    out = {}
    for name, first in stored.items():
        second = held[name].to(first.device)
        merged = torch.empty(
            (aside.shape[0], *first.shape[1:]), dtype=first.dtype, device=first.device
        )
        mask = aside.to(first.device)
        merged[~mask] = first
        merged[mask] = second.to(first.dtype)
        out[name] = merged
    return out
