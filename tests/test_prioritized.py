"""Prioritized replay on both buffers: the sampling law, PER weights, stale updates, eviction,
bad input and checkpoints. References are computed here, in float64, from the priorities set."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from replaybuf import EpisodeReplayBuffer, ReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.accel import numba_loader as compiled
from replaybuf.priority.backends import make_priority_index
from replaybuf.priority.policy import Prioritizer


def _extension_loads() -> bool:
    try:
        make_priority_index(4, "cpu", "torchrl-segment-tree")
    except (ValueError, RuntimeError, ImportError):
        return False
    return True


BACKENDS = [
    "torch",
    pytest.param(
        "torchrl-segment-tree",
        marks=pytest.mark.skipif(not _extension_loads(), reason="torchrl._torchrl does not load"),
    ),
]


def ring(tmp_path: Path, backend: str, capacity: int = 8, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(
        "cpu", "cpu", capacity, scratch_dir=tmp_path, seed=0, prioritized=True,
        priority_backend=backend, **kwargs,
    )  # fmt: skip


def add(buf: ReplayBuffer, first: int, count: int) -> None:
    buf.add_batch({"x": torch.arange(first, first + count, dtype=torch.float32)})


def law(priorities: dict[int, float], alpha: float, eps: float) -> dict[int, float]:
    """P(i) = (p_i + eps)^alpha / sum_j (p_j + eps)^alpha, the slow obvious way."""
    powered = {i: (p + eps) ** alpha for i, p in priorities.items()}
    total = sum(powered.values())
    return {i: v / total for i, v in powered.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_samples_by_priority_and_weights_follow_per(tmp_path: Path, backend: str) -> None:
    alpha, beta, eps = 0.7, 0.5, 1e-3
    with ring(tmp_path, backend, alpha=alpha, beta=beta, eps=eps) as buf:
        add(buf, 0, 8)
        ids = buf.sample_batch(64)["index"].unique()
        priorities = {int(x): float(x) % 5 + 0.5 for x in range(8)}  # item x is value x
        applied = buf.update_priorities(list(priorities), list(priorities.values()))
        assert applied == 8
        assert ids.numel() > 0
        expected = law(priorities, alpha, eps)
        draws = 40_000
        batch = buf.sample_batch(draws)
        counts = Counter(int(v) for v in batch["x"])
        observed = [counts[i] for i in range(8)]
        assert chisquare(observed, [expected[i] * draws for i in range(8)]).pvalue > 1e-3
        n = len(buf)
        per = {i: (n * p) ** -beta for i, p in expected.items()}
        top = max(per.values())
        for x, w in zip(batch["x"][:200].tolist(), batch["weight"][:200].tolist(), strict=True):
            assert w == pytest.approx(per[int(x)] / top, rel=1e-5)


def test_new_items_enter_at_the_current_maximum(tmp_path: Path) -> None:
    with ring(tmp_path, "torch", alpha=1.0, eps=0.0) as buf:
        add(buf, 0, 2)
        assert buf.update_priorities([0, 1], [3.0, 1.0]) == 2
        add(buf, 2, 1)  # enters at max(3, 1) = 3
        expected = law({0: 3.0, 1: 1.0, 2: 3.0}, 1.0, 0.0)
        counts = Counter(int(v) for v in buf.sample_batch(30_000)["x"])
        observed = [counts[i] for i in range(3)]
        assert chisquare(observed, [expected[i] * 30_000 for i in range(3)]).pvalue > 1e-3


def test_an_overwritten_item_is_skipped_not_applied_to_the_new_occupant(tmp_path: Path) -> None:
    with ring(tmp_path, "torch", capacity=4, alpha=1.0, eps=0.0) as buf:
        add(buf, 0, 4)
        old = buf.sample_by_index([0])  # slot 0 holds id 0
        assert old["x"].item() == 0
        add(buf, 4, 1)  # id 4 overwrites slot 0
        assert buf.update_priorities([0, 1], [100.0, 2.0]) == 1  # id 0 is gone: skipped
        counts = Counter(int(v) for v in buf.sample_batch(20_000)["x"])
        assert counts[0] == 0  # the overwritten item left the distribution
        expected = law({4: 1.0, 1: 2.0, 2: 1.0, 3: 1.0}, 1.0, 0.0)
        observed = [counts[i] for i in (4, 1, 2, 3)]
        assert chisquare(observed, [expected[i] * 20_000 for i in (4, 1, 2, 3)]).pvalue > 1e-3


@pytest.mark.parametrize(
    ("index", "priority", "error", "match"),
    [
        ([0, 1], [1.0], ValueError, "expected 2, got 1"),
        ([0], [-1.0], ValueError, "finite and >= 0, got -1"),
        ([0], [float("nan")], ValueError, "finite and >= 0, got nan"),
        ([0], [float("inf")], ValueError, "finite and >= 0, got inf"),
        ([99], [1.0], IndexError, r"ids of written items \(in \[0, 4\)\), got 99"),
        ([-1], [1.0], IndexError, "got -1"),
        ([0.5], [1.0], TypeError, "integer ids"),
    ],
)
def test_bad_priority_updates_raise_and_change_nothing(
    tmp_path: Path, index, priority, error, match
) -> None:
    with ring(tmp_path, "torch", capacity=4) as buf:
        add(buf, 0, 4)
        before = buf._priorities.tree.weights().clone()
        with pytest.raises(error, match=match):
            buf.update_priorities(index, priority)
        assert torch.equal(buf._priorities.tree.weights(), before)


@pytest.mark.parametrize(
    ("index", "priority", "error", "match"),
    [
        (torch.tensor([0, 1]), torch.tensor([1.0]), ValueError, "expected 2, got 1"),
        (torch.tensor([0]), torch.tensor([-1.0]), ValueError, "finite and >= 0, got -1"),
        (np.array([0]), np.array([np.nan]), ValueError, "finite and >= 0, got nan"),
        (torch.tensor([0]), torch.tensor([np.inf]), ValueError, "finite and >= 0, got inf"),
        (torch.tensor([5000]), torch.ones(1), IndexError, "got 5000"),
        (torch.tensor([-1]), torch.ones(1), IndexError, "got -1"),
    ],
)
@pytest.mark.parametrize("kind", ["ring", "episodes"])
def test_bad_updates_as_arrays_raise_the_checked_paths_errors(
    tmp_path: Path, kind, index, priority, error, match
) -> None:
    """CPU tensors and numpy arrays take the numpy path (host_update_inputs) while nothing is
    wrong; bad values and ids fall through to the checked torch path: its error, no change.
    (Buffers of 2,048 items: the numpy path writes when the update touches few blocks.)"""
    if kind == "ring":
        buf = ring(tmp_path, "torch", capacity=2048)
        add(buf, 0, 4)
        tree = buf._priorities.tree
    else:
        buf = episodes(tmp_path, max_steps=2048)
        write(buf, 4)
        buf.sample_n_step(1)  # the staged steps enter the tree (as any update first does)
        tree = buf._core.priorities.tree
        if match == "got 5000":  # an id of a later allocation is merely stale here
            index, match = torch.tensor([10**9]), "got 1000000000, which no step ever had"
    with buf:
        before = tree.weights().clone()
        with pytest.raises(error, match=match):
            buf.update_priorities(index, priority)
        assert torch.equal(tree.weights(), before)


@pytest.mark.skipif(
    compiled.kernels_unavailable_reason() is not None,
    reason=f"{compiled.kernels_unavailable_reason()}",
)
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rounds=st.lists(
        st.tuples(
            st.integers(1, 30),  # 60x: items (ring) or steps (episodes) written before a batch
            st.integers(1, 12),  # batch size
            st.sampled_from(["float32", "float64", "numpy", "zeros"]),
            st.booleans(),  # also update the previous round's ids (stale ones skipped)
        ),
        min_size=1,
        max_size=6,
    ),
    kind=st.sampled_from(["ring", "episodes"]),
)
def test_updates_from_arrays_match_the_checked_torch_path(tmp_path: Path, rounds, kind) -> None:
    """Twin buffers of 2,048 items, one updated with CPU tensors or arrays (the numpy path)
    and one with the same values as lists (the checked torch path): the same counts applied,
    the same weights bit for bit, the same stats, so the same batches next; stale ids
    (overwritten items, evicted steps), duplicates and zero priorities included."""
    if kind == "ring":
        twins = [ring(tmp_path, "torch", capacity=2048, alpha=0.6, eps=1e-3) for _ in range(2)]
    else:
        twins = [episodes(tmp_path, max_steps=2048, alpha=0.6, eps=1e-3) for _ in range(2)]
    fast, slow = twins
    rng = np.random.default_rng(len(rounds))
    written, previous = 0, None
    for count, size, form, again in rounds:
        for buf in twins:
            if kind == "ring":
                add(buf, written, 60 * count)
            else:
                write(buf, 60 * count, end=count % 3 != 0)
        written += 60 * count
        if kind == "ring":
            batches = [buf.sample_batch(size) for buf in twins]
        else:
            batches = [buf.sample_n_step(size) for buf in twins]
        assert torch.equal(batches[0]["index"], batches[1]["index"])
        ids = batches[0]["index"]
        if again and previous is not None:
            ids = torch.cat([previous, ids])
        values = np.abs(rng.normal(size=ids.shape[0])) * (form != "zeros")
        given_ = {
            "float32": torch.from_numpy(values.astype(np.float32)),
            "float64": torch.from_numpy(values),
            "numpy": values,
            "zeros": torch.from_numpy(values),
        }[form]
        as_list = torch.as_tensor(given_).double().tolist()
        assert fast.update_priorities(ids, given_) == slow.update_priorities(ids.tolist(), as_list)
        trees = [b._priorities.tree if kind == "ring" else b._core.priorities.tree for b in twins]
        assert torch.equal(trees[0].weights(), trees[1].weights())
        assert [trees[0].total(), trees[0].min_positive(), trees[0].max()] == [
            trees[1].total(), trees[1].min_positive(), trees[1].max()
        ]  # fmt: skip
        previous = ids
    for buf in twins:
        buf.close()


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no cast warning before the error
@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix
@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda p: p[::-1], ValueError, "stride"),  # torch.as_tensor refuses negative strides
        (lambda p: p.astype(">f8"), ValueError, "byte order"),
        (lambda p: p.astype(np.longdouble), TypeError, "longdouble"),
        (lambda p: np.ma.masked_array(p - 3, mask=[0, 1, 0, 0]), ValueError, "got -2"),
        (lambda p: p * 1e300, ValueError, "finite and >= 0 in float32"),  # overflows float32
        (lambda p: np.matrix(p), None, None),  # read as a flat [4]: applied, as from a list
    ],
)
@pytest.mark.parametrize("kind", ["ring", "episodes"])
def test_odd_numpy_priorities_get_what_the_checked_path_gives(
    tmp_path: Path, kind, make, error, match
) -> None:
    """numpy inputs that torch.as_tensor refuses, or reads differently from their face value
    (a mask, a matrix), or that overflow float32: the checked path's error (nothing changed),
    or its result."""
    if kind == "ring":
        buf = ring(tmp_path, "torch", capacity=2048, alpha=2.0, eps=0.0)
        add(buf, 0, 4)
        index, tree = np.arange(4), buf._priorities.tree
    else:
        buf = episodes(tmp_path, max_steps=2048, alpha=2.0, eps=0.0)
        write(buf, 4)
        index, tree = (
            buf.sample_n_step(4, replace=False)["index"].numpy(),
            buf._core.priorities.tree,
        )
    with buf:
        before = tree.weights().clone()
        priority = make(np.array([1.0, 2.0, 3.0, 4.0]))
        if error is None:
            assert buf.update_priorities(np.matrix(index), priority) == 4
            weights = tree.weights()
            assert sorted(weights[weights > 0].tolist()) == [1.0, 4.0, 9.0, 16.0]
            return
        with pytest.raises(error, match=match):
            buf.update_priorities(index, priority)
        assert torch.equal(tree.weights(), before)


@pytest.mark.parametrize("form", ["list", "tensor"])
def test_updates_of_evicted_steps_whose_rows_lie_free_are_skipped(tmp_path: Path, form) -> None:
    """An evicted step's row that no later step took keeps its allocation number but lost its
    link: an update naming it applies nothing, on the torch path (lists) and the numpy one."""
    with episodes(tmp_path, max_steps=2048) as buf:
        write(buf, 1500)
        index = buf.sample_n_step(16, replace=False)["index"]
        write(buf, 1000)  # evicts the first episode; 1,000 of its rows are taken again
        buf.sample_n_step(1)  # the staged steps enter the tree (as any update first does)
        assert buf.stats()["evicted_episodes"] == 1
        core = buf._core
        rows, made = index % core.slots.capacity, index // core.slots.capacity
        assert bool((core.links.alloc[rows] == made).any())  # some rows still lie free
        tree = core.priorities.tree
        before = tree.weights().clone()
        priority = [5.0] * 16 if form == "list" else torch.full((16,), 5.0)
        assert buf.update_priorities(index if form == "tensor" else index.tolist(), priority) == 0
        assert torch.equal(tree.weights(), before)


@pytest.mark.skipif(
    compiled.kernels_unavailable_reason() is not None,
    reason=f"{compiled.kernels_unavailable_reason()}",
)
def test_well_formed_cpu_updates_skip_the_torch_path(tmp_path: Path, monkeypatch) -> None:
    """Ids from a batch and CPU priorities: the numpy path applies them on both buffers (the
    torch path, made to fail here, is not taken), and the draws follow the new priorities."""
    with ring(tmp_path, "torch", capacity=2048, alpha=1.0, eps=0.0) as buf:
        add(buf, 0, 2048)
        ids = torch.arange(8)
        buf.update_priorities(torch.arange(8, 2048).tolist(), [0.0] * 2040)  # the torch path
        monkeypatch.setattr(Prioritizer, "update", lambda *_: pytest.fail("took the torch path"))
        assert buf.update_priorities(ids, torch.tensor([0.0] * 7 + [3.0])) == 8
        assert set(buf.sample_batch(64)["x"].tolist()) == {7.0}
        monkeypatch.undo()
    with episodes(tmp_path, max_steps=2048, alpha=1.0, eps=0.0) as buf:
        write(buf, 5)
        batch = buf.sample_n_step(5, replace=False)
        monkeypatch.setattr(Prioritizer, "update", lambda *_: pytest.fail("took the torch path"))
        priority = (batch["start_step"] == 2).float()  # only step 2 keeps a weight
        assert buf.update_priorities(batch["index"], priority.numpy()) == 5
        assert set(buf.sample_n_step(64)["start_step"].tolist()) == {2}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": -0.1}, r"alpha must lie in \[0, 100\], got -0.1"),
        ({"alpha": 1e30}, r"alpha must lie in \[0, 100\], got 1e\+30"),
        ({"alpha": float("nan")}, r"alpha must lie in \[0, 100\], got nan"),
        ({"beta": 1.5}, r"beta must lie in \[0, 1\], got 1.5"),
        ({"eps": -1}, r"eps must lie in \[0, 1e\+06\], got -1"),
        ({"eps": float("inf")}, r"eps must lie in \[0, 1e\+06\], got inf"),
        ({"priority_backend": "magic"}, "magic"),
    ],
)
def test_bad_priority_settings_are_refused_at_construction(tmp_path: Path, kwargs, match) -> None:
    settings = {"priority_backend": "auto", **kwargs}
    with pytest.raises(ValueError, match=match):
        ReplayBuffer("cpu", "cpu", 8, scratch_dir=tmp_path, prioritized=True, **settings)
    assert not list(tmp_path.glob("replaybuf-*"))


def test_set_beta_anneals_and_is_checked(tmp_path: Path) -> None:
    with ring(tmp_path, "torch", beta=0.4) as buf:
        add(buf, 0, 4)
        buf.update_priorities([0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0])
        buf.set_beta(1.0)
        assert buf.stats()["beta"] == 1.0
        with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\], got 2"):
            buf.set_beta(2)
        assert buf.stats()["beta"] == 1.0


def test_stats_say_which_backend_runs(tmp_path: Path) -> None:
    with ring(tmp_path, "torch") as buf:
        assert (buf.stats()["prioritized"], buf.stats()["priority_backend"]) == (True, "torch")
    with ReplayBuffer("cpu", "cpu", 4, scratch_dir=tmp_path) as plain:
        assert plain.stats()["prioritized"] is False


def test_update_priorities_on_a_uniform_buffer_says_so(tmp_path: Path) -> None:
    with ReplayBuffer("cpu", "cpu", 4, scratch_dir=tmp_path) as plain:
        add(plain, 0, 2)
        with pytest.raises(ValueError, match="prioritized=True"):
            plain.update_priorities([0], [1.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_priorities_survive_a_checkpoint_exactly(tmp_path: Path, backend: str) -> None:
    with ring(tmp_path, backend, capacity=6) as buf:
        add(buf, 0, 9)
        batch = buf.sample_batch(6)
        buf.update_priorities(batch["index"], torch.arange(6, dtype=torch.float32))
        buf.save_checkpoint(tmp_path / "ck")
        with ReplayBuffer.load_checkpoint(tmp_path / "ck", scratch_dir=tmp_path) as back:
            assert torch.equal(back._priorities.tree.weights(), buf._priorities.tree.weights())
            for _ in range(3):
                assert (back.sample_batch(16) == buf.sample_batch(16)).all()
            assert back.update_priorities(batch["index"], [1.0] * 6) == buf.update_priorities(
                batch["index"], [1.0] * 6
            )


# --------------------------------------------------------------------------- episodes
def episodes(tmp_path: Path, **kwargs) -> SyncEpisodeReplayBuffer:
    return SyncEpisodeReplayBuffer(
        kwargs.pop("max_steps", 100), scratch_dir=tmp_path, seed=0, prioritized=True,
        priority_backend="torch", **kwargs,
    )  # fmt: skip


def write(buf: SyncEpisodeReplayBuffer, steps: int, end: bool = True) -> int:
    e = buf.start_episode()
    for t in range(steps):
        buf.append_observation_action_reward(e, torch.tensor([float(e), float(t)]), t, 1.0)
    if end:
        buf.end_episode(e, "terminated", final_observation=torch.tensor([float(e), float(steps)]))
    return e


def test_n_step_starts_are_drawn_by_their_priority(tmp_path: Path) -> None:
    with episodes(tmp_path, alpha=1.0, eps=0.0) as buf:
        a, b = write(buf, 3), write(buf, 2)
        batch = buf.sample_n_step(5, n=2, replace=False)
        keyed = {
            (int(e), int(t)): i
            for e, t, i in zip(
                batch["episode_id"], batch["start_step"], batch["index"], strict=True
            )
        }
        priorities = {(a, 0): 1.0, (a, 1): 2.0, (a, 2): 3.0, (b, 0): 4.0, (b, 1): 0.5}
        assert buf.update_priorities([keyed[k] for k in priorities], list(priorities.values())) == 5
        expected = law(priorities, 1.0, 0.0)
        draws = buf.sample_n_step(30_000, n=2)
        counts = Counter(
            zip(draws["episode_id"].tolist(), draws["start_step"].tolist(), strict=True)
        )
        keys = list(priorities)
        observed = [counts[k] for k in keys]
        assert chisquare(observed, [expected[k] * 30_000 for k in keys]).pvalue > 1e-3
        smallest = min(expected.values())
        for e, t, w in zip(
            draws["episode_id"][:100].tolist(),
            draws["start_step"][:100].tolist(),
            draws["weight"][:100].tolist(),
            strict=True,
        ):
            assert w == pytest.approx(
                (expected[(e, t)] / smallest) ** -buf.stats()["beta"], rel=1e-5
            )


@pytest.mark.parametrize("backend", BACKENDS)
def test_priorities_that_require_grad_are_taken_as_data(tmp_path: Path, backend: str) -> None:
    """A |TD error| straight from the loss (still requiring grad) updates like its detached
    value, on both buffers: priorities are data, never differentiated."""

    def both(make, fill, draw):
        out = []
        for grad in (True, False):
            with make(tmp_path) as buf:
                fill(buf)
                batch = draw(buf)
                error = torch.linspace(0.5, 3.0, batch["index"].numel(), requires_grad=True)
                priority = error * 2.0 if grad else (error * 2.0).detach()
                assert buf.update_priorities(batch["index"], priority) == priority.numel()
                out.append(draw(buf))
        assert torch.equal(out[0]["index"], out[1]["index"])
        assert torch.equal(out[0]["weight"], out[1]["weight"])

    both(
        lambda where: ring(where, backend, capacity=16),
        lambda buf: add(buf, 0, 16),
        lambda buf: buf.sample_batch(32),
    )
    both(
        lambda where: SyncEpisodeReplayBuffer(
            100, scratch_dir=where, seed=0, prioritized=True, priority_backend=backend
        ),
        lambda buf: (write(buf, 5), write(buf, 4)),
        lambda buf: buf.sample_n_step(16, n=2),
    )


def test_evicted_steps_leave_the_distribution_and_their_updates_are_skipped(tmp_path: Path) -> None:
    with episodes(tmp_path, max_steps=4) as buf:
        old = write(buf, 3)
        index = buf.sample_n_step(3, replace=False)["index"]
        write(buf, 3)  # evicts `old`
        assert buf.stats()["evicted_episodes"] == 1
        assert buf.update_priorities(index, [5.0, 5.0, 5.0]) == 0
        assert old not in buf.sample_n_step(2_000)["episode_id"].tolist()


def test_sequences_carry_the_start_steps_index_and_weight(tmp_path: Path) -> None:
    with episodes(tmp_path) as buf:
        write(buf, 6)
        seq = buf.sample_sequences(8, 3)
        assert seq["index"].shape == (8, 3)
        assert bool((seq["index"] == seq["index"][:, :1]).all())
        assert buf.update_priorities(seq["index"][:, 0], [2.0] * 8) == 8


def test_episode_priorities_survive_a_checkpoint(tmp_path: Path) -> None:
    with episodes(tmp_path) as buf:
        write(buf, 5)
        write(buf, 4, end=False)
        batch = buf.sample_n_step(6, replace=False)
        buf.update_priorities(batch["index"], torch.arange(6, dtype=torch.float32) + 1)
        buf.save_checkpoint(tmp_path / "ck")
        with SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ck", scratch_dir=tmp_path) as back:
            assert torch.equal(
                back._core.priorities.tree.weights(), buf._core.priorities.tree.weights()
            )
            assert (back.sample_n_step(32, n=2) == buf.sample_n_step(32, n=2)).all()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_async_updates_interleaved_with_appends_stay_consistent(tmp_path: Path) -> None:
    buf = EpisodeReplayBuffer(
        60, seed=0, scratch_dir=tmp_path, prioritized=True, priority_backend="torch"
    )

    async def collector(k: int) -> None:
        for _ in range(4):
            e = await buf.start_episode()
            for t in range(5 + k):
                await buf.append_observation_action_reward(
                    e, torch.tensor([float(e), float(t)]), t, 1.0
                )
                await asyncio.sleep(0)
            await buf.end_episode(e, "truncated", final_observation=torch.tensor([float(e), -1.0]))

    async def learner() -> int:
        applied = 0
        for _ in range(40):
            await asyncio.sleep(0)
            if len(buf) >= 8:
                batch = await buf.sample_n_step(8, n=3)
                applied += await buf.update_priorities(batch["index"], batch["reward"].abs() + 0.1)
        return applied

    *_, applied = await asyncio.gather(*(collector(k) for k in range(3)), learner())
    assert applied > 0
    core = buf.sync._core
    weights = core.priorities.tree.weights()
    anchors = core.links.next_row.cpu() >= 0
    assert bool((weights[anchors] > 0).all())  # every stored step can be drawn
    assert bool((weights[~anchors] == 0).all())  # nothing else can
    await buf.close()


def test_without_torchrls_extension_both_buffers_still_prioritize(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from replaybuf.priority import backends, segment_tree

    monkeypatch.delenv(backends.BACKEND_ENV, raising=False)
    monkeypatch.setenv(compiled.NUMBA_ENV, "0")  # else "auto" takes the kernels first
    monkeypatch.setattr(segment_tree, "_segment_trees", lambda: "torchrl._torchrl does not load")
    with ring(tmp_path, "auto") as buf:
        add(buf, 0, 4)
        assert buf.stats()["priority_backend"] == "torch"
        batch = buf.sample_batch(8)
        assert buf.update_priorities(batch["index"], torch.ones(8)) == 8
    with SyncEpisodeReplayBuffer(
        10, scratch_dir=tmp_path, prioritized=True, priority_backend="auto"
    ) as episodic:
        write(episodic, 3)
        assert episodic.stats()["priority_backend"] == "torch"
        assert episodic.sample_n_step(4)["weight"].shape == (4,)


@pytest.mark.skipif(
    compiled.kernels_unavailable_reason() is not None,
    reason=f"{compiled.kernels_unavailable_reason()}",
)
def test_compiled_and_numpy_draws_give_the_same_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU torch index with the numba kernels and without: the same items, index and
    importance weights (float32, pow from two libraries: equal to 1e-6), and stats() says
    which ran."""
    rings = {}
    for kernels in ("numba", "numpy"):
        monkeypatch.setenv(compiled.NUMBA_ENV, "0" if kernels == "numpy" else "1")
        (tmp_path / kernels).mkdir()
        rings[kernels] = ring(tmp_path / kernels, "torch", capacity=4000, beta=0.6)
        assert rings[kernels].stats()["priority_kernels"] == kernels
    for buf in rings.values():
        add(buf, 0, 5000)  # 1,000 overwritten
        ids = torch.arange(1000, 5000)
        buf.update_priorities(ids, (ids % 17).double() ** 2)  # many items: every block redone
    for round_ in range(4):
        got, expected = (rings[k].sample_batch(64) for k in ("numba", "numpy"))
        assert torch.equal(got["x"], expected["x"])
        assert torch.equal(got["index"], expected["index"])
        torch.testing.assert_close(got["weight"], expected["weight"], rtol=1e-6, atol=0)
        for buf in rings.values():  # 64 of 4,000 items: the kernels' small write
            assert buf.update_priorities(got["index"], got["x"] % 5 + round_) == 64
    assert rings["numba"]._priorities.tree.total() == rings["numpy"]._priorities.tree.total()
    for buf in rings.values():
        buf.close()
    with ReplayBuffer("cpu", "cpu", 4, scratch_dir=tmp_path) as plain:
        assert plain.stats()["priority_kernels"] is None


def test_steps_staged_before_an_eviction_enter_at_the_maximum_before_it() -> None:
    """New steps enter at the largest priority held when they were appended, even when an
    eviction that follows removes the episode holding it: they are admitted first."""
    buf = SyncEpisodeReplayBuffer(8, storage="tensor", seed=0, prioritized=True, alpha=1.0, eps=0)
    core = buf._core

    def step(episode: int, value: float) -> None:
        buf.append_observation_action_reward(episode, torch.full((3,), float(value)), 0, 1.0)

    old = buf.start_episode()
    for t in range(3):
        step(old, t)
    buf.end_episode(old, "terminated", torch.zeros(3))
    new = buf.start_episode()
    step(new, 10.0)
    core.flush()  # ``old`` ended before this flush: evicting it needs none of its own
    held = torch.tensor(list(core.episodes[old].rows[:-1]))
    buf.update_priorities(core.row_ids(held), torch.full((len(held),), 100.0))
    for t in range(1, 7):  # staged; the 5th needs room and evicts ``old``
        step(new, 10.0 + t)
    assert old not in core.episodes
    core.flush()
    rows = torch.tensor(list(core.episodes[new].rows[:-1]))
    assert core.priorities.tree.get(rows).tolist() == [100.0] * len(rows)
