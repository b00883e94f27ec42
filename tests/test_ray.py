"""The episode buffer as a Ray actor: collectors in other processes, a learner, checkpoints, errors.

One local Ray instance (``num_cpus=2``) serves the module. Every step written encodes where it
came from: observation ``[writer, episode, t, 0]``, final observation ``[writer, episode, T, 1]``,
action ``1_000_000 writer + 1000 episode + t``, reward ``t / 4``. So the test can list every
stored step afterwards and tell a lost, duplicated or corrupted one.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import pickle
import sys
from collections import Counter

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

ray = pytest.importorskip("ray")

from replaybuf import (  # noqa: E402 - after the skip, as the module is optional
    ArgumentTypeError,
    BufferClosedError,
    EmptyBufferError,
    EpisodeReplayBuffer,
    EpisodeStateError,
    InsufficientSpaceError,
    SchemaError,
)
from replaybuf.integrations.ray import (  # noqa: E402
    RemoteEpisodeReplayBuffer,
    pack_batch,
    unpack_batch,
)

GAMMA = 0.5  # rewards t/4 and powers of 1/2: n-step returns are exact in float32
# Episode lengths per writer (0 is an episode that ends before its first step).
LENGTHS = {0: [5, 0, 7, 3, 6, 4], 1: [4, 6, 2, 5, 3, 7, 4, 5], 2: [3, 6, 4]}
STATUS = ("terminated", "truncated")


def obs(writer: int, episode: int, t: int, final: bool = False) -> torch.Tensor:
    return torch.tensor([writer, episode, t, float(final)], dtype=torch.float32)


def action(writer: int, episode: int, t: int) -> int:
    return 1_000_000 * writer + 1000 * episode + t


def status(writer: int, episode: int) -> str:
    return STATUS[(writer + episode) % 2]


async def write_stepwise(buf, writer: int) -> list[tuple[int, int, int]]:
    """Episodes one step per call; returns ``(episode, id, length)`` per episode."""
    done = []
    for episode, length in enumerate(LENGTHS[writer]):
        eid = await buf.start_episode(f"writer-{writer}")
        for t in range(length):
            await buf.append_observation_action_reward(
                eid,
                obs(writer, episode, t),
                action(writer, episode, t),
                t / 4,
                {"logp": torch.tensor(-t / 8)},
            )
        await buf.end_episode(eid, status(writer, episode), obs(writer, episode, length, True))
        done.append((episode, eid, length))
    return done


async def write_vectorized(buf, writer: int, envs: int = 3) -> list[tuple[int, int, int]]:
    """Episodes on ``envs`` lock-step envs, one ``append_batch`` per step of all running ones."""
    queue = list(enumerate(LENGTHS[writer]))
    running: dict[int, tuple[int, int, int, int]] = {}  # env -> (episode, id, length, t)
    done = []
    while queue or running:
        for env in range(envs):
            if env not in running and queue:
                episode, length = queue.pop(0)
                running[env] = (episode, await buf.start_episode(f"writer-{writer}"), length, 0)
        for env, (episode, eid, length, t) in list(running.items()):
            if t == length:
                await buf.end_episode(eid, status(writer, episode), obs(writer, episode, t, True))
                done.append((episode, eid, length))
                del running[env]
        if running:
            steps = list(running.values())
            await buf.append_batch(
                [eid for _, eid, _, _ in steps],
                torch.stack([obs(writer, e, t) for e, _, _, t in steps]),
                torch.tensor([action(writer, e, t) for e, _, _, t in steps]),
                torch.tensor([t / 4 for *_, t in steps]),
                {"logp": torch.tensor([-t / 8 for *_, t in steps])},
            )
            running = {env: (e, i, n, t + 1) for env, (e, i, n, t) in running.items()}
    return done


@ray.remote(num_cpus=0)
class Collector:
    """A collector process: writes its episodes through a handle it received pickled."""

    async def collect(self, buf: RemoteEpisodeReplayBuffer, writer: int, vectorized: bool):
        write = write_vectorized if vectorized else write_stepwise
        return await write(buf, writer)

    async def try_start_episode(self, buf: RemoteEpisodeReplayBuffer) -> str:
        try:
            await buf.start_episode()
        except BufferClosedError as error:
            return f"BufferClosedError: {error}"
        return "no error"


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance for this module; the module ships by value (workers can't import it)."""
    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 * 1024**2,
        namespace="replaybuf-tests",
    )
    try:
        yield
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(module)


async def wait_until_dead(actor) -> None:
    """Return once calls on ``actor`` fail because it is dead (``ray.kill`` lands later)."""
    for _ in range(200):
        try:
            await actor.call.remote(("stats", (), {}))
        except ray.exceptions.RayActorError:
            return
        except BufferClosedError:
            pass  # closed, not yet dead
        await asyncio.sleep(0.05)
    raise AssertionError(f"{actor} is still alive 10 s after it was killed")


def check_transitions(batch: TensorDict, lengths: dict[tuple[int, int], int], n: int) -> None:
    """Each sampled n-step transition is the one its observation names, window and return."""
    for i in range(batch.batch_size[0]):
        writer, episode, t, final = (int(v) for v in batch["observation"][i].tolist())
        length, m = lengths[(writer, episode)], int(batch["actual_n"][i])
        cut, ended = bool(batch["cut"][i]), t + m == length  # cut: episode in progress
        assert final == 0
        assert int(batch["action"][i]) == action(writer, episode, t)
        assert 1 <= m <= min(n, length - t)
        assert m == min(n, length - t) or cut
        assert not (cut and ended)
        next_obs = obs(writer, episode, t + m, ended)
        assert batch["next_observation"][i].tolist() == next_obs.tolist()
        expected = sum(GAMMA**k * (t + k) / 4 for k in range(m))
        assert float(batch["reward"][i]) == pytest.approx(expected, abs=1e-6)
        assert bool(batch["terminated"][i]) == (ended and status(writer, episode) == "terminated")


async def write_bulk(buf, writer: int) -> list[tuple[int, int, int]]:
    """Every episode of ``writer`` started in one call, each written whole by one
    ``append_steps``, all ended by one ``end_episodes`` (statuses and finals per episode)."""
    lengths = LENGTHS[writer]
    ids = await buf.start_episodes(len(lengths), f"writer-{writer}")
    for episode, (eid, length) in enumerate(zip(ids, lengths, strict=True)):
        if length:
            await buf.append_steps(
                eid,
                torch.stack([obs(writer, episode, t) for t in range(length)]),
                torch.tensor([action(writer, episode, t) for t in range(length)]),
                torch.tensor([t / 4 for t in range(length)]),
                {"logp": torch.tensor([-t / 8 for t in range(length)])},
            )
    await buf.end_episodes(
        ids,
        [status(writer, e) for e in range(len(lengths))],
        torch.stack([obs(writer, e, n, True) for e, n in enumerate(lengths)]),
    )
    return [(e, eid, n) for e, (eid, n) in enumerate(zip(ids, lengths, strict=True))]


async def check_bulk_writes(buf, writer: int) -> None:
    """What :func:`write_bulk` stores: every step once, whole episodes, their ends."""
    done = await write_bulk(buf, writer)
    assert await stored_steps(buf) == Counter(
        (writer, e, t) for e, n in enumerate(LENGTHS[writer]) for t in range(n)
    )
    for episode, eid, length in done:
        got = await buf.get_episode(eid)
        assert got["action"].tolist() == [action(writer, episode, t) for t in range(length)]
        assert bool(got[status(writer, episode)])
        assert got["observation"][-1].tolist() == obs(writer, episode, length, True).tolist()
    with pytest.raises(EpisodeStateError):  # ended: refused, as by the local buffer
        await buf.append_steps(done[0][1], obs(0, 0, 0)[None], [0], torch.tensor([0.0]))


async def stored_steps(buf) -> Counter:
    """Every stored step once, as ``(writer, episode, t)``, by an unshuffled epoch."""
    seen: Counter = Counter()
    async for batch in buf.iterate_epochs(64, shuffle=False):
        for row in batch["observation"].tolist():
            seen[(int(row[0]), int(row[1]), int(row[2]))] += 1
    return seen


async def test_collectors_and_learner_write_and_sample_concurrently(ray_cluster, tmp_path):
    collectors = [Collector.remote(), Collector.remote()]  # their processes start meanwhile
    home = tmp_path / "replay"  # no checkpoint there yet: a new buffer that saves there
    buf = await RemoteEpisodeReplayBuffer.create(
        2_000,
        max_episodes=64,
        directory=home,
        storage="memmap",  # files in scratch_dir, whose removal at shutdown is checked
        scratch_dir=str(tmp_path),
        seed=0,
        num_cpus=1,
    )
    lengths = {(w, e): n for w, ns in LENGTHS.items() for e, n in enumerate(ns)}
    total = sum(lengths.values())
    writes: list[asyncio.Future] = []
    try:
        # Write: two collector processes (per-step and batched) and the learner itself.
        refs = [c.collect.remote(buf, w, w == 1) for w, c in enumerate(collectors)]
        remote_writes = asyncio.gather(*refs)
        own_writes = asyncio.ensure_future(write_stepwise(buf, 2))
        writes += [remote_writes, own_writes]
        await buf.wait_for_steps(10)
        snapshot = await buf.save_checkpoint(tmp_path / "while-writing", durable=False)
        sampled = 0
        while not (remote_writes.done() and own_writes.done()):
            check_transitions(await buf.sample_n_step(32, n=3, gamma=GAMMA), lengths, 3)
            sampled += 32
        ids = {
            (w, e): (eid, n)
            for w, done in enumerate([*await remote_writes, await own_writes])
            for e, eid, n in done
        }
        assert sampled > 0
        assert sorted(ids) == sorted(lengths)

        # Account: every appended step is stored exactly once; episodes are whole.
        stats = await buf.stats()
        assert stats["steps"] == stats["valid_steps"] == total
        assert (stats["episodes"], stats["in_progress"]) == (len(lengths), 0)
        assert stats["evicted_episodes"] == 0
        expected = Counter((w, e, t) for (w, e), n in lengths.items() for t in range(n))
        assert await stored_steps(buf) == expected
        episodes = {key: await buf.get_episode(eid) for key, (eid, _) in ids.items()}
        for (w, e), episode in episodes.items():
            n = lengths[(w, e)]
            assert int(episode["length"]) == n
            assert episode["observation"][-1].tolist() == obs(w, e, n, True).tolist()
            assert episode["action"].tolist() == [action(w, e, t) for t in range(n)]
            assert bool(episode["terminated"]) == (status(w, e) == "terminated")

        # Checkpoints: taken through the handle, inside the actor; both load here.
        path = await buf.save_checkpoint()
        assert path == home
        local = await EpisodeReplayBuffer.open(path, max_steps=2_000, scratch_dir=tmp_path)
        try:
            assert len(local) == total
            local_stats = await local.stats()
            for key in ("episodes", "steps", "valid_steps", "terminated", "truncated", "agents"):
                assert local_stats[key] == stats[key], key
            assert await stored_steps(local) == expected
            for key, (eid, _) in ids.items():
                assert (await local.get_episode(eid) == episodes[key]).all(), key
        finally:
            await local.close()
        early = await EpisodeReplayBuffer.load_checkpoint(snapshot, storage="tensor")
        try:
            early_steps = await stored_steps(early)  # a snapshot of one instant mid-write
            assert set(early_steps) <= set(expected)
            assert max(early_steps.values()) == 1
            assert len(early) == sum(early_steps.values()) >= 10
            for w, e in {(w, e) for w, e, _ in early_steps}:  # each episode a whole prefix
                ts = sorted(t for w2, e2, t in early_steps if (w2, e2) == (w, e))
                assert ts == list(range(len(ts)))
        finally:
            await early.close()

        # Shut down: files gone, actor gone, every handle (also a collector's copy) says so.
        assert list(tmp_path.glob("replaybuf-*")) != []
        await buf.close()
        assert list(tmp_path.glob("replaybuf-*")) == []
        with pytest.raises(BufferClosedError, match=r"stats: the buffer was shut down"):
            await buf.stats()
        reply = await collectors[0].try_start_episode.remote(buf.with_device("cpu"))
        assert reply.startswith("BufferClosedError: RemoteEpisodeReplayBuffer.start_episode")
        await wait_until_dead(buf.actor)
        reply = await collectors[1].try_start_episode.remote(RemoteEpisodeReplayBuffer(buf.actor))
        assert reply.startswith("BufferClosedError: RemoteEpisodeReplayBuffer.start_episode")
        assert "is gone" in reply
        await buf.close()  # idempotent
    finally:
        for write in writes:
            write.cancel()
        await asyncio.gather(*writes, return_exceptions=True)
        await buf.close()
        for collector in collectors:
            ray.kill(collector)


async def test_errors_come_back_as_the_buffers_own(ray_cluster, monkeypatch):
    # Room for twice this machine's RAM of 4 MiB observations (the rows are allocated lazily).
    row = torch.zeros(2**20)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    made = await asyncio.gather(  # two actor processes start side by side
        RemoteEpisodeReplayBuffer.create(0, storage="tensor", num_cpus=0),
        RemoteEpisodeReplayBuffer.create(
            2 * ram // row.nbytes,
            storage="tensor",
            name="errors",
            lifetime="detached",
            num_cpus=0,
        ),
        return_exceptions=True,
    )
    bad, buf = made
    try:
        assert isinstance(bad, ValueError)  # raised in the actor, returned as itself
        assert str(bad) == "max_steps must be >= 1, got 0"
        assert isinstance(buf, RemoteEpisodeReplayBuffer)
        eid = await buf.start_episode()
        # A first write that no RAM holds is refused before allocating, and the error (whose
        # class does not unpickle by itself) arrives whole; the buffer is unchanged.
        with pytest.raises(InsufficientSpaceError, match="not enough space") as caught:
            await buf.append_observation_action_reward(eid, row, 0, 0.0)
        assert caught.value.needed > caught.value.free
        with pytest.raises(EmptyBufferError, match="0 valid step"):
            await buf.sample_n_step(8)
        with pytest.raises(EmptyBufferError):
            async for _ in buf.iterate_epochs(8):
                pass
        await buf.append_observation_action_reward(eid, torch.zeros(3), 1, 0.5)
        with pytest.raises(SchemaError, match="'observation' expected shape"):
            await buf.append_observation_action_reward(eid, torch.zeros(4), 1, 0.5)
        with pytest.raises(EpisodeStateError, match="12345"):
            await buf.append_observation_action_reward(12345, torch.zeros(3), 1, 0.5)
        with pytest.raises(ValueError, match="status must be"):
            await buf.end_episode(eid, "finished", torch.zeros(3))
        await buf.append_observation_action_reward(eid, torch.ones(3), 2, 0.5)
        async for batch in buf.iterate_epochs(1, shuffle=False):
            assert batch["observation"].tolist() == [[0.0, 0.0, 0.0]]
            break  # leaving early drops the actor's iterator; the buffer goes on
        assert (await buf.stats())["valid_steps"] == 1
        with pytest.raises(asyncio.TimeoutError):  # cancelling the wait cancels it in the actor
            await asyncio.wait_for(buf.wait_for_steps(1000), 0.2)

        copy = pickle.loads(pickle.dumps(buf))
        assert isinstance(copy, RemoteEpisodeReplayBuffer)
        assert copy.device == buf.device
        assert (await copy.get_episode(eid))["action"].tolist() == [1, 2]
        by_name = RemoteEpisodeReplayBuffer.get("errors")  # as another job would find it
        assert (await by_name.stats())["steps"] == 2
        with pytest.raises(ValueError, match="name: no Ray actor named 'no-such-buffer'"):
            RemoteEpisodeReplayBuffer.get("no-such-buffer")
        with pytest.raises(TypeError, match="actor must be a Ray actor handle"):
            RemoteEpisodeReplayBuffer("my-buffer")
        with pytest.raises(ValueError, match="device must be"):
            buf.with_device("tpu")
        with pytest.raises(TypeError, match="unexpected keyword argument 'storag'"):
            await RemoteEpisodeReplayBuffer.create(100, storag="tensor")  # no process started

        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        with pytest.raises(BufferClosedError, match=r"sample_n_step: Ray is not running"):
            await buf.sample_n_step(1)
        monkeypatch.undo()

        ray.kill(buf.actor)  # the actor dies under the handle: a clear error, not RayActorError
        await wait_until_dead(buf.actor)
        gone = r"get_episode: the buffer actor .errors. is gone"
        with pytest.raises(BufferClosedError, match=gone):
            await buf.get_episode(eid)
    finally:
        for handle in made:
            if isinstance(handle, RemoteEpisodeReplayBuffer):
                await handle.close()
    with pytest.raises(BufferClosedError, match=r"append_batch: the buffer was shut down"):
        await buf.append_batch([eid], torch.zeros(1, 3), torch.ones(1), torch.ones(1))


def test_packed_batches_keep_keys_dtypes_and_values():
    batch = TensorDict(
        {
            "observation": torch.arange(12, dtype=torch.uint8).reshape(3, 4),
            "reward": torch.tensor([0.5, -1.0, 2.0], dtype=torch.bfloat16),
            "done": torch.tensor([True, False, True]),
            "extras": {"logp": torch.tensor([[-1.0], [0.0], [1.5]]).t().contiguous().t()},
        },
        batch_size=[3],
    )
    packed = pickle.loads(pickle.dumps(pack_batch(batch)))
    for _, leaf in packed.leaves:
        leaf.array.setflags(write=False)  # as arrays mapped from Ray's object store arrive
    back = unpack_batch(packed)
    assert back.batch_size == batch.batch_size
    assert set(back.keys(True, True)) == set(batch.keys(True, True))
    for key in batch.keys(True, True):
        assert back[key].dtype == batch[key].dtype, key
        assert torch.equal(back[key], batch[key]), key
    back["reward"] += 1  # owned, writable memory
    with pytest.raises(TypeError, match="batch must be a TensorDict"):
        pack_batch({"observation": torch.zeros(2)})


def test_small_packed_batches_pickle_in_band_and_large_ones_out_of_band():
    """Below the inline size a batch is one bytes object in the pickle (no out-of-band
    buffers for Ray to track); above it its arrays are left to Ray's zero-copy buffers."""
    from replaybuf.integrations.ray.packing import INBAND_BYTES

    for rows, in_band in ((4, True), (INBAND_BYTES // 4 + 1, False)):
        batch = TensorDict(
            {"x": torch.arange(rows, dtype=torch.float32), "y": {"z": torch.ones(rows, 2)}},
            batch_size=[rows],
        )
        packed = pack_batch(batch)
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(packed, protocol=5, buffer_callback=buffers.append)
        assert (len(buffers) == 0) == in_band
        back = unpack_batch(pickle.loads(data, buffers=buffers))
        assert torch.equal(back["x"], batch["x"])
        assert torch.equal(back["y", "z"], batch["y", "z"])


def test_in_band_batches_round_trip_every_dtype_and_never_unpickle_objects():
    """The in-band bytes hold a JSON header and raw arrays: every dtype and shape comes back
    exactly, views are aligned, and a header naming an object dtype is refused."""
    from replaybuf.integrations.ray.packing import decode_inband, encode_inband

    rows = 3
    batch = TensorDict(
        {
            "f16": torch.randn(rows, 2).half(),
            "bf16": torch.randn(rows).bfloat16(),
            "flag": torch.tensor([True, False, True]),
            "u8": torch.arange(rows * 5, dtype=torch.uint8).reshape(rows, 5),
            "i64": torch.arange(rows, dtype=torch.int64),
            "empty": torch.zeros(rows, 0),
            "deep": {"f64": torch.randn(rows, 2, 2, dtype=torch.float64)},
        },
        batch_size=[rows],
    )
    data = encode_inband(pack_batch(batch))
    packed = decode_inband(data)
    for _, leaf in packed.leaves:
        assert leaf.array.ctypes.data % max(1, leaf.array.dtype.alignment) == 0
    back = unpack_batch(packed)
    assert set(back.keys(True, True)) == set(batch.keys(True, True))
    for key in batch.keys(True, True):
        assert back[key].dtype == batch[key].dtype, key
        assert torch.equal(back[key], batch[key]), key
    head = b'{"batch_size": [1], "leaves": [[["x"], "|O", [1], "float32", 0]]}'
    forged = len(head).to_bytes(8, "little") + head + bytes(64)
    with pytest.raises(ArgumentTypeError, match="cannot hold objects"):
        decode_inband(forged)


def test_batches_with_objects_leave_their_objects_to_ray():
    """Text and other objects are not in-band: the batch pickles as itself."""
    batch = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    batch.set("text", NonTensorStack("a", "b"))
    packed = pack_batch(batch)
    assert packed.__reduce__()[0] is type(packed)
    back = unpack_batch(pickle.loads(pickle.dumps(packed)))
    assert back.get("text").tolist() == ["a", "b"]


def test_without_ray_the_module_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` sees without the extra
    monkeypatch.delitem(sys.modules, "replaybuf.integrations.ray")
    with pytest.raises(ImportError, match=r"pip install 'replaybuf\[ray\]'"):
        importlib.import_module("replaybuf.integrations.ray")


async def test_bulk_calls_store_what_they_store_locally(ray_cluster):
    buf = await RemoteEpisodeReplayBuffer.create(200, 16, storage="tensor", num_cpus=0)
    try:
        await check_bulk_writes(buf, 1)
    finally:
        await buf.close()
