"""TensorDicts built from flat keys and values, without the public constructor's checks.

Every batch a buffer returns is built here. The keys and values come from the storage's own
columns, so their shapes and devices are known to be right: where tensordict has the unchecked
constructor (``TensorDict._new_unsafe``) it is used, as re-validating every leaf costs several
times the construction itself.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from replaybuf.storage.schema import Key

# tensordict's unchecked constructor, where this version has it (else None).
NEW_UNSAFE = getattr(TensorDict, "_new_unsafe", None)


def build_tensordict(
    keys: Sequence[Key],
    values: list[torch.Tensor],
    rows: int | tuple[int, ...],
    device: torch.device | None,
) -> TensorDict:
    """A (nested) TensorDict from flat keys and ``[rows, ...]`` values on ``device`` (None:
    wherever each value lives); ``rows`` a tuple gives a batch of several dims."""
    size = torch.Size([rows] if isinstance(rows, int) else rows)
    names = _flat_names(tuple(keys))
    if NEW_UNSAFE is not None and names is not None:  # no nesting to build
        return NEW_UNSAFE(dict(zip(names, values, strict=True)), batch_size=size, device=device)
    return _assemble(nest(dict(zip(keys, values, strict=True))), size, device)


def shared_attributes(batch_size: torch.Size, device: torch.device) -> dict[str, Any] | None:
    """The attributes ``TensorDict._new_unsafe`` gives a flat TensorDict of ``batch_size`` on
    ``device``, but its leaves (``_tensordict``), or None where they cannot be shared.

    A batch built from them (a new instance, these attributes, its own leaf dict) is the one
    ``_new_unsafe`` builds, without its per-call device conversion and leaf loop: the path of a
    hot sampler, built the same way for every batch. They are read off a batch built by
    ``_new_unsafe`` itself, so they follow whatever this tensordict version sets; None where the
    leaves are not a plain dict or an attribute holds anything mutable (a shared one would tie
    the batches together)."""
    if NEW_UNSAFE is None:
        return None
    probe = NEW_UNSAFE({}, batch_size=batch_size, device=device)
    attributes = dict(getattr(probe, "__dict__", {}))
    leaves = attributes.pop("_tensordict", None)
    if type(leaves) is not dict or leaves:
        return None
    if not all(isinstance(value, _IMMUTABLE) for value in attributes.values()):
        return None
    return attributes


# The attribute values a batch may share with every other (see shared_attributes).
_IMMUTABLE = (type(None), bool, int, float, str, torch.Size, torch.device)
_NEW_INSTANCE = TensorDict.__new__  # a bare instance, for batches of shared attributes


def with_attributes(leaves: dict[str, torch.Tensor], attributes: dict[str, Any]) -> TensorDict:
    """The flat TensorDict of ``leaves`` (its own dict from now on) that ``_new_unsafe``
    builds, given the ``attributes`` :func:`shared_attributes` read for its size and device.
    For the host sampling paths, which torch.compile does not trace (under compilation
    ``_new_unsafe`` itself builds through the public constructor)."""
    batch = _NEW_INSTANCE(TensorDict)
    batch.__dict__.update(attributes)
    batch._tensordict = leaves
    return batch


def tensordict_of(leaves: dict[Key, torch.Tensor]) -> TensorDict:
    """Flat ``[rows, ...]`` leaves as a (nested) TensorDict of batch size ``[rows]``."""
    rows = next(iter(leaves.values())).shape[0]
    return build_tensordict(list(leaves), list(leaves.values()), rows, None)


@functools.lru_cache(maxsize=256)
def _flat_names(keys: tuple[Key, ...]) -> tuple[str, ...] | None:
    """The keys' names when none is nested, else None; cached, as a sampler builds the same
    keys for every batch."""
    return tuple(key[0] for key in keys) if all(len(key) == 1 for key in keys) else None


def nest(leaves: Mapping[Key, Any]) -> dict:
    """Flat keys to a nested dict, as TensorDict's constructor takes them."""
    nested: dict = {}
    for key, value in leaves.items():
        node = nested
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return nested


def _assemble(tree: dict, batch_size: torch.Size, device: torch.device | None) -> TensorDict:
    """A nested dict of tensors as a TensorDict, sub-dicts as nested TensorDicts."""
    source = {
        name: _assemble(value, batch_size, device) if isinstance(value, dict) else value
        for name, value in tree.items()
    }
    if NEW_UNSAFE is not None:
        return NEW_UNSAFE(source, batch_size=batch_size, device=device)
    return TensorDict(source, batch_size=batch_size, device=device)
