"""``ReplayBuffer`` <-> checkpoint directory: what is saved, how it is checked, how it comes back.

A ``ReplayBuffer`` checkpoint (kind ``"ReplayBuffer"``, format of :mod:`replaybuf.persist.format`)
holds::

    meta     capacity, size, pointer, storage, device, storing_device, print_gc_warning,
             torchrl_write_count, generator_device, spec (FieldSpec.to_json, or null)
    tensors  rows/<field>              slots [0, size) of each field, e.g. rows/next/obs
             sampler/generator_state   torch.Generator.get_state() of the sampling generator

A field whose name is not a safe file name (or that collides with another one when case is
ignored) is stored as ``rows-by-index/<i>``, ``i`` its position in the spec; the spec maps it
back. Rows are written straight from storage, a memmap one included, in bounded chunks, and
streamed back into a freshly created storage, their checksums verified on the way.

Loading checks everything it can before creating anything: the kind, every meta field and its
range, and each row tensor's shape and dtype against the spec. A load that fails afterwards
(a damaged file, too little space) closes the half-made buffer, removing its files.

This module is the buffer's own translation layer: it reads and sets the buffer's private
ring state (``_slots``, ``_generator``, ``_size``, ``_pointer``), which nothing else does.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from replaybuf.errors import CheckpointKindError, CorruptCheckpointError, NoCheckpointError
from replaybuf.persist.format import Checkpoint, read_checkpoint, write_checkpoint
from replaybuf.persist.format.names import valid_name
from replaybuf.persist.metadata import read_spec, require_int
from replaybuf.storage import FieldSpec, Key, key_name, resolve_device, resolve_kind

if TYPE_CHECKING:
    from replaybuf.buffers import ReplayBuffer

KIND = "ReplayBuffer"
GENERATOR = "sampler/generator_state"
PRIORITY = "priority/weights"
OVERRIDES = (
    "device",
    "storing_device",
    "storage",
    "scratch_dir",
    "print_gc_warning",
    "priority_backend",
)


@dataclass(frozen=True)
class RingState:
    """Everything a ``ReplayBuffer`` checkpoint records besides the tensors."""

    capacity: int
    size: int
    pointer: int
    storage: str
    device: str
    storing_device: str
    print_gc_warning: bool
    torchrl_write_count: int
    generator_device: str
    spec: FieldSpec | None
    writes: int  # rows ever written (ids of update_priorities); >= size
    priority: dict[str, float] | None  # alpha, beta, eps of a prioritized buffer

    def to_meta(self) -> dict[str, Any]:
        meta = {name: getattr(self, name) for name in self.__dataclass_fields__}
        meta["spec"] = None if self.spec is None else self.spec.to_json()
        return meta


def row_tensor_names(spec: FieldSpec) -> dict[Key, str]:
    """The tensor name of each field: ``rows/<parts>``, else ``rows-by-index/<i>``.

    The fallback is taken by a field whose parts are not safe file names, or whose path (or a
    folder on it) would equal another field's when case is ignored.
    """
    names: dict[Key, str] = {}
    folded: dict[str, str] = {}  # lower-cased path prefix -> the prefix as first used
    for i, key in enumerate(spec):
        name = "rows/" + "/".join(key)
        prefixes = ["rows/" + "/".join(key[: j + 1]) for j in range(len(key))]
        readable = valid_name(name) and all(folded.get(p.lower(), p) == p for p in prefixes)
        if readable:
            folded.update((p.lower(), p) for p in prefixes)
            names[key] = name
        else:
            names[key] = f"rows-by-index/{i}"
    return names


# --------------------------------------------------------------------------------- saving
def save(buffer: ReplayBuffer, directory: str | os.PathLike[str], durable: bool) -> Path:
    """Write ``buffer`` (rows, ring state, sampler state) as a checkpoint at ``directory``."""
    slots, size = buffer._slots, buffer.size
    state = RingState(
        capacity=buffer.buffer_size,
        size=size,
        pointer=buffer.pointer,
        storage=buffer.storage_kind,
        device=str(buffer.device),
        storing_device=str(buffer.storing_device),
        print_gc_warning=bool(buffer.print_gc_warning),
        torchrl_write_count=int(slots.memory.writer.state_dict()["_write_count"]),
        generator_device=buffer._generator.device.type,
        spec=buffer.spec,
        writes=buffer._writes,
        priority=None
        if buffer._priorities is None
        else {k: getattr(buffer._priorities, k) for k in ("alpha", "beta", "eps")},
    )
    tensors: dict[str, torch.Tensor] = {GENERATOR: buffer._generator.get_state()}
    if buffer._priorities is not None:
        tensors[PRIORITY] = buffer._priorities.tree.weights()
    if state.spec is not None:
        for key, name in row_tensor_names(state.spec).items():
            if size:
                tensors[name] = slots.column(key)[:size]  # a view: streamed, never copied whole
            else:
                field = state.spec[key]
                tensors[name] = torch.empty((0, *field.shape), dtype=field.dtype)
    return write_checkpoint(directory, KIND, state.to_meta(), tensors, durable=durable)


# --------------------------------------------------------------------------------- loading
def load(
    cls: type[ReplayBuffer], directory: str | os.PathLike[str], overrides: Mapping[str, Any]
) -> ReplayBuffer:
    """A new ``cls`` holding the checkpoint at ``directory`` (``ReplayBuffer.load_checkpoint``)."""
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise TypeError(f"checkpoint overrides must be among {list(OVERRIDES)}, got {unknown}")
    with _open(directory) as checkpoint:
        where = f"checkpoint {str(checkpoint.directory)!r}"
        state = check(checkpoint)
        kwargs = _constructor_kwargs(state, overrides, where)
        generator_state = checkpoint.load(GENERATOR, verify=True)
        _check_generator_state(generator_state, state, kwargs["storing_device"], where)
        buffer = cls(**kwargs)
        try:
            _restore(buffer, state, checkpoint, generator_state)
        except BaseException:
            buffer.close()  # nothing half-made stays behind: its scratch files go too
            raise
    return buffer


def open_or_create(
    cls: type[ReplayBuffer], directory: str | os.PathLike[str], kwargs: Mapping[str, Any]
) -> ReplayBuffer:
    """Load the checkpoint at ``directory`` if there is one, else ``cls(**kwargs)``."""
    try:
        checkpoint = _open(directory)
    except NoCheckpointError:
        return cls(**kwargs)
    with checkpoint:
        capacity = checkpoint.meta.get("capacity")
    wanted = kwargs.get("buffer_size", capacity)
    if wanted != capacity:
        raise ValueError(
            f"open({str(checkpoint.directory)!r}): buffer_size={wanted!r}, but the checkpoint"
            f" there holds a buffer of capacity {capacity!r}"
        )
    overrides = {k: v for k, v in kwargs.items() if k not in ("buffer_size", "seed")}
    return load(cls, directory, overrides)


def _open(directory: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint, sizes checked; checksums are verified as each tensor streams in."""
    try:
        return read_checkpoint(directory, KIND, verify=False)
    except CheckpointKindError as exc:
        raise CheckpointKindError(f"{exc}; load it with that class's load_checkpoint") from None


def check(checkpoint: Checkpoint) -> RingState:
    """The ring state of a ``ReplayBuffer`` checkpoint, after checking it agrees with itself."""
    where = f"checkpoint {str(checkpoint.directory)!r}"
    state = parse_meta(checkpoint.meta, where)
    check_tensors(checkpoint, state, where)
    return state


def parse_meta(meta: Mapping[str, Any], where: str) -> RingState:
    """The ring state recorded in ``meta``, each field checked (ranges and consistency)."""
    capacity = meta_int(meta, "capacity", where, low=1)
    size = meta_int(meta, "size", where, low=0, high=capacity)
    pointer = meta_int(meta, "pointer", where, low=0, high=capacity - 1)
    if size < capacity and pointer != size:
        raise CorruptCheckpointError(
            f"{where}: pointer expected {size} (size % capacity while the ring is not full),"
            f" got {pointer}"
        )
    strings = {}
    for name in ("storage", "device", "storing_device", "generator_device"):
        strings[name] = meta.get(name)
        if not isinstance(strings[name], str):
            raise CorruptCheckpointError(
                f"{where}: meta {name!r} expected a str, got {meta.get(name)!r}"
            )
    if strings["storage"] not in ("memmap", "tensor"):
        raise CorruptCheckpointError(
            f"{where}: meta 'storage' expected 'memmap' or 'tensor', got {strings['storage']!r}"
        )
    print_gc_warning = meta.get("print_gc_warning")
    if not isinstance(print_gc_warning, bool):
        raise CorruptCheckpointError(
            f"{where}: meta 'print_gc_warning' expected a bool, got {print_gc_warning!r}"
        )
    spec = meta_spec(meta, "spec", where)
    if spec is None and size:
        raise CorruptCheckpointError(f"{where}: size {size} expected 0 with no spec")
    writes = meta_int(meta, "writes", where, low=size)
    if writes % capacity != pointer:
        raise CorruptCheckpointError(
            f"{where}: meta 'writes' expected {pointer} modulo {capacity} (the pointer), "
            f"got {writes}"
        )
    priority = meta.get("priority")
    if priority is not None and (
        not isinstance(priority, dict)
        or sorted(priority) != ["alpha", "beta", "eps"]
        or not all(isinstance(v, int | float) for v in priority.values())
    ):
        raise CorruptCheckpointError(f"{where}: meta 'priority' is malformed: {priority!r}")
    return RingState(
        capacity=capacity,
        size=size,
        pointer=pointer,
        print_gc_warning=print_gc_warning,
        # TorchRL keeps its write count in a C int, which wraps negative after 2**31 rows
        torchrl_write_count=meta_int(meta, "torchrl_write_count", where, -(1 << 31), (1 << 31) - 1),
        spec=spec,
        writes=writes,
        priority=priority,
        **strings,
    )


def check_tensors(checkpoint: Checkpoint, state: RingState, where: str) -> None:
    """Each field's tensor is there with shape ``[size, *field shape]`` and the field's dtype."""
    names = row_tensor_names(state.spec) if state.spec is not None else {}
    for key, name in names.items():
        field = state.spec[key]
        info = checkpoint.tensors.get(name)
        if info is None:
            raise CorruptCheckpointError(
                f"{where}: field {key_name(key)!r} expected tensor {name!r}, which is missing"
            )
        expected = ((state.size, *field.shape), field.dtype)
        if (info.shape, info.dtype) != expected:
            raise CorruptCheckpointError(
                f"{where}: field {key_name(key)!r} ({name}) expected shape {list(expected[0])}"
                f" dtype {field.dtype} from the spec and size, got shape {list(info.shape)}"
                f" dtype {info.dtype}"
            )
    expected_priority = {PRIORITY} if state.priority is not None else set()
    extra = sorted(set(checkpoint.tensors) - set(names.values()) - {GENERATOR} - expected_priority)
    if state.priority is not None:
        info = checkpoint.tensors.get(PRIORITY)
        if info is None or info.shape != (state.capacity,):
            got = None if info is None else f"shape {list(info.shape)}"
            raise CorruptCheckpointError(
                f"{where}: tensor {PRIORITY!r} expected shape [{state.capacity}], got {got}"
            )
    if extra:
        raise CorruptCheckpointError(f"{where}: tensors {extra} belong to no field of the spec")
    info = checkpoint.tensors.get(GENERATOR)
    if info is None or info.dtype != torch.uint8 or len(info.shape) != 1:
        got = None if info is None else f"shape {list(info.shape)} dtype {info.dtype}"
        raise CorruptCheckpointError(
            f"{where}: tensor {GENERATOR!r} expected a 1-d uint8 tensor, got {got}"
        )


def meta_int(
    meta: Mapping[str, Any], name: str, where: str, low: int, high: int | None = None
) -> int:
    """An int of a checkpoint's meta in ``[low, high]``, else CorruptCheckpointError."""
    context = f"{where}: meta"
    return require_int(meta, name, low, high, error=CorruptCheckpointError, context=context)


def meta_spec(meta: Mapping[str, Any], name: str, where: str) -> FieldSpec | None:
    """A field spec of a checkpoint's meta, else CorruptCheckpointError."""
    return read_spec(meta, name, error=CorruptCheckpointError, context=f"{where}: meta")


def _constructor_kwargs(
    state: RingState, overrides: Mapping[str, Any], where: str
) -> dict[str, Any]:
    """The new buffer's arguments: the saved ones, then ``overrides``, checked before use."""
    kwargs: dict[str, Any] = {
        "device": state.device,
        "storing_device": state.storing_device,
        "buffer_size": state.capacity,
        "print_gc_warning": state.print_gc_warning,
        "storage": state.storage,
        **({"prioritized": True, **state.priority} if state.priority is not None else {}),
        **overrides,
    }
    try:  # fail here, naming the checkpoint, rather than half-way through the constructor
        storing = resolve_device(kwargs["storing_device"], "storing_device")
        resolve_device(kwargs["device"], "device")
        resolve_kind(kwargs["storage"], storing)
    except ValueError as exc:
        raise ValueError(
            f"{where} cannot load here: {exc}; pass device=, storing_device= or storage="
            " to load_checkpoint to load it elsewhere"
        ) from None
    return kwargs


def _check_generator_state(
    generator_state: torch.Tensor, state: RingState, storing_device: Any, where: str
) -> None:
    """The saved state must be one the new sampling generator accepts, when it will take it."""
    device = resolve_device(storing_device, "storing_device")
    if device.type != state.generator_device:
        return  # reseeded from it instead: see restore_generator
    try:
        torch.Generator(device=device).set_state(generator_state)
    except RuntimeError as exc:
        raise CorruptCheckpointError(
            f"{where}: {GENERATOR} is not a {device.type} generator state: {exc}"
        ) from None


def _restore(
    buffer: ReplayBuffer, state: RingState, checkpoint: Checkpoint, generator_state: torch.Tensor
) -> None:
    """Fill ``buffer`` (fresh and empty) with the rows and ring state of ``checkpoint``."""
    if state.spec is not None:
        buffer._slots.prepare(state.spec)  # the space check, before anything is allocated
        names = row_tensor_names(state.spec)

        def fill(key: Key, out: torch.Tensor) -> None:
            checkpoint.load_into(names[key], out, verify=True)  # streamed, hashed on the way

        buffer._slots.restore(state.size, state.pointer, state.torchrl_write_count, fill)
    buffer._size, buffer._pointer, buffer._writes = state.size, state.pointer, state.writes
    if buffer._priorities is not None:
        weights = checkpoint.load(PRIORITY, verify=True)
        if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
            raise CorruptCheckpointError(f"{PRIORITY} must hold finite weights >= 0")
        buffer._priorities.tree.load(weights)
    restore_generator(buffer._generator, generator_state, state.generator_device)


def restore_generator(generator: torch.Generator, saved: torch.Tensor, saved_type: str) -> None:
    """Continue the saved sampler stream; across CPU <-> CUDA, reseed from it deterministically.

    CPU (Mersenne Twister) and CUDA (Philox) generators keep different states, so a stream
    cannot move between them: the new one is seeded with a hash of the saved state instead.
    """
    if generator.device.type == saved_type:
        generator.set_state(saved)
        return
    digest = hashlib.sha256(saved.numpy().tobytes()).digest()
    generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
