"""Deterministic transitions and state snapshots for the ReplayBuffer tests.

Row ``k`` (its global write id) holds ``obs = k``, ``action = -k``, ``reward = k / 2``,
``done = k % 2 == 0`` and ``next.obs = k + 1``, so any stored row can be recomputed and a
row's fields can be checked against each other.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tensordict import TensorDict

from replaybuf import ReplayBuffer

OBS_DIM = 4
ACTION_DIM = 2


def transition(k: int) -> TensorDict:
    """One transition (batch size ``[]``) for write id ``k``."""
    return rows(k, 1)[0]


def rows(start: int, count: int) -> TensorDict:
    """``count`` transitions with write ids ``start, start + 1, ...`` as one batch."""
    ids = torch.arange(start, start + count, dtype=torch.float32)
    return TensorDict(
        {
            "obs": ids[:, None].expand(count, OBS_DIM).clone(),
            "action": (-ids)[:, None].expand(count, ACTION_DIM).clone(),
            "reward": ids / 2,
            "done": (torch.arange(start, start + count) % 2) == 0,
            "next": {"obs": (ids + 1)[:, None].expand(count, OBS_DIM).clone()},
        },
        batch_size=[count],
    )


def ids_of(td: TensorDict) -> list[int]:
    """The write ids of a batch, after checking every field of every row agrees with its id."""
    ids = td["obs"][:, 0]
    expected = rows(0, 0)  # only for the key set
    assert set(td.keys(include_nested=True, leaves_only=True)) == set(
        expected.keys(include_nested=True, leaves_only=True)
    )
    assert torch.equal(td["obs"], ids[:, None].expand_as(td["obs"]))
    assert torch.equal(td["action"], (-ids)[:, None].expand_as(td["action"]))
    assert torch.equal(td["reward"], ids / 2)
    assert torch.equal(td["done"], (ids.long() % 2) == 0)
    assert torch.equal(td["next", "obs"], (ids + 1)[:, None].expand_as(td["next", "obs"]))
    return [int(i) for i in ids.tolist()]


def snapshot(buf: ReplayBuffer) -> tuple:
    """Everything a failed call must leave as it was: counters, capacity, spec and contents."""
    contents = None
    if len(buf):
        every = buf.sample_all().to("cpu")
        contents = {
            key: value.clone() for key, value in every.items(include_nested=True, leaves_only=True)
        }
    return len(buf), buf.pointer, buf.buffer_size, buf.spec, contents


def same_state(a: tuple, b: tuple) -> bool:
    *head_a, contents_a = a
    *head_b, contents_b = b
    if head_a != head_b:
        return False
    if contents_a is None or contents_b is None:
        return contents_a is contents_b
    return contents_a.keys() == contents_b.keys() and all(
        torch.equal(contents_a[k], contents_b[k]) for k in contents_a
    )


@contextmanager
def unchanged(buf: ReplayBuffer):
    """Assert that the block leaves ``buf`` exactly as it found it."""
    before = snapshot(buf)
    yield
    after = snapshot(buf)
    assert same_state(before, after), f"buffer changed: {before[:4]} -> {after[:4]}"
