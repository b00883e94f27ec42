"""Ragged fields in checkpoints: each as CSR (values end to end, int64 offsets), checked.

Offsets are the part a tampered file could turn into reads out of range, so they are checked
before anything is restored: ``[rows + 1]`` int64, starting at 0, never decreasing, ending at
the number of values. Text and JSON-like rows are checked as they are restored (their bytes
must decode: UTF-8, and JSON with no NaN or infinity); decoding is ``bytes.decode`` and
``json.loads``, which build plain values and never run code.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import torch

from replaybuf.errors import CorruptCheckpointError
from replaybuf.persist.state import StateSource
from replaybuf.storage import FieldSpec, Key, key_name
from replaybuf.storage.ragged import MAX_LENGTH
from replaybuf.storage.schema import JSON, TEXT


def ragged_name(spec: FieldSpec, key: Key) -> str:
    """The tensors' prefix of ragged field ``key``: ``ragged/<its place among them>``."""
    return f"ragged/{spec.ragged_keys.index(key)}"


def check_ragged(source: StateSource, spec: FieldSpec | None, rows: int, where: str) -> None:
    """Every ragged field's values and offsets: present, of their shape and dtype, and the
    offsets a valid partition of the values into ``rows`` rows."""
    for key in spec.ragged_keys if spec is not None else ():
        assert spec is not None
        field, name = spec[key], ragged_name(spec, key)
        values = source.tensors.get(f"{name}/values")
        if values is None or values.dtype != field.dtype or tuple(values.shape[1:]) != field.shape:
            got = None if values is None else f"shape {list(values.shape)} dtype {values.dtype}"
            raise CorruptCheckpointError(
                f"{where}: field {key_name(key)!r} expected {name}/values of "
                f"{field.describe()}, got {got}"
            )
        if f"{name}/offsets" not in source.tensors:
            raise CorruptCheckpointError(f"{where}: {name}/offsets is missing")
        offsets = source.load(f"{name}/offsets", verify=True)
        _check_offsets(offsets, rows, int(values.shape[0]), f"{where}: {name}/offsets")


def _check_offsets(offsets: torch.Tensor, rows: int, total: int, where: str) -> None:
    if offsets.dtype != torch.int64 or tuple(offsets.shape) != (rows + 1,):
        raise CorruptCheckpointError(
            f"{where} expected int64 of shape [{rows + 1}], got {offsets.dtype} "
            f"{list(offsets.shape)}"
        )
    steps = offsets[1:] - offsets[:-1]
    if int(offsets[0]) != 0 or int(offsets[-1]) != total:
        raise CorruptCheckpointError(
            f"{where} expected to run from 0 to {total} (the values), got "
            f"{int(offsets[0])} .. {int(offsets[-1])}"
        )
    if steps.numel() and (bool((steps < 0).any()) or int(steps.max()) > MAX_LENGTH):
        bad = int(torch.nonzero((steps < 0) | (steps > MAX_LENGTH))[0])
        raise CorruptCheckpointError(
            f"{where} expected non-decreasing offsets, at most {MAX_LENGTH} values a row; row "
            f"{bad} runs from {int(offsets[bad])} to {int(offsets[bad + 1])}"
        )


def load_ragged(
    source: StateSource, spec: FieldSpec, key: Key
) -> tuple[torch.Tensor, torch.Tensor]:
    """Field ``key``'s values and offsets (checked by :func:`check_ragged`), its text and JSON
    rows decoded once to prove them well formed."""
    name = ragged_name(spec, key)
    values = source.load(f"{name}/values", verify=True)
    offsets = source.load(f"{name}/offsets", verify=True)
    kind = spec[key].kind
    if kind in (TEXT, JSON):
        check_encoded(kind, values, offsets, f"{source.directory}: field {key_name(key)!r}")
    return values, offsets


def check_encoded(kind: str, values: torch.Tensor, offsets: torch.Tensor, where: str) -> None:
    """Each row of a text or JSON-like field decodes (UTF-8; JSON without NaN/infinity)."""
    raw = values.numpy().tobytes()
    bounds = offsets.tolist()
    for row, (start, end) in enumerate(itertools.pairwise(bounds)):
        if start == end and kind == JSON:
            continue  # a row with no value (a free row)
        try:
            text = raw[start:end].decode("utf-8")
            if kind == JSON:
                json.loads(text, parse_constant=_refuse)
        except (UnicodeDecodeError, ValueError) as exc:
            raise CorruptCheckpointError(
                f"{where}: row {row} is not valid {'UTF-8' if kind == TEXT else 'JSON'}: {exc}"
            ) from None


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON replaybuf writes")


__all__ = ["check_encoded", "check_ragged", "load_ragged", "ragged_name"]
