"""The episode buffer and prioritized replay with CUDA storage or a CUDA training device.

The random-program property test of ``test_episodes.py`` runs here with every placement that
involves the GPU (every batch must arrive on the training device, then is checked on the CPU
against the reference model); sampling from CUDA storage, also right after appends, must not
wait for the GPU (checked with ``torch.cuda.set_sync_debug_mode("error")``); the row
bookkeeping read on the GPU matches CPU storage's; priorities on CUDA follow the PER law;
epochs from memmap storage reach a CUDA learner whole; checkpoints move between CUDA and CPU.
Skipped without a CUDA device.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from episode_helpers import batch_of, step
from episode_program import Program
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from tensordict import TensorDictBase
from test_bookkeeping import assert_same_bookkeeping, run
from test_bookkeeping import ops as bookkeeping_ops
from test_episodes import operations

from replaybuf import ReplayBuffer, SyncEpisodeReplayBuffer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (device, storing_device, storage): every placement that involves the GPU.
PLACEMENTS = [("cuda", "cuda", "tensor"), ("cuda", "cpu", "memmap"), ("cpu", "cuda", "tensor")]


class Arrived:
    """Forwards to a buffer; every batch it reads must be on ``device`` and is returned on
    the CPU, where the reference helpers compare it."""

    def __init__(self, buf: SyncEpisodeReplayBuffer) -> None:
        self._buf = buf

    def __len__(self) -> int:
        return len(self._buf)

    def _check(self, td: TensorDictBase) -> TensorDictBase:
        want = self._buf.device.type
        for leaf in td.values(include_nested=True, leaves_only=True):
            assert leaf.device.type == want, f"a leaf on {leaf.device}, not {want}"
        return td.cpu()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._buf, name)
        if name in ("sample_n_step", "sample_sequences", "get_episode"):
            return lambda *a, **k: self._check(attr(*a, **k))
        if name == "sample_episodes":
            return lambda *a, **k: [self._check(td) for td in attr(*a, **k)]
        if name == "iterate_epochs":

            def epochs(*a: Any, **k: Any) -> Iterator[TensorDictBase]:
                for td in attr(*a, **k):
                    yield self._check(td)

            return epochs
        return attr


@pytest.mark.parametrize(("device", "storing", "storage"), PLACEMENTS)
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    max_steps=st.integers(2, 12),
    max_episodes=st.one_of(st.none(), st.integers(1, 4)),
    ops=st.lists(operations, min_size=8, max_size=40),
)
def test_random_programs_agree_with_the_reference(
    tmp_path, device, storing, storage, max_steps, max_episodes, ops
):
    buf = SyncEpisodeReplayBuffer(
        max_steps, max_episodes, device=device, storing_device=storing, storage=storage,
        scratch_dir=tmp_path, seed=0,
    )  # fmt: skip
    with buf:
        assert (buf._core.links.host is None) == (storing == "cuda")  # torch index path on CUDA
        program = Program(Arrived(buf))  # type: ignore[arg-type]
        program.check()
        for name, *args in ops:
            getattr(program, name)(*args)
            program.check()


@pytest.mark.parametrize("frame_stack", [None, 2])
@settings(max_examples=40, deadline=None)
@given(ops_=bookkeeping_ops)
def test_row_bookkeeping_read_on_cuda_matches_the_host_columns(ops_, frame_stack):
    # CUDA storage reads its links and anchors from copies on the GPU, updated when read;
    # CPU storage reads the host columns the writes land in. Both must agree with the slow
    # rebuild (inside run) and with each other, column by column.
    with mock.patch.multiple("replaybuf.episodes.staging", _FLUSH_ROWS=3, _FLUSH_BYTES=0):
        host = run(ops_, frame_stack)
        gpu = run(ops_, frame_stack, storing="cuda")
    assert gpu.links._mirror is not None
    assert gpu.anchors._mirror is not None
    assert gpu.links.next_row.device.type == "cuda"
    assert gpu.anchors.rows.device.type == "cuda"
    assert_same_bookkeeping(host, gpu)


def filled_episodes(
    storing: str, prioritized: bool = False, **kwargs: Any
) -> SyncEpisodeReplayBuffer:
    """Six episodes (lengths 3 to 40, ended both ways, one still running) on ``storing``."""
    buf = SyncEpisodeReplayBuffer(
        200, device="cuda", storing_device=storing, storage="tensor", seed=0,
        prioritized=prioritized, **kwargs,
    )  # fmt: skip
    lengths = [3, 40, 7, 25, 12, 30]
    ids = [buf.start_episode() for _ in lengths]
    for t in range(max(lengths)):
        live = [(i, e) for i, e in enumerate(ids) if lengths[i] > t]
        buf.append_batch([e for _, e in live], *batch_of([step(e, t) for _, e in live]))
        for i, e in live:
            if lengths[i] == t + 1 and i != len(ids) - 1:
                buf.end_episode(e, "terminated" if i % 2 else "truncated", step(e, t + 1)[0])
    return buf


def no_sync_calls(buf: SyncEpisodeReplayBuffer) -> dict[str, Callable[[], Any]]:
    calls = {
        "sample_n_step": lambda: buf.sample_n_step(64, n=3, gamma=0.9),
        "sample_n_step random n": lambda: buf.sample_n_step(64, n=(1, 4), gamma=0.9),
        "sample_sequences padded": lambda: buf.sample_sequences(8, 20, strict=False),
    }
    if buf._core.priorities is None:  # uniform: slots whose tries fall short redrawn on the GPU
        calls["sample_sequences strict"] = lambda: buf.sample_sequences(8, 20)
    return calls


@pytest.mark.parametrize("prioritized", [False, True])
def test_sampling_from_cuda_storage_never_waits_for_the_gpu(prioritized):
    with filled_episodes("cuda", prioritized) as buf:
        calls = no_sync_calls(buf)
        for fn in calls.values():
            fn()  # first calls may allocate and build caches
        torch.cuda.synchronize()
        for name, fn in calls.items():
            torch.cuda.set_sync_debug_mode("error")
            try:
                batch = fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert batch.device.type == "cuda", name
    with ReplayBuffer("cuda", "cuda", 100, seed=0, prioritized=prioritized) as ring:
        ring.add_batch({"x": torch.arange(100.0, device="cuda")})
        ring.sample_batch(32)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            batch = ring.sample_batch(32)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert batch["x"].device.type == "cuda"


def test_appending_then_sampling_on_cuda_storage_never_waits_for_the_gpu():
    # The first read after appends writes the staged rows and updates the bookkeeping's
    # device copies: both go through pinned memory without blocking. (Not yet with
    # prioritized replay: admitting new steps goes through the priority index's checked
    # write, which reads its checks on the host.)
    with filled_episodes("cuda") as buf:
        running = 5  # the one episode filled_episodes leaves running, 30 steps
        for fn in no_sync_calls(buf).values():
            fn()  # first calls may allocate and build caches
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in range(30, 33):
                buf.append_observation_action_reward(running, *step(running, t))
            batch = buf.sample_n_step(64, n=3, gamma=0.9)
            buf.append_observation_action_reward(running, *step(running, 33))
            sequences = buf.sample_sequences(8, 20, strict=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert batch.device.type == sequences.device.type == "cuda"
        assert buf.get_episode(running)["observation"].shape[0] == 34


def test_cuda_and_cpu_storage_serve_the_same_n_step_values():
    gpu, cpu = filled_episodes("cuda"), filled_episodes("cpu")
    with gpu, cpu:
        batch = gpu.sample_n_step(500, n=(1, 5), gamma=0.9).cpu()
        # The same windows from the CPU buffer's numpy index path, through an epoch over
        # every step: rows keyed by (episode, start step, n) must agree field by field.
        twin = {}
        for n in range(1, 6):
            for b in cpu.iterate_epochs(10_000, n=n, gamma=0.9):
                b = b.cpu()
                for i, (e, t) in enumerate(zip(b["episode_id"].tolist(), b["start_step"].tolist())):  # noqa: B905
                    twin[(e, t, n)] = b[i]
        for i in range(batch.batch_size[0]):
            e, t = int(batch["episode_id"][i]), int(batch["start_step"][i])
            m, cut = int(batch["actual_n"][i]), bool(batch["cut"][i])
            matches = [twin[(e, t, n)] for n in range(1, 6) if (e, t, n) in twin]
            matches = [w for w in matches if int(w["actual_n"]) == m and bool(w["cut"]) == cut]
            assert matches, (e, t, m, cut)
            want = matches[0]
            for key in ("observation", "next_observation", "action", "terminated", "truncated"):
                assert torch.equal(batch[key][i], want[key]), (e, t, key)
            assert torch.allclose(batch["reward"][i], want["reward"], rtol=1e-6, atol=1e-6)
            assert torch.allclose(batch["next_discount"][i], want["next_discount"], rtol=1e-6)


def law(priorities: list[float], alpha: float) -> list[float]:
    powered = [p**alpha for p in priorities]
    return [v / sum(powered) for v in powered]


def test_ring_priorities_on_cuda_follow_the_per_law():
    alpha, beta = 0.7, 0.5
    with ReplayBuffer(
        "cuda", "cuda", 8, seed=0, prioritized=True, alpha=alpha, beta=beta, eps=0.0
    ) as buf:
        buf.add_batch({"x": torch.arange(8.0)})
        assert buf.stats()["priority_backend"] == "torch"
        priorities = [float(x) % 5 + 0.5 for x in range(8)]
        assert buf.update_priorities(list(range(8)), priorities) == 8
        expected = law(priorities, alpha)
        draws = 40_000
        batch = buf.sample_batch(draws).cpu()
        counts = Counter(int(v) for v in batch["x"])
        observed = [counts[i] for i in range(8)]
        assert chisquare(observed, [p * draws for p in expected]).pvalue > 1e-3
        per = [(8 * p) ** -beta for p in expected]
        for x, w in zip(batch["x"][:200].tolist(), batch["weight"][:200].tolist(), strict=True):
            assert w == pytest.approx(per[int(x)] / max(per), rel=1e-5)


def test_episode_priorities_on_cuda_follow_the_per_law_and_skip_stale_updates():
    with filled_episodes("cuda", prioritized=True, alpha=1.0, eps=0.0) as buf:
        first = buf.sample_n_step(5, n=2, replace=False).cpu()
        keys = list(zip(first["episode_id"].tolist(), first["start_step"].tolist()))  # noqa: B905
        priorities = [1.0, 2.0, 3.0, 4.0, 0.5]
        # Every other step keeps the initial maximum priority (1.0).
        assert buf.update_priorities(first["index"], priorities) == 5
        valid = len(buf)
        weights = {k: p for k, p in zip(keys, priorities, strict=True)}
        total = sum(weights.values()) + (valid - 5) * 1.0
        draws = buf.sample_n_step(60_000, n=2).cpu()
        counts = Counter(zip(draws["episode_id"].tolist(), draws["start_step"].tolist()))  # noqa: B905
        observed = [counts[k] for k in keys]
        expected = [weights[k] / total * 60_000 for k in keys]
        rest = 60_000 - sum(observed)
        assert chisquare([*observed, rest], [*expected, 60_000 - sum(expected)]).pvalue > 1e-3
    with SyncEpisodeReplayBuffer(
        4, device="cuda", storing_device="cuda", seed=0, prioritized=True
    ) as small:
        first, second = small.start_episode(), small.start_episode()
        for t in range(4):
            small.append_observation_action_reward(first, *step(first, t)[:3])
        small.end_episode(first, "terminated", step(first, 4)[0])
        index = small.sample_n_step(4, replace=False)["index"]
        for t in range(4):  # evicts the first episode; its rows are reused
            small.append_observation_action_reward(second, *step(second, t)[:3])
        assert small.stats()["evicted_episodes"] == 1
        assert small.update_priorities(index, [5.0] * 4) == 0


@pytest.mark.parametrize("kind", ["ring", "episodes"])
def test_cuda_learners_priority_updates_into_cpu_storage_match_the_checked_path(
    tmp_path: Path, kind
):
    """CPU storage, batches on the GPU: an update from the batch's CUDA index and CUDA TD
    errors (copied to the host, then the numpy path) gives the weights that the same values
    as lists (the checked path) give a twin buffer, bit for bit."""

    def make():
        if kind == "ring":
            buf = ReplayBuffer("cuda", "cpu", 2048, storage="memmap", scratch_dir=tmp_path,
                               seed=0, prioritized=True, priority_backend="torch")  # fmt: skip
            buf.add_batch({"x": torch.arange(3000.0)})
            return buf
        buf = SyncEpisodeReplayBuffer(2048, device="cuda", storing_device="cpu",
                                      scratch_dir=tmp_path, seed=0, prioritized=True,
                                      priority_backend="torch")  # fmt: skip
        for e in range(4):
            episode = buf.start_episode()
            for t in range(300):
                buf.append_observation_action_reward(episode, *step(e, t)[:3])
            buf.end_episode(episode, "terminated", step(e, 300)[0])
        return buf

    with make() as fast, make() as slow:
        trees = [b._priorities.tree if kind == "ring" else b._core.priorities.tree
                 for b in (fast, slow)]  # fmt: skip
        for round_ in range(3):
            batches = [b.sample_batch(12) if kind == "ring" else b.sample_n_step(12)
                       for b in (fast, slow)]  # fmt: skip
            index = batches[0]["index"]
            assert index.is_cuda
            td_error = torch.rand(12, device="cuda") + round_
            applied = fast.update_priorities(index, td_error)
            assert applied == slow.update_priorities(index.tolist(), td_error.double().tolist())
            assert torch.equal(trees[0].weights(), trees[1].weights())


def test_epochs_from_memmap_storage_reach_a_cuda_learner_whole(tmp_path: Path):
    lengths = [3, 40, 7, 25, 12, 30]
    with SyncEpisodeReplayBuffer(
        300, device="cuda", storing_device="cpu", storage="memmap", scratch_dir=tmp_path, seed=0
    ) as buf:
        for e, length in enumerate(lengths):
            assert buf.start_episode() == e
            for t in range(length):
                buf.append_observation_action_reward(e, *step(e, t)[:3])
            if e != len(lengths) - 1:
                buf.end_episode(e, "terminated" if e % 2 else "truncated", step(e, length)[0])
        seen = []
        for batch in buf.iterate_epochs(7, n=3, gamma=0.9):
            assert batch["observation"].device.type == "cuda"
            seen += list(zip(batch["episode_id"].tolist(), batch["start_step"].tolist()))  # noqa: B905
        # The running episode's last step waits for its next observation.
        assert len(seen) == len(set(seen)) == len(buf) == sum(lengths) - 1
    with ReplayBuffer("cuda", "cpu", 1000, storage="memmap", scratch_dir=tmp_path, seed=0) as ring:
        ring.add_batch({"x": torch.arange(1000.0)})
        got = torch.cat([b["x"].cpu() for b in ring.create_epoch_iterator(64)])
        assert torch.equal(got.sort().values, torch.arange(1000.0))


@pytest.mark.parametrize(("saved_on", "loaded_on"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_episode_checkpoints_move_between_cuda_and_cpu(tmp_path: Path, saved_on, loaded_on):
    original = filled_episodes(saved_on, prioritized=True)
    with original:
        original.save_checkpoint(tmp_path / "ckpt")
        loaded = SyncEpisodeReplayBuffer.load_checkpoint(
            tmp_path / "ckpt", storing_device=loaded_on, storage="tensor"
        )
        with loaded:
            assert loaded.stats()["storing_device"].startswith(loaded_on)
            reference = filled_episodes("cpu")
            with reference:
                for e in range(6):
                    want = reference.get_episode(e).cpu()
                    got = loaded.get_episode(e).cpu()
                    keys = set(want.keys(True, True))
                    assert set(got.keys(True, True)) == keys
                    for key in keys:
                        assert torch.equal(got[key], want[key]), (e, key)
            a = original.sample_n_step(32, n=2).cpu()
            b = loaded.sample_n_step(32, n=2).cpu()
            assert b["index"].shape == a["index"].shape
