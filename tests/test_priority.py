"""PriorityIndex on both backends, compute_importance_weights and sequence_priority.

Three layers: named table cases with hand-computed values, a plain-Python reference (a list of
float32 weights, last write wins) that hypothesis drives through random ``set`` sequences, and
chi-square tests of the sampling distribution with fixed seeds.
"""

from __future__ import annotations

import math
import pickle
import sys
import types
from copy import deepcopy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from replaybuf.accel import numba_loader as compiled
from replaybuf.core.weights import compute_importance_weights, sequence_priority
from replaybuf.priority import backends, draws, segment_tree
from replaybuf.priority.backends import BACKEND_ENV, make_priority_index
from replaybuf.priority.draws import block_width, locate, locate_host
from replaybuf.priority.leaves import last_write_wins_host
from replaybuf.priority.segment_tree import segment_tree_unavailable_reason

MISSING = segment_tree_unavailable_reason()
needs_segment_tree = pytest.mark.skipif(MISSING is not None, reason=f"{MISSING}")
NO_KERNELS = compiled.kernels_unavailable_reason()
needs_kernels = pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
BACKENDS = [
    "torch",
    pytest.param("torchrl-segment-tree", marks=needs_segment_tree),
]
BACKENDS_BY_NAME = ("torch", "torchrl-segment-tree")
CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True, params=[pytest.param("numba", marks=needs_kernels), "numpy"])
def cpu_kernels(request, monkeypatch):
    """Every test twice: the CPU torch index with replaybuf.accel.numba_kernels (numba) and
    without."""
    if request.param == "numpy":
        monkeypatch.setenv(compiled.NUMBA_ENV, "0")
    else:
        monkeypatch.delenv(compiled.NUMBA_ENV, raising=False)
    return request.param


# 20 items, 5 absent, the rest spread over more than three decades.
UNEVEN = [0, 1000, 0.3, 50, 0, 2, 7, 0.5, 300, 1, 0, 20, 0.25, 4, 90, 0, 8, 0.4, 60, 15]


def index_with(backend: str, weights: list[float], device: str = "cpu"):
    index = make_priority_index(len(weights), device, backend)
    index.set(torch.arange(len(weights)), torch.tensor(weights, dtype=torch.float64))
    return index


def draw(index, batch_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=index.device).manual_seed(seed)
    return index.sample(batch_size, generator)


def chi_square_p(items: torch.Tensor, weights: list[float]) -> float:
    """p-value of the draws' counts against weight / total, over the items of positive weight."""
    counts = torch.bincount(items.cpu(), minlength=len(weights)).numpy()
    w = np.array(weights, dtype=np.float64)
    assert counts[w == 0].sum() == 0, "an item of weight 0 was drawn"
    expected = w[w > 0] / w.sum() * len(items)
    return stats.chisquare(counts[w > 0], expected).pvalue


# --------------------------------------------------------------------------- table cases
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_new_index_has_every_weight_zero(backend):
    index = make_priority_index(5, "cpu", backend)
    assert index.backend == backend
    assert (index.capacity, index.device) == (5, torch.device("cpu"))
    assert (index.total(), index.min_positive(), index.max()) == (0.0, math.inf, 0.0)
    assert index.weights().tolist() == [0.0] * 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_get_total_min_max(backend):
    index = make_priority_index(10, "cpu", backend)
    index.set(torch.tensor([0, 3, 9]), torch.tensor([1.0, 5.0, 0.5]))
    assert index.total() == 6.5
    assert (index.min_positive(), index.max()) == (0.5, 5.0)
    got = index.get(torch.tensor([9, 3, 1]))
    assert got.dtype == torch.float32
    assert got.tolist() == [0.5, 5.0, 0.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicates_in_one_call_the_last_value_wins(backend):
    index = make_priority_index(8, "cpu", backend)
    index.set(torch.tensor([3, 5, 3, 3, 5]), torch.tensor([1.0, 0.0, 2.0, 0.0, 4.0]))
    assert index.get(torch.tensor([3, 5])).tolist() == [0.0, 4.0]
    assert (index.total(), index.min_positive(), index.max()) == (4.0, 4.0, 4.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_zero_removes_an_item(backend):
    index = index_with(backend, [2.0, 3.0, 4.0])
    index.set(torch.tensor([2]), torch.tensor([0.0]))
    assert (index.total(), index.min_positive(), index.max()) == (5.0, 2.0, 3.0)
    assert set(draw(index, 2000, 0).tolist()) == {0, 1}
    index.set(torch.tensor([0, 1]), torch.tensor([0.0, -0.0]))
    assert (index.total(), index.min_positive(), index.max()) == (0.0, math.inf, 0.0)
    assert math.copysign(1.0, index.weights()[1].item()) == 1.0  # -0.0 is stored as 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("capacity", [1, 2, 1000, 1024])
def test_capacity_edges_sample_only_present_items(backend, capacity):
    index = make_priority_index(capacity, "cpu", backend)
    last = capacity - 1
    index.set(torch.tensor([last]), torch.tensor([0.25]))
    assert draw(index, 100, 1).tolist() == [last] * 100
    index.set(torch.tensor([0]), torch.tensor([0.75]))
    assert set(draw(index, 500, 2).tolist()) == {0, last}


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_is_reproducible_and_uses_only_the_generator(backend):
    index = index_with(backend, UNEVEN)
    torch.manual_seed(0)
    first = draw(index, 256, 7)
    torch.manual_seed(1)
    np.random.seed(1)
    assert torch.equal(draw(index, 256, 7), first)
    assert first.dtype == torch.long
    assert first.shape == (256,)
    assert draw(index, 0, 7).shape == (0,)


# --------------------------------------------------------------------------- distribution
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_draws_follow_weight_over_total(backend, seed):
    index = index_with(backend, UNEVEN)
    assert chi_square_p(draw(index, 60_000, seed), UNEVEN) > 0.001


@pytest.mark.parametrize("backend", BACKENDS)
def test_draws_follow_weights_after_updates_in_a_large_index(backend):
    # 4096 items, most absent; 30 present ones rewritten twice with duplicates in one call.
    index = make_priority_index(4096, "cpu", backend)
    rng = np.random.default_rng(3)
    items = torch.from_numpy(rng.choice(4096, 30, replace=False))
    index.set(items, torch.ones(30))
    weights = torch.from_numpy(rng.uniform(0.05, 20.0, 30))
    index.set(torch.cat([items, items[:5]]), torch.cat([weights * 0 + 3, weights[:5]]))
    index.set(items[5:], weights[5:])
    reference = [0.0] * 4096
    for item, weight in zip(items.tolist(), weights.tolist(), strict=True):
        reference[item] = float(np.float32(weight))
    assert chi_square_p(draw(index, 60_000, 4), reference) > 0.001


# --------------------------------------------------------------------------- round-off guard
def round_off_weights() -> list[float]:
    """Weights whose float64 root rounds up, so u = total overshoots item 2 by 1 ulp.

    node 2 = 1 + 2**-23 and w2 = 0.75 ulp(1): the root rounds to node 2 + 1 ulp, and a
    descent with u = root goes right at the root, then right again past w2 into item 3,
    whose weight is 0, unless guarded.
    """
    return [1.0, 2.0**-23, 0.75 * 2.0**-52, 0.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_masses_at_the_top_of_the_range_never_reach_an_absent_item(backend, monkeypatch):
    index = index_with(backend, round_off_weights())
    monkeypatch.setattr(
        sys.modules[type(index).__module__],  # where the index's draw looks it up
        "sample_masses",
        lambda b, total, g, d: torch.full((b,), float(total), dtype=torch.float64),
    )
    assert draw(index, 4, 0).tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_masses_just_above_zero_skip_leading_absent_items(backend, monkeypatch):
    index = index_with(backend, [0.0, 0.0, 0.0, 2.0, 1.0])
    monkeypatch.setattr(
        sys.modules[type(index).__module__],  # where the index's draw looks it up
        "sample_masses",
        lambda b, total, g, d: torch.full((b,), 5e-324, dtype=torch.float64),
    )
    assert draw(index, 3, 0).tolist() == [3, 3, 3]


@needs_segment_tree
def test_torchrl_scan_alone_would_return_the_absent_item():
    # Why the guard exists: TorchRL's raw descent lands on item 3 (weight 0) for u = total.
    sums, _ = segment_tree._segment_trees()
    tree = sums(4)
    tree.update(torch.arange(4), torch.tensor(round_off_weights(), dtype=torch.float64))
    total = tree.query(0, 4)
    assert tree.scan_lower_bound(torch.tensor([total], dtype=torch.float64)).tolist() == [3]


# --------------------------------------------------------------------------- vs a reference
WEIGHTS = st.sampled_from([0.0, 0.0, 1.0, 0.5, 3.0, 7.25, 2.0**-20, 1e-30, 1e30, 123456.789])


@st.composite
def set_sequences(draw_):
    capacity = draw_(st.integers(1, 40))
    entry = st.tuples(st.integers(0, capacity - 1), WEIGHTS)
    calls = draw_(st.lists(st.lists(entry, max_size=12), max_size=8))
    return capacity, calls


def reference_after(capacity: int, calls) -> list[float]:
    """Weights after ``calls``: plain Python, one entry at a time, float32 like the index."""
    weights = [0.0] * capacity
    for call in calls:
        for item, weight in call:
            weights[item] = float(np.float32(weight))
    return weights


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(case=set_sequences())
def test_random_set_sequences_match_the_reference(backend, case):
    capacity, calls = case
    index = make_priority_index(capacity, "cpu", backend)
    for call in calls:
        items = torch.tensor([item for item, _ in call], dtype=torch.long)
        index.set(items, torch.tensor([weight for _, weight in call], dtype=torch.float64))
    expected = reference_after(capacity, calls)
    positive = [w for w in expected if w > 0]
    assert index.weights().tolist() == expected
    assert index.get(torch.arange(capacity)).tolist() == expected
    assert index.total() == pytest.approx(math.fsum(expected), rel=1e-12, abs=0.0)
    assert index.min_positive() == (min(positive) if positive else math.inf)
    assert index.max() == max(expected)
    if positive:
        assert all(expected[i] > 0 for i in draw(index, 64, 0).tolist())


@needs_segment_tree
@pytest.mark.parametrize("capacity", [1, 7, 1000, 1024, 5000])
def test_backends_agree_draw_for_draw(capacity):
    # The totals are float64 sums in different orders (a tree, blocks): equal to rounding, so a
    # draw could differ only where u falls within a few ulps of an item's boundary.
    rng = np.random.default_rng(capacity)
    weights = rng.lognormal(0.0, 3.0, capacity) * (rng.random(capacity) < 0.7)
    a, b = (index_with(backend, weights.tolist()) for backend in BACKENDS_BY_NAME)
    assert a.total() == pytest.approx(b.total(), rel=1e-13)
    assert (a.min_positive(), a.max()) == (b.min_positive(), b.max())
    if a.total() > 0:
        assert torch.equal(draw(a, 5000, 11), draw(b, 5000, 11))
    items = torch.from_numpy(rng.integers(0, capacity, 64))
    a.set(items, torch.zeros(64))
    b.set(items, torch.zeros(64))
    assert a.total() == pytest.approx(b.total(), rel=1e-13)
    if a.total() > 0:
        assert torch.equal(draw(a, 5000, 12), draw(b, 5000, 12))


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("target", BACKENDS)
def test_weights_load_round_trip(backend, target):
    source = index_with(backend, UNEVEN)
    saved = source.weights()
    assert (saved.dtype, saved.device) == (torch.float32, torch.device("cpu"))
    restored = make_priority_index(len(UNEVEN), "cpu", target)
    restored.load(saved)
    assert torch.equal(restored.weights(), saved)
    assert restored.total() == source.total()
    assert (restored.min_positive(), restored.max()) == (source.min_positive(), source.max())
    assert torch.equal(draw(restored, 1000, 5), draw(source, 1000, 5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("weights", "match"),
    [
        pytest.param(torch.ones(4), r"weights must have shape \(5,\), got \(4,\)", id="short"),
        pytest.param(torch.ones(5, 1), r"must have shape \(5,\), got \(5, 1\)", id="2-D"),
        pytest.param(torch.tensor([1.0, -1, 1, 1, 1]), r"got -1.0 at position 1", id="neg"),
        pytest.param(torch.tensor([1.0, 1, 1, 1, math.nan]), r"got nan at position 4", id="nan"),
    ],
)
def test_load_refuses_bad_weights_and_changes_nothing(backend, weights, match):
    index = index_with(backend, [1.0, 2.0, 3.0, 4.0, 5.0])
    with pytest.raises(ValueError, match=match):
        index.load(weights)
    assert index.weights().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert index.total() == 15.0


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("items", "weights", "match"),
    [
        pytest.param([0, 5], [1.0, 1.0], r"items must lie in \[0, 5\), got 5 at position 1"),
        pytest.param([-1], [1.0], r"items must lie in \[0, 5\), got -1 at position 0"),
        pytest.param([0.0], [1.0], r"items must be an integer tensor, got dtype torch.float32"),
        pytest.param([[0]], [[1.0]], r"items must be 1-D \[k\], got shape \(1, 1\)"),
        pytest.param([0, 1], [1.0], r"same shape, got items \(2,\) and weights \(1,\)"),
        pytest.param([0, 1], [1.0, -2.0], r"finite and >= 0 .*got -2.0 at position 1"),
        pytest.param([0], [math.inf], r"finite and >= 0 .*got inf at position 0"),
        pytest.param([0], [math.nan], r"finite and >= 0 .*got nan at position 0"),
        pytest.param([0], [1e39], r"finite and >= 0 in float32 .*got 1e\+39 at position 0"),
        pytest.param([0], [True], r"weights must be real numbers, got dtype torch.bool"),
    ],
)
def test_set_refuses_bad_input_and_changes_nothing(backend, items, weights, match):
    index = index_with(backend, [1.0, 2.0, 3.0, 4.0, 5.0])
    dtype = torch.float64 if isinstance(weights[0], float) else None
    with pytest.raises(ValueError, match=match):
        index.set(torch.tensor(items), torch.tensor(weights, dtype=dtype))
    assert index.weights().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert (index.total(), index.min_positive(), index.max()) == (15.0, 1.0, 5.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_refuses_items_out_of_range(backend):
    index = make_priority_index(5, "cpu", backend)
    with pytest.raises(ValueError, match=r"items must lie in \[0, 5\), got 7 at position 2"):
        index.get(torch.tensor([0, 1, 7]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_refuses_when_nothing_has_weight(backend):
    index = make_priority_index(5, "cpu", backend)
    with pytest.raises(ValueError, match="nothing to sample: every weight is 0"):
        draw(index, 4, 0)
    index.set(torch.tensor([1]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="batch_size must be an int >= 0, got -1"):
        draw(index, -1, 0)


@pytest.mark.parametrize(
    ("capacity", "match"),
    [(0, "capacity must be an int >= 1, got 0"), (2.0, "capacity must be an int >= 1, got 2.0")],
)
def test_make_refuses_a_bad_capacity(capacity, match):
    with pytest.raises(ValueError, match=match):
        make_priority_index(capacity, "cpu", "torch")


# --------------------------------------------------------------------------- backend choice
def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match=r"backend must be one of .*got 'numpy'"):
        make_priority_index(4, "cpu", "numpy")


def test_segment_tree_on_cuda_is_refused_before_anything_is_allocated():
    with pytest.raises(ValueError, match=r"cannot serve device cuda.*use backend 'torch'"):
        make_priority_index(4, "cuda", "torchrl-segment-tree")


def test_auto_on_cpu_takes_the_kernels_then_the_segment_tree_then_torch(monkeypatch, cpu_kernels):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    index = make_priority_index(4, "cpu")
    if cpu_kernels == "numba":  # the compiled draw beats TorchRL's tree (benchmarks/)
        assert (index.backend, index.kernels) == ("torch", "numba")
    else:
        expected = ("torch", "numpy") if MISSING else ("torchrl-segment-tree", "torchrl")
        assert (index.backend, index.kernels) == expected
    assert make_priority_index(4, "cpu", "torch").kernels == cpu_kernels
    assert f"kernels={cpu_kernels!r}" in repr(make_priority_index(4, "cpu", "torch"))


def test_the_kernel_loader_reports_failures_instead_of_raising(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # numba not installed
    monkeypatch.delitem(sys.modules, "replaybuf.accel.numba_kernels", raising=False)
    reason = compiled._load_kernels.__wrapped__()
    assert isinstance(reason, str)
    assert "replaybuf.accel.numba_kernels does not load (ModuleNotFoundError: " in reason
    monkeypatch.setattr(compiled, "_load_kernels", lambda: reason)
    monkeypatch.delenv(compiled.NUMBA_ENV, raising=False)
    assert compiled.kernels_unavailable_reason() == reason
    assert make_priority_index(4, "cpu", "torch").kernels == "numpy"
    monkeypatch.setenv(compiled.NUMBA_ENV, "0")
    assert compiled.kernels_unavailable_reason() == f"{compiled.NUMBA_ENV}=0"


def test_env_var_overrides_auto_only(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert make_priority_index(4, "cpu").backend == "torch"
    assert make_priority_index(4, "cpu", "auto").backend == "torch"
    monkeypatch.setenv(BACKEND_ENV, "torchrl-segment-tree")
    assert make_priority_index(4, "cpu", "torch").backend == "torch"
    with pytest.raises(ValueError, match=rf"{BACKEND_ENV}='torchrl-segment-tree' .* cuda"):
        make_priority_index(4, "cuda")
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=rf"{BACKEND_ENV} must be one of .*got 'fast'"):
        make_priority_index(4, "cpu")


@needs_segment_tree
def test_env_var_can_force_the_segment_tree(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torchrl-segment-tree")
    assert make_priority_index(4, "cpu").backend == "torchrl-segment-tree"


def test_without_the_extension_auto_falls_back_and_forcing_says_why(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    reason = "torchrl._torchrl does not load (ImportError: undefined symbol)"
    monkeypatch.setattr(segment_tree, "_segment_trees", lambda: reason)
    assert make_priority_index(4, "cpu").backend == "torch"
    with pytest.raises(ValueError, match=r"'torchrl-segment-tree' is unavailable: .*undefined"):
        make_priority_index(4, "cpu", "torchrl-segment-tree")


@pytest.mark.parametrize(
    ("module", "error"),
    [
        pytest.param(None, "ModuleNotFoundError", id="import-fails"),
        pytest.param(types.ModuleType("torchrl._torchrl"), "AttributeError", id="no-trees"),
    ],
)
def test_the_extension_loader_reports_failures_instead_of_raising(monkeypatch, module, error):
    monkeypatch.setitem(sys.modules, "torchrl._torchrl", module)
    reason = segment_tree._segment_trees.__wrapped__()
    assert isinstance(reason, str)
    assert f"({error}: " in reason
    assert "only loads with the torch TorchRL was built for" in reason


# --------------------------------------------------------------------------- importance weights
@pytest.mark.parametrize(
    ("beta", "expected"),
    [
        # P = (1/2, 1/4, 1/8, 1/8), N = 4: N·P = (2, 1, 1/2, 1/2), the max weight at P = 1/8.
        pytest.param(0.0, [1.0, 1.0, 1.0, 1.0], id="beta-0"),
        pytest.param(0.5, [0.5, 0.7071067811865476, 1.0, 1.0], id="beta-half"),  # 2^-1/2 / 2^1/2
        pytest.param(1.0, [0.25, 0.5, 1.0, 1.0], id="beta-1"),  # (1/2) / 2
    ],
)
def test_importance_weights_table(beta, expected):
    probabilities = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    got = compute_importance_weights(probabilities, 4, beta)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(expected, rel=1e-15)
    # N cancels in the normalised weight; float32 in, float32 out.
    got32 = compute_importance_weights(probabilities.float(), 1000, beta)
    assert got32.dtype == torch.float32
    assert got32.tolist() == pytest.approx(expected, rel=1e-6)


def test_importance_weights_keep_their_shape_and_the_default_beta_is_memorax_s():
    probabilities = torch.tensor([[0.1, 0.4], [0.4, 0.1]])
    got = compute_importance_weights(probabilities, 10)
    assert got.shape == (2, 2)
    assert got[0, 1].item() == pytest.approx(4.0**-0.4, rel=1e-6)


@pytest.mark.parametrize(
    ("probabilities", "buffer_size", "beta", "match"),
    [
        pytest.param([0.5], 4, 1.5, r"beta must be a number in \[0, 1\], got 1.5", id="beta>1"),
        pytest.param([0.5], 4, -0.1, r"beta must be a number in \[0, 1\], got -0.1", id="beta<0"),
        pytest.param([0.5], 4, math.nan, r"beta must be .*got nan", id="beta-nan"),
        pytest.param([0.5], 4, True, r"beta must be .*got True", id="beta-bool"),
        pytest.param([0.5], 0, 0.4, r"buffer_size must be an int >= 1, got 0", id="size-0"),
        pytest.param([0.5], 2.5, 0.4, r"buffer_size must be an int >= 1, got 2.5", id="size-f"),
        pytest.param([0.5, 0.0], 4, 0.4, r"probabilities must be finite and > 0, got 0.0", id="0"),
        pytest.param([-0.5], 4, 0.4, r"probabilities must be .* > 0, got -0.5", id="negative"),
        pytest.param([math.nan], 4, 0.4, r"probabilities must be .* > 0, got nan", id="nan"),
        pytest.param([1], 4, 0.4, r"probabilities must be floating point, got dtype torch.int64"),
    ],
)
def test_importance_weights_refuse_bad_arguments(probabilities, buffer_size, beta, match):
    with pytest.raises(ValueError, match=match):
        compute_importance_weights(torch.tensor(probabilities), buffer_size, beta)


# --------------------------------------------------------------------------- sequence priority
@pytest.mark.parametrize(
    ("eta", "expected"),
    [
        # rows: |δ| = (1, 3, 2): max 3, mean 2;  |δ| = (.5, .5, .5): max .5, mean .5
        pytest.param(0.9, [0.9 * 3 + 0.1 * 2, 0.5], id="r2d2"),
        pytest.param(1.0, [3.0, 0.5], id="max"),
        pytest.param(0.0, [2.0, 0.5], id="mean"),
    ],
)
def test_sequence_priority_table(eta, expected):
    td_errors = torch.tensor([[1.0, -3.0, 2.0], [0.5, -0.5, 0.5]])
    assert sequence_priority(td_errors, eta).tolist() == pytest.approx(expected, rel=1e-6)


def test_sequence_priority_ignores_padded_steps():
    td_errors = torch.tensor([[1.0, -3.0, 10.0], [4.0, 4.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    # row 0 sees (1, 3): 0.9 · 3 + 0.1 · 2; row 1 has no valid step
    assert sequence_priority(td_errors, 0.9, mask).tolist() == pytest.approx([2.9, 0.0])
    assert sequence_priority(td_errors, 0.9).tolist()[0] == pytest.approx(0.9 * 10 + 0.1 * 14 / 3)


def test_sequence_priority_reduces_only_the_last_dim():
    td_errors = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    got = sequence_priority(td_errors)
    assert got.shape == (2, 3)
    assert got[1, 2].item() == pytest.approx(0.9 * 23 + 0.1 * 21.5)
    assert sequence_priority(torch.zeros(2, 0)).tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"eta": 1.2}, r"eta must be a number in \[0, 1\], got 1.2", id="eta"),
        pytest.param(
            {"mask": torch.ones(2, 2, dtype=torch.bool)},
            r"mask must be bool with the shape of td_errors \(2, 3\), got .* shape \(2, 2\)",
            id="shape",
        ),
        pytest.param({"mask": torch.ones(2, 3)}, r"mask must be bool .*torch.float32", id="dtype"),
    ],
)
def test_sequence_priority_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sequence_priority(torch.ones(2, 3), **kwargs)


def test_sequence_priority_refuses_integer_td_errors():
    with pytest.raises(ValueError, match="td_errors must be a floating point tensor"):
        sequence_priority(torch.ones(2, 3, dtype=torch.long))


# --------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_index_lives_on_the_gpu_and_matches_the_cpu_tree(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    index = make_priority_index(len(UNEVEN), "cuda")
    assert index.backend == "torch"
    weights = torch.tensor(UNEVEN, device="cuda")
    index.set(torch.arange(len(UNEVEN), device="cuda"), weights)
    items = draw(index, 60_000, 0)
    assert (items.device.type, items.dtype) == ("cuda", torch.long)
    assert chi_square_p(items, UNEVEN) > 0.001
    got = index.get(items[:8])
    assert (got.device.type, got.dtype) == ("cuda", torch.float32)
    assert index.weights().device == torch.device("cpu")
    cpu = index_with("torch", UNEVEN)
    assert index.total() == pytest.approx(cpu.total(), rel=1e-12)
    assert (index.min_positive(), index.max()) == (cpu.min_positive(), cpu.max())
    assert torch.equal(index.weights(), cpu.weights())
    # The blocks' search, which CUDA no longer keeps up to date, on the same weights there.
    blocks = make_priority_index(len(UNEVEN), "cpu", "torch")
    blocks.set(torch.arange(len(UNEVEN)), torch.tensor(UNEVEN, dtype=torch.float64))
    masses = torch.rand(4096, dtype=torch.float64) * blocks.total()
    leaves = blocks._leaves.cuda()
    on_gpu = locate(blocks._starts.cuda(), leaves, masses.cuda())
    on_cpu = locate(blocks._starts, blocks._leaves, masses)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(on_gpu, on_cpu, strict=True))
    with pytest.raises(ValueError, match="generator must live on the index's device"):
        index.sample(4, torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("capacity", "width"), [(1, 32), (1024, 32), (1_000_000, 32), (4_200_000, 64), (10**7, 128)]
)
def test_block_width_grows_with_the_square_root_of_capacity(capacity, width):
    assert block_width(capacity) == width


def test_locate_picks_the_first_item_whose_running_sum_reaches_the_mass():
    # Two blocks of 4: weights 0 1 0 2 | 0 0 3 0; the items own (0,1], (1,3] and (3,6].
    leaves = torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 3.0, 0.0]], dtype=torch.float64)
    starts = torch.tensor([0.0, 3.0, 6.0], dtype=torch.float64)
    masses = torch.tensor([1e-300, 1.0, 1.5, 3.0, 3.0 + 1e-12, 6.0], dtype=torch.float64)
    items, weights = locate(starts, leaves, masses)
    assert items.tolist() == [1, 1, 3, 3, 6, 6]
    assert weights.tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    # The host version searches the masses in ascending order and answers in draw order.
    shuffled = [5, 0, 3, 1, 4, 2]
    running = leaves.cumsum(1).numpy()
    got = locate_host(starts.numpy(), running, leaves.numpy(), masses[shuffled].numpy())
    assert got[0].tolist() == [items[i] for i in shuffled]
    assert got[1].tolist() == [weights[i] for i in shuffled]


def test_last_write_wins_host_keeps_each_items_last_value():
    items = np.array([4, 1, 4, 7, 1, 4])
    values = np.array([0.5, 1.0, 2.0, 3.0, 4.0, 5.0])
    unique, last = last_write_wins_host(items, values)
    assert unique.tolist() == [1, 4, 7]
    assert last.tolist() == [4.0, 5.0, 3.0]


def calls_on_4000_items(per_call: int):
    """Up to 8 ``set`` calls of 1..per_call (item, weight) entries over 4,000 items."""
    entry = st.tuples(st.integers(0, 3999), WEIGHTS)
    return st.lists(st.lists(entry, min_size=1, max_size=per_call), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(
    calls=calls_on_4000_items(24),
    seed=st.integers(0, 2**31 - 1),
)
def test_small_writes_keep_every_block_summary_of_a_large_index(calls, seed):
    """Writes touching few of the 125 blocks update only those blocks' sums, running sums and
    extremes (larger ones recompute all; the kernels do the small ones where they load): all
    must leave what a full recompute gives, bit for bit."""
    index = make_priority_index(4000, "cpu", "torch")
    for call in calls:
        items = torch.tensor([item for item, _ in call], dtype=torch.long)
        index.set(items, torch.tensor([weight for _, weight in call], dtype=torch.float64))
    expected = reference_after(4000, calls)
    assert index.weights().tolist() == expected
    leaves = index._leaves
    assert torch.equal(index._running, leaves.cumsum(1))
    assert torch.equal(index._blocks, leaves.cumsum(1)[:, -1])  # sequential, like the kernels
    assert torch.equal(index._starts[1:], index._blocks.cumsum(0))
    assert torch.equal(index._lowest, torch.where(leaves > 0, leaves, math.inf).amin(1).float())
    assert torch.equal(index._highest, leaves.amax(1).float())
    positive = [w for w in expected if w > 0]
    assert index.min_positive() == (min(positive) if positive else math.inf)
    assert index.max() == max(expected)
    if positive:
        drawn = draw(index, 256, seed)
        assert all(expected[i] > 0 for i in drawn.tolist())
        masses = torch.rand(256, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        masses = torch.where(masses > 0, masses, 1.0).mul_(index.total())  # (0, total]
        host = locate_host(
            index._starts.numpy(), index._running.numpy(), leaves.numpy(), masses.numpy()
        )
        by_torch = locate(index._starts, leaves, masses)
        assert np.array_equal(host[0], by_torch[0].numpy())
        assert np.array_equal(host[1], by_torch[1].numpy())


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), total=st.floats(1e-300, 1e300), batch=st.integers(0, 64))
def test_sample_masses_numpy_and_torch_paths_agree_bit_for_bit(seed, total, batch):
    # A float total takes the numpy path (the segment tree's), a tensor total the torch path
    # (the torch backend's): the same generator state must give the same masses, in (0, total].
    def masses(total_arg):
        generator = torch.Generator().manual_seed(seed)
        return draws.sample_masses(batch, total_arg, generator, torch.device("cpu"))

    by_numpy = masses(total)
    by_torch = masses(torch.tensor(total, dtype=torch.float64))
    assert by_numpy.dtype == by_torch.dtype == torch.float64
    assert torch.equal(by_numpy, by_torch)
    assert bool(((by_numpy > 0) & (by_numpy <= total)).all())


@pytest.fixture
def flat(monkeypatch):
    """The torch backend's flat cumulative sums (CUDA's draw), forced on the CPU."""
    monkeypatch.setattr(backends, "FLAT_DEVICES", ("cpu", "cuda"))


def test_flat_stats_follow_writes_down_to_nothing_stored(flat):
    index = make_priority_index(100, "cpu", "torch")
    assert (index.total(), index.min_positive(), index.max()) == (0.0, math.inf, 0.0)
    index.set(torch.tensor([3, 70, 99]), torch.tensor([2.0, 0.25, 8.0]))
    assert (index.total(), index.min_positive(), index.max()) == (10.25, 0.25, 8.0)
    assert index._top == int(index._cumulative[-1]) > 0
    index.set(torch.tensor([99, 70]), torch.tensor([0.0, 0.0]))
    assert (index.total(), index.min_positive(), index.max()) == (2.0, 2.0, 2.0)
    assert draw(index, 50, 0).tolist() == [3] * 50
    index.set(torch.tensor([3]), torch.tensor([0.0]))
    assert (index.total(), index.min_positive(), index.max(), index._top) == (0.0, math.inf, 0.0, 0)
    with pytest.raises(ValueError, match="nothing to sample"):
        draw(index, 1, 0)


def test_flat_draws_follow_weight_over_total_and_skip_absent_items(flat):
    index = index_with("torch", UNEVEN)
    assert index._cumulative is not None
    assert chi_square_p(draw(index, 200_000, 0), UNEVEN) > 1e-3
    index.set(torch.tensor([1, 8]), torch.tensor([0.0, 0.0]))  # the two heaviest leave
    after = [0 if i in (1, 8) else w for i, w in enumerate(UNEVEN)]
    assert chi_square_p(draw(index, 200_000, 1), after) > 1e-3


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    weights=st.lists(
        st.one_of(st.just(0.0), st.floats(1e-30, 1e30, allow_subnormal=False)),
        min_size=1,
        max_size=300,
    ).filter(lambda w: any(x > 0 for x in w)),
    seed=st.integers(0, 2**31 - 1),
)
def test_flat_draws_own_their_mass_and_have_positive_weight(flat, weights, seed):
    """Each drawn item i is the first whose cumulative units reach the mass: the sums before
    it are < u <= its own, and its weight is positive (the blocked path's contract)."""
    index = index_with("torch", weights)
    cumulative = index._cumulative
    masses = index._flat_masses(64, torch.Generator().manual_seed(seed))
    assert masses.min() >= 1
    assert masses.max() <= cumulative[-1]
    items = torch.searchsorted(cumulative, masses)
    stored = torch.tensor(weights, dtype=torch.float32).double()
    for u, i in zip(masses.tolist(), items.tolist(), strict=True):
        assert stored[i] > 0
        assert cumulative[i] >= u
        assert i == 0 or cumulative[i - 1] < u
    drawn, got = index.sample_weighted(64, torch.Generator().manual_seed(seed), torch.float64)
    assert torch.equal(drawn, items)
    assert torch.equal(got, stored[drawn])
    # The stats come from the leaves on this path (no blocks): the same values.
    positive = [w for w in stored.tolist() if w > 0]
    assert index.total() == pytest.approx(math.fsum(stored.tolist()), rel=1e-12)
    assert (index.min_positive(), index.max()) == (min(positive), max(stored.tolist()))


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.one_of(st.just(0.0), st.floats(1e-20, 1e20)), min_size=1, max_size=200),
    seed=st.integers(0, 2**31 - 1),
)
def test_locate_numpy_and_torch_paths_agree_bit_for_bit(weights, seed):
    """The CPU index draws with :func:`locate_host` (numpy); CUDA's blocks use :func:`locate`."""
    index = index_with("torch", weights)
    if index.total() == 0:
        return
    generator = torch.Generator().manual_seed(seed)
    masses = torch.rand(128, dtype=torch.float64, generator=generator).mul_(index.total())
    masses = torch.where(masses > 0, masses, index.total())  # (0, total]
    items, got = locate(index._starts, index._leaves, masses)
    host_items, host_got = locate_host(
        index._starts.numpy(), index._running.numpy(), index._leaves.numpy(), masses.numpy()
    )
    assert np.array_equal(items.numpy(), host_items)
    assert np.array_equal(got.numpy(), host_got)
    assert (host_got > 0).all()


RUNS = st.lists(  # runs of equal weights: long runs of zeros leave whole blocks empty
    st.tuples(st.integers(1, 90), st.one_of(st.just(0.0), st.floats(1e-20, 1e20))),
    min_size=1,
    max_size=40,
)


@needs_kernels
@settings(max_examples=80, deadline=None)
@given(runs=RUNS, seed=st.integers(0, 2**31 - 1))
def test_compiled_locate_equals_numpy_bit_for_bit(runs, seed):
    """:func:`replaybuf.accel.numba_kernels.locate` (a level-synchronous search) against
    :func:`locate_host` (numpy's ``searchsorted``): random masses, the smallest one, and
    every block's end exactly (where the next blocks may be empty: the search must stop at
    the first block that reaches the mass)."""
    from replaybuf.accel import numba_kernels as kernels

    index = index_with("torch", [weight for length, weight in runs for _ in range(length)])
    if index.total() == 0:
        return
    starts, running, leaves = (t.numpy() for t in (index._starts, index._running, index._leaves))
    generator = torch.Generator().manual_seed(seed)
    masses = draws.sample_masses(64, index.total(), generator, torch.device("cpu")).numpy()
    masses = np.concatenate([masses, [5e-324], starts[1:][starts[1:] > 0]])
    items, got = np.empty(masses.size, np.int64), np.empty(masses.size)
    kernels.locate(starts, running, leaves, masses, items, got)
    expected_items, expected = locate_host(starts, running, leaves, masses)
    assert np.array_equal(items, expected_items)
    assert np.array_equal(got, expected)
    assert (got > 0).all()


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(calls=calls_on_4000_items(40))
def test_compiled_writes_leave_the_numpy_paths_state_bit_for_bit(calls):
    """The same ``set`` calls through the kernels and through numpy/torch: equal tensors."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(compiled.NUMBA_ENV, raising=False)
        fast = make_priority_index(4000, "cpu", "torch")
        patch.setenv(compiled.NUMBA_ENV, "0")
        plain = make_priority_index(4000, "cpu", "torch")
    assert (fast.kernels, plain.kernels) == ("numba", "numpy")
    for call in calls:
        items = torch.tensor([item for item, _ in call], dtype=torch.long)
        weights = torch.tensor([weight for _, weight in call], dtype=torch.float64)
        fast.set(items, weights)
        plain.set(items, weights)
    for name in ("_leaves", "_running", "_blocks", "_starts", "_lowest", "_highest"):
        assert torch.equal(getattr(fast, name), getattr(plain, name)), name
    assert fast._stats == plain._stats
    assert fast.weights().tolist() == reference_after(4000, calls)


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.one_of(st.just(0.0), st.floats(1e-20, 1e20)), min_size=1, max_size=300),
    seed=st.integers(0, 2**31 - 1),
    power=st.sampled_from([-1.0, -0.4, -0.0, 0.5]),
)
def test_sample_relative_draws_as_sample_and_powers_the_weights(weights, seed, power):
    """The fused CPU draw (kernels) and the generic one: sample's items, (w / min) ** power."""
    index = index_with("torch", weights)
    if index.total() == 0:
        return
    items, relative = index.sample_relative(50, torch.Generator().manual_seed(seed), power)
    assert torch.equal(items, draw(index, 50, seed))
    assert relative.dtype == torch.float32
    stored = np.array(weights, dtype=np.float32).astype(np.float64)
    expected = (stored[items.numpy()] / stored[stored > 0].min()) ** power
    np.testing.assert_allclose(relative.numpy(), expected.astype(np.float32), rtol=1e-6)


def test_sample_relative_of_nothing_and_a_pickled_index_draw_alike(cpu_kernels):
    index = index_with("torch", UNEVEN)
    items, relative = index.sample_relative(0, torch.Generator().manual_seed(0), -0.4)
    assert (items.shape, relative.shape, relative.dtype) == ((0,), (0,), torch.float32)
    for copy in (pickle.loads(pickle.dumps(index)), deepcopy(index)):
        assert copy.kernels == index.kernels == cpu_kernels
        copy.set(torch.tensor([1]), torch.tensor([0.0]))  # the copy's own tensors, not index's
        assert index.get(torch.tensor([1])).item() == 1000.0
        assert copy.total() == index.total() - 1000.0
        assert draw(copy, 500, 3).tolist().count(1) == 0
        index_draws, copy_draws = draw(index, 64, 5), draw(copy, 64, 5)
        assert (index_draws == 1).any()
        assert not (copy_draws == 1).any()


@pytest.mark.parametrize("items", [[3, 5000], [-1, 3]], ids=["past-the-end", "negative"])
def test_the_write_kernel_refuses_items_out_of_range_before_writing(items, cpu_kernels):
    # set_in_range's contract is items in range (it skips set's checks). Out of the storage,
    # the numba kernel (no bounds checks inside) still raises before writing anything; the
    # numpy path raises from index_copy_.
    index = make_priority_index(4000, "cpu", "torch")  # 125 blocks: 2 items take the kernel
    index.set(torch.arange(4000), torch.ones(4000))
    before = index.weights().clone()
    with pytest.raises((IndexError, RuntimeError)):
        index.set_in_range(torch.tensor(items), torch.tensor([5.0, 6.0]))
    if cpu_kernels == "numba":
        assert torch.equal(index.weights(), before)
