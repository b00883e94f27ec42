"""Field specs: turn user input into a checked TensorDict before anything touches storage.

TorchRL advances its cursor before a failing ``extend`` raises, broadcasts ``[1]`` into ``[4]``,
and adds or drops unknown keys depending on the storage (``shared/RELIABILITY.md`` §5), so every
write is converted and checked here first. The first write fixes the spec; every later write must
match it key for key, shape for shape and dtype for dtype. Python numbers are the one lossless
exception: they take the field's dtype when the value survives the cast.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from replaybuf.errors import SchemaError

Key = tuple[str, ...]
# Keys the buffers add to their own output; a user field with one of these names would be shadowed.
RESERVED_KEYS = frozenset({"index"})
_SCALARS = (bool, int, float, np.generic)

_CPU = torch.device("cpu")


@functools.cache
def storable(dtype: torch.dtype) -> bool:
    """Whether torch can write rows of ``dtype`` the way the storages do: ``index_put`` (TorchRL's
    ``set``) and ``index_copy_`` (replaybuf's direct writes). Probed once per dtype, because
    it depends on the torch build: 2.14 lacks them for uint16/32/64, float8 and the sub-byte
    dtypes, which would otherwise fail inside TorchRL at the first flush."""
    try:
        column, row, rows = (
            torch.zeros(2, dtype=dtype),
            torch.zeros(1, dtype=dtype),
            torch.tensor([1]),
        )
        column[rows] = row
        column.index_copy_(0, rows, row)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def check_storable(dtype: torch.dtype, what: str) -> None:
    """Raise :class:`SchemaError` naming ``what`` when rows of ``dtype`` cannot be stored."""
    if not storable(dtype):
        raise SchemaError(
            f"{what} has dtype {dtype}, which this torch cannot write into storage rows "
            "(index_put / index_copy_ are not implemented for it); store it as a wider "
            "signed integer or a float dtype"
        )


def key_name(key: Key) -> str:
    """A nested key as users write it: ``obs`` or ``obs.pixels``."""
    return ".".join(key)


@dataclass(frozen=True)
class Field:
    """One stored leaf: its per-row shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


class FieldSpec(Mapping[Key, Field]):
    """An ordered, immutable mapping from nested key to :class:`Field`."""

    def __init__(self, fields: Mapping[Key, Field]) -> None:
        self._fields = dict(sorted(fields.items()))
        self._tree = _field_tree(self._fields)
        self._groups: dict[tuple[str, ...], tuple[Key, ...]] = {}

    def __getitem__(self, key: Key) -> Field:
        return self._fields[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{key_name(k)}: {f.describe()}" for k, f in self._fields.items())
        return f"FieldSpec({inner})"

    def group(self, *names: str) -> tuple[Key, ...]:
        """The keys under any of the top-level ``names``, in order (cached: sampling asks in
        every batch, and the spec never changes)."""
        keys = self._groups.get(names)
        if keys is None:
            keys = self._groups[names] = tuple(k for k in self._fields if k[0] in names)
        return keys

    @property
    def row_bytes(self) -> int:
        """Bytes one row of every field occupies."""
        return sum(f.row_bytes for f in self._fields.values())

    @classmethod
    def of(cls, td: TensorDictBase | Mapping[Key, torch.Tensor], batch_dims: int) -> FieldSpec:
        """The spec of ``td``'s leaves (or flat leaves), dropping ``batch_dims`` dimensions."""
        fields = {}
        items = _leaves(td) if isinstance(td, TensorDictBase) else td.items()
        for key, value in items:
            fields[key] = Field(tuple(value.shape[batch_dims:]), value.dtype)
        return cls(fields)

    @classmethod
    def declare(cls, spec: Any, what: str = "spec") -> FieldSpec:
        """A spec given up front: a FieldSpec, or a (nested) dict of name -> ``Field``,
        ``(shape, dtype)`` or an example tensor of one row. Raises ``ValueError`` naming the
        field for anything else."""
        if isinstance(spec, FieldSpec):
            for key, field in spec.items():
                check_storable(field.dtype, f"{what} field {key_name(key)!r}")
            return spec
        if not isinstance(spec, Mapping) or not spec:
            raise ValueError(
                f"{what} must be a FieldSpec or a non-empty dict of fields, got {spec!r}"
            )
        fields: dict[Key, Field] = {}
        for key, value in _flatten_mapping(spec, (), what):
            name = f"{what} field {key_name(key)!r}"
            fields[key] = _declared_field(value, name)
            check_storable(fields[key].dtype, name)
        return cls(fields)

    def to_json(self) -> dict[str, dict[str, Any]]:
        return {
            key_name(k): {"key": list(k), "shape": list(f.shape), "dtype": str(f.dtype)}
            for k, f in self._fields.items()
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FieldSpec:
        """Rebuild a spec written by :meth:`to_json`; raises ``ValueError`` on anything else."""
        fields = {}
        for name, entry in data.items():
            dtype = getattr(torch, str(entry["dtype"]).removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"field {name!r}: unknown dtype {entry['dtype']!r}")
            key, shape = entry["key"], entry["shape"]
            if not isinstance(key, list) or ".".join(map(str, key)) != name:
                raise ValueError(f"field {name!r}: key expected the name's parts, got {key!r}")
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
            ):
                raise ValueError(f"field {name!r}: shape expected sizes >= 0, got {shape!r}")
            fields[tuple(key)] = Field(tuple(shape), dtype)
        return cls(fields)

    def zeros(self, rows: int, device: torch.device | str = "cpu") -> TensorDict:
        """A TensorDict of ``rows`` zero rows matching the spec (filler rows, tests)."""
        td = TensorDict({}, batch_size=[rows], device=device)
        for key, f in self._fields.items():
            td.set(key, torch.zeros((rows, *f.shape), dtype=f.dtype, device=device))
        return td

    def match(self, data: Any, batched: bool) -> dict[Key, torch.Tensor] | None:
        """``data``'s leaves by key when it is a TensorDict or dict of tensors that matches the
        spec exactly (keys, shapes, dtypes and, for a batch, one row count), else None.

        The fast path of a write: what :func:`to_leaves` and :meth:`check` would accept as is,
        found without flattening, converting or re-checking. None means "take the general
        path", which converts what needs converting or raises the precise error. Values on any
        device but ``meta`` are taken, as there.
        """
        if self._tree is None or (type(data) is not TensorDict and type(data) is not dict):
            return None
        leaves: dict[Key, torch.Tensor] = {}
        return None if _match(data, self._tree, batched, leaves, -1) is None else leaves

    def check(
        self, td: TensorDictBase | Mapping[Key, torch.Tensor], batch_dims: int, what: str
    ) -> None:
        """Raise :class:`SchemaError` unless ``td`` (or flat leaves by key) matches exactly."""
        got = dict(_leaves(td)) if isinstance(td, TensorDictBase) else td
        missing = [key_name(k) for k in self._fields if k not in got]
        extra = [key_name(k) for k in got if k not in self._fields]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {missing}")
            if extra:
                parts.append(f"unexpected {extra}")
            raise SchemaError(
                f"{what}: keys differ from the stored spec ({'; '.join(parts)}); "
                f"expected {sorted(key_name(k) for k in self._fields)}"
            )
        for key, f in self._fields.items():
            value = got[key]
            shape = tuple(value.shape[batch_dims:])
            if shape != f.shape:
                raise SchemaError(
                    f"{what}: field {key_name(key)!r} expected shape {list(f.shape)}, "
                    f"got {list(shape)}"
                )
            if value.dtype != f.dtype:
                raise SchemaError(
                    f"{what}: field {key_name(key)!r} expected dtype {f.dtype}, got {value.dtype}"
                )


# A spec as a tree for FieldSpec.match: name -> subtree (a dict), or (key, shape, dtype).
_Tree = dict[str, Any]


def _field_tree(fields: Mapping[Key, Field]) -> _Tree | None:
    """The fields as a tree of names; None where no write can match as is (a reserved name,
    which to_leaves refuses, or a key that is both a leaf and a prefix of another)."""
    tree: _Tree = {}
    for key, field in fields.items():
        if key[0] in RESERVED_KEYS:
            return None
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                return None
        if key[-1] in node:
            return None
        node[key[-1]] = (key, field.shape, field.dtype)
    return tree


def _match(data: Mapping, tree: _Tree, batched: bool, leaves: dict, rows: int) -> int | None:
    """Add ``data``'s leaves to ``leaves`` if they match ``tree`` exactly. Returns the batch's
    row count (``rows``: the count so far, -1 before the first leaf) or None on a difference."""
    seen = 0
    for name, value in data.items():
        node = tree.get(name)
        if node is None:
            return None
        seen += 1
        if type(node) is dict:  # a subtree (leaves are tuples)
            if type(value) is not TensorDict and type(value) is not dict:
                return None
            matched = _match(value, node, batched, leaves, rows)
            if matched is None:
                return None
            rows = matched
            continue
        key, shape, dtype = node
        if (
            type(value) is not torch.Tensor
            or value.dtype != dtype
            or value.is_meta
            or value.layout is not torch.strided
        ):
            return None
        size = value.shape
        if batched:
            if rows < 0:  # the first leaf fixes the row count
                if not size:
                    return None
                rows = size[0]
            # One compare with a tuple: torch.Size slicing (size[1:]) would build a new Size
            # per leaf on top of the compare.
            if size != (rows, *shape):
                return None
        elif size != shape:
            return None
        # to_leaves detaches every tensor; one that needs no grad is the same data as is.
        leaves[key] = value.detach() if value.requires_grad else value
    return rows if seen == len(tree) else None


def _declared_field(value: Any, what: str) -> Field:
    """One declared field: a Field, ``(shape, dtype)`` or an example tensor / array."""
    if isinstance(value, Field):
        return value
    if isinstance(value, torch.Tensor | np.ndarray):
        example = torch.as_tensor(value)
        return Field(tuple(example.shape), example.dtype)
    if isinstance(value, tuple) and len(value) == 2:
        shape, dtype = value
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."), dtype)
        ok_shape = isinstance(shape, tuple | list) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        )
        if ok_shape and isinstance(dtype, torch.dtype):
            return Field(tuple(shape), dtype)
    raise ValueError(
        f"{what} expected a Field, (shape, dtype) such as ((4,), torch.float32) or an example "
        f"tensor, got {value!r}"
    )


def _leaves(td: TensorDictBase) -> Iterator[tuple[Key, torch.Tensor]]:
    for key, value in td.items(include_nested=True, leaves_only=True):
        yield (key,) if isinstance(key, str) else tuple(key), value


def to_leaves(
    data: Any,
    *,
    batched: bool,
    what: str,
    spec: FieldSpec | None = None,
) -> dict[Key, torch.Tensor]:
    """Convert one row (``batched=False``) or a batch of rows into detached tensors by key.

    Accepts a TensorDict or a (nested) mapping of tensors, numpy arrays and Python numbers.
    Python numbers take the spec's dtype when the cast is lossless. For a batch, rows are checked
    to agree across fields. Raises ``TypeError`` for unsupported values and
    :class:`SchemaError` for structural errors. The tensors may share memory with ``data``.
    """
    if isinstance(data, TensorDictBase):
        items = list(_leaves(data))
    elif isinstance(data, Mapping):
        items = list(_flatten_mapping(data, (), what))
    else:
        raise TypeError(f"{what}: expected a TensorDict or a dict of tensors, got {_kind(data)}")
    if not items:
        raise SchemaError(f"{what}: expected at least one field, got none")
    leaves: dict[Key, torch.Tensor] = {}
    for key, value in items:
        if key[0] in RESERVED_KEYS:
            raise SchemaError(f"{what}: field name {key[0]!r} is reserved by replaybuf")
        field = spec.get(key) if spec is not None else None
        leaves[key] = _to_tensor(value, key, field, batched, what)
    if batched:
        _common_rows(leaves, what)
    return leaves


def _flatten_mapping(data: Mapping, prefix: Key, what: str) -> Iterator[tuple[Key, Any]]:
    for name, value in data.items():
        if not isinstance(name, str):
            raise TypeError(f"{what}: field names must be str, got {name!r}")
        key = (*prefix, name)
        if isinstance(value, Mapping):  # a dict or a TensorDict (whose bool() raises)
            if len(value.keys()) == 0:
                raise SchemaError(f"{what}: field {key_name(key)!r} is an empty dict")
            yield from _flatten_mapping(value, key, what)
        else:
            yield key, value


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
            raise TypeError(
                f"{what}: field {name!r} expected a dense (strided) tensor, got layout "
                f"{value.layout}; convert it with .to_dense()"
            )
        return value.detach()
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError(f"{what}: field {name!r} is an object array; expected numbers")
        # np.ascontiguousarray would turn a 0-d array into shape (1,): only copy when needed.
        return torch.from_numpy(value if value.flags.c_contiguous else np.ascontiguousarray(value))
    if isinstance(value, _SCALARS) and not batched:
        return _scalar(value.item() if isinstance(value, np.generic) else value, name, field, what)
    if isinstance(value, _SCALARS):
        raise SchemaError(
            f"{what}: field {name!r} expected a batch of rows, got a scalar {value!r}"
        )
    raise TypeError(
        f"{what}: field {name!r} expected a tensor, array or number, got {_kind(value)}"
    )


def _scalar(value: bool | int | float, name: str, field: Field | None, what: str) -> torch.Tensor:
    """A Python number as a 0-d tensor, in the field's dtype when that holds it.

    Floats round into any floating dtype (that is what storing a float means); ints must fit
    exactly; a float never goes silently into an integer or bool field.
    """
    if field is None or field.shape != ():
        return torch.tensor(value, device=_CPU)  # not the default device: rows go to storage
    dtype = field.dtype
    cast = None
    if dtype.is_floating_point or not isinstance(value, float):
        try:
            cast = torch.tensor(value, dtype=dtype, device=_CPU)
        except (RuntimeError, OverflowError):
            cast = None
    if cast is None or (not isinstance(value, float) and cast.item() != value):
        raise SchemaError(
            f"{what}: field {name!r} expected dtype {dtype}, got {value!r} which it cannot hold"
        )
    return cast


def _common_rows(leaves: Mapping[Key, torch.Tensor], what: str) -> int:
    sizes = {key_name(k): (v.shape[0] if v.dim() else None) for k, v in leaves.items()}
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


def _kind(value: Any) -> str:
    return type(value).__name__
