"""Batches from episode rows: n-step transitions, sequences, frame stacks, whole episodes."""

from replaybuf.sampling.batches import (
    draw_anchors,
    draw_sequences,
    episode_record,
    nstep_batch,
    sequence_batch,
    uniform_host_nstep,
    with_priority_keys,
)
from replaybuf.sampling.graphed import graphed_nstep, graphed_sequences

__all__ = [
    "draw_anchors",
    "draw_sequences",
    "episode_record",
    "graphed_nstep",
    "graphed_sequences",
    "nstep_batch",
    "sequence_batch",
    "uniform_host_nstep",
    "with_priority_keys",
]
