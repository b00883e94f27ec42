"""Batches from episode rows: n-step transitions, sequences, frame stacks, whole episodes."""

from replaybuf.sampling.device_draws import DeviceDraws, seed_key
from replaybuf.sampling.draws import with_priority_keys
from replaybuf.sampling.layout import LAYOUTS, check_layout, torchrl_episode, torchrl_transitions
from replaybuf.sampling.paths import Paths, choose
from replaybuf.sampling.ragged import FORMS, check_ragged_form
from replaybuf.sampling.records import episode_record

__all__ = [
    "FORMS",
    "LAYOUTS",
    "DeviceDraws",
    "Paths",
    "check_layout",
    "check_ragged_form",
    "choose",
    "episode_record",
    "seed_key",
    "torchrl_episode",
    "torchrl_transitions",
    "with_priority_keys",
]
