"""SB3ReplayBuffer.add's fast path (replaybuf.integrations.sb3.fastadd) against its general path.

Two adapters get the same random vector-env stream (dones, timeouts, jumps, segment splits,
evictions, inputs the fast path declines: other dtypes, lists, discrete shapes); one runs every
add through the general path (``_fast_add = False``). Their episode buffers' stored rows and
bookkeeping, their held-aside transitions, counters and seeded samples must be the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("stable_baselines3")
from gymnasium import spaces

from replaybuf.integrations.sb3 import SB3ReplayBuffer

BOX = spaces.Box(-10.0, 10.0, (3,), np.float32)
ACTIONS = spaces.Box(-1.0, 1.0, (2,), np.float32)


def _bytes(value) -> tuple:
    array = value.cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return array.dtype.str, array.shape, array.tobytes()


def snapshot(rb: SB3ReplayBuffer) -> dict:
    """What the adapter and its episode buffer hold, and what orders later rows and draws."""
    buf = rb.episode_buffer
    core = buf._core
    core.flush()
    held = rb._held
    out = {
        "stats": rb.stats(),
        "counters": (rb.transitions, rb.size(), rb.pos, rb.full),
        "episode": list(rb._episode),
        "pending": list(held.pending),
        "held": [_bytes(a[held.envs()]) for a in (held.obs, held.next_obs, held.action)]
        + [_bytes(held.reward[held.envs()])],
        "ids": buf.episode_ids(),
        "anchors": core.anchors.rows[: len(core.anchors)].tolist(),
        "free": list(core.free),
        "links": [
            core.links.column(name).tolist() for name in ("next_row", "episode", "end_kind", "step")
        ],
        "episodes": {},
    }
    for e in buf.episode_ids():
        record = buf.get_episode(e)
        out["episodes"][e] = {k: _bytes(record[k]) for k in record.keys()}  # noqa: SIM118 (a TensorDict's keys)
    if rb.transitions:
        buf._generator.manual_seed(5)
        rb._generator.manual_seed(6)
        out["sample"] = [_bytes(t) for t in rb.sample(16) if t is not None]
    return out


def stream(rng, n, steps, *, discrete_obs, discrete_actions, p_done, p_jump, p_odd):
    """SB3 add calls of a vector env; a few (``p_odd``) in forms only the general path takes."""
    obs_shape = () if discrete_obs else (3,)

    def fresh(k):
        if discrete_obs:
            return rng.integers(0, 4, (k, 1))
        values = rng.standard_normal((k, *obs_shape)).astype(np.float32)
        values[rng.random(k) < 0.05] = np.nan  # continuity is bit for bit: NaN continues
        return values

    obs = fresh(n)
    for _ in range(steps):
        next_obs = fresh(n)
        if discrete_actions:
            action = rng.integers(0, 5, (n,) if rng.random() < 0.5 else (n, 1))
        else:
            action = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
        reward = rng.standard_normal(n).astype(np.float32)
        done = rng.random(n) < p_done
        truncated = done & (rng.random(n) < 0.5)
        infos = [
            {"TimeLimit.truncated": bool(t)} if d else {}
            for d, t in zip(done, truncated, strict=True)
        ]
        args = [obs, next_obs, action, reward, done.astype(np.float32), infos]
        if rng.random() < p_odd:  # declined by the fast path: converted by the general one
            which = rng.integers(0, 5)
            if which == 0:
                args[3] = reward.astype(np.float64)
            elif which == 1:
                args[4] = done.astype(np.int64)
            elif which == 2:
                args[0] = obs.tolist()
            elif which == 3:
                args[5] = tuple(infos)
            else:
                args[4] = done  # bool: taken by the fast path too
        if discrete_obs and rng.random() < 0.5:  # SB3 reshapes [n] discrete observations
            args[1] = next_obs.reshape(n)
            if isinstance(args[0], np.ndarray):
                args[0] = obs.reshape(n)
        yield tuple(args)
        obs = next_obs.copy()
        restart = done | (rng.random(n) < p_jump)
        obs[restart] = fresh(int(restart.sum()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 3),
    steps=st.integers(1, 90),
    buffer_size=st.sampled_from([24, 40, 200]),
    segment=st.sampled_from([None, 3, 7]),
    handle=st.booleans(),
    discrete_obs=st.booleans(),
    discrete_actions=st.booleans(),
    p_done=st.sampled_from([0.0, 0.08, 0.4]),
    p_jump=st.sampled_from([0.0, 0.1]),
    p_odd=st.sampled_from([0.0, 0.1]),
    check_every=st.sampled_from([1, 7, 1000]),
)
def test_fast_adds_leave_what_general_adds_leave(
    tmp_path_factory,
    seed,
    n,
    steps,
    buffer_size,
    segment,
    handle,
    discrete_obs,
    discrete_actions,
    p_done,
    p_jump,
    p_odd,
    check_every,
):
    rng = np.random.default_rng(seed)
    obs_space = spaces.Discrete(4) if discrete_obs else BOX
    action_space = spaces.Discrete(5) if discrete_actions else ACTIONS
    segment = min(segment or buffer_size, buffer_size // n)
    made = []
    for fast in (True, False):
        rb = SB3ReplayBuffer(
            buffer_size,
            obs_space,
            action_space,
            device="cpu",
            n_envs=n,
            handle_timeout_termination=handle,
            segment_steps=segment,
            max_episodes=max(buffer_size // 4, n + 1),
            storage="tensor",
            scratch_dir=tmp_path_factory.mktemp("sb3"),
            seed=3,
        )
        rb._fast_add = fast
        made.append(rb)
    fast_rb, general_rb = made
    try:
        args = dict(discrete_obs=discrete_obs, discrete_actions=discrete_actions)
        for t, step in enumerate(
            stream(rng, n, steps, p_done=p_done, p_jump=p_jump, p_odd=p_odd, **args)
        ):
            for rb in made:
                rb.add(*(np.copy(x) if isinstance(x, np.ndarray) else x for x in step))
            if t % check_every == check_every - 1:
                assert snapshot(fast_rb) == snapshot(general_rb)
        assert snapshot(fast_rb) == snapshot(general_rb)
    finally:
        for rb in made:
            rb.close()


def test_the_fast_path_takes_a_vec_envs_usual_adds(tmp_path):
    """SB3's usual call (float32 arrays, bool dones, a list of dicts) takes the general path
    only at the first add and where a segment is full: dones, timeouts and resets take the
    fast one."""
    rb = SB3ReplayBuffer(
        400, BOX, ACTIONS, device="cpu", n_envs=2, scratch_dir=tmp_path, storage="tensor"
    )
    calls = []
    general = rb._add_general
    rb._add_general = lambda *a: (calls.append(1), general(*a))  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    steps = stream(
        rng, 2, 150, discrete_obs=False, discrete_actions=False, p_done=0.1, p_jump=0, p_odd=0
    )
    for obs, next_obs, action, reward, done, infos in steps:
        rb.add(obs, next_obs, action, reward, done != 0, infos)
    splits = rb.stats()["segments_split"]
    assert splits > 0
    assert len(calls) <= 1 + splits  # the first add, and the adds that split segments
    rb.close()


@pytest.mark.parametrize("stage", [1, 3, 128])
@pytest.mark.parametrize("p_done", [0.0, 0.05, 0.3])
def test_staged_one_env_adds_leave_what_general_adds_leave(tmp_path, monkeypatch, stage, p_done):
    """One env's fast adds are staged and handed to the episode buffer in runs (when the
    stage is full, before an end, before any read): the state after every kind of read, a
    pickle round trip and a reset included, is the general path's, whatever the stage holds."""
    import pickle

    from replaybuf.integrations.sb3 import staged

    monkeypatch.setattr(staged, "_STEPS", stage)
    made = []
    for fast in (True, False):
        rb = SB3ReplayBuffer(
            60, BOX, ACTIONS, device="cpu", segment_steps=25, max_episodes=12,
            storage="tensor", scratch_dir=tmp_path, seed=3,
        )  # fmt: skip
        rb._fast_add = fast
        made.append(rb)
    rng = np.random.default_rng(stage)
    steps = stream(
        rng, 1, 400, discrete_obs=False, discrete_actions=False, p_done=p_done, p_jump=0.02,
        p_odd=0.02,
    )  # fmt: skip
    try:
        for t, step in enumerate(steps):
            for rb in made:
                rb.add(*(np.copy(x) if isinstance(x, np.ndarray) else x for x in step))
            if t % 37 == 36:  # reads that hand the staged steps over
                assert [rb.size() for rb in made] == [made[1].size()] * 2
                assert snapshot(made[0]) == snapshot(made[1])
            if t == 200:
                made = [pickle.loads(pickle.dumps(rb)) for rb in made] + made
                for rb in made[2:]:
                    rb.close()
                made = made[:2]
            if t == 300:
                for rb in made:
                    rb.reset()
        assert made[0]._staged.count or p_done > 0.1  # something was left staged at the end
        assert snapshot(made[0]) == snapshot(made[1])
    finally:
        for rb in made:
            rb.close()


def test_reads_from_another_thread_hand_over_each_staged_step_once(tmp_path):
    """A learner thread's samples and sizes hand the collector's staged steps over while it
    adds: every step is stored once, as in a buffer read only at the end."""
    import threading

    made = [
        SB3ReplayBuffer(
            5000, BOX, ACTIONS, device="cpu", storage="tensor", scratch_dir=tmp_path, seed=1
        )
        for _ in range(2)
    ]
    steps = list(
        stream(
            np.random.default_rng(0), 1, 3000, discrete_obs=False, discrete_actions=False,
            p_done=0.01, p_jump=0.0, p_odd=0.0,
        )
    )  # fmt: skip
    busy, stop = made[0], threading.Event()

    def learner() -> None:
        while not stop.is_set():
            busy.sample(8)
            busy.size()

    for rb in made:
        rb.add(*steps[0])
    thread = threading.Thread(target=learner)
    thread.start()
    try:
        for step in steps[1:]:
            busy.add(*step)
    finally:
        stop.set()
        thread.join()
    for step in steps[1:]:
        made[1].add(*step)
    try:
        assert busy.stats()["steps"] == made[1].stats()["steps"]
        assert snapshot(busy)["episodes"] == snapshot(made[1])["episodes"]
    finally:
        for rb in made:
            rb.close()


def test_close_after_the_episode_buffer_closed_keeps_quiet(tmp_path):
    """Steps staged after the episode buffer was closed on its own: closing the adapter does
    not raise, and a read of the episode buffer raises BufferClosedError as before."""
    from replaybuf import BufferClosedError

    rb = SB3ReplayBuffer(500, BOX, ACTIONS, device="cpu", storage="tensor", scratch_dir=tmp_path)
    steps = stream(
        np.random.default_rng(1), 1, 5, discrete_obs=False, discrete_actions=False,
        p_done=0.0, p_jump=0.0, p_odd=0.0,
    )  # fmt: skip
    first, *rest = steps
    rb.add(*first)
    rb.episode_buffer.close()
    for step in rest:
        rb.add(*step)
    assert rb._staged.count
    with pytest.raises(BufferClosedError):
        rb.stats()
    rb.close()
    rb.close()
