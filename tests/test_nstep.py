"""n-step return math: compute_discounted_return, window_return, bootstrap_discount."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replaybuf import compute_discounted_return
from replaybuf.core.nstep import bootstrap_discount, window_return


def loop_return(rewards: list[float], gamma: float) -> float:
    """Σ_k γ^k r_k in float64, front to back."""
    total, scale = 0.0, 1.0
    for r in rewards:
        total += scale * r
        scale *= gamma
    return total


# --------------------------------------------------------------------------- table cases
@pytest.mark.parametrize(
    ("rewards", "gamma", "expected"),
    [
        pytest.param([], 0.9, 0.0, id="empty"),
        pytest.param([2.0], 0.5, 2.0, id="one-reward"),
        pytest.param([1.0, 2.0, 3.0], 0.5, 1.0 + 1.0 + 0.75, id="three-halving"),
        pytest.param([1.0, 1.0, 1.0, 1.0], 1.0, 4.0, id="undiscounted"),
        pytest.param([0.0, 0.0, 8.0], 0.25, 0.5, id="late-reward"),
        pytest.param([1, -1, 1], 0.5, 1 - 0.5 + 0.25, id="python-ints"),
    ],
)
def test_discounted_return_of_a_list(rewards, gamma, expected):
    got = compute_discounted_return(rewards, gamma)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, abs=1e-12)


def test_discounted_return_of_a_tensor_reduces_the_last_dim_and_keeps_float_dtype():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]], dtype=torch.float32)
    got = compute_discounted_return(rewards, 0.5)
    assert got.dtype == torch.float32
    assert got.tolist() == [2.75, 1.0]
    got64 = compute_discounted_return(rewards.double()[None], 0.5)
    assert got64.dtype == torch.float64
    assert got64.shape == (1, 2)


def test_discounted_return_of_an_integer_tensor_is_not_truncated():
    got = compute_discounted_return(torch.tensor([1, 1, 1]), 0.5)
    assert got.is_floating_point()
    assert got.item() == pytest.approx(1.75)


def test_discounted_return_of_an_empty_last_dim_is_zero():
    got = compute_discounted_return(torch.zeros(3, 0), 0.9)
    assert got.tolist() == [0.0, 0.0, 0.0]


def batch_major_return(rewards: torch.Tensor, valid: torch.Tensor, gamma: float, backend: str):
    """window_return of batch-major ``rewards [B, n, ...]`` / ``valid [B, n]`` (it takes them
    time-major), on torch tensors or, for ``"numpy"``, numpy arrays."""
    rewards, valid = rewards.transpose(0, 1), valid.T
    if backend == "numpy":
        got = window_return(rewards.numpy(), valid.numpy(), gamma)
        assert isinstance(got, np.ndarray)
        return torch.from_numpy(got)
    return window_return(rewards, valid, gamma)


BACKENDS = ["torch", "numpy"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_window_return_sums_only_the_valid_prefix_even_over_nan(backend, dtype):
    rewards = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.0]], dtype=dtype)
    valid = torch.tensor([[True, True, False], [True, False, False]])
    got = batch_major_return(rewards, valid, 0.5, backend)
    assert got.dtype == dtype
    assert got.tolist() == [2.0, 4.0]


def test_window_return_keeps_trailing_reward_dims():
    # [B=1, n=2, 2]: a vector reward per step
    rewards = torch.tensor([[[1.0, 10.0], [2.0, 20.0]]])
    valid = torch.tensor([[True, True]])
    got = batch_major_return(rewards, valid, 0.5, "torch")
    assert got.shape == (1, 2)
    assert got.tolist() == [[2.0, 20.0]]


def test_window_return_of_integer_rewards_is_a_float():
    rewards = torch.tensor([[1, 1, 1]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    got = batch_major_return(rewards, valid, 0.5, "torch")
    assert got.is_floating_point()
    assert got.item() == pytest.approx(1.75)


@pytest.mark.parametrize(
    ("m", "terminal", "gamma", "expected"),
    [
        pytest.param([1, 2, 3], [False, False, False], 0.5, [0.5, 0.25, 0.125], id="bootstrap"),
        pytest.param([3], [True], 0.5, [0.0], id="terminated-no-bootstrap"),
        pytest.param([2, 2], [False, True], 1.0, [1.0, 0.0], id="gamma-one"),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bootstrap_discount(m, terminal, gamma, expected, backend):
    m_t, terminal_t = torch.tensor(m), torch.tensor(terminal)
    if backend == "numpy":
        got = torch.from_numpy(bootstrap_discount(m_t.numpy(), terminal_t.numpy(), gamma))
    else:
        got = bootstrap_discount(m_t, terminal_t, gamma)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(expected)


# --------------------------------------------------------------------------- hypothesis
rewards_strategy = st.floats(-100, 100, allow_nan=False, width=32)
gammas = st.one_of(st.sampled_from([1.0, 0.99, 0.9, 0.5]), st.floats(0.01, 1.0))


@settings(max_examples=100, deadline=None)
@given(rewards=st.lists(rewards_strategy, max_size=12), gamma=gammas)
def test_list_return_matches_the_loop(rewards, gamma):
    assert compute_discounted_return(rewards, gamma) == pytest.approx(
        loop_return(rewards, gamma), rel=1e-9, abs=1e-9
    )


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(st.lists(rewards_strategy, min_size=4, max_size=4), min_size=1, max_size=5),
    gamma=gammas,
)
def test_tensor_return_matches_the_loop_row_by_row(rows, gamma):
    got = compute_discounted_return(torch.tensor(rows, dtype=torch.float32), gamma)
    for i, row in enumerate(rows):
        want = loop_return([float(torch.tensor(r, dtype=torch.float32)) for r in row], gamma)
        assert math.isclose(float(got[i]), want, rel_tol=1e-5, abs_tol=1e-4)


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 6),
    batch=st.integers(1, 6),
    gamma=gammas,
    backend=st.sampled_from(BACKENDS),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_window_return_and_discount_match_the_loop(data, n, batch, gamma, backend, dtype):
    rewards = data.draw(
        st.lists(st.lists(rewards_strategy, min_size=n, max_size=n), min_size=batch, max_size=batch)
    )
    m = data.draw(st.lists(st.integers(1, n), min_size=batch, max_size=batch))
    terminal = data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    valid = torch.tensor([[k < m[b] for k in range(n)] for b in range(batch)])
    stored = torch.tensor(rewards, dtype=dtype)
    got = batch_major_return(stored, valid, gamma, backend)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    discount = bootstrap_discount(torch.tensor(m), torch.tensor(terminal), gamma)
    for b in range(batch):
        want = loop_return(stored[b, : m[b]].tolist(), gamma)  # the stored (rounded) rewards
        assert math.isclose(float(got[b]), want, rel_tol=tolerance, abs_tol=100 * tolerance)
        want_discount = 0.0 if terminal[b] else gamma ** m[b]
        assert math.isclose(float(discount[b]), want_discount, rel_tol=1e-6)
