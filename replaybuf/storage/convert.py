"""User values to checked leaves by key: tensors for fixed fields, :class:`Ragged` rows else.

Fixed fields take tensors, numpy arrays, Python numbers and (nested) lists of numbers; Python
numbers take the field's dtype when the cast is lossless. Ragged fields take, per row, a
tensor, array or list of any leading length. Non-tensor fields take ``str`` (text), ``bytes``
or JSON-like values (dicts with str keys, lists, tuples, numbers, booleans, None, nested),
encoded pickle-free as UTF-8 JSON; a value JSON cannot carry (a lambda, a set, an object, NaN,
a cycle) is refused by name. Where the spec is not known yet, a ``str`` is text, ``bytes``
are bytes and a value that is neither numbers nor a dict of them (None, a list holding text or
dicts, an object array) is JSON, when the caller takes ragged values (``ragged=True``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from typing import Any, Literal, overload

import numpy as np
import torch
from tensordict import NonTensorData, TensorDictBase

from replaybuf.args import check_int64
from replaybuf.errors import ArgumentTypeError, SchemaError
from replaybuf.storage.ragged import Ragged
from replaybuf.storage.schema import (
    BYTES,
    JSON,
    RAGGED,
    RESERVED_KEYS,
    TEXT,
    Field,
    FieldSpec,
    Key,
    _leaves,
    check_storable,
    has_memory,
    key_name,
)

_SCALARS = (bool, int, float, np.generic)
_CPU = torch.device("cpu")
_MAX_DEPTH = 256  # nesting of a JSON-like value at most
Leaf = torch.Tensor | Ragged


@overload
def to_leaves(
    data: Any,
    *,
    batched: bool,
    what: str,
    spec: FieldSpec | None = None,
    ragged: Literal[False] = False,
    declared: FieldSpec | None = None,
) -> dict[Key, torch.Tensor]: ...


@overload
def to_leaves(
    data: Any,
    *,
    batched: bool,
    what: str,
    spec: FieldSpec | None = None,
    ragged: bool,
    declared: FieldSpec | None = None,
) -> dict[Key, Leaf]: ...


def to_leaves(
    data: Any,
    *,
    batched: bool,
    what: str,
    spec: FieldSpec | None = None,
    ragged: bool = False,
    declared: FieldSpec | None = None,
) -> dict[Key, Leaf] | dict[Key, torch.Tensor]:
    """Convert one row (``batched=False``) or a batch of rows into checked leaves by key.

    Accepts a TensorDict or a (nested) mapping. For a batch, rows are checked to agree across
    fields. Raises ``TypeError`` for unsupported values and :class:`SchemaError` for
    structural errors. The tensors may share memory with ``data``. ``ragged``: the caller
    stores ragged and non-tensor fields (an episode buffer), so values that can only be those
    are taken as them where the spec is not known yet. ``declared``: fields declared up front
    (some of them, maybe), which a first write's values take before the spec is fixed.
    """
    if isinstance(data, TensorDictBase):
        items = list(_leaves(data))
    elif isinstance(data, Mapping):
        items = list(flatten(data, (), what, spec or declared))
    else:
        raise ArgumentTypeError(
            f"{what}: expected a TensorDict or a dict of tensors, got {kind_of(data)}"
        )
    if not items:
        raise SchemaError(f"{what}: expected at least one field, got none")
    leaves: dict[Key, Leaf] = {}
    for key, value in items:
        if key[0] in RESERVED_KEYS:
            raise SchemaError(f"{what}: field name {key[0]!r} is reserved by replaybuf")
        field = spec.get(key) if spec is not None else None
        if field is None and spec is None and declared is not None:
            field = declared.get(key)
        if field is None and ragged:  # new (or, spec fixed, unknown: check() names it)
            field = inferred(value, batched)
        if field is not None and field.is_ragged:
            leaves[key] = to_ragged(value, key, field, batched, what)
        else:
            leaves[key] = _to_tensor(value, key, field, batched, what)
    if batched:
        _common_rows(leaves, what)
    return leaves


def flatten(
    data: Mapping, prefix: Key, what: str, spec: FieldSpec | None
) -> Iterator[tuple[Key, Any]]:
    """A mapping's leaves by key; a dict at a JSON field's key is that field's value."""
    for name, value in data.items():
        if not isinstance(name, str):
            raise ArgumentTypeError(f"{what}: field names must be str, got {name!r}")
        key = (*prefix, name)
        field = None if spec is None else spec.get(key)
        if isinstance(value, Mapping) and (field is None or field.kind != JSON):
            if len(value.keys()) == 0:
                raise SchemaError(f"{what}: field {key_name(key)!r} is an empty dict")
            yield from flatten(value, key, what, spec)
        else:
            yield key, value


def inferred(value: Any, batched: bool) -> Field | None:
    """The non-tensor kind ``value`` (a row, or the first row of a batch) leaves no doubt
    about: text for ``str``, bytes for ``bytes``, JSON for what numbers cannot be; else None."""
    row = value
    if batched:
        if not isinstance(value, list | tuple) or not value:
            return None
        row = value[0]
    if isinstance(row, NonTensorData):
        row = row.data
    if isinstance(row, str):
        return Field.text()
    if isinstance(row, bytes | bytearray):
        return Field.bytes()
    if row is None or isinstance(row, Mapping):
        return Field.json()
    if isinstance(row, np.ndarray) and row.dtype == object:
        return Field.json()
    if isinstance(row, list | tuple) and not _numbers_only(row):
        return Field.json()
    return None


def _numbers_only(value: Any, depth: int = 0) -> bool:
    """Whether a (nested) list holds only numbers (a tensor's worth)."""
    if depth > _MAX_DEPTH:
        return False
    if isinstance(value, list | tuple):
        return all(_numbers_only(v, depth + 1) for v in value)
    return isinstance(value, _SCALARS) and not isinstance(value, np.object_)


# ----------------------------------------------------------------------------- ragged values
def to_ragged(value: Any, key: Key, field: Field, batched: bool, what: str) -> Ragged:
    """Rows of a ragged or non-tensor field (one row unless ``batched``)."""
    name = key_name(key)
    if batched:
        if isinstance(value, torch.Tensor | np.ndarray) and field.kind == RAGGED:
            rows = list(value)  # a batch of rows of one length
        elif isinstance(value, list | tuple):
            rows = list(value)
        else:
            raise SchemaError(
                f"{what}: field {name!r} expected a list of rows ({field.describe()}), got "
                f"{kind_of(value)}"
            )
    else:
        rows = [value]
    if field.kind == RAGGED:
        tensors = [_ragged_row(row, name, field, what) for row in rows]
    else:
        tensors = [_encoded(row, name, field.kind, what) for row in rows]
    return Ragged.of_rows(tensors, field.shape, field.dtype, field.kind)


def _ragged_row(value: Any, name: str, field: Field, what: str) -> torch.Tensor:
    """One row of a ragged numeric field: ``[length, *shape]`` of the field's dtype."""
    if isinstance(value, list | tuple) and not value:
        return torch.empty((0, *field.shape), dtype=field.dtype)
    tensor = _as_tensor(value, (name,), None, False, what)
    if tensor.dim() == 0 or tuple(tensor.shape[1:]) != field.shape:
        raise SchemaError(
            f"{what}: field {name!r} expected rows [length, *{list(field.shape)}] "
            f"({field.describe()}), got shape {list(tensor.shape)}"
        )
    if tensor.dtype != field.dtype:
        cast = tensor.to(field.dtype)
        lossless = cast.to(tensor.dtype).equal(tensor) if tensor.numel() else True
        if not lossless or (tensor.is_floating_point() and not field.dtype.is_floating_point):
            raise SchemaError(
                f"{what}: field {name!r} expected dtype {field.dtype}, got {tensor.dtype}"
            )
        tensor = cast
    return tensor.to(_CPU)


def _encoded(value: Any, name: str, kind: str, what: str) -> torch.Tensor:
    """One non-tensor row as its bytes (a uint8 tensor)."""
    if isinstance(value, NonTensorData):
        value = value.data
    if kind == TEXT:
        if not isinstance(value, str):
            raise SchemaError(f"{what}: field {name!r} expected text (str), got {kind_of(value)}")
        try:
            raw = value.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate
            raise SchemaError(
                f"{what}: field {name!r} holds text that is not valid UTF-8: {exc}"
            ) from None
    elif kind == BYTES:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise SchemaError(f"{what}: field {name!r} expected bytes, got {kind_of(value)}")
        raw = bytes(value)
    else:
        raw = encode_json(value, name, what)
    return (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )


def encode_json(value: Any, name: str, what: str) -> bytes:
    """``value`` as UTF-8 JSON, after checking that JSON carries it (tuples and numpy arrays
    come back as lists, numpy and 0-d tensor numbers as Python numbers)."""
    plain = _plain(value, name, what, 0, set())
    return json.dumps(plain, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()


def _plain(value: Any, name: str, what: str, depth: int, seen: set[int]) -> Any:
    """``value`` in JSON's types, refusing what JSON would drop, change or choke on: non-str
    keys, NaN and infinities, cycles, deep nesting, and every type that is not JSON (named)."""
    if depth > _MAX_DEPTH:
        raise SchemaError(f"{what}: field {name!r} nests deeper than {_MAX_DEPTH} levels")
    if isinstance(value, NonTensorData):
        value = value.data
    if isinstance(value, np.generic | torch.Tensor) and getattr(value, "ndim", 0) == 0:
        if isinstance(value, np.generic) and value.dtype.kind not in "biuf":
            raise SchemaError(f"{what}: field {name!r} holds a numpy {value.dtype}, not a number")
        value = value.item()
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SchemaError(f"{what}: field {name!r} holds {value}, which JSON cannot carry")
        return value
    if isinstance(value, np.ndarray | torch.Tensor):
        value = value.tolist()  # an object array's items are checked below like a list's
    if isinstance(value, list | tuple | dict):
        if id(value) in seen:
            raise SchemaError(f"{what}: field {name!r} holds a cycle (a container inside itself)")
        seen.add(id(value))
        if isinstance(value, dict):
            for k in value:
                if not isinstance(k, str):
                    raise SchemaError(
                        f"{what}: field {name!r} has a dict key {k!r}; JSON keys are str"
                    )
            plain: Any = {k: _plain(v, name, what, depth + 1, seen) for k, v in value.items()}
        else:
            plain = [_plain(v, name, what, depth + 1, seen) for v in value]
        seen.discard(id(value))
        return plain
    raise SchemaError(
        f"{what}: field {name!r} holds a {kind_of(value)}, which is not JSON-like (dicts with str "
        "keys, lists, tuples, str, numbers, booleans, None); replaybuf never pickles"
    )


def decode(kind: str, raw: bytes) -> Any:
    """A non-tensor row from its stored bytes."""
    if kind == TEXT:
        return raw.decode("utf-8")
    if kind == BYTES:
        return raw
    return json.loads(raw)


# ----------------------------------------------------------------------------- fixed values
def _to_tensor(value: Any, key: Key, field: Field | None, batched: bool, what: str) -> torch.Tensor:
    tensor = _as_tensor(value, key, field, batched, what)
    if field is None:  # a new field (a write that fixes the spec): its dtype must be storable
        check_storable(tensor.dtype, f"{what}: field {key_name(key)!r}")
    return tensor


def _as_tensor(value: Any, key: Key, field: Field | None, batched: bool, what: str) -> torch.Tensor:
    name = key_name(key)
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            raise SchemaError(f"{what}: field {name!r} is a meta tensor (it holds no data)")
        if value.layout is not torch.strided:  # storage columns are dense: refuse up front
            raise ArgumentTypeError(
                f"{what}: field {name!r} expected a dense (strided) tensor, got layout "
                f"{value.layout}; convert it with .to_dense()"
            )
        if not has_memory(value):  # refused before any row is taken for it
            raise SchemaError(
                f"{what}: field {name!r} is a tensor without memory of its own (a torch.func "
                "transform's, such as vmap's or functionalize's); write its values outside "
                "the transform"
            )
        return value.detach()
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise ArgumentTypeError(f"{what}: field {name!r} is an object array; expected numbers")
        # np.ascontiguousarray would turn a 0-d array into shape (1,): only copy when needed.
        return torch.from_numpy(value if value.flags.c_contiguous else np.ascontiguousarray(value))
    if isinstance(value, _SCALARS) and not batched:
        return _scalar(value.item() if isinstance(value, np.generic) else value, name, field, what)
    if isinstance(value, _SCALARS):
        raise SchemaError(
            f"{what}: field {name!r} expected a batch of rows, got a scalar {value!r}"
        )
    if isinstance(value, list | tuple) and value and _numbers_only(value):
        return _from_list(value, name, field, what)
    raise ArgumentTypeError(
        f"{what}: field {name!r} expected a tensor, array, number or list of numbers, got "
        f"{kind_of(value)} (text, bytes, JSON-like and ragged fields: an episode buffer "
        "without frame_stack)"
    )


def _from_list(value: list | tuple, name: str, field: Field | None, what: str) -> torch.Tensor:
    """A (nested) list of numbers as the tensor of its shape (the field's dtype when it holds
    every value exactly)."""
    try:
        tensor = torch.tensor(value, device=_CPU)
    except OverflowError:
        raise SchemaError(
            f"{what}: field {name!r} expected ints within int64 [-2**63, 2**63 - 1], got a "
            "list holding one beyond"
        ) from None
    except (ValueError, TypeError, RuntimeError) as exc:
        raise SchemaError(
            f"{what}: field {name!r} is a list that is no tensor ({exc}){_RAGGED_LIST}"
        ) from None
    if field is None or field.dtype == tensor.dtype:
        return tensor
    cast = tensor.to(field.dtype)
    if cast.to(tensor.dtype).equal(tensor) and not (
        tensor.is_floating_point() and not field.dtype.is_floating_point
    ):
        return cast
    raise SchemaError(f"{what}: field {name!r} expected dtype {field.dtype}, got {value!r}")


_RAGGED_LIST = (
    "; rows of varying length are a ragged field: declare it, e.g. "
    "spec={'observation': Field.ragged(torch.int64)}"
)


def _scalar(value: bool | int | float, name: str, field: Field | None, what: str) -> torch.Tensor:
    """A Python number as a 0-d tensor, in the field's dtype when that holds it.

    Floats round into any floating dtype (that is what storing a float means); ints must fit
    exactly; a float never goes silently into an integer or bool field.
    """
    if type(value) is int and (field is None or not field.dtype.is_floating_point):
        check_int64(value, f"{what}: field {name!r}", SchemaError)  # torch's message names none
    if field is None or field.shape != ():
        return torch.tensor(value, device=_CPU)  # not the default device: rows go to storage
    dtype = field.dtype
    cast = None
    if dtype.is_floating_point or not isinstance(value, float):
        try:
            cast = torch.tensor(value, dtype=dtype, device=_CPU)
        except (RuntimeError, OverflowError, ValueError):
            cast = None
    if cast is None or (not isinstance(value, float) and cast.item() != value):
        raise SchemaError(
            f"{what}: field {name!r} expected dtype {dtype}, got {value!r} which it cannot hold"
        )
    return cast


def _common_rows(leaves: Mapping[Key, Leaf], what: str) -> int:
    sizes = {
        key_name(k): v.rows if isinstance(v, Ragged) else (v.shape[0] if v.dim() else None)
        for k, v in leaves.items()
    }
    scalars = [n for n, s in sizes.items() if s is None]
    if scalars:
        raise SchemaError(
            f"{what}: field {scalars[0]!r} expected a batch of rows, got a 0-d tensor"
        )
    distinct = set(sizes.values())
    if len(distinct) != 1:
        raise SchemaError(f"{what}: fields disagree on the batch dimension: {sizes}")
    size = distinct.pop()
    assert size is not None  # 0-d fields were refused above
    return int(size)


def kind_of(value: Any) -> str:
    return type(value).__name__
