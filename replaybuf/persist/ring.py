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

The buffer hands this module its configuration and components (:class:`RingParts`); the
module composes their ``state_dict()``s into the checkpoint's meta and tensors
(:func:`compose`), checks a state (:func:`check`) and restores one into the parts
(:func:`restore`). ``ReplayBuffer.state_dict()`` / ``load_state_dict()`` are the same in memory.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from replaybuf.errors import (
    ArgumentError,
    ArgumentTypeError,
    CheckpointKindError,
    CorruptCheckpointError,
    MetadataError,
    NoCheckpointError,
)
from replaybuf.persist.format import Checkpoint, read_checkpoint, write_checkpoint
from replaybuf.persist.format.names import FORMAT_VERSION, valid_name
from replaybuf.persist.meta_checks import (
    check_meta_keys,
    format_version,
    meta_choice,
    meta_device,
    meta_int,
    meta_priority,
)
from replaybuf.persist.metadata import read_spec
from replaybuf.persist.state import StateSource, state_of
from replaybuf.priority import Prioritizer
from replaybuf.storage import FieldSpec, Key, SlotStorage, key_name, resolve_device, resolve_kind

if TYPE_CHECKING:
    from replaybuf.buffers import ReplayBuffer

KIND = "ReplayBuffer"
GENERATOR = "sampler/generator_state"
PRIORITY = "priority/weights"
PRIORITY_META = ("alpha", "beta", "eps")  # a prioritized buffer's exponents, in the meta
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


@dataclass
class RingParts:
    """A ``ReplayBuffer``'s configuration and components, as its checkpoint code reads them."""

    capacity: int
    storage: str
    device: torch.device
    storing_device: torch.device
    print_gc_warning: bool
    slots: SlotStorage
    priorities: Prioritizer | None
    generator: torch.Generator
    size: int  # rows stored
    pointer: int  # the slot the next row goes to
    writes: int  # rows ever written


# --------------------------------------------------------------------------------- saving
def compose(parts: RingParts, copy: bool) -> dict[str, Any]:
    """The buffer's ``state_dict()``: rows (views unless ``copy``), ring state, sampler state."""
    slots = parts.slots.state_dict(parts.size)
    priorities = None if parts.priorities is None else parts.priorities.state_dict()
    state = RingState(
        capacity=parts.capacity,
        size=parts.size,
        pointer=parts.pointer,
        storage=parts.storage,
        device=str(parts.device),
        storing_device=str(parts.storing_device),
        print_gc_warning=bool(parts.print_gc_warning),
        torchrl_write_count=slots["write_count"],
        generator_device=parts.generator.device.type,
        spec=slots["spec"],
        writes=parts.writes,
        priority=None if priorities is None else {k: priorities[k] for k in PRIORITY_META},
    )
    tensors: dict[str, torch.Tensor] = {GENERATOR: parts.generator.get_state()}
    if priorities is not None:
        tensors[PRIORITY] = priorities["weights"]
    if state.spec is not None:
        for key, name in row_tensor_names(state.spec).items():
            tensors[name] = slots["columns"][key]
    return state_of(KIND, state.to_meta(), tensors, copy)


def save(buffer: ReplayBuffer, directory: str | os.PathLike[str], durable: bool) -> Path:
    """Write ``buffer`` (rows, ring state, sampler state) as a checkpoint at ``directory``."""
    state = buffer.state_dict(copy=False)  # rows streamed from storage, never copied whole
    return write_checkpoint(directory, KIND, state["meta"], state["tensors"], durable=durable)


# --------------------------------------------------------------------------------- loading
def load(
    cls: type[ReplayBuffer], directory: str | os.PathLike[str], overrides: Mapping[str, Any]
) -> ReplayBuffer:
    """A new ``cls`` holding the checkpoint at ``directory`` (``ReplayBuffer.load_checkpoint``)."""
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise ArgumentTypeError(
            f"checkpoint overrides must be among {list(OVERRIDES)}, got {unknown}",
            argument="overrides",
        )
    checkpoint, _, kwargs = examine(directory, overrides)
    with checkpoint:
        # Any seed: the saved sampler state replaces it (none is drawn from torch's generator).
        buffer = cls(**{**kwargs, "seed": 0})
        try:
            buffer.load_state_dict(checkpoint)
        except BaseException:
            buffer.close()  # nothing half-made stays behind: its scratch files go too
            raise
    return buffer


def examine(
    directory: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None
) -> tuple[Checkpoint, RingState, dict[str, Any]]:
    """Read and check everything a load checks before it builds the buffer: the open checkpoint
    (sizes checked; the caller closes it), its ring state and the buffer's arguments.

    :func:`load` builds the buffer from these, and ``replaybuf verify`` calls this alone: one
    set of checks for both.
    """
    checkpoint = _open(directory)
    try:
        where = f"checkpoint {str(checkpoint.directory)!r}"
        state = check(checkpoint)
        kwargs = _constructor_kwargs(state, overrides or {}, where)
        generator_state = checkpoint.load(GENERATOR, verify=True)
        _check_generator_state(generator_state, state, kwargs["storing_device"], where)
        if state.priority is not None:
            check_weights(checkpoint.load(PRIORITY, verify=True), where)
    except BaseException:
        checkpoint.close()
        raise
    return checkpoint, state, kwargs


def check_weights(weights: torch.Tensor, where: str) -> None:
    """A prioritized ring's stored weights: finite and >= 0."""
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
        raise CorruptCheckpointError(f"{where}: {PRIORITY} must hold finite weights >= 0")


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
        raise ArgumentError(
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


def check(checkpoint: StateSource) -> RingState:
    """The ring state of a ``ReplayBuffer`` checkpoint, after checking it agrees with itself."""
    where = f"checkpoint {str(checkpoint.directory)!r}"
    state = parse_meta(checkpoint.meta, where, format_version(checkpoint))
    check_tensors(checkpoint, state, where)
    return state


META_KEYS = tuple(name for name in RingState.__dataclass_fields__ if name != "priority")


def parse_meta(meta: Mapping[str, Any], where: str, version: int = FORMAT_VERSION) -> RingState:
    """The ring state recorded in ``meta``, each field checked (ranges and consistency)."""
    meta = check_meta_keys(meta, META_KEYS, {"priority": None}, version, where)
    capacity = meta_int(meta, "capacity", where, low=1)
    size = meta_int(meta, "size", where, low=0, high=capacity, since="the 'capacity'")
    pointer = meta_int(meta, "pointer", where, 0, capacity - 1, since="the 'capacity'")
    if size < capacity and pointer != size:
        raise CorruptCheckpointError(
            f"{where}: pointer expected {size} (size % capacity while the ring is not full),"
            f" got {pointer}"
        )
    storage = meta_choice(meta, "storage", where, ("memmap", "tensor"))
    devices = {name: meta_device(meta, name, where) for name in ("device", "storing_device")}
    generator_device = meta_choice(
        meta, "generator_device", where, (devices["storing_device"].type,)
    )
    print_gc_warning = meta_choice(meta, "print_gc_warning", where, (False, True))
    spec = meta_spec(meta, "spec", where)
    if spec is None and size:
        raise CorruptCheckpointError(f"{where}: size {size} expected 0 with no spec")
    writes = meta_int(meta, "writes", where, low=size, since="the 'size'")
    if writes % capacity != pointer:
        raise CorruptCheckpointError(
            f"{where}: meta 'writes' expected {pointer} modulo {capacity} (the 'pointer' and "
            f"'capacity'), got {writes}"
        )
    # TorchRL keeps its write count in a C int, which wraps negative after 2**31 rows
    torchrl_writes = meta_int(meta, "torchrl_write_count", where, -(1 << 31), (1 << 31) - 1)
    if (
        torchrl_writes >= 0 and (torchrl_writes > writes or torchrl_writes % capacity != pointer)
    ) or (torchrl_writes < 0 and writes < 1 << 31):
        raise CorruptCheckpointError(
            f"{where}: meta 'torchrl_write_count' expected at most the 'writes' ({writes}) and "
            f"{pointer} modulo {capacity} (the 'pointer'), got {torchrl_writes}"
        )
    priority = meta["priority"]
    if priority is not None:
        if not isinstance(priority, dict) or sorted(priority) != list(PRIORITY_META):
            raise CorruptCheckpointError(
                f"{where}: meta 'priority' expected an object of {list(PRIORITY_META)}, "
                f"got {priority!r}"
            )
        priority = meta_priority(priority, where, " 'priority':")
    return RingState(
        capacity=capacity,
        size=size,
        pointer=pointer,
        storage=storage,
        device=meta["device"],
        storing_device=meta["storing_device"],
        print_gc_warning=print_gc_warning,
        torchrl_write_count=torchrl_writes,
        generator_device=generator_device,
        spec=spec,
        writes=writes,
        priority=priority,
    )


def check_tensors(checkpoint: StateSource, state: RingState, where: str) -> None:
    """Each field's tensor is there with shape ``[size, *field shape]`` and the field's dtype."""
    names = row_tensor_names(state.spec) if state.spec is not None else {}
    for key, name in names.items():
        assert state.spec is not None  # names is empty without a spec
        field = state.spec[key]
        info = checkpoint.tensors.get(name)
        if info is None:
            raise CorruptCheckpointError(
                f"{where}: field {key_name(key)!r} expected tensor {name!r}, which is missing"
                " from the manifest's tensors"
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
        raise ArgumentError(
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


def check_fits(state: RingState, source: StateSource, parts: RingParts) -> None:
    """``state`` can replace the contents of the buffer of ``parts``: same capacity, priorities
    both or neither, a generator state the buffer's generator takes, and room for the rows."""
    where = f"checkpoint {str(source.directory)!r}"
    if state.capacity != parts.capacity:
        raise MetadataError(
            f"{where}: capacity expected {parts.capacity} (this buffer's buffer_size), "
            f"got {state.capacity}"
        )
    if (state.priority is None) != (parts.priorities is None):
        raise MetadataError(
            f"{where}: prioritized expected {parts.priorities is not None} (this buffer), "
            f"got {state.priority is not None}"
        )
    generator_state = source.load(GENERATOR, verify=True)
    _check_generator_state(generator_state, state, parts.storing_device, where)
    if state.spec is not None:
        parts.slots.check_space(parts.capacity, state.spec)  # before anything changes


def restore(parts: RingParts, state: RingState, source: StateSource) -> None:
    """Fill the parts of a buffer (emptied, its priorities fresh) with the rows, priorities and
    sampler state of ``source``; the caller sets its size, pointer and writes from ``state``."""
    if state.spec is not None:
        parts.slots.prepare(state.spec)  # the space check, before anything is allocated
        names = row_tensor_names(state.spec)

        def fill(key: Key, out: torch.Tensor) -> None:
            source.load_into(names[key], out, verify=True)  # streamed, hashed on the way

        parts.slots.restore(state.size, state.pointer, state.torchrl_write_count, fill)
    if parts.priorities is not None and state.priority is not None:
        weights = source.load(PRIORITY, verify=True)
        check_weights(weights, f"checkpoint {str(source.directory)!r}")
        parts.priorities.load_state_dict({**state.priority, "weights": weights})
    generator_state = source.load(GENERATOR, verify=True)
    restore_generator(parts.generator, generator_state, state.generator_device)


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
