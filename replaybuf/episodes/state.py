"""The episode core's state: the part of a buffer's ``state_dict()`` it owns, and its restore.

The core composes its components' states (row links, anchors, priorities, storage rows) with
its own episode table and counters. The names of the checkpoint that holds them, and the
checks a state passes before it is restored, are :mod:`replaybuf.persist.episodes`'.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from replaybuf.core import END_NONE
from replaybuf.episodes.core import EpisodeCore
from replaybuf.episodes.episode import Episode
from replaybuf.priority import priority_stats
from replaybuf.storage import FieldSpec, Key, Ragged, nest

COUNTERS = ("next_id", "next_seq", "allocations", "steps", "valid_steps", "evicted")
# One episode of the table: id, agent, start order, end kind, steps, whether a final row holds
# its final observation (else, ended with no step, the observation is kept apart).
TableEntry = list[Any]


def core_state(core: EpisodeCore) -> dict[str, Any]:
    """The core's state now (staged steps written first): counters, the episode table, copies
    of the index state, and views of the stored rows ``[0, high_water)``."""
    core.flush()
    episodes = list(core.episodes.values())
    owned = [[*e.rows, *([e.final_row] if e.final_row is not None else [])] for e in episodes]
    flat = [row for rows in owned for row in rows]
    high_water = max(flat) + 1 if flat else 0
    obs_keys = list(observation_spec(core) or {})
    finals = [_final_leaves(e, obs_keys) for e in episodes if e.final_observation is not None]
    return {
        "counters": {name: getattr(core, name) for name in COUNTERS},
        "high_water": high_water,
        "table": [
            [e.episode_id, e.agent_id, e.seq, e.end_kind, e.steps, e.final_row is not None]
            for e in episodes
        ],
        "links": core.links.state_dict(),
        "anchors": core.anchors.state_dict()["rows"],
        "free": free_rows(core),
        "episode_rows": torch.tensor(flat, dtype=torch.long),
        "finals": finals,
        "priorities": None if core.priorities is None else core.priorities.state_dict(),
        "storage": core.slots.state_dict(high_water),
        "first_obs_spec": core._first_obs_spec,
    }


def _final_leaves(episode: Episode, obs_keys: list[Key]) -> list[torch.Tensor]:
    """A zero-step episode's final observation, field by field (a ragged field: its values)."""
    ragged = episode.final_ragged or {}
    assert episode.final_observation is not None
    return [
        ragged[key].values.clone() if key in ragged else episode.final_observation.get(key).clone()
        for key in obs_keys
    ]


def observation_spec(core: EpisodeCore) -> FieldSpec | None:
    """The observation fields: the spec's, or those a zero-step episode's end fixed."""
    spec = core.slots.spec
    if spec is not None:
        return FieldSpec({k: f for k, f in spec.items() if k[0] == "observation"})
    return core._first_obs_spec


def free_rows(core: EpisodeCore) -> torch.Tensor:
    """The free rows (quarantined ones last) as a new int64 tensor, in hand-out order."""
    free = torch.frombuffer(core.free, dtype=torch.long).clone() if len(core.free) else None
    quarantined = torch.tensor(core.quarantine, dtype=torch.long)
    return quarantined if free is None else torch.cat([free, quarantined])


def restore_core(
    core: EpisodeCore,
    state: dict[str, Any],
    fill: Callable[[Key, torch.Tensor], None],
    ragged: Callable[[Key], tuple[torch.Tensor, torch.Tensor]],
    final: Callable[[int, Key], torch.Tensor],
) -> None:
    """Set an empty core to ``state`` (:func:`core_state`'s shape, checked by the caller);
    ``fill(key, out)`` writes each fixed field's rows ``[0, high_water)``, ``ragged(key)``
    gives a ragged field's rows ``[0, high_water)`` as CSR (values, offsets), ``final(j, key)``
    field ``key`` of the j-th zero-step episode's final observation (a ragged one: its values)."""
    spec = state["storage"]["spec"]
    if spec is not None:
        core.slots.prepare(spec)
        high_water = state["high_water"]
        core.slots.restore(
            high_water, high_water % core.slots.capacity, high_water, fill, ring=False
        )
        for key, column in core.slots.ragged.items():
            column.load_rows(*ragged(key))
    core.links.load_state_dict(state["links"])
    core.anchors.load_state_dict({"rows": state["anchors"]})
    core.allocations = state["counters"]["allocations"]
    if core.priorities is not None and state["priorities"] is not None:
        core.priorities.load_state_dict(state["priorities"])
    core.free = array("q", state["free"].numpy().tobytes())
    core._first_obs_spec = state["first_obs_spec"]
    _restore_table(core, state["table"], state["episode_rows"], final)
    for name in COUNTERS:
        setattr(core, name, state["counters"][name])


def _restore_table(
    core: EpisodeCore,
    table: list[TableEntry],
    episode_rows: torch.Tensor,
    final: Callable[[int, Key], torch.Tensor],
) -> None:
    flat = array("q", episode_rows.to(torch.long).numpy().tobytes())
    obs_spec = observation_spec(core) or FieldSpec({})
    at, zero = 0, 0
    for episode_id, agent, seq, end_kind, steps, has_final in table:
        episode = Episode(episode_id, agent, seq, own=flat[at : at + steps], end_kind=end_kind)
        at += steps
        if has_final:
            episode.final_row = flat[at]
            at += 1
        elif end_kind != END_NONE:
            leaves = {key: final(zero, key) for key in obs_spec}
            kept = {
                key: Ragged(value, torch.tensor([value.shape[0]]), obs_spec[key].kind)
                for key, value in leaves.items()
                if obs_spec[key].is_ragged
            }
            fixed = {key: value for key, value in leaves.items() if key not in kept}
            episode.final_observation = TensorDict(nest(fixed), batch_size=[])
            episode.final_ragged = kept or None
            zero += 1
        core.register(episode)
        if end_kind != END_NONE:
            core.finished.push((seq, episode_id))


def core_stats(core: EpisodeCore) -> dict[str, Any]:
    """The core's part of ``stats()``: counts of episodes, steps, agents, storage and bytes."""
    statuses = [e.status for e in core.episodes.values()]
    agents: dict[str, int] = {}
    for e in core.episodes.values():
        agents[e.agent_id] = agents.get(e.agent_id, 0) + 1
    return {
        "episodes": len(core.episodes),
        "in_progress": statuses.count("in_progress"),
        "terminated": statuses.count("terminated"),
        "truncated": statuses.count("truncated"),
        "steps": core.steps,
        "valid_steps": core.valid_steps,
        "agents": agents,
        "evicted_episodes": core.evicted,
        "rows": core.slots.capacity,
        "storage": core.slots.reported_kind,
        "planned_bytes": core.slots.planned_bytes,
        "bytes": core.slots.stored_bytes() + core.links.nbytes + core.anchors.nbytes,
        **priority_stats(core.priorities),
    }
