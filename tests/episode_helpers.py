"""Deterministic episode data and checks of sampled output against the reference model.

Step t of episode e holds ``obs = [e, t, 0]``, ``action = 1000 e + t``, a reward that is a
multiple of 1/4 (exact in float32) and extras ``logp = -(t + 1) / 8``, ``flag = [t even, 1]``.
The final observation of an episode of T steps is ``[e, T, 1]``. So any sampled value names
the episode and step it came from, and a window that crossed episodes would show.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any
from unittest import mock

import torch
from reference import ReferenceBuffer
from tensordict import TensorDict

from replaybuf.episodes.anchors import AnchorSet
from replaybuf.episodes.links import RowLinks


def mirrored() -> Any:
    """Episode buffers built inside read their row bookkeeping through device copies updated
    when read, and run their index math in torch on those copies: CUDA storage's path, on the
    CPU."""
    return mock.patch.multiple(
        "replaybuf.episodes.core",
        RowLinks=partial(RowLinks, mirror=True),
        AnchorSet=partial(AnchorSet, mirror=True),
    )


def obs(e: int, t: int) -> torch.Tensor:
    return torch.tensor([e, t, 0], dtype=torch.float32)


def final_obs(e: int, steps: int) -> torch.Tensor:
    return torch.tensor([e, steps, 1], dtype=torch.float32)


def action(e: int, t: int) -> torch.Tensor:
    return torch.tensor(1000 * e + t, dtype=torch.int64)


def reward(e: int, t: int) -> float:
    return ((7 * e + 3 * t) % 9 - 4) / 4


def extras(t: int) -> dict[str, torch.Tensor]:
    return {
        "logp": torch.tensor(-(t + 1) / 8, dtype=torch.float32),
        "flag": torch.tensor([t % 2 == 0, True]),
    }


def step(e: int, t: int) -> tuple[torch.Tensor, torch.Tensor, float, dict[str, torch.Tensor]]:
    return obs(e, t), action(e, t), reward(e, t), extras(t)


def batch_of(steps: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """``append_batch`` arguments stacking the ``step(e, t)`` tuples of several episodes."""
    return (
        torch.stack([s[0] for s in steps]),
        torch.stack([s[1] for s in steps]),
        torch.tensor([s[2] for s in steps]),
        {name: torch.stack([s[3][name] for s in steps]) for name in ("logp", "flag")},
    )


STAT_KEYS = (
    "episodes",
    "in_progress",
    "terminated",
    "truncated",
    "steps",
    "valid_steps",
    "agents",
    "evicted_episodes",
)


def assert_counts_agree(buf, ref: ReferenceBuffer, stats: dict | None = None) -> None:
    stats = buf.stats() if stats is None else stats
    assert {k: stats[k] for k in STAT_KEYS} == ref.stats()
    assert len(buf) == ref.valid_steps
    assert stats["bytes"] > 0 or ref.steps == 0


def _same(got: torch.Tensor, want: Any) -> bool:
    want = torch.as_tensor(want)
    return got.shape == want.shape and bool(torch.equal(got.to(want.dtype), want))


def pairs_of(batch: TensorDict) -> list[tuple[int, int]]:
    return list(zip(batch["episode_id"].tolist(), batch["start_step"].tolist(), strict=True))


def assert_nstep_row(batch: TensorDict, i: int, want: dict[str, Any]) -> None:
    """Row ``i`` of an n-step batch equals the reference's expectation, field by field."""
    e, t = want["episode_id"], want["start_step"]
    where = f"episode {e} step {t}"
    assert int(batch["episode_id"][i]) == e, where
    assert int(batch["start_step"][i]) == t, where
    assert int(batch["actual_n"][i]) == want["actual_n"], where
    assert _same(batch["observation"][i], want["observation"]), where
    assert _same(batch["action"][i], want["action"]), where
    assert _same(batch["next_observation"][i], want["next_observation"]), where
    newest = batch["next_observation"][i]
    while newest.dim() > 1:  # a frame stack: its newest frame
        newest = newest[-1]
    assert int(newest[0]) == e, f"{where}: window crossed episodes"
    assert bool(batch["terminated"][i]) == want["terminated"], where
    assert bool(batch["truncated"][i]) == want["truncated"], where
    assert bool(batch["cut"][i]) == want["cut"], where
    assert math.isclose(float(batch["reward"][i]), want["reward"], rel_tol=1e-6, abs_tol=1e-6)
    assert math.isclose(
        float(batch["next_discount"][i]), want["next_discount"], rel_tol=1e-6, abs_tol=1e-7
    ), where
    if want["extras"] is not None:
        for name, value in want["extras"].items():
            assert _same(batch[name][i], value), f"{where}: extras {name}"


def assert_nstep_batch(batch: TensorDict, ref: ReferenceBuffer, n, gamma: float) -> None:
    """Every row of ``batch`` is a valid step of the reference, with the reference's fields.

    For a ``(low, high)`` n each row drew its own n; the row must match the reference for one
    of them.
    """
    valid = ref.valid_pairs()
    for i, pair in enumerate(pairs_of(batch)):
        assert pair in valid, f"sampled {pair}, which is not a stored valid step"
        if isinstance(n, tuple):
            candidates = [ref.nstep(*pair, k, gamma) for k in range(n[0], n[1] + 1)]
            m = int(batch["actual_n"][i])
            cut = bool(batch["cut"][i])
            matching = [c for c in candidates if c["actual_n"] == m and c["cut"] == cut]
            assert matching, f"{pair}: actual_n={m}, cut={cut} fits no n in {n}"
            assert_nstep_row(batch, i, matching[0])
        else:
            assert_nstep_row(batch, i, ref.nstep(*pair, n, gamma))


def assert_sequence_batch(batch: TensorDict, ref: ReferenceBuffer, length: int) -> None:
    """Each [L] row is consecutive steps of one stored episode, padded with zeros past its end."""
    assert batch.batch_size == (batch.batch_size[0], length)
    for b in range(batch.batch_size[0]):
        e = int(batch["episode_id"][b, 0])
        t = int(batch["step"][b, 0])
        assert (e, t) in ref.valid_pairs(), f"sequence starts at {(e, t)}, not a valid step"
        want = ref.sequence(e, t, length)
        for k, w in enumerate(want):
            assert bool(batch["mask"][b, k]) == (w is not None), (e, t, k)
            if w is None:
                for key in ("observation", "action", "reward", "next_observation", "logp"):
                    assert not batch[key][b, k].any(), f"padding {key} not zero at {(e, t, k)}"
                continue
            assert int(batch["episode_id"][b, k]) == e
            assert int(batch["step"][b, k]) == w["step"]
            assert _same(batch["observation"][b, k], w["observation"])
            assert _same(batch["action"][b, k], w["action"])
            assert float(batch["reward"][b, k]) == w["reward"]
            assert _same(batch["next_observation"][b, k], w["next_observation"])
            assert bool(batch["terminated"][b, k]) == w["terminated"]
            assert bool(batch["truncated"][b, k]) == w["truncated"]
            if w["extras"] is not None:
                for name, value in w["extras"].items():
                    assert _same(batch[name][b, k], value)


def assert_episode_record(record: TensorDict, ref: ReferenceBuffer, e: int) -> None:
    """``get_episode``'s record equals the reference episode."""
    ep = ref.episodes[e]
    assert int(record["episode_id"]) == e
    assert int(record["length"]) == ep.steps
    assert bool(record["terminated"]) == (ep.status == "terminated")
    assert bool(record["truncated"]) == (ep.status == "truncated")
    observations = ref.episode_observations(e)
    if observations:
        assert _same(record["observation"], torch.stack(observations))
    else:  # no observation yet: empty, or absent while no step fixed the buffer's fields
        assert "observation" not in record or record["observation"].shape[0] == 0
    if ep.steps:
        assert _same(record["action"], torch.stack(ep.actions))
        assert _same(record["reward"], torch.tensor(ep.rewards, dtype=torch.float32))
        if ep.extras[0] is not None:
            for name in ep.extras[0]:
                assert _same(record[name], torch.stack([x[name] for x in ep.extras]))
    elif "action" in record:
        assert record["action"].shape[0] == 0
