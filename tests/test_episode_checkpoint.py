"""Episode-buffer checkpoints: exact round trips, resumed episodes, refusal of damage, and
snapshots that stay consistent while asyncio tasks keep writing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from episode_helpers import action, extras, final_obs, obs, reward

from replaybuf import (
    CheckpointKindError,
    CorruptCheckpointError,
    EpisodeReplayBuffer,
    ReplayBuffer,
    SyncEpisodeReplayBuffer,
)
from replaybuf.episodes.episode import RowsPinned
from replaybuf.persist.format.names import seal


def fill(buf: SyncEpisodeReplayBuffer) -> list[int]:
    """Interleaved episodes: ended ones, in-progress ones, a zero-step one, and evictions."""
    ids = [buf.start_episode(f"agent{i % 2}") for i in range(5)]
    for t in range(9):
        for i, e in enumerate(ids):
            if t < 3 + 2 * i:
                buf.append_observation_action_reward(
                    e, obs(e, t), action(e, t), reward(e, t), extras(t)
                )
        if t == 4:
            buf.end_episode(ids[0], "terminated", final_observation=final_obs(ids[0], 3))
            buf.end_episode(ids[1], "truncated", final_observation=final_obs(ids[1], 5))
    empty = buf.start_episode("agent9")
    buf.end_episode(empty, "terminated", final_observation=final_obs(empty, 0))
    return [*ids, empty]


def same_contents(a: SyncEpisodeReplayBuffer, b: SyncEpisodeReplayBuffer) -> None:
    ignored = {"bytes": 0, "storage": ""}  # may differ by design (loading into another kind)
    assert a.stats() | ignored == b.stats() | ignored
    assert len(a) == len(b)
    for episode_id in a._core.episodes:
        x, y = a.get_episode(episode_id), b.get_episode(episode_id)
        assert (x == y).all(), f"episode {episode_id} differs"


@pytest.mark.parametrize("storage", ["memmap", "tensor"])
def test_round_trip_restores_episodes_counters_and_sampling(tmp_path: Path, storage: str) -> None:
    with SyncEpisodeReplayBuffer(30, seed=5, storage=storage, scratch_dir=tmp_path) as buf:
        ids = fill(buf)
        assert buf.stats()["evicted_episodes"] > 0  # the layout includes evictions
        buf.save_checkpoint(tmp_path / "ck")
        with SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ck", scratch_dir=tmp_path) as back:
            same_contents(buf, back)
            for _ in range(5):  # the saved sampler goes on exactly
                assert (buf.sample_n_step(16, n=(1, 3)) == back.sample_n_step(16, n=(1, 3))).all()
                assert (buf.sample_sequences(4, 2) == back.sample_sequences(4, 2)).all()
            live = [
                e
                for e in ids
                if e in back._core.episodes and back.get_episode(e)["terminated"] == 0
            ]
            in_progress = [e for e in live if back._core.episodes[e].in_progress]
            assert in_progress, "the layout must leave episodes in progress"
            for e in in_progress:  # appending continues where it stopped, on both
                for b in (buf, back):
                    steps = b._core.episodes[e].steps
                    b.append_observation_action_reward(
                        e, obs(e, steps), action(e, steps), 0.5, extras(steps)
                    )
                    b.end_episode(e, "truncated", final_observation=final_obs(e, steps + 1))
            assert back.start_episode() == buf.start_episode()  # ids keep counting
            same_contents(buf, back)


def test_a_buffer_restored_after_a_zero_step_end_evicts_and_samples_as_the_original() -> None:
    """The save's flush finds nothing staged, right after a zero-step episode ended (it stages
    nothing). The original and the restored buffer then evict that episode alike (the restored
    one reads every ended episode as flushed; so must the original), so staged anchors join
    the anchor set in the same order and seeded draws agree."""

    def after(restore: bool) -> tuple[list[int], torch.Tensor]:
        buf = SyncEpisodeReplayBuffer(1000, 4, seed=0, storage="tensor")
        empty = buf.start_episode()  # the oldest: evicted first
        for j in range(2):
            e = buf.start_episode()
            for t in range(5):
                buf.append_observation_action_reward(e, torch.full((3,), 10.0 * j + t), 0, 1.0)
            buf.end_episode(e, "terminated", torch.zeros(3))
        buf.sample_n_step(2)  # a flush: nothing staged after it
        buf.end_episode(empty, "terminated", torch.zeros(3))  # zero steps: stages nothing
        state = buf.state_dict()  # its flush finds nothing staged
        if restore:
            twin = SyncEpisodeReplayBuffer(1000, 4, storage="tensor")
            twin.load_state_dict(state)
            buf.close()
            buf = twin
        late = buf.start_episode()
        for t in range(3):  # staged: their anchors join the set at the next flush
            buf.append_observation_action_reward(late, torch.full((3,), 100.0 + t), 0, 1.0)
        buf.start_episode()  # over max_episodes: evicts ``empty``
        buf.start_episode()  # evicts the first episode with steps, removing its anchors
        core = buf._core
        core.flush()
        anchors = core.anchors.rows[: len(core.anchors)].tolist()
        batch = buf.sample_n_step(8)["observation"]
        buf.close()
        return anchors, batch

    (anchors, batch), (anchors_back, batch_back) = after(False), after(True)
    assert anchors == anchors_back
    assert torch.equal(batch, batch_back)


def test_checkpoint_loads_into_the_other_storage_kind(tmp_path: Path) -> None:
    with SyncEpisodeReplayBuffer(30, seed=1, storage="tensor", scratch_dir=tmp_path) as buf:
        fill(buf)
        buf.save_checkpoint(tmp_path / "ck")
        with SyncEpisodeReplayBuffer.load_checkpoint(
            tmp_path / "ck", storage="memmap", scratch_dir=tmp_path
        ) as back:
            assert back.stats()["storage"] == "memmap"
            same_contents(buf, back)


def test_save_load_save_gives_identical_checksums(tmp_path: Path) -> None:
    with SyncEpisodeReplayBuffer(30, seed=2, scratch_dir=tmp_path) as buf:
        fill(buf)
        buf.save_checkpoint(tmp_path / "a")
    with SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "a", scratch_dir=tmp_path) as back:
        back.save_checkpoint(tmp_path / "b")
    digests = [
        {
            k: v["sha256"]
            for k, v in json.loads((tmp_path / d / "MANIFEST.json").read_text())["tensors"].items()
        }
        for d in ("a", "b")
    ]
    assert digests[0] == digests[1]


def empty_new(buf: SyncEpisodeReplayBuffer) -> None:
    """Nothing stored yet: no spec, no episode (left as created)."""
    assert buf.spec is None
    assert buf.stats()["episodes"] == 0


def cleared(buf: SyncEpisodeReplayBuffer) -> None:
    """A spec, rows allocated, and no episode left."""
    fill(buf)
    buf.clear()


def zero_step_only(buf: SyncEpisodeReplayBuffer) -> None:
    """A spec, and only an episode that ended with no step: no row holds anything."""
    e = buf.start_episode()
    buf.append_observation_action_reward(e, obs(e, 0), action(e, 0), 1.0, extras(0))
    buf.end_episode(e, "terminated", final_observation=final_obs(e, 1))
    empty = buf.start_episode()
    buf.end_episode(empty, "truncated", final_observation=final_obs(empty, 0))
    buf._core.flush()
    buf._core.remove_episode(buf._core.episodes[e])  # as an eviction would


@pytest.mark.parametrize("layout", [empty_new, cleared, zero_step_only])
def test_buffers_holding_no_rows_save_load_and_save_again(tmp_path: Path, layout) -> None:
    """Saving, loading, saving the loaded buffer again, then appending: with no stored rows
    (the restore then allocates no storage) every step still works."""
    with SyncEpisodeReplayBuffer(30, seed=3, scratch_dir=tmp_path) as buf:
        layout(buf)
        buf.save_checkpoint(tmp_path / "a")
        with SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "a", scratch_dir=tmp_path) as back:
            same_contents(buf, back)
            back.save_checkpoint(tmp_path / "b")
            for b in (buf, back):
                e = b.start_episode()
                for t in range(3):
                    b.append_observation_action_reward(e, obs(e, t), action(e, t), 1.0, extras(t))
                b.end_episode(e, "terminated", final_observation=final_obs(e, 3))
            same_contents(buf, back)
        with SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "b", scratch_dir=tmp_path) as again:
            assert again.stats()["episodes"] == buf.stats()["episodes"] - 1


@pytest.mark.asyncio
async def test_open_creates_then_loads_and_saves_to_its_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    buf = await EpisodeReplayBuffer.open(home, max_steps=20, seed=0, scratch_dir=tmp_path)
    e = await buf.start_episode()
    await buf.append_observation_action_reward(e, obs(e, 0), action(e, 0), 1.0, extras(0))
    await buf.save_checkpoint()
    await buf.close()
    again = await EpisodeReplayBuffer.open(home, max_steps=20, scratch_dir=tmp_path)
    assert (await again.stats())["steps"] == 1
    await again.append_observation_action_reward(e, obs(e, 1), action(e, 1), 1.0, extras(1))
    assert len(again) == 1
    with pytest.raises(ValueError, match="max_steps=21, but the checkpoint there holds"):
        await EpisodeReplayBuffer.open(home, max_steps=21, scratch_dir=tmp_path)
    await again.close()


def test_save_checkpoint_without_a_home_names_the_missing_directory(tmp_path: Path) -> None:
    with (
        SyncEpisodeReplayBuffer(10, scratch_dir=tmp_path) as buf,
        pytest.raises(ValueError, match="needs a directory"),
    ):
        buf.save_checkpoint()


def test_a_transition_checkpoint_is_refused_by_kind(tmp_path: Path) -> None:
    with ReplayBuffer("cpu", "cpu", 4, scratch_dir=tmp_path) as ring:
        ring.add({"obs": torch.zeros(2)})
        ring.save_checkpoint(tmp_path / "ring")
    with pytest.raises(CheckpointKindError, match="EpisodeReplayBuffer"):
        SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ring")


def test_links_that_disagree_with_the_episode_table_are_refused(tmp_path: Path) -> None:
    with SyncEpisodeReplayBuffer(30, seed=2, scratch_dir=tmp_path) as buf:
        fill(buf)
        buf.save_checkpoint(tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "MANIFEST.json").read_text())
    table = manifest["meta"]["episodes"]
    table[0][4] += 1  # one more step than the links hold
    (tmp_path / "ck" / "MANIFEST.json").write_text(json.dumps(seal(manifest)))
    with pytest.raises(
        CorruptCheckpointError, match=r"disagree with the episode table|does not match"
    ):
        SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ck", scratch_dir=tmp_path)
    assert not list(tmp_path.glob("replaybuf-*")), "a refused load left storage behind"


def test_a_flipped_row_byte_is_caught_by_its_checksum(tmp_path: Path) -> None:
    with SyncEpisodeReplayBuffer(30, seed=2, scratch_dir=tmp_path) as buf:
        fill(buf)
        buf.save_checkpoint(tmp_path / "ck")
    target = tmp_path / "ck" / "data" / "rows" / "observation.bin"
    data = bytearray(target.read_bytes())
    data[5] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="observation"):
        SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ck", scratch_dir=tmp_path)
    assert not list(tmp_path.glob("replaybuf-*"))


# --------------------------------------------------------------------------- asyncio snapshots
def consistent(buf: SyncEpisodeReplayBuffer) -> None:
    """Every stored step is its episode's own, in order: a torn snapshot would break this."""
    for episode_id in buf._core.episodes:
        ep = buf.get_episode(episode_id)
        steps = int(ep["length"])
        assert ep["observation"][:steps, 0].eq(episode_id).all()
        assert ep["observation"][:steps, 1].tolist() == list(range(steps))
        assert ep["action"].tolist() == [1000 * episode_id + t for t in range(steps)]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_checkpoints_taken_while_tasks_write_are_consistent_snapshots(tmp_path: Path) -> None:
    buf = EpisodeReplayBuffer(200, max_episodes=12, seed=0, scratch_dir=tmp_path)
    stop = asyncio.Event()

    async def writer(k: int) -> None:
        while not stop.is_set():
            e = await buf.start_episode(f"w{k}")
            for t in range(7 + k):
                await buf.append_observation_action_reward(
                    e, obs(e, t), action(e, t), 1.0, extras(t)
                )
                await asyncio.sleep(0)
            await buf.end_episode(e, "terminated", final_observation=final_obs(e, 7 + k))

    async def sampler() -> None:
        while not stop.is_set():
            if len(buf):
                await buf.sample_n_step(8, n=3)
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(writer(k)) for k in range(6)] + [asyncio.create_task(sampler())]
    saved = []
    for i in range(6):
        await asyncio.sleep(0.01)
        counts = (await buf.stats())["steps"]
        saved.append((await buf.save_checkpoint(tmp_path / f"ck{i}"), counts))
    stop.set()
    await asyncio.gather(*tasks)
    assert (await buf.stats())["evicted_episodes"] > 0  # evictions ran while rows were pinned
    for path, _ in saved:
        with SyncEpisodeReplayBuffer.load_checkpoint(path, scratch_dir=tmp_path) as back:
            consistent(back)
            assert back.stats()["steps"] > 0
    await buf.close()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_cancelled_save_leaves_a_loadable_checkpoint_and_a_working_buffer(
    tmp_path: Path,
) -> None:
    async with EpisodeReplayBuffer(50, seed=0, scratch_dir=tmp_path) as buf:
        e = await buf.start_episode()
        for t in range(20):
            await buf.append_observation_action_reward(e, obs(e, t), action(e, t), 1.0, extras(t))
        await buf.save_checkpoint(tmp_path / "ck")
        for step, delay in enumerate((0, 0.001, 0.005), start=20):
            task = asyncio.create_task(buf.save_checkpoint(tmp_path / "ck"))
            await asyncio.sleep(delay)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            append = buf.append_observation_action_reward(
                e, obs(e, step), action(e, step), 1.0, extras(step)
            )
            await asyncio.wait_for(append, 5)  # the lock and the rows were released
            with SyncEpisodeReplayBuffer.load_checkpoint(
                tmp_path / "ck", scratch_dir=tmp_path
            ) as back:
                consistent(back)
        assert not buf.sync._core.pinned  # rows were released after the cancelled writes ended


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_writers_needing_pinned_rows_wait_for_the_checkpoint(tmp_path: Path) -> None:
    # max_episodes=1: 8 step rows + 1 final row, all used by the first episode.
    async with EpisodeReplayBuffer(8, max_episodes=1, seed=0, scratch_dir=tmp_path) as buf:
        first = await buf.start_episode()
        for t in range(8):
            await buf.append_observation_action_reward(
                first, obs(first, t), action(first, t), 1.0, extras(t)
            )
        await buf.end_episode(first, "terminated", final_observation=final_obs(first, 8))
        buf.sync.begin_checkpoint(tmp_path / "ck")  # pin, as a save does
        buf._idle.clear()
        try:
            second = await buf.start_episode()  # evicts `first`; its rows stay pinned
            with pytest.raises(RowsPinned, match="every free row is held"):  # where it'd wait
                buf.append_observation_action_reward_nowait(
                    second, obs(second, 0), action(second, 0), 1.0, extras(0)
                )
            blocked = asyncio.create_task(
                buf.append_observation_action_reward(
                    second, obs(second, 0), action(second, 0), 1.0, extras(0)
                )
            )
            await asyncio.sleep(0.05)
            assert not blocked.done()  # no free row: it waits, having changed nothing
            assert (await buf.stats())["steps"] == 0
        finally:
            buf.sync.end_checkpoint()
            buf._idle.set()
        await asyncio.wait_for(blocked, 5)
        stats = await buf.stats()
        assert (stats["steps"], stats["evicted_episodes"]) == (1, 1)


KILL_PHASES = [
    ("after_data_chunk:2", 1),
    ("before_manifest", 1),
    ("after_manifest", 1),
    ("after_old_renamed", 2),
    ("after_publish_rename", 2),
    ("during_old_removal", 2),
]


def test_an_episode_save_killed_at_any_phase_leaves_the_old_or_the_new_buffer(
    tmp_path: Path,
) -> None:
    import os
    import subprocess
    import sys

    from buffer_crash_helper import make_episodes

    from replaybuf.persist.format import CRASH_ENV

    helper = Path(__file__).with_name("buffer_crash_helper.py")
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    phases = [phase for phase, _ in KILL_PHASES]
    result = subprocess.run(
        [sys.executable, str(helper), "episodes", str(tmp_path), *phases],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    trials = json.loads(result.stdout.splitlines()[-1])
    scratch = tmp_path / "expected"
    scratch.mkdir()
    expected = {seed: make_episodes(seed, scratch) for seed in (1, 2)}
    draws = {seed: buf.sample_n_step(6, n=3) for seed, buf in expected.items()}
    try:
        for i, ((phase, seed), trial) in enumerate(zip(KILL_PHASES, trials, strict=True)):
            assert trial["signal"] == 9, (trial, result.stderr)
            directory = tmp_path / str(i) / "ckpt"
            with SyncEpisodeReplayBuffer.load_checkpoint(directory, scratch_dir=scratch) as back:
                same_contents(expected[seed], back)  # (sampling does not change contents)
                assert (back.sample_n_step(6, n=3) == draws[seed]).all(), phase
            assert sorted(p.name for p in directory.parent.iterdir()) == ["ckpt", "scratch"]
    finally:
        for buf in expected.values():
            buf.close()
