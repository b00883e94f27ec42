"""``SB3ReplayBuffer``'s pickle: what ``model.save_replay_buffer`` writes and
``model.load_replay_buffer`` reads back.

The pickle holds plain data only, numpy arrays and Python values:

* the arguments that build the adapter again (spaces, sizes, devices as strings, the storage
  choice and scratch folder);
* the episode buffer's ``state_dict()`` (rows, episodes in progress, links, counters, sampler
  state), its tensors as numpy arrays: stored rows are copied out of their storage, memmap
  files included, so the pickle does not depend on any file;
* the adapter's own state: each environment's episode in progress and segment start, the
  held-aside newest transitions, the counters and the sampling generator's state.

No TorchRL storage, lock, thread, file or torch storage is pickled. Loading builds a new adapter
from the arguments (fresh, empty storage of the same choice, its own lock) and loads the state
into it with the episode buffer's ``load_state_dict()``, so it samples what the saved one would
have sampled next and goes on adding where it stopped.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from replaybuf.errors import ArgumentError

if TYPE_CHECKING:
    from replaybuf.buffers import SyncEpisodeReplayBuffer
    from replaybuf.integrations.sb3.buffer import SB3ReplayBuffer

FORMAT = 1  # the layout of the pickled state; a later layout raises on this version's load
# The adapter's attributes that pickle as they are (lists of ints or None, ints, a float, bools).
ADAPTER_FIELDS = (
    "_episode",
    "_ids",
    "_unstarted",
    "_seg_start",
    "_split_at",
    "_adds",
    "_discontinuities",
    "_segments_split",
    "_primed",
    "_fast_add",
)
HELD_ARRAYS = ("obs", "next_obs", "action", "reward")


def state_of(rb: SB3ReplayBuffer) -> dict[str, Any]:
    """What ``rb`` pickles as (see the module docstring). A closed adapter pickles as its
    arguments and ``closed``, and loads closed: SB3's ``save_replay_buffer`` creates its file
    before it pickles, so refusing would leave an empty ``.pkl`` behind."""
    if rb.closed:
        return {"format": FORMAT, "closed": True, "arguments": _arguments_of(rb, rb._buffer)}
    buffer = rb.episode_buffer
    # Taken under the episode buffer's lock, rows copied: a consistent snapshot.
    episodes = buffer.state_dict()
    episodes["tensors"] = {name: _array(t) for name, t in episodes["tensors"].items()}
    held = rb._held
    return {
        "format": FORMAT,
        "arguments": _arguments_of(rb, buffer),
        "episode_buffer": episodes,
        "adapter": {name: _copy(getattr(rb, name)) for name in ADAPTER_FIELDS},
        "held": {
            "pending": list(held.pending),
            **{name: getattr(held, name).copy() for name in HELD_ARRAYS},
        },
        "generator": rb._generator.get_state().numpy(),
    }


def _arguments_of(rb: SB3ReplayBuffer, buffer: SyncEpisodeReplayBuffer) -> dict[str, Any]:
    """The constructor arguments that build ``rb`` again (devices as strings)."""
    storage, scratch_dir = rb._storage_args
    return {
        "buffer_size": rb.max_steps,
        "observation_space": rb.observation_space,
        "action_space": rb.action_space,
        "device": str(rb.device),
        "n_envs": rb.n_envs,
        "handle_timeout_termination": rb.handle_timeout_termination,
        "n_steps": rb.n_steps,
        "gamma": rb.gamma,
        "max_episodes": buffer.max_episodes,
        "segment_steps": rb.segment_steps,
        "storage": storage,
        "storing_device": str(buffer.storing_device),
        "scratch_dir": scratch_dir,
    }


def arguments(state: Any) -> dict[str, Any]:
    """The constructor arguments of a pickled adapter, for this machine.

    The saved ``scratch_dir`` is kept if it is an existing folder here; otherwise (another
    machine, a removed folder) memmap files go to the default, a private folder of the system
    temp dir, with a ``RuntimeWarning``.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ArgumentError(
            f"SB3ReplayBuffer pickle: expected format {FORMAT}, got {got!r} (saved by another "
            "version of replaybuf?)"
        )
    args = dict(state["arguments"])
    scratch_dir = args["scratch_dir"]
    if scratch_dir is not None and not os.path.isdir(scratch_dir):
        args["scratch_dir"] = None
        if args["storage"] != "tensor":
            warnings.warn(
                f"SB3ReplayBuffer pickle: its scratch_dir {scratch_dir!r} is not a folder here; "
                "the loaded buffer's memmap files go to the system temp dir",
                RuntimeWarning,
                stacklevel=3,  # the caller of pickle.load (above __setstate__)
            )
    return args


def restore(rb: SB3ReplayBuffer, state: dict[str, Any]) -> None:
    """Load a pickled state into ``rb``, a new adapter built from :func:`arguments`."""
    episodes = dict(state["episode_buffer"])
    episodes["tensors"] = {name: _tensor(a) for name, a in episodes["tensors"].items()}
    rb.episode_buffer.load_state_dict(episodes)
    for name, value in state["adapter"].items():
        if name not in ADAPTER_FIELDS:
            raise ArgumentError(f"SB3ReplayBuffer pickle: unknown adapter field {name!r}")
        setattr(rb, name, _copy(value))
    saved, held = state["held"], rb._held
    if len(saved["pending"]) != rb.n_envs:
        raise ArgumentError(
            f"SB3ReplayBuffer pickle: held-aside transitions for {len(saved['pending'])} "
            f"environments, expected {rb.n_envs}"
        )
    held.pending = [bool(p) for p in saved["pending"]]
    for name in HELD_ARRAYS:
        target = getattr(held, name)
        value = np.asarray(saved[name])
        if value.shape != target.shape or value.dtype != target.dtype:
            raise ArgumentError(
                f"SB3ReplayBuffer pickle: held-aside {name} is {value.dtype}{list(value.shape)}, "
                f"expected {target.dtype}{list(target.shape)}"
            )
        target[...] = value
    rb._generator.set_state(_tensor(state["generator"]))


def _copy(value: Any) -> Any:
    """A list copied (the adapter changes its lists in place), anything else as it is."""
    return list(value) if isinstance(value, list) else value


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A tensor of the state as a numpy array on the CPU (numpy pickles its bytes directly;
    a torch tensor would pickle through an in-memory ``torch.save`` of its storage)."""
    return tensor.detach().to("cpu").numpy()


def _tensor(array: Any) -> torch.Tensor:
    """A pickled array as a CPU tensor (sharing its memory unless it is read-only)."""
    array = np.asarray(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())
