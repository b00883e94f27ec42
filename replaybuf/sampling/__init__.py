"""Batches from episode rows: n-step transitions, sequences, frame stacks, whole episodes."""

from replaybuf.sampling.device_draws import DeviceDraws, seed_key
from replaybuf.sampling.draws import with_priority_keys
from replaybuf.sampling.paths import Paths, choose
from replaybuf.sampling.records import episode_record

__all__ = ["DeviceDraws", "Paths", "choose", "episode_record", "seed_key", "with_priority_keys"]
