"""The batch keys a :class:`~replaybuf.integrations.torchrl.writer.CollectorWriter` reads: how
they are given (a str or a tuple of str), checked and named in messages."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replaybuf.episodes import RETURNED_KEYS
from replaybuf.errors import ArgumentError, ArgumentTypeError

NestedKey = str | tuple[str, ...]
Key = tuple[str, ...]


def as_key(value: Any, name: str) -> Key:
    """A TensorDict key as a tuple, or ``TypeError`` naming the argument."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, tuple) and value and all(isinstance(part, str) for part in value):
        return value
    raise ArgumentTypeError(
        f"{name} must be a str or a tuple of str (a TensorDict key), got {value!r}"
    )


def extras_keys(extras: Mapping[str, NestedKey] | None) -> dict[str, Key]:
    """The ``extras`` argument checked: stored name -> batch key."""
    if extras is None:
        return {}
    if not isinstance(extras, Mapping):
        raise ArgumentTypeError(f"extras must map stored names to batch keys, got {extras!r}")
    out = {}
    for name, key in extras.items():
        if not isinstance(name, str) or not name:
            raise ArgumentTypeError(f"extras names must be non-empty str, got {name!r}")
        if name in RETURNED_KEYS:
            raise ArgumentError(f"extras name {name!r} collides with a key sampling returns")
        out[name] = as_key(key, f"extras[{name!r}]")
    return out


def dotted(key: Key | str) -> str:
    """A TensorDict key as users read it: ``next.reward``."""
    return ".".join((key,) if isinstance(key, str) else key)
