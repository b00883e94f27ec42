"""The fields of an SB3 sample: stored transitions (n-step windows of the episode buffer, a cut
window finished with the held-aside newest step) and held-aside ones, merged in draw order."""

from __future__ import annotations

import torch

from replaybuf.buffers import SyncEpisodeReplayBuffer
from replaybuf.integrations.sb3.held import HeldAside
from replaybuf.sampling.budget import transition_bytes
from replaybuf.sampling.host import HostNStep
from replaybuf.sampling.nstep import host_gathers
from replaybuf.sampling.windows import NO_N, compiled_windows

# What a one-step SB3 sample takes of an n-step batch: field name, batch key.
_ONE_STEP = (
    ("obs", ("observation",)),
    ("next_obs", ("next_observation",)),
    ("action", ("action",)),
    ("done", ("terminated",)),
    ("reward", ("reward",)),
)


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
    if n_steps == 1:
        fields = one_step_fields(buffer, count, gamma)
        if fields is not None:
            return fields
    # The batch's leaves in one pass (its fields are flat: the adapter stores no Dict space).
    batch = dict(buffer.sample_n_step(count, n=n_steps, gamma=gamma).items())
    fields = {
        "obs": batch["observation"],
        "action": batch["action"],
        "next_obs": batch["next_observation"],
        "done": batch["terminated"],
        "reward": batch["reward"],
        "steps": batch["actual_n"],
    }
    if n_steps > 1:
        finish_cut_windows(fields, batch["cut"], batch["episode_id"], held, episodes, gamma)
    return fields


def one_step_fields(
    buffer: SyncEpisodeReplayBuffer, count: int, gamma: float
) -> dict[str, torch.Tensor] | None:
    """The fields of ``buffer.sample_n_step(count, n=1, gamma=gamma)`` a one-step sample
    holds, drawn and gathered as that call's host path (CPU storage and delivery, uniform, no
    frame stack) draws and gathers them, so the same values for the same generator state,
    without the batch's other tensors and its TensorDict. None, with nothing drawn, where that
    path does not apply (``sample_n_step`` then)."""
    lock = buffer._lock  # as every public call of the buffer: atomic with respect to others
    lock.acquire()
    try:
        buffer._require_steps("sample")
        path = buffer._chosen_paths().n_step
        if type(path) is not HostNStep:
            return None
        core, plan = path.core, path.plan
        if core.priorities is not None or plan.frame_stack is not None:
            return None
        buffer._ensure_fits(count, transition_bytes(buffer.spec, 1, 1))
        start = core.anchors.sample_host(count, path.generator)
        w = compiled_windows(plan.windows, start, NO_N, 1, plan.links, plan.rewards, gamma)
        # The windows are numpy arrays on this path, though Windows types them as either kind.
        ends, info = w.ends, w.values()
        views = plan.observations, plan.steps
        values = host_gathers(*views, ends, start, info)  # type: ignore[arg-type]
    finally:
        lock.release()
    by_key = dict(zip(plan.keys, values, strict=True))
    return {name: torch.from_numpy(by_key[key]) for name, key in _ONE_STEP}


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
