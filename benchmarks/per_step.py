"""W4's per-step calls against SB3's own: ``ReplayBuffer.add`` of one transition (torch, numpy
and numpy-plus-Python-number inputs) beside SB3's ``ReplayBuffer.add``, the SB3 adapter's
``add`` and ``sample`` beside SB3's, and the two in turn (``train_freq=1``). Inputs are made
before timing (as for every W4 writer), so the buffers are timed, not the dicts' or arrays'
construction."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import peers
from peers import ACT, OBS, StepPool, Turn, steady

from replaybuf import ReplayBuffer

# ReplayBuffer.add's input forms, as W4 rows name them ("tensordict": ObjectRL's form, one
# transition as a TensorDict of batch size [] holding the torch row)
INPUTS = ("torch", "numpy", "python", "tensordict")
BATCH = 256  # sample(BATCH), as W1


def ring_add_writer(buf: ReplayBuffer, pool: StepPool, inputs: str) -> Callable[[], None]:
    """``buf.add`` of one transition per call: a dict of torch tensors (0-d reward and done),
    of numpy arrays and numpy scalars, of numpy arrays and Python numbers (what a gymnasium
    env returns), or the torch row as a TensorDict (ObjectRL's form), into a full ring."""
    rows: list[Any] = []
    for i in range(pool.size):
        if inputs == "tensordict":
            rows.append(pool.td[i])
            continue
        if inputs == "torch":
            row = {"reward": pool.reward_t[i], "done": pool.done[i]}
            row.update(obs=pool.obs[i], action=pool.action[i])
        elif inputs == "numpy":
            row = {"reward": np.float32(pool.reward[i]), "done": np.bool_(False)}
            row.update(obs=pool.obs_np[i], action=pool.action_np[i])
        else:
            row = {"reward": float(pool.reward[i]), "done": False}
            row.update(obs=pool.obs_np[i], action=pool.action_np[i])
        rows.append(row)
    turn = Turn(pool.size)

    def write() -> None:
        buf.add(rows[turn()])

    return steady(write, pool, buf.buffer_size)


def sb3_pair(pool: StepPool, capacity: int) -> dict[str, Callable[[], Any]]:
    """SB3's own ``ReplayBuffer`` and replaybuf's SB3 adapter (``n_envs=1``) given the same
    ``add`` calls (an episode ends every ``pool.size`` steps, as the adapter's episodes need
    ends to evict) and ``sample(256)``, each full first."""
    from gymnasium import spaces

    from replaybuf.integrations.sb3 import SB3ReplayBuffer as Adapter

    obs_space = spaces.Box(-np.inf, np.inf, (OBS,), np.float32)
    act_space = spaces.Box(-1, 1, (ACT,), np.float32)
    theirs = peers.SB3ReplayBuffer(capacity, obs_space, act_space, device="cpu", n_envs=1)
    ours = Adapter(
        capacity,
        obs_space,
        act_space,
        device="cpu",
        n_envs=1,
        max_episodes=capacity // pool.size + 8,
        storage="tensor",
        seed=0,
    )
    obs = [o.reshape(1, OBS) for o in pool.obs_np]
    act = [a.reshape(1, ACT) for a in pool.action_np]
    done = [np.array([float(i == pool.size - 1)], np.float32) for i in range(pool.size)]
    infos: list[dict[str, Any]] = [{}]

    def adder(rb: Any) -> Callable[[], None]:
        turn = Turn(pool.size)

        def add() -> None:
            i = turn()
            rb.add(obs[i], obs[(i + 1) % pool.size], act[i], pool.reward_np[i], done[i], infos)

        return steady(add, pool, capacity)

    sb3_add, adapter_add = adder(theirs), adder(ours)

    def pair(add: Callable[[], None], rb: Any) -> Callable[[], Any]:
        """One add then one sample: SAC's and TD3's loop with SB3's ``train_freq=1``, where
        each sample follows an add (for replaybuf, a read right after a staged write)."""

        def step() -> Any:
            add()
            return rb.sample(BATCH)

        return step

    return {
        "sb3 add": sb3_add,
        "adapter add": adapter_add,
        "sb3 sample": lambda: theirs.sample(BATCH),
        "adapter sample": lambda: ours.sample(BATCH),
        "sb3 add+sample": pair(sb3_add, theirs),
        "adapter add+sample": pair(adapter_add, ours),
        "close": ours.close,
    }
