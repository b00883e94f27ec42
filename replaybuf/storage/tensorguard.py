"""One compiled check of a tensor against its field: the guard ``torch.compile`` checks its
inputs with.

The per-step fast paths (:mod:`replaybuf.storage.ringrow`, :mod:`replaybuf.storage.fastrow`)
copy a CPU tensor's bytes from its address only once it is known to be a dense CPU tensor of
the field's exact dtype and shape, contiguous and without torch's negative bit. Read attribute
by attribute that is six calls into torch per field, most of a per-step write's cost. torch's
C++ tensor guard (``torch._C._dynamo.guards.TensorGuards``) compares all of it with an
example tensor in one call: the exact Python type, the dispatch keys (device, layout, the
negative and conjugate bits, wrappers such as functionalization's or vmap's), dtype, device
index, ``requires_grad``, sizes and strides. torch has no public equivalent.

Being private, it is built here from a contiguous example and probed on what the fast paths
must decline; where it is missing, takes other arguments or passes a probe, or with
``REPLAYBUF_TENSOR_GUARD=0``, there is no guard. A tensor the guard refuses is not declined by
that: the callers' attribute checks then decide (a tensor needing grad, or a strided view of
a one-element field, is still taken).

The guard compares dispatch keys as the thread's dispatch state includes and excludes them
(as ``torch.compile`` must): under another state than the one it was built in (inside
``torch.inference_mode`` when built outside it, say) the keys differ and it refuses, and the
attribute checks decide. Only torch's own internals exclude the keys that mark a tensor the
fast paths must not read (negative bit, sparse, meta, wrappers); a buffer called from inside
them is outside what the guard is probed for.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

GUARD_ENV = "REPLAYBUF_TENSOR_GUARD"  # "0": no guard; the attribute checks alone

Guard = Callable[[torch.Tensor], bool]  # True: the field's exact dense CPU contiguous tensor
RowGuard = Callable[..., bool]  # the same for several fields' tensors at once


class _Probe(torch.Tensor):
    """A tensor subclass: its methods may run user code, so the guard must refuse it."""


def field_guard(dtype: torch.dtype, shape: tuple[int, ...]) -> Guard | None:
    """The guard of a field's tensors (``dtype``, ``shape``) on the CPU, or None (see the
    module's docstring). Built once per field, when a fast path is chosen."""
    return row_guard([(dtype, shape)])


def row_guard(fields: list[tuple[torch.dtype, tuple[int, ...]]]) -> RowGuard | None:
    """One guard of a row of tensors, one per field of ``fields`` (dtype, shape), in order:
    one call for them all. None where any field would have no guard."""
    if os.environ.get(GUARD_ENV, "1") == "0" or any(dtype.is_complex for dtype, _ in fields):
        return None
    try:
        from torch._C._dynamo.guards import TensorGuards

        guards: Any = TensorGuards  # its stub omits the example tensors it takes first
        examples = [torch.zeros(shape, dtype=dtype) for dtype, shape in fields]
        made = guards(*examples, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        check: RowGuard = made.check
        at_offset = [torch.zeros((2, *shape), dtype=dtype)[1] for dtype, shape in fields]
        if check(*examples) is not True or check(*at_offset) is not True:
            return None
        for at, example in enumerate(examples):
            for refused in _refused(example):
                if check(*examples[:at], refused, *examples[at + 1 :]) is not False:
                    return None
    except Exception:  # private API: absent, or with another signature (torch's own errors)
        return None
    return check


def _refused(example: torch.Tensor) -> Iterator[torch.Tensor]:
    """Tensors like ``example`` that the fast paths must not read as bytes as it is."""
    dtype, shape = example.dtype, tuple(example.shape)
    yield example.to(torch.float32 if dtype is torch.float64 else torch.float64)
    yield torch.zeros((*shape, 1), dtype=dtype)
    if shape:
        yield torch.zeros((shape[0] + 1, *shape[1:]), dtype=dtype)
        yield torch.zeros((*shape, 2), dtype=dtype)[..., 0]  # strided
        yield example.to_sparse()
    yield example.as_subclass(_Probe)
    yield torch.zeros(shape, dtype=dtype, device="meta")
    yield torch._efficientzerotensor(shape, dtype=dtype)  # no memory: data_ptr() 0
    yield torch._to_functional_tensor(example)
    if dtype.is_floating_point:
        yield example.clone().requires_grad_()
    if dtype is not torch.bool:
        yield torch._neg_view(example)
