"""``SB3ReplayBuffer.add``'s fast path: a vectorized step whose arrays already have the exact
types, shapes and dtypes the buffer stores, taken with a few identity and tuple comparisons and
no conversion.

It applies to SB3's usual call: numpy arrays from a ``VecEnv`` (observations of the
observation space's dtype, actions as the algorithm passes them, float32 rewards, bool or float
dones, a list of dicts), every environment continuing from the observation its last step led
to, and no segment due to end. It makes the episode-buffer calls the general path
(:meth:`SB3ReplayBuffer._add_general`) makes, in the same order and with the same values, so
both leave the buffer in the same state; anything else (another dtype to cast, a list, a jump,
a segment split, a first add) goes to the general path, with nothing changed, which checks,
converts or raises.

:func:`add` is ``SB3ReplayBuffer.add`` itself, with the one-env fast path written out in it
(its appends staged: :mod:`~replaybuf.integrations.sb3.staged`); :func:`add_exact` is the
fast path for several envs (one ``append_batch`` per step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

from replaybuf.buffers.locking import reentered

if TYPE_CHECKING:
    from replaybuf.integrations.sb3.buffer import SB3ReplayBuffer

_ND = np.ndarray
Shapes = tuple[tuple[int, ...], ...]  # of (obs, next_obs, action, reward, done)
_DONE_KINDS = "bf"  # bool or float dones (a VecEnv's bool, SB3's float32 in tests)


def add_exact(
    rb: SB3ReplayBuffer,
    obs: Any,
    next_obs: Any,
    action: Any,
    reward: Any,
    done: Any,
    infos: Any,
) -> bool:
    """Record the step as the general path would, if its values need no conversion and no
    episode has to end before it is appended; False, with nothing changed, otherwise."""
    if (
        not rb._primed  # the first add fixes the stored fields: the general path's
        or type(obs) is not _ND
        or type(next_obs) is not _ND
        or type(action) is not _ND
        or type(reward) is not _ND
        or type(done) is not _ND
        or (obs.dtype, next_obs.dtype, action.dtype, reward.dtype) != rb._exact_dtypes
        or done.dtype.kind not in _DONE_KINDS
    ):
        return False
    shapes = (obs.shape, next_obs.shape, action.shape, reward.shape, done.shape)
    if shapes != rb._exact_shapes:
        if shapes not in rb._flat_shapes:  # only [n] discrete observations or actions
            return False
        want = rb._obs_want
        obs, next_obs = obs.reshape(want), next_obs.reshape(want)
        action = action.reshape(rb._action_want)
    n = rb.n_envs
    handle = rb.handle_timeout_termination
    if handle and not _all_dicts(infos, n):  # as checks.timeouts: only read when handled
        return False
    held, starts = rb._held, rb._unstarted
    # Every env with an episode in progress continues from its held next_obs, bit for bit.
    if not starts:
        if obs.tobytes() != held.next_obs.tobytes():
            return False
    elif len(starts) < n:
        going = held.envs()
        if obs[going].tobytes() != held.next_obs[going].tobytes():
            return False
    adds = rb._adds
    if adds >= rb._split_at:  # some segment may be full: the general path ends it
        return False

    # Nothing can refuse from here on: the episode-buffer calls of the general path, in order.
    buf, episode = rb._buffer, rb._episode
    if starts:
        seg_start, agents = rb._seg_start, rb._agent_ids
        for i in starts:
            episode[i] = buf.start_episode(agent_id=agents[i])
            seg_start[i] = adds
        rb._split_at = min(seg_start) + rb.segment_steps  # every env has an episode now
        # A new list (append_batch's run keeps the one it gets); every env has an episode.
        rb._ids = ids = cast(list[int], list(episode))
    else:
        ids = rb._ids
    buf.append_batch(ids, obs, action, reward)
    ended = done.tolist()
    if any(ended):
        pending, finished = held.pending, []
        for i, end in enumerate(ended):
            if end:
                truncated = handle and bool(infos[i].get("TimeLimit.truncated", False))
                buf.end_episode(ids[i], "truncated" if truncated else "terminated", next_obs[i])
                episode[i] = None
                pending[i] = False
                finished.append(i)
        held.keep(obs, next_obs, action, reward, done != 0)
        for i in starts:
            pending[i] = not ended[i]
        rb._unstarted = finished
    else:
        held.keep_all(obs, next_obs, action, reward)
        if starts:
            pending = held.pending
            for i in starts:
                pending[i] = True
            rb._unstarted = []
    rb._adds = adds + 1
    return True


def add(
    rb: SB3ReplayBuffer,
    obs: Any,
    next_obs: Any,
    action: Any,
    reward: Any,
    done: Any,
    infos: Any,
) -> None:
    """Record one vectorized step: transition ``(obs[i], action[i], reward[i],
    next_obs[i], done[i])`` for every environment i. Everything is checked first; on an
    error (``SchemaError`` naming the argument) the buffer is unchanged."""
    # SB3ReplayBuffer.add itself (a class attribute there), so one Python call per step: with
    # one env the fast path is written out here; several envs go through add_exact.
    buf = rb._buffer
    lock = buf._lock
    if lock._is_owned():  # called by code run during another adapter call (sb3.calls)
        raise reentered("SB3ReplayBuffer.add")
    if rb._closed:
        rb._check_open()
    staged = rb._staged
    if staged is None:
        with lock:  # the adapter's rows change under the lock (sb3.calls)
            if not (rb._fast_add and add_exact(rb, obs, next_obs, action, reward, done, infos)):
                rb._add_general(obs, next_obs, action, reward, done, infos)
        return
    if not (
        rb._fast_add
        and rb._primed  # the first add fixes the stored fields: the general path's
        and type(obs) is _ND
        and type(next_obs) is _ND
        and type(action) is _ND
        and type(reward) is _ND
        and type(done) is _ND
        and (obs.dtype, next_obs.dtype, action.dtype, reward.dtype) == rb._exact_dtypes
        and done.dtype.kind in _DONE_KINDS
    ):
        _general(rb, obs, next_obs, action, reward, done, infos)
        return
    o, no, a = obs, next_obs, action  # reshaped where SB3 passes [n] forms
    shapes: Shapes = (o.shape, no.shape, a.shape, reward.shape, done.shape)
    if shapes != rb._exact_shapes and shapes in rb._flat_shapes:
        o, no, a = o.reshape(rb._obs_want), no.reshape(rb._obs_want), a.reshape(rb._action_want)
        shapes = rb._exact_shapes
    handle = rb.handle_timeout_termination
    held = rb._held
    starting = bool(rb._unstarted)
    if not (
        shapes == rb._exact_shapes
        and (not handle or (type(infos) is list and len(infos) == 1 and type(infos[0]) is dict))
        # the episode in progress continues from its held next_obs, bit for bit
        and (starting or o.tobytes() == (staged.next_obs or held.next_obs.tobytes()))
        and rb._adds < rb._split_at  # else a segment may be full: the general path ends it
    ):
        _general(rb, obs, next_obs, action, reward, done, infos)
        return

    # The step is staged (rows of the adapter's own arrays, see staged), and so is the
    # held-aside transition: its obs, action and reward are the staged row itself, its next
    # observation kept as bytes (what the next add's continuity test compares), copied into
    # the held-aside arrays at a hand-over. The
    # episode-buffer calls are the general path's, in its order. Under the episode buffer's
    # lock (re-entrant: those calls take it again), so that a hand-over by another thread's
    # read (sample, size) sees the stage and its count agree.
    adds = rb._adds
    lock.acquire()
    try:
        at = staged.count
        if at == staged.capacity:  # handed over first: a refusal leaves this step unrecorded
            staged.hand_over(buf, held)
            at = 0
        if starting:  # the stage is empty: the last episode's end handed its steps over
            episode = buf.start_episode(agent_id=rb._agent_ids[0])
            rb._episode[0] = episode
            rb._ids = [episode]
            rb._seg_start[0] = adds
            rb._split_at = adds + rb.segment_steps
        if not at:  # the episode in progress (started here, or by the general path)
            staged.episode = rb._episode[0]  # type: ignore[assignment]
        staged.obs[at] = o
        staged.action[at] = a
        staged.reward[at] = reward[0]
        staged.count = at + 1
        if done[0]:
            truncated = handle and bool(infos[0].get("TimeLimit.truncated", False))
            staged.hand_over(buf, held)  # the episode's steps, before its end
            buf.end_episode(staged.episode, "truncated" if truncated else "terminated", no[0])
            rb._episode[0] = None
            held.pending[0] = False
            rb._unstarted = [0]
        else:
            staged.held_at = at  # the held-aside transition's obs, action and reward
            staged.next_obs = no.tobytes()  # ... and its next observation's bytes
            if starting:
                held.pending[0] = True
                rb._unstarted = []
        rb._adds = adds + 1
    finally:
        lock.release()


def _general(rb: SB3ReplayBuffer, *args: Any) -> None:
    """The general path, after the staged steps are handed over, under the episode buffer's
    lock as every change to the adapter's rows (sb3.calls)."""
    with rb._buffer._lock:
        rb._hand_over()
        rb._add_general(*args)


def _all_dicts(infos: Any, n: int) -> bool:
    """Whether ``infos`` is a list of ``n`` dicts (anything else: the general path's checks)."""
    if type(infos) is not list or len(infos) != n:
        return False
    if n == 1:
        return type(infos[0]) is dict
    return all(type(info) is dict for info in infos)


def exact_shapes(
    n: int, obs: tuple[int, ...], action: tuple[int, ...], discrete_obs: bool
) -> tuple[Shapes, set[Shapes]]:
    """The shapes of (obs, next_obs, action, reward, done) the fast path takes as they are, and
    those it reshapes first: ``[n]`` observations of a ``Discrete`` space and ``[n]`` actions
    of one dimension, as SB3 passes them and the general path reshapes them."""
    exact: Shapes = (obs, obs, action, (n,), (n,))
    obs_forms = [obs, (n,)] if discrete_obs and obs == (n, 1) else [obs]
    action_forms = [action, (n,)] if action == (n, 1) else [action]
    flat: set[Shapes] = {(o, o, a, (n,), (n,)) for o in obs_forms for a in action_forms}
    flat.discard(exact)
    return exact, flat
