"""Checks of a checkpoint's meta, field by field, shared by the ring and episode loaders.

A tampered or damaged manifest must be refused before anything is allocated or any loop runs
over it, with a :class:`CorruptCheckpointError` naming the field: a count of ``1e30`` or
``10**30`` would otherwise overflow later, a ``frame_stack`` of ``10**9`` would hang a read, a
renamed key would surface as a bare ``KeyError``. Each helper checks one field's type and
range; the loaders add what the fields imply of each other and of the stored tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from replaybuf.errors import CorruptCheckpointError
from replaybuf.persist.format.names import FORMAT_VERSION
from replaybuf.persist.metadata import require_int
from replaybuf.priority.policy import MAX_ALPHA, MAX_EPS

MAX_COUNT = 1 << 62  # counters and ids live in int64 tensors, with room to count on


def format_version(source: object) -> int:
    """The format version of what is loaded: a checkpoint's, or the current one in memory."""
    version = getattr(source, "format_version", FORMAT_VERSION)
    return version if isinstance(version, int) else FORMAT_VERSION


def check_meta_keys(
    meta: Mapping[str, Any],
    required: Iterable[str],
    legacy: Mapping[str, Any],
    version: int,
    where: str,
    since: str = "",
) -> dict[str, Any]:
    """``meta`` with exactly the keys ``required`` plus ``legacy``: a missing, unknown or renamed
    key is refused by name. Version 1 checkpoints were written before the ``legacy`` keys
    existed: a missing one takes the default given there."""
    expected = {*required, *legacy}
    if not isinstance(meta, Mapping):
        raise CorruptCheckpointError(f"{where}: meta expected an object, got {meta!r}")
    optional = set(legacy) if version < 2 else set()
    missing = sorted(expected - set(meta) - optional)
    unknown = sorted(str(key) for key in set(meta) - expected)
    if missing or unknown:
        said = [f"missing {missing}"] * bool(missing) + [f"unknown {unknown}"] * bool(unknown)
        raise CorruptCheckpointError(f"{where}: meta keys {', '.join(said)}{since}")
    return {**{k: v for k, v in legacy.items() if k not in meta}, **meta}


def meta_int(
    meta: Mapping[str, Any],
    name: str,
    where: str,
    low: int,
    high: int | None = None,
    *,
    since: str = "",
) -> int:
    """An int of a checkpoint's meta in ``[low, high]`` (``high`` at most ``MAX_COUNT``);
    ``since`` names the fields the bounds come from, for the message."""
    try:
        value = require_int(meta, name, low, high, error=CorruptCheckpointError, context="meta")
        if value > MAX_COUNT:
            raise CorruptCheckpointError(f"meta {name!r} expected at most {MAX_COUNT}, got {value}")
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}" + (f" ({since})" if since else "")) from None
    return value


def meta_number(meta: Mapping[str, Any], name: str, where: str, low: float, high: float) -> float:
    """A finite int or float of a checkpoint's meta in ``[low, high]``."""
    value = meta.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CorruptCheckpointError(f"{where}: meta {name!r} expected a number, got {value!r}")
    if not (math.isfinite(value) and low <= value <= high):
        raise CorruptCheckpointError(
            f"{where}: meta {name!r} expected a number in [{low}, {high}], got {value!r}"
        )
    return value


def meta_choice(meta: Mapping[str, Any], name: str, where: str, choices: Iterable[Any]) -> Any:
    """A meta field that must be one of ``choices`` (of the same type: ``1`` is not ``True``)."""
    value, options = meta.get(name), tuple(choices)
    if not any(type(value) is type(c) and value == c for c in options):
        expected = " or ".join(map(repr, options)) if len(options) < 3 else f"one of {options}"
        raise CorruptCheckpointError(f"{where}: meta {name!r} expected {expected}, got {value!r}")
    return value


def meta_device(meta: Mapping[str, Any], name: str, where: str) -> torch.device:
    """A device string of a checkpoint's meta, parsed (not necessarily present on this host)."""
    value = meta.get(name)
    try:
        if not isinstance(value, str):
            raise TypeError(f"expected a str, got {type(value).__name__}")
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{where}: meta {name!r} expected a device such as 'cpu' or 'cuda:0', got {value!r}"
            f" ({exc})"
        ) from None
    if str(device) != value:
        raise CorruptCheckpointError(
            f"{where}: meta {name!r} expected a device as torch writes it ({str(device)!r}), "
            f"got {value!r}"
        )
    return device


def meta_priority(meta: Mapping[str, Any], where: str, prefix: str = "") -> dict[str, float]:
    """A prioritized buffer's ``alpha``, ``beta`` and ``eps`` (under ``prefix`` in messages)."""
    return {
        "alpha": meta_number(meta, "alpha", where + prefix, 0.0, MAX_ALPHA),
        "beta": meta_number(meta, "beta", where + prefix, 0.0, 1.0),
        "eps": meta_number(meta, "eps", where + prefix, 0.0, MAX_EPS),
    }
