"""Adapters that plug replaybuf's buffers into other RL libraries (each needs its own extra)."""
