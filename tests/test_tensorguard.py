"""torch's tensor guard as the per-step fast paths use it (``replaybuf.storage.tensorguard``).

The reference is the attribute checks it stands in for: a tensor the guard passes must be one
they pass too (a dense CPU tensor of the field's exact type, dtype and shape, contiguous,
without the negative bit), for any tensor hypothesis makes. Where the private API is missing,
behaves otherwise or is turned off, there is no guard.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replaybuf.storage import tensorguard
from replaybuf.storage.tensorguard import GUARD_ENV, field_guard

DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int16, torch.uint8,
          torch.bool, torch.bfloat16]  # fmt: skip
SHAPES = [(), (1,), (3,), (2, 3), (0,)]


class Sub(torch.Tensor):
    pass


def attributes_pass(value: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """The attribute checks the guard replaces (replaybuf.storage.ringrow, fastrow)."""
    return (
        type(value) is torch.Tensor
        and value.dtype is dtype
        and value.shape == shape
        and value.is_cpu
        and value.layout is torch.strided
        and value.is_contiguous()
        and not value.is_neg()
        and not value.is_conj()
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_guard_passes_the_fields_tensors_and_their_contiguous_views(dtype, shape):
    guard = field_guard(dtype, shape)
    assert guard is not None
    assert guard(torch.zeros(shape, dtype=dtype)) is True
    assert guard(torch.ones((3, *shape), dtype=dtype)[2]) is True  # at an offset
    assert guard(torch.zeros((*shape, 1), dtype=dtype)) is False
    other = torch.int32 if dtype.is_floating_point or dtype is torch.bool else torch.float32
    assert guard(torch.zeros(shape, dtype=other)) is False


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(4, 3)[:, 0],
        lambda: torch.zeros(3).requires_grad_(),
        lambda: torch._neg_view(torch.zeros(3)),
        lambda: torch.zeros(3).to_sparse(),
        lambda: torch.zeros(3, device="meta"),
        lambda: torch._efficientzerotensor(3),
        lambda: torch.zeros(3).as_subclass(Sub),
        lambda: torch.complex(torch.zeros(3), torch.ones(3)).conj().imag,
    ],
    ids=["strided", "grad", "negative", "sparse", "meta", "no memory", "subclass", "conj imag"],
)
def test_a_guard_refuses_what_the_fast_paths_must_not_read_as_bytes(make):
    guard = field_guard(torch.float32, (3,))
    assert guard is not None
    value = make()
    assert guard(value) is False
    # what the attribute checks pass besides: a tensor needing grad (taken by them), and one
    # without memory (declined by them, at data_ptr() 0)
    assert not attributes_pass(value, torch.float32, (3,)) or (
        value.requires_grad or value.data_ptr() == 0
    )


def test_a_guard_refuses_wrapped_tensors_inside_functorch_transforms():
    """Inside ``vmap`` and ``functionalize`` tensors are wrappers (no memory of their own
    at ``data_ptr()``): the guard refuses them, and the attribute checks decide."""
    guard = field_guard(torch.float32, (3,))
    assert guard is not None
    seen = []

    def inside(x):
        y = x * 2
        seen.append(guard(y))
        return y

    torch.func.vmap(inside)(torch.ones(2, 3))
    torch.func.functionalize(inside)(torch.ones(3))
    assert seen == [False, False]


@st.composite
def tensors(draw):
    """A tensor of any of the dtypes and shapes, maybe a view (offset, strided, transposed,
    expanded), maybe with the negative bit or grad."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from(SHAPES))
    base = torch.zeros((2, *shape, 2), dtype=dtype)
    view = draw(st.sampled_from(["plain", "offset", "strided", "transposed", "expanded"]))
    if view == "plain":
        value = torch.zeros(shape, dtype=dtype)
    elif view == "offset":  # contiguous, at an offset into a larger tensor
        numel = int(np.prod(shape))
        value = torch.zeros(2 * numel + 1, dtype=dtype)[numel + 1 :].view(shape)
    elif view == "strided":
        value = base[1, ..., 0]
    elif view == "transposed":
        value = torch.zeros(shape[::-1], dtype=dtype).T if len(shape) == 2 else base[0, ..., 1]
    else:
        value = torch.zeros((1,), dtype=dtype).expand(shape) if shape else base[0, ..., 0]
    if draw(st.booleans()) and dtype is not torch.bool:
        value = torch._neg_view(value)
    if draw(st.booleans()) and dtype.is_floating_point:
        value = value.detach().requires_grad_()
    return value


@settings(max_examples=300, deadline=None)
@given(value=tensors(), field=st.tuples(st.sampled_from(DTYPES), st.sampled_from(SHAPES)))
def test_whatever_a_guard_passes_the_attribute_checks_pass(value, field):
    dtype, shape = field
    guard = field_guard(dtype, shape)
    assert guard is not None
    if guard(value):
        assert attributes_pass(value, dtype, shape)
        assert not value.requires_grad
    elif attributes_pass(value, dtype, shape) and not value.requires_grad:
        # refused while the attributes pass: only a view whose strides differ from the
        # contiguous example's (size-1 or empty dimensions, where any stride is contiguous)
        assert value.stride() != torch.zeros(shape, dtype=dtype).stride()


def test_no_guard_when_turned_off_for_complex_fields_or_without_the_private_api(monkeypatch):
    assert field_guard(torch.complex64, (2,)) is None  # conj bits: never copied by address
    monkeypatch.setenv(GUARD_ENV, "0")
    assert field_guard(torch.float32, (3,)) is None
    monkeypatch.delenv(GUARD_ENV)
    assert field_guard(torch.float32, (3,)) is not None
    monkeypatch.setitem(sys.modules, "torch._C._dynamo.guards", types.ModuleType("empty"))
    assert field_guard(torch.float32, (3,)) is None


@pytest.mark.parametrize("passes", ["everything", "nothing", "raises"])
def test_a_guard_that_misbehaves_on_the_probes_is_not_used(monkeypatch, passes):
    """A private API that changed: one passing a probe it must refuse, refusing the field's
    own tensor or raising, gives no guard (the attribute checks alone run)."""

    class Changed:
        def __init__(self, *examples, **kwargs):
            pass

        def check(self, *values):
            if passes == "raises":
                raise TypeError("another signature")
            return passes == "everything"

    fake = types.ModuleType("guards")
    fake.TensorGuards = Changed  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._C._dynamo.guards", fake)
    assert field_guard(torch.float32, (3,)) is None
    monkeypatch.undo()
    assert tensorguard.field_guard(torch.float32, (3,)) is not None
