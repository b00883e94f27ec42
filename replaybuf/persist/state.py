"""A buffer's whole state in memory, read the way a checkpoint directory is read.

``state_dict()`` gives ``{"kind", "meta", "tensors"}``: the JSON meta and the named tensors a
checkpoint of the buffer holds, nothing more (RLlib's ``get_state``). ``load_state_dict()``
takes such a dict, or an open :class:`~replaybuf.persist.format.Checkpoint`: both offer
``meta``, ``tensors`` (each with a shape and dtype), ``load`` and ``load_into``, so one set of
checks and one restore serve both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from replaybuf.errors import CheckpointKindError, CorruptCheckpointError


class StateSource(Protocol):
    """What the checks and restores read: an open checkpoint or a :class:`MemoryState`.

    Read-only: the checks and restores never assign to a source, so an open checkpoint (whose
    ``kind`` and ``meta`` are properties over its manifest) fits as well as a ``MemoryState``.
    """

    @property
    def directory(self) -> Any: ...

    @property
    def kind(self) -> str: ...

    @property
    def meta(self) -> dict[str, Any]: ...

    @property
    def tensors(self) -> Mapping[str, Any]: ...  # name -> something with .shape and .dtype

    def load(self, name: str, *, verify: bool = ...) -> torch.Tensor: ...

    # A checkpoint hands ``out`` back, a MemoryState nothing: callers ignore the result.
    def load_into(self, name: str, out: torch.Tensor, *, verify: bool = ...) -> object: ...


class MemoryState:
    """A ``state_dict()`` read as a checkpoint: tensors handed out as CPU copies."""

    directory = "<state_dict>"

    def __init__(self, state: Mapping[str, Any], kind: str) -> None:
        if not isinstance(state, Mapping) or not {"kind", "meta", "tensors"} <= set(state):
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise CorruptCheckpointError(
                f"state expected a mapping with 'kind', 'meta' and 'tensors' (a state_dict()), "
                f"got {got}"
            )
        if state["kind"] != kind:
            raise CheckpointKindError(
                f"state expected kind {kind!r}, got {state['kind']!r}; load it into that buffer"
            )
        meta, tensors = state["meta"], state["tensors"]
        if not isinstance(meta, Mapping) or not isinstance(tensors, Mapping):
            raise CorruptCheckpointError("state 'meta' and 'tensors' must be mappings")
        bad = sorted(str(name) for name, t in tensors.items() if not isinstance(t, torch.Tensor))
        if bad:
            raise CorruptCheckpointError(f"state tensors {bad} are not tensors")
        self.kind = kind
        self.meta = dict(meta)
        self.tensors = dict(tensors)

    def load(self, name: str, verify: bool = True) -> torch.Tensor:
        """A CPU copy of tensor ``name`` (the caller may keep or change it)."""
        return self.tensors[name].detach().to("cpu", copy=True)

    def load_into(self, name: str, out: torch.Tensor, verify: bool = True) -> None:
        """Copy tensor ``name`` into ``out`` (its shape and dtype were checked)."""
        out.copy_(self.tensors[name])


def source_of(state: Any, kind: str) -> StateSource:
    """``state`` as a :class:`StateSource`: an open checkpoint passes through."""
    if hasattr(state, "load_into") and hasattr(state, "meta"):
        return state
    return MemoryState(state, kind)


def state_of(kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor], copy: bool):
    """A ``state_dict()``: ``copy`` clones the tensors that are views of live storage."""
    if copy:
        tensors = {name: t.clone() for name, t in tensors.items()}
    return {"kind": kind, "meta": meta, "tensors": tensors}
