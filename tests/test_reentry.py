"""A call on a buffer made by code that runs inside another call on the same thread (a signal
handler, a torch function mode, a garbage-collection callback) is refused before it touches
anything, and the outer call completes as if the inner one had not been made."""

from __future__ import annotations

import contextlib
import signal

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from replaybuf import InvalidStateError, ReplayBuffer, SyncEpisodeReplayBuffer


class CallsBack(TorchFunctionMode):
    """Runs ``call`` (once per torch call, at most ``limit`` times) from inside whatever buffer
    call touches a tensor attribute, and records what it raised."""

    def __init__(self, call, limit: int = 3) -> None:
        super().__init__()
        self.call, self.limit, self.refused = call, limit, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if len(self.refused) < self.limit:
            try:
                self.call()
                self.refused.append(None)  # it ran: the test fails below
            except InvalidStateError as error:
                self.refused.append(str(error))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def calls_on_a_timer(call, seconds: float):
    """Run ``call`` from a SIGALRM handler every ``seconds`` inside the block; yields the
    count of calls made (``drawn``) and refused."""
    outcomes = {"drawn": 0, "refused": 0}

    def handler(signum, frame):
        try:
            call()
            outcomes["drawn"] += 1
        except InvalidStateError:
            outcomes["refused"] += 1

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds, seconds)
    try:
        yield outcomes
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
    assert outcomes["drawn"] + outcomes["refused"] > 0, outcomes


def step(t: int) -> tuple:
    return torch.full((3,), float(t)), torch.tensor(t), torch.tensor(float(t))


def ring_row(t: int) -> dict:
    return {"obs": torch.full((3,), float(t)), "action": torch.tensor(t)}


@pytest.mark.parametrize("inner", ["add", "sample_batch", "sample_all"])
def test_a_ring_call_made_inside_an_add_is_refused_and_the_add_completes(inner):
    with (
        ReplayBuffer("cpu", "cpu", 8, storage="tensor", seed=0) as buf,
        ReplayBuffer("cpu", "cpu", 8, storage="tensor", seed=0) as twin,
    ):
        for b in (buf, twin):
            b.add(ring_row(0))
        call = {
            "add": lambda: buf.add(ring_row(7)),
            "sample_batch": lambda: buf.sample_batch(2),
            "sample_all": lambda: buf.sample_all(),
        }[inner]
        row, mode = ring_row(1), CallsBack(call)  # the row made before the mode
        with mode:
            buf.add(row)
        twin.add(ring_row(1))
        assert mode.refused
        assert all(f"{inner}: called while another call" in str(m) for m in mode.refused)
        assert buf.size == twin.size == 2
        for key in ("obs", "action"):
            assert torch.equal(buf.sample_all()[key], twin.sample_all()[key])
        assert torch.equal(buf.sample_batch(4)["obs"], twin.sample_batch(4)["obs"])  # same draws


@pytest.mark.parametrize("inner", ["append", "sample_n_step", "stats", "end_episode"])
def test_an_episode_call_made_inside_an_append_is_refused_and_the_append_completes(inner):
    with (
        SyncEpisodeReplayBuffer(64, storage="tensor", seed=0) as buf,
        SyncEpisodeReplayBuffer(64, storage="tensor", seed=0) as twin,
    ):
        for b in (buf, twin):
            ep, other = b.start_episode(), b.start_episode()
            for episode in (ep, other):
                for t in range(3):
                    b.append_observation_action_reward(episode, *step(t))
        call = {
            "append": lambda: buf.append_observation_action_reward(other, *step(7)),
            "sample_n_step": lambda: buf.sample_n_step(2),
            "stats": buf.stats,
            "end_episode": lambda: buf.end_episode(other, "truncated", torch.zeros(3)),
        }[inner]
        values, mode = step(5), CallsBack(call)  # the values made before the mode
        with mode:
            buf.append_observation_action_reward(ep, *values)
        twin.append_observation_action_reward(ep, *step(5))
        assert mode.refused
        assert all("called while another call" in str(m) for m in mode.refused)
        for b in (buf, twin):
            for episode in (ep, other):
                b.end_episode(episode, "truncated", torch.zeros(3))
        for episode in (ep, other):
            got, want = buf.get_episode(episode), twin.get_episode(episode)
            keys = set(want.keys())
            assert set(got.keys()) == keys
            assert all(torch.equal(got[k], want[k]) for k in keys)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_a_signal_handler_sampling_during_appends_changes_no_step():
    """A timer's handler samples while the main thread appends step after step: the samples
    that land inside an append are refused, the others drawn, and every stored step holds its
    own values in order (before the refusal, a sample inside an append flushed the stager under
    it: mixed rows, or a crash)."""
    with SyncEpisodeReplayBuffer(40_000, storage="tensor", seed=0) as buf:
        ep = buf.start_episode()
        for t in range(4):
            buf.append_observation_action_reward(ep, np.full(3, t, np.float32), t, float(t))
        with calls_on_a_timer(lambda: buf.sample_n_step(4), 0.0002):
            for t in range(4, 30_000):
                buf.append_observation_action_reward(ep, np.full(3, t, np.float32), t, float(t))
        buf.end_episode(ep, "truncated", np.zeros(3, np.float32))
        episode = buf.get_episode(ep)
    steps = torch.arange(30_000)
    assert torch.equal(episode["action"], steps)
    assert torch.equal(episode["reward"], steps.float())
    assert torch.equal(episode["observation"][:-1], steps.float()[:, None].expand(-1, 3))


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_a_signal_handler_sampling_the_sb3_adapter_during_adds_changes_no_transition():
    """The SB3 adapter keeps rows of its own (staged steps, each env's newest transition):
    a timer's handler sampling it during ``add`` is refused there too, and every transition
    stored holds its own values (before, one of 20,000 sampled did not, and a sample could
    raise a bare ``KeyError``)."""
    pytest.importorskip("stable_baselines3")
    from gymnasium import spaces

    from replaybuf.integrations.sb3 import SB3ReplayBuffer

    box = spaces.Box(-1e9, 1e9, (3,), np.float32)
    act = spaces.Box(-1e9, 1e9, (1,), np.float32)

    def transition(t: int) -> tuple:
        obs = np.full((1, 3), t, np.float32)
        done = np.array([float(t % 50 == 49)], np.float32)
        return obs, obs + 1, np.array([[t]], np.float32), np.array([float(t)], np.float32), done

    with SB3ReplayBuffer(100_000, box, act, device="cpu", storage="tensor", seed=0) as rb:
        rb.add(*transition(0), [{}])
        with calls_on_a_timer(lambda: rb.sample(8), 0.003):
            for t in range(1, 60_000):
                rb.add(*transition(t), [{}])
        batch = rb.sample(20_000)
    obs = batch.observations[:, 0]
    assert torch.equal(batch.actions[:, 0], obs)
    assert torch.equal(batch.rewards[:, 0], obs)
    assert torch.equal(batch.next_observations[:, 0], obs + 1)
