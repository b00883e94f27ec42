"""Tensors and TensorDicts in transit to and from the Ray buffer actor, as numpy arrays.

Ray serializes numpy arrays out of band (one object in the shared-memory object store, mapped
by a reader on the same node), where ``torch``'s pickler would copy each storage into a bytes
object. A small batch of arrays (up to ``INBAND_BYTES``), which Ray copies into its message
anyway, travels in-band instead, as one bytes object: a JSON header (keys, dtypes, shapes) and
the arrays' raw bytes, read back with ``numpy.frombuffer`` (nothing in it is unpickled). The
actor's arguments and results
pass through :func:`pack_value` / :func:`unpack_value` and :func:`pack_result` /
:func:`unpack_result`.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import (
    NonTensorData,
    NonTensorStack,
    TensorDict,
    TensorDictBase,
    is_leaf_nontensor,
)

from replaybuf.errors import ArgumentTypeError
from replaybuf.storage import resolve_device

# Integer dtypes of each element size: numpy has no bfloat16 / float8, so those travel as bits.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_READ_ONLY = "The given NumPy array is not writable"
# Ray copies a reply or an argument of up to 100 KiB (its default inline limit) into the
# message itself, so below that its out-of-band numpy buffers save no copy but cost Ray's
# bookkeeping of one buffer per array: batches this small travel in-band as one bytes object.
INBAND_BYTES = 64 * 1024


@dataclass(frozen=True)
class PackedArray:
    """One tensor in transit: a numpy array Ray moves zero-copy, and the torch dtype it holds."""

    array: np.ndarray
    dtype: str  # torch dtype name ("float32", "bfloat16", ...); the array may hold its bits


@dataclass(frozen=True)
class PackedNested:
    """A ``torch.nested`` jagged tensor in transit: its values and offsets."""

    values: PackedArray
    offsets: PackedArray


@dataclass(frozen=True)
class PackedObjects:
    """A non-tensor entry in transit (text, bytes, JSON-like values): the objects, nested as
    the entry's batch dimensions (a ``NonTensorStack``) or one value (``NonTensorData``)."""

    objects: Any
    dims: int  # the stack's batch dimensions (0: one NonTensorData)


Packed = PackedArray | PackedNested | PackedObjects


@dataclass(frozen=True)
class PackedBatch:
    """A TensorDict in transit: its batch size and its leaves, by nested key, flat."""

    batch_size: tuple[int, ...]
    leaves: tuple[tuple[tuple[str, ...], Packed], ...]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """In-band, as one bytes object, when it holds arrays only and they are small (see
        ``INBAND_BYTES``); else as itself, its arrays left to Ray's out-of-band buffers."""
        if self.nbytes() <= INBAND_BYTES and all(
            isinstance(leaf, PackedArray) for _, leaf in self.leaves
        ):
            return decode_inband, (encode_inband(self),)
        return PackedBatch, (self.batch_size, self.leaves)

    def nbytes(self) -> int:
        """The bytes of its arrays (objects not counted)."""
        total = 0
        for _, leaf in self.leaves:
            if isinstance(leaf, PackedArray):
                total += leaf.array.nbytes
            elif isinstance(leaf, PackedNested):
                total += leaf.values.array.nbytes + leaf.offsets.array.nbytes
        return total


_ALIGN = 64  # each array's offset in an in-band batch, so that frombuffer views are aligned


def encode_inband(batch: PackedBatch) -> bytes:
    """A batch of :class:`PackedArray` leaves as bytes: an 8-byte header length, the JSON
    header, then each array's bytes at an offset that is a multiple of ``_ALIGN``."""
    entries, blobs, at = [], [], 0
    for key, leaf in batch.leaves:
        assert isinstance(leaf, PackedArray)  # checked by the caller
        array = np.ascontiguousarray(leaf.array)
        entries.append([list(key), array.dtype.str, list(array.shape), leaf.dtype, at])
        blobs.append((at, array.tobytes()))
        at += -(-array.nbytes // _ALIGN) * _ALIGN
    head = json.dumps({"batch_size": list(batch.batch_size), "leaves": entries}).encode()
    start = -(-(8 + len(head)) // _ALIGN) * _ALIGN
    out = bytearray(start + at)
    out[:8] = len(head).to_bytes(8, "little")
    out[8 : 8 + len(head)] = head
    for offset, blob in blobs:
        out[start + offset : start + offset + len(blob)] = blob
    return bytes(out)


def decode_inband(data: bytes) -> PackedBatch:
    """The batch :func:`encode_inband` wrote: arrays are read-only views of ``data``, made by
    ``numpy.frombuffer`` (an object dtype is refused: nothing is unpickled)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    start = -(-(8 + size) // _ALIGN) * _ALIGN
    leaves = []
    for key, np_dtype, shape, dtype, offset in header["leaves"]:
        kind = np.dtype(np_dtype)
        if kind.hasobject:
            raise ArgumentTypeError(f"an in-band batch cannot hold objects, got dtype {kind}")
        count = math.prod(shape)
        array = np.frombuffer(data, kind, count, start + offset).reshape(shape)
        leaves.append((tuple(key), PackedArray(array, dtype)))
    return PackedBatch(tuple(header["batch_size"]), tuple(leaves))


def _pack_tensor(tensor: torch.Tensor, name: str = "tensor") -> PackedArray:
    """A tensor as a CPU numpy array (shared with the tensor when it is already one)."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise ArgumentTypeError(
            f"{name}: only dense tensors can be sent to a Ray buffer, got {tensor!r}"
        )
    tensor = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    try:
        array = tensor.numpy()
    except TypeError:  # no numpy dtype (bfloat16, float8, complex32): send the bits
        array = tensor.view(_BITS[tensor.element_size()]).numpy()
    return PackedArray(array, dtype)


def _unpack_tensor(packed: PackedArray, device: torch.device, copy: bool) -> torch.Tensor:
    """The tensor of a :class:`PackedArray` on ``device``; ``copy`` makes it writable memory."""
    dtype = getattr(torch, packed.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(f"packed array: unknown torch dtype {packed.dtype!r}")
    array = packed.array
    if copy and device.type == "cpu" and not array.flags.writeable:
        array = array.copy()  # numpy's copy: cheaper here than a fresh torch clone
    with warnings.catch_warnings():  # arrays from Ray's object store are read-only views
        warnings.filterwarnings("ignore", _READ_ONLY, UserWarning)
        tensor = torch.from_numpy(array)
    if tensor.dtype != dtype:
        tensor = tensor.view(dtype)
    return tensor if device.type == "cpu" else tensor.to(device)  # the H2D copy is the copy


def pack_batch(batch: TensorDictBase) -> PackedBatch:
    """A TensorDict as numpy leaves, so Ray moves it without pickling tensors one by one."""
    if not isinstance(batch, TensorDictBase):
        raise ArgumentTypeError(f"batch must be a TensorDict, got {type(batch).__name__}")
    leaves: list[tuple[tuple[str, ...], Packed]] = []
    for key, value in batch.items(True, True, is_leaf=is_leaf_nontensor):  # objects too
        key = (key,) if isinstance(key, str) else tuple(key)
        name = ".".join(key)
        if isinstance(value, NonTensorStack):
            leaves.append((key, PackedObjects(value.tolist(), len(value.batch_size))))
        elif isinstance(value, NonTensorData):
            leaves.append((key, PackedObjects(value.data, 0)))
        elif isinstance(value, torch.Tensor) and value.is_nested:
            offsets = value.offsets()  # type: ignore[attr-defined]  # a jagged NestedTensor's
            nested = PackedNested(_pack_tensor(value.values(), name), _pack_tensor(offsets, name))
            leaves.append((key, nested))
        elif isinstance(value, torch.Tensor):
            leaves.append((key, _pack_tensor(value, name)))
        else:
            raise ArgumentTypeError(f"batch: field {name!r} is not a tensor ({value!r})")
    return PackedBatch(tuple(batch.batch_size), tuple(leaves))


def unpack_batch(
    packed: PackedBatch, device: torch.device | str = "cpu", *, copy: bool = True
) -> TensorDict:
    """The TensorDict of :func:`pack_batch` on ``device``.

    With ``copy`` (the default) every tensor owns writable memory; ``copy=False`` keeps CPU
    tensors as views of the received arrays, read-only when they sit in Ray's object store.
    """
    if not isinstance(packed, PackedBatch):
        raise ArgumentTypeError(f"packed must be a PackedBatch, got {type(packed).__name__}")
    device = resolve_device(device, "device")
    td = TensorDict({}, batch_size=list(packed.batch_size), device=device)
    for key, leaf in packed.leaves:
        if isinstance(leaf, PackedObjects):
            td.set(key, _objects(leaf))
        elif isinstance(leaf, PackedNested):
            values = _unpack_tensor(leaf.values, device, copy)
            offsets = _unpack_tensor(leaf.offsets, device, copy)
            td.set(key, torch.nested.nested_tensor_from_jagged(values, offsets))
        else:
            td.set(key, _unpack_tensor(leaf, device, copy))
    return td


def _objects(packed: PackedObjects) -> NonTensorData | NonTensorStack:
    """A non-tensor entry again: one object per row (a list-valued object stays one)."""
    if not packed.dims:
        return NonTensorData(packed.objects)

    def stack(rows: list[Any], depth: int) -> NonTensorStack:
        if depth == 1:
            return NonTensorStack(*(NonTensorData(o) for o in rows))
        return NonTensorStack(*(stack(r, depth - 1) for r in rows))

    return stack(packed.objects, packed.dims)


def pack_value(value: Any) -> Any:
    """An argument for the actor: tensors and numeric arrays (also inside dicts) packed."""
    if isinstance(value, TensorDictBase):
        return pack_batch(value)
    if isinstance(value, torch.Tensor):
        return _pack_tensor(value)
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        return _pack_tensor(torch.from_numpy(np.ascontiguousarray(value)))
    if type(value) is dict:
        return {k: pack_value(v) for k, v in value.items()}
    return value  # numbers, ids, strings and anything the buffer itself will judge


def unpack_value(value: Any) -> Any:
    """An argument as the buffer expects it; no copy: the buffer copies what it stores."""
    cpu = torch.device("cpu")
    if isinstance(value, PackedBatch):
        return unpack_batch(value, cpu, copy=False)
    if isinstance(value, PackedArray):
        return _unpack_tensor(value, cpu, copy=False)
    if type(value) is dict:
        return {k: unpack_value(v) for k, v in value.items()}
    return value


def pack_result(value: Any) -> Any:
    """A result for the client: TensorDicts (also in a list) packed, the rest as is."""
    if isinstance(value, TensorDictBase):
        return pack_batch(value)
    if isinstance(value, list):
        return [pack_result(v) for v in value]
    return value


def unpack_result(value: Any, device: torch.device) -> Any:
    """A result as the local buffer would return it, batches rebuilt on ``device``."""
    if isinstance(value, PackedBatch):
        return unpack_batch(value, device)
    if isinstance(value, list):
        return [unpack_result(v, device) for v in value]
    return value
