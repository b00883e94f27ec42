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

from replaybuf.errors import ArgumentTypeError, SchemaError, UnknownFieldError
from replaybuf.storage.ragged import Ragged

Key = tuple[str, ...]
# Keys the buffers add to their own output; a user field with one of these names would be shadowed.
RESERVED_KEYS = frozenset({"index"})
_SCALARS = (bool, int, float, np.generic)

_CPU = torch.device("cpu")


def has_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values lie in memory of its own: not a ``torch.func`` wrapper,
    whose ``data_ptr()`` raises (vmap's batched tensors) or is 0 while it has elements
    (functionalization's); a zero tensor (no memory, torch writes its zeros) counts as one.
    Subclasses are taken at their word (a ``__torch_dispatch__`` wrapper's ``data_ptr()`` may
    be 0 while torch's copy reads its values), as before this check."""
    if type(tensor) is not torch.Tensor:
        return True
    try:
        address = tensor.data_ptr()
    except RuntimeError:
        return False
    return bool(address) or not tensor.numel() or tensor._is_zerotensor()


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


FIXED, RAGGED, TEXT, BYTES, JSON = "fixed", "ragged", "text", "bytes", "json"
NON_TENSOR = (TEXT, BYTES, JSON)  # stored as encoded bytes, returned as Python objects
KINDS = (FIXED, RAGGED, *NON_TENSOR)


@dataclass(frozen=True)
class Field:
    """One stored leaf: its per-row shape and dtype, and its kind.

    ``kind`` is ``"fixed"`` (every row ``shape``), ``"ragged"`` (each row ``[length, *shape]``,
    the length varying from row to row: token ids) or a non-tensor kind: ``"text"`` (``str``),
    ``"bytes"`` or ``"json"`` (dicts, lists, numbers, booleans, None, nested), stored as
    UTF-8 or raw bytes in a ragged uint8 field (see :mod:`replaybuf.storage.ragged`).
    ``reserve``: values (bytes, for the non-tensor kinds) to make room for at the field's first
    write, so that a buffer that will hold that many never moves them to grow; None: room
    grows as needed.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = FIXED
    reserve: int | None = None

    @classmethod
    def ragged(
        cls,
        dtype: torch.dtype = torch.int64,
        shape: tuple[int, ...] = (),
        *,
        reserve: int | None = None,
    ) -> Field:
        """A field whose rows are ``[length, *shape]`` of ``dtype``, any length."""
        return cls(tuple(shape), dtype, RAGGED, reserve)

    @classmethod
    def text(cls, *, reserve: int | None = None) -> Field:
        """A ``str`` per row, stored as UTF-8."""
        return cls((), torch.uint8, TEXT, reserve)

    @classmethod
    def bytes(cls, *, reserve: int | None = None) -> Field:
        """A ``bytes`` value per row."""
        return cls((), torch.uint8, BYTES, reserve)

    @classmethod
    def json(cls, *, reserve: int | None = None) -> Field:
        """A JSON-like value per row (dicts with str keys, lists, numbers, bools, None)."""
        return cls((), torch.uint8, JSON, reserve)

    @property
    def is_ragged(self) -> bool:
        """Whether rows vary in length (ragged and non-tensor kinds)."""
        return self.kind != FIXED

    @property
    def row_bytes(self) -> int:
        """Bytes a row takes in the row storage (a ragged row: its 8-byte span)."""
        if self.is_ragged:
            return 8
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        if self.kind in NON_TENSOR:
            return self.kind
        dims = list(self.shape) if self.kind == FIXED else ["*", *self.shape]
        return f"{str(self.dtype).removeprefix('torch.')}{dims}"


class FieldSpec(Mapping[Key, Field]):
    """An ordered, immutable mapping from nested key to :class:`Field`."""

    def __init__(self, fields: Mapping[Key, Field]) -> None:
        self._fields = dict(sorted(fields.items()))
        self._tree = _field_tree(self._fields)
        self._groups: dict[tuple[str, ...], tuple[Key, ...]] = {}
        self.ragged_keys = tuple(k for k, f in self._fields.items() if f.is_ragged)
        # The fields of one shape per row (what the row storage holds as columns).
        self._fixed = self if not self.ragged_keys else None

    def __getitem__(self, key: Key) -> Field:
        return self._fields[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{key_name(k)}: {f.describe()}" for k, f in self._fields.items())
        return f"FieldSpec({inner})"

    @property
    def fixed(self) -> FieldSpec:
        """The fields of one shape per row (all but the ragged ones)."""
        if self._fixed is None:
            self._fixed = FieldSpec({k: f for k, f in self._fields.items() if not f.is_ragged})
        return self._fixed

    def group(self, *names: str) -> tuple[Key, ...]:
        """The keys under any of the top-level ``names``, in order (cached: sampling asks in
        every batch, and the spec never changes)."""
        keys = self._groups.get(names)
        if keys is None:
            keys = self._groups[names] = tuple(k for k in self._fields if k[0] in names)
        return keys

    @functools.cached_property
    def row_bytes(self) -> int:
        """Bytes one row of every field occupies (computed once: the spec is immutable, and
        every sample's memory check asks)."""
        return sum(f.row_bytes for f in self._fields.values())

    @classmethod
    def of(cls, td: TensorDictBase | Mapping[Key, torch.Tensor], batch_dims: int) -> FieldSpec:
        """The spec of ``td``'s leaves (or flat leaves), dropping ``batch_dims`` dimensions."""
        fields = {}
        items = _leaves(td) if isinstance(td, TensorDictBase) else td.items()
        for key, value in items:
            if isinstance(value, Ragged):  # rows of any length: the shape after it
                fields[key] = Field(tuple(value.values.shape[1:]), value.values.dtype, value.kind)
            else:
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
            raise SchemaError(
                f"{what} must be a FieldSpec or a non-empty dict of fields, got {spec!r}"
            )
        fields: dict[Key, Field] = {}
        for key, value in _flatten_mapping(spec, (), what):
            name = f"{what} field {key_name(key)!r}"
            fields[key] = _declared_field(value, name)
            check_storable(fields[key].dtype, name)
        return cls(fields)

    def to_json(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for k, f in self._fields.items():
            entry: dict[str, Any] = {"key": list(k), "shape": list(f.shape), "dtype": str(f.dtype)}
            if f.is_ragged:  # fixed fields stay as specs of every version wrote them
                entry.update(kind=f.kind, reserve=f.reserve)
            out[key_name(k)] = entry
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FieldSpec:
        """Rebuild a spec written by :meth:`to_json`; raises ``ValueError`` on anything else."""
        fields = {}
        for name, entry in data.items():
            dtype = getattr(torch, str(entry["dtype"]).removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise SchemaError(f"field {name!r}: unknown dtype {entry['dtype']!r}")
            key, shape = entry["key"], entry["shape"]
            if not isinstance(key, list) or ".".join(map(str, key)) != name:
                raise SchemaError(f"field {name!r}: key expected the name's parts, got {key!r}")
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
            ):
                raise SchemaError(f"field {name!r}: shape expected sizes >= 0, got {shape!r}")
            kind, budget = entry.get("kind", FIXED), entry.get("reserve")
            if kind not in KINDS:
                raise SchemaError(f"field {name!r}: kind expected one of {KINDS}, got {kind!r}")
            if budget is not None and (
                not isinstance(budget, int) or isinstance(budget, bool) or budget < 1
            ):
                raise SchemaError(f"field {name!r}: reserve expected an int >= 1, got {budget!r}")
            if kind in NON_TENSOR and (dtype != torch.uint8 or shape):
                raise SchemaError(f"field {name!r}: a {kind} field is stored as uint8[]")
            fields[tuple(key)] = Field(tuple(shape), dtype, kind, budget)
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

    def check(self, td: TensorDictBase | Mapping[Key, Any], batch_dims: int, what: str) -> None:
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
            if f.is_ragged or isinstance(value, Ragged):
                _check_ragged(key, f, value, what)
                continue
            shape = tuple(value.shape[batch_dims:])
            if shape != f.shape:
                raise SchemaError(
                    f"{what}: field {key_name(key)!r} expected shape {list(f.shape)}, "
                    f"got {list(shape)}{_RAGGED_HINT if shape[1:] == f.shape[1:] else ''}"
                )
            if value.dtype != f.dtype:
                raise SchemaError(
                    f"{what}: field {key_name(key)!r} expected dtype {f.dtype}, got {value.dtype}"
                )


# What a shape mismatch in the leading dimension suggests.
_RAGGED_HINT = (
    "; a field whose size varies from step to step is declared ragged, e.g. "
    "spec={'observation': Field.ragged(torch.int64)} (Field.text(), Field.json() for text "
    "and JSON-like values)"
)


def _check_ragged(key: Key, field: Field, value: Any, what: str) -> None:
    """A ragged leaf: the field's kind, dtype and the shape after the varying length."""
    name = key_name(key)
    if not field.is_ragged:
        raise SchemaError(
            f"{what}: field {name!r} expected {field.describe()}, got values of varying "
            f"length ({value.kind})"
        )
    if not isinstance(value, Ragged):
        raise SchemaError(f"{what}: field {name!r} expected {field.describe()}, got a tensor")
    if value.kind != field.kind:
        raise SchemaError(f"{what}: field {name!r} expected {field.kind} values, got {value.kind}")
    got = (tuple(value.values.shape[1:]), value.values.dtype)
    if got != (field.shape, field.dtype):
        raise SchemaError(
            f"{what}: field {name!r} expected {field.describe()}, got rows of "
            f"{str(got[1]).removeprefix('torch.')}{['*', *got[0]]}"
        )


# A spec as a tree for FieldSpec.match: name -> subtree (a dict), or (key, shape, dtype).
_Tree = dict[str, Any]


def _field_tree(fields: Mapping[Key, Field]) -> _Tree | None:
    """The fields as a tree of names; None where no write can match as is (a reserved name,
    which to_leaves refuses, or a key that is both a leaf and a prefix of another)."""
    tree: _Tree = {}
    for key, field in fields.items():
        if key[0] in RESERVED_KEYS or field.is_ragged:  # ragged values: the general path
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
            or not has_memory(value)  # to_leaves names what it lacks
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
    """One declared field: a Field, ``(shape, dtype)``, an example tensor / array, or the
    name of a non-tensor kind (``"text"``, ``"bytes"``, ``"json"``)."""
    if isinstance(value, Field):
        return value
    if isinstance(value, str) and value in NON_TENSOR:
        return Field((), torch.uint8, value)
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
    raise SchemaError(
        f"{what} expected a Field, (shape, dtype) such as ((4,), torch.float32), an example "
        f"tensor or one of {NON_TENSOR}, got {value!r}"
    )


def _leaves(td: TensorDictBase) -> Iterator[tuple[Key, torch.Tensor]]:
    for key, value in td.items(include_nested=True, leaves_only=True):
        yield (key,) if isinstance(key, str) else tuple(key), value


def _flatten_mapping(data: Mapping, prefix: Key, what: str) -> Iterator[tuple[Key, Any]]:
    for name, value in data.items():
        if not isinstance(name, str):
            raise ArgumentTypeError(f"{what}: field names must be str, got {name!r}")
        key = (*prefix, name)
        if isinstance(value, Mapping):  # a dict or a TensorDict (whose bool() raises)
            if len(value.keys()) == 0:
                raise SchemaError(f"{what}: field {key_name(key)!r} is an empty dict")
            yield from _flatten_mapping(value, key, what)
        else:
            yield key, value


def field_key(spec: FieldSpec | None, field: str | Key) -> Key:
    """The stored key a user names ``field`` by: a name, a key tuple, or a dotted name
    (``"next.obs"``, as ``stats()`` and errors write nested keys)."""
    key = (field,) if isinstance(field, str) else tuple(field)
    if spec is not None and isinstance(field, str) and key not in spec:
        key = tuple(field.split("."))
    if spec is None or key not in spec:
        known = [".".join(k) for k in spec] if spec is not None else []
        raise UnknownFieldError(f"unknown field {field!r}; stored fields are {known}")
    return key
