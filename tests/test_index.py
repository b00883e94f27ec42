"""Index math over linked rows: nstep_windows, sequence_rows, full_sequence_starts.

Three layers: named table cases with hand-computed rows, a plain-loop oracle over episode lists,
and hypothesis comparing the vectorized code to that oracle on random interleavings.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replaybuf.accel.numba_loader import kernels_unavailable_reason
from replaybuf.core.index import (
    END_NONE,
    END_TERMINATED,
    END_TRUNCATED,
    Windows,
    full_sequence_starts,
    full_sequence_starts_by_jumps,
    jump,
    jump_levels,
    jump_tables,
    nstep_windows,
    sequence_rows,
    sequence_rows_by_jumps,
    stack_rows,
)
from replaybuf.core.nstep import bootstrap_discount, host_powers, reward_powers, window_return


def link(episodes: list[tuple[list[int], int]], rows: int):
    """Per-row tensors for episodes given as (rows of obs_0.., end kind).

    An ended episode's last row is its final observation; an in-progress episode's last row is
    its newest observation. Anchors are every row with a successor.
    """
    next_row = torch.full((rows,), -1, dtype=torch.long)
    end_kind = torch.zeros(rows, dtype=torch.int8)
    for ep_rows, kind in episodes:
        for a, b in itertools.pairwise(ep_rows):
            next_row[a] = b
        if kind != END_NONE:
            end_kind[ep_rows[-1]] = kind
    return next_row, end_kind


def successors(next_row: torch.Tensor) -> torch.Tensor:
    """``succ``: next_row with each row itself where it has no successor (RowLinks.succ)."""
    return torch.where(next_row >= 0, next_row, torch.arange(next_row.shape[0]))


BACKENDS = ["torch", "numpy"]
SEQUENCE_BACKENDS = [*BACKENDS, "jumps"]  # sequences also walk by jump tables on CUDA


def windows(episodes, rows, start, n, n_max=None, backend="torch"):
    """nstep_windows on torch tensors or numpy arrays, returned as batch-major tensors
    (``rows [B, n_max + 1]``, ``valid [B, n_max]``) so that each case reads one sample a row."""
    next_row, end_kind = link(episodes, rows)
    succ = successors(next_row)
    start = torch.tensor(start, dtype=torch.long)
    if n_max is None:
        n_max = n if isinstance(n, int) else max(n)
    if not isinstance(n, int):
        n = torch.tensor(n)
    if backend == "numpy":
        n = n if isinstance(n, int) else n.numpy()
        w = nstep_windows(start.numpy(), n, n_max, succ.numpy(), end_kind.numpy())
        assert all(isinstance(v, np.ndarray) for v in w)
        w = Windows(*(torch.from_numpy(np.ascontiguousarray(v)) for v in w))
    else:
        w = nstep_windows(start, n, n_max, succ, end_kind)
        assert all(isinstance(v, torch.Tensor) for v in w)
    assert w.rows.shape == (n_max + 1, start.shape[0])  # time-major
    assert w.valid.shape == (n_max, start.shape[0])
    return w._replace(rows=w.rows.T, valid=w.valid.T)


# --------------------------------------------------------------------------- table cases
@pytest.mark.parametrize("backend", BACKENDS)
def test_window_stops_at_terminated_final_observation(backend):
    # terminated, 3 steps, n = 5:
    #   row:   0      1      2      3
    #         obs_0 ▶ obs_1 ▶ obs_2 ▶ obs_3 (final, terminated)
    #   from t=0: m = 3, next obs = row 3, terminal, not cut
    w = windows([([0, 1, 2, 3], END_TERMINATED)], 4, [0], 5, backend=backend)
    assert w.m.tolist() == [3]
    assert w.valid.tolist() == [[True, True, True, False, False]]
    assert w.rows.tolist() == [[0, 1, 2, 3, 3, 3]]  # past m: the row of obs_{t+m}
    assert w.last_row.tolist() == [3]
    assert w.terminal.tolist() == [True]
    assert w.truncated.tolist() == [False]
    assert w.cut.tolist() == [False]


def test_window_stops_at_truncated_final_observation():
    w = windows([([0, 1, 2, 3], END_TRUNCATED)], 4, [1], 5)
    assert w.m.tolist() == [2]
    assert w.last_row.tolist() == [3]
    assert (w.terminal.item(), w.truncated.item(), w.cut.item()) == (False, True, False)


def test_window_of_in_progress_episode_is_cut_at_newest_observation():
    # in progress, 4 steps appended (obs_3 has no successor yet, so step 3 is not valid):
    #   row:   0      1      2      3
    #         obs_0 ▶ obs_1 ▶ obs_2 ▶ obs_3 (newest)
    #   from t=1, n=5: steps 1, 2 -> m = 2, next obs = row 3, cut, never terminal
    w = windows([([0, 1, 2, 3], END_NONE)], 4, [1], 5)
    assert w.m.tolist() == [2]
    assert w.last_row.tolist() == [3]
    assert (w.terminal.item(), w.truncated.item(), w.cut.item()) == (False, False, True)


def test_full_window_inside_in_progress_episode_is_not_cut():
    w = windows([([0, 1, 2, 3], END_NONE)], 4, [0], 2)
    assert w.m.tolist() == [2]
    assert w.last_row.tolist() == [2]
    assert (w.terminal.item(), w.truncated.item(), w.cut.item()) == (False, False, False)


def test_full_window_ending_exactly_on_terminated_final_is_terminal():
    w = windows([([0, 1, 2, 3], END_TERMINATED)], 4, [1], 2)
    assert w.m.tolist() == [2]
    assert w.terminal.tolist() == [True]
    assert w.cut.tolist() == [False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_follows_links_through_interleaved_rows_and_never_crosses_episodes(backend):
    # episode A rows 0, 2, 4 (4 = final, terminated); episode B rows 1, 3, 5 (in progress)
    #   storage: A0 B0 A1 B1 A_final B2
    episodes = [([0, 2, 4], END_TERMINATED), ([1, 3, 5], END_NONE)]
    w = windows(episodes, 6, [0, 2, 1, 3], 3, backend=backend)
    assert w.m.tolist() == [2, 1, 2, 1]
    assert w.rows.tolist() == [[0, 2, 4, 4], [2, 4, 4, 4], [1, 3, 5, 5], [3, 5, 5, 5]]
    assert w.last_row.tolist() == [4, 4, 5, 5]
    assert w.terminal.tolist() == [True, True, False, False]
    assert w.cut.tolist() == [False, False, True, True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_sample_uses_its_own_n(backend):
    w = windows([([0, 1, 2, 3, 4, 5], END_TRUNCATED)], 6, [0, 0, 0], [1, 2, 3], backend=backend)
    assert w.m.tolist() == [1, 2, 3]
    assert w.last_row.tolist() == [1, 2, 3]
    assert w.valid.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert w.truncated.tolist() == [False, False, False]


def sequences(episodes, rows, start, length, backend="torch"):
    """sequence_rows and full_sequence_starts on torch tensors or numpy arrays, as tensors."""
    succ = successors(link(episodes, rows)[0])
    start = torch.tensor(start, dtype=torch.long)
    if backend == "numpy":
        obs_rows, mask = sequence_rows(start.numpy(), length, succ.numpy())
        full = full_sequence_starts(start.numpy(), length, succ.numpy())
        assert all(isinstance(v, np.ndarray) for v in (obs_rows, mask, full))
        return torch.from_numpy(obs_rows), torch.from_numpy(mask), torch.from_numpy(full)
    if backend == "jumps":  # CUDA's walk: doubling jump tables
        jumps = jump_tables(succ, jump_levels(length), [])
        obs_rows, mask = sequence_rows_by_jumps(start, length, jumps)
        return obs_rows, mask, full_sequence_starts_by_jumps(start, length, jumps)
    obs_rows, mask = sequence_rows(start, length, succ)
    return obs_rows, mask, full_sequence_starts(start, length, succ)


@pytest.mark.parametrize("backend", SEQUENCE_BACKENDS)
def test_sequence_rows_pad_past_episode_end_with_last_real_row(backend):
    # terminated, 2 steps: rows 7 -> 3 -> 5 (final); length 4 from t=0
    obs_rows, mask, _ = sequences([([7, 3, 5], END_TERMINATED)], 8, [7, 3], 4, backend)
    assert obs_rows.tolist() == [[7, 3, 5, 5, 5], [3, 5, 5, 5, 5]]
    assert mask.tolist() == [[True, True, False, False], [True, False, False, False]]
    _, _, full = sequences([([7, 3, 5], END_TERMINATED)], 8, [7, 3], 2, backend)
    assert full.tolist() == [True, False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_of_in_progress_episode_stops_before_newest_observation(backend):
    obs_rows, mask, _ = sequences([([0, 1, 2], END_NONE)], 3, [0], 3, backend)
    assert mask.tolist() == [[True, True, False]]
    assert obs_rows.tolist() == [[0, 1, 2, 2]]


# --------------------------------------------------------------------------- oracle
def oracle_window(ep_rows: list[int], kind: int, t: int, n: int, n_max: int) -> dict:
    """A window from step t, by walking the episode's row list."""
    valid_steps = len(ep_rows) - 1  # every row with a successor
    m = 0
    while m < n and t + m < valid_steps:
        m += 1
    reach = min(n_max, valid_steps - t)  # the walk ignores a per-sample n (valid masks it)
    rows = [ep_rows[t + min(k, reach)] for k in range(n_max + 1)]
    last = ep_rows[t + m]
    at_end = t + m == len(ep_rows) - 1
    return {
        "rows": rows,
        "valid": [k < m for k in range(n_max)],
        "m": m,
        "last_row": last,
        "terminal": at_end and kind == END_TERMINATED,
        "truncated": at_end and kind == END_TRUNCATED,
        "cut": m < n and kind == END_NONE,
    }


def oracle_sequence(ep_rows: list[int], t: int, length: int) -> tuple[list[int], list[bool]]:
    valid_steps = len(ep_rows) - 1
    real = min(length, valid_steps - t)
    obs_rows = [ep_rows[t + min(k, real)] for k in range(length + 1)]
    return obs_rows, [k < real for k in range(length)]


@st.composite
def layouts(draw):
    """1-4 episodes (observation counts 1-8, any end kind) interleaved in a random row order."""
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=4))
    kinds = draw(
        st.lists(
            st.sampled_from([END_NONE, END_TERMINATED, END_TRUNCATED]),
            min_size=len(sizes),
            max_size=len(sizes),
        )
    )
    total = sum(sizes)
    spare = draw(st.integers(0, 3))  # rows that belong to no episode
    order = draw(st.permutations(list(range(total + spare))))
    episodes, at = [], 0
    for size, kind in zip(sizes, kinds, strict=True):
        episodes.append((list(order[at : at + size]), kind))
        at += size
    return episodes, total + spare


def window_case(episodes, data):
    """Anchors (episode, step) to sample, n_max, whether n is per sample, and each one's n;
    None when no episode has a step."""
    starts = [(e, t) for e, (r, _) in enumerate(episodes) for t in range(len(r) - 1)]
    if not starts:
        return None
    picks = data.draw(st.lists(st.sampled_from(starts), min_size=1, max_size=8))
    n_max = data.draw(st.integers(1, 6))
    per_sample = data.draw(st.booleans())
    ns = [n_max] * len(picks)
    if per_sample:
        ns = data.draw(st.lists(st.integers(1, n_max), min_size=len(picks), max_size=len(picks)))
    return picks, n_max, per_sample, ns


@settings(max_examples=150, deadline=None)
@given(layout=layouts(), data=st.data())
def test_nstep_windows_match_the_loop_oracle(layout, data):
    episodes, rows = layout
    case = window_case(episodes, data)
    if case is None:
        return
    picks, n_max, per_sample, ns = case
    start = [episodes[e][0][t] for e, t in picks]
    backend = data.draw(st.sampled_from(BACKENDS))
    w = windows(episodes, rows, start, ns if per_sample else n_max, n_max, backend)
    for i, (e, t) in enumerate(picks):
        ep_rows, kind = episodes[e]
        want = oracle_window(ep_rows, kind, t, ns[i], n_max)
        got = {
            "rows": w.rows[i].tolist(),
            "valid": w.valid[i].tolist(),
            "m": int(w.m[i]),
            "last_row": int(w.last_row[i]),
            "terminal": bool(w.terminal[i]),
            "truncated": bool(w.truncated[i]),
            "cut": bool(w.cut[i]),
        }
        assert got == want, (e, t, ns[i])
        # never crosses an episode: every row used belongs to this episode
        assert set(got["rows"]) | {got["last_row"]} <= set(ep_rows)


@settings(max_examples=150, deadline=None)
@given(layout=layouts(), data=st.data())
def test_sequence_rows_and_full_starts_match_the_loop_oracle(layout, data):
    episodes, rows = layout
    starts = [(e, t) for e, (r, _) in enumerate(episodes) for t in range(len(r) - 1)]
    if not starts:
        return
    picks = data.draw(st.lists(st.sampled_from(starts), min_size=1, max_size=8))
    length = data.draw(st.integers(1, 20))
    start = [episodes[e][0][t] for e, t in picks]
    backend = data.draw(st.sampled_from(SEQUENCE_BACKENDS))
    obs_rows, mask, full = sequences(episodes, rows, start, length, backend)
    for i, (e, t) in enumerate(picks):
        want_rows, want_mask = oracle_sequence(episodes[e][0], t, length)
        assert obs_rows[i].tolist() == want_rows
        assert mask[i].tolist() == want_mask
        assert bool(full[i]) == all(want_mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 3])
def test_windows_accept_an_empty_batch(n, backend):
    w = windows([([0, 1], END_TERMINATED)], 2, [], n, 3, backend)
    assert w.rows.shape == (0, 4)
    assert w.m.shape == (0,)


@settings(max_examples=100, deadline=None)
@given(layout=layouts(), steps=st.integers(0, 40), data=st.data())
def test_a_jump_equals_that_many_single_steps(layout, steps, data):
    episodes, rows = layout
    succ = successors(link(episodes, rows)[0])
    start = torch.tensor(data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=6)))
    want = start
    for _ in range(steps):
        want = succ[want]
    jumps = jump_tables(succ, jump_levels(max(steps, 1)), [])
    assert torch.equal(jump(start, steps, jumps), want)


def test_jump_tables_extend_what_is_known_and_levels_cover_the_walk():
    succ = torch.tensor([1, 2, 3, 3])  # one episode: rows 0 -> 1 -> 2 -> 3 (self-loop)
    known: list[torch.Tensor] = []
    assert [t.tolist() for t in jump_tables(succ, 2, known)] == [[1, 2, 3, 3], [2, 3, 3, 3]]
    assert len(known) == 2
    assert jump_tables(succ, 3, known)[2].tolist() == [3, 3, 3, 3]
    assert [jump_levels(n) for n in (1, 2, 3, 4, 16, 80)] == [1, 2, 2, 3, 5, 7]


NO_KERNELS = kernels_unavailable_reason()


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
@settings(max_examples=150, deadline=None)
@given(layout=layouts(), data=st.data())
def test_compiled_nstep_windows_match_the_oracle_and_the_numpy_path(layout, data):
    """replaybuf.accel.numba_kernels.nstep_windows (one call for the whole batch) against the loop
    oracle
    and against the numpy path's values (window_return, bootstrap_discount)."""
    from replaybuf.accel import numba_kernels as kernels

    episodes, rows = layout
    case = window_case(episodes, data)
    if case is None:
        return
    picks, n_max, per_sample, ns = case
    dtype = data.draw(st.sampled_from([np.float32, np.float64]))
    gamma = data.draw(st.sampled_from([0.0, 0.5, 0.99, 1.0]))
    reward = np.array(
        data.draw(st.lists(st.floats(-1e3, 1e3), min_size=rows, max_size=rows)), dtype=dtype
    )
    next_row, end_kind = link(episodes, rows)
    succ, end_kind = successors(next_row).numpy(), end_kind.numpy()
    step, episode = np.arange(rows) * 3, np.arange(rows) + 100  # any per-row columns
    start = np.array([episodes[e][0][t] for e, t in picks], dtype=np.int64)
    each = np.array(ns, dtype=np.int64) if per_sample else np.empty(0, np.int64)
    got = kernels.nstep_windows(
        start, each, n_max, succ, end_kind, step, episode, reward,
        reward_powers(gamma, n_max, reward.dtype), host_powers(gamma, n_max),
    )  # fmt: skip
    ends, total, terminal, truncated, cut, discount, m, first_step, first_episode = got
    assert total.dtype == dtype
    assert discount.dtype == np.float32
    w = nstep_windows(start, each if per_sample else n_max, n_max, succ, end_kind)
    assert np.array_equal(ends, np.concatenate([start, w.last_row]))
    for name, value in [("m", m), ("terminal", terminal), ("truncated", truncated), ("cut", cut)]:
        assert np.array_equal(value, getattr(w, name)), name
    assert np.array_equal(discount, bootstrap_discount(w.m, w.terminal, gamma, n_max))
    expected = window_return(reward[w.rows[:n_max]], w.valid, gamma)
    # Cancelling rewards leave ~1e-13 of rounding around 0 in float64, ~1e-4 in float32.
    np.testing.assert_allclose(
        total, expected, rtol=1e-6, atol=1e-3 if dtype == np.float32 else 1e-9
    )
    for i, (e, t) in enumerate(picks):  # the slow obvious sum, float64
        ep_rows, kind = episodes[e]
        want = oracle_window(ep_rows, kind, t, ns[i], n_max)
        assert (int(m[i]), int(ends[len(picks) + i])) == (want["m"], want["last_row"])
        slow = sum(gamma**k * float(reward[ep_rows[t + k]]) for k in range(want["m"]))
        assert float(total[i]) == pytest.approx(slow, rel=1e-5, abs=1e-3)
    assert np.array_equal(first_step, step[start])
    assert np.array_equal(first_episode, episode[start])


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
@settings(max_examples=150, deadline=None)
@given(layout=layouts(), data=st.data())
def test_compiled_stack_rows_match_the_oracle_and_the_numpy_path(layout, data):
    """replaybuf.accel.numba_kernels.stack_rows (flat [N * k]) against a slow list per row (the
    rows j
    steps back in its episode, the first row where there is none) and index.stack_rows."""
    from replaybuf.accel import numba_kernels as kernels

    episodes, rows = layout
    k = data.draw(st.integers(1, 5))
    prev_row = np.full(rows, -1, np.int64)
    where: dict[int, tuple[list[int], int]] = {}  # row -> (its episode's rows, its index)
    for ep_rows, _ in episodes:
        for t, row in enumerate(ep_rows):
            where[row] = (ep_rows, t)
            if t:
                prev_row[row] = ep_rows[t - 1]
    picks = np.array(data.draw(st.lists(st.sampled_from(sorted(where)), max_size=8)), np.int64)
    stacked, real = kernels.stack_rows(picks, k, prev_row)
    assert stacked.shape == real.shape == (picks.shape[0] * k,)
    for i, row in enumerate(picks.tolist()):
        ep_rows, t = where[row]
        want = [ep_rows[max(t - j, 0)] for j in range(k - 1, -1, -1)]  # oldest first
        assert stacked[i * k : (i + 1) * k].tolist() == want
        assert real[i * k : (i + 1) * k].tolist() == [t - j >= 0 for j in range(k - 1, -1, -1)]
    numpy_rows, numpy_real = stack_rows(picks, k, prev_row)
    assert np.array_equal(stacked, numpy_rows.reshape(-1))
    assert np.array_equal(real, numpy_real.reshape(-1))


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"{NO_KERNELS}")
def test_compiled_nstep_windows_of_no_anchors():
    from replaybuf.accel import numba_kernels as kernels

    succ, end_kind = np.arange(4), np.zeros(4, np.int8)
    each = np.empty(0, np.int64)
    reward = np.zeros(4, np.float32)
    got = kernels.nstep_windows(
        np.empty(0, np.int64), each, 3, succ, end_kind, np.arange(4), np.arange(4), reward,
        reward_powers(0.9, 3, reward.dtype), host_powers(0.9, 3),
    )  # fmt: skip
    assert [v.shape for v in got] == [(0,)] * 9
