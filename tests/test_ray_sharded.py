"""The sharded episode buffer on Ray: K buffer actors behind one handle, sampled as one.

One local Ray instance (``num_cpus=2``) serves the module. Steps encode where they came from
(the scheme of ``tests/test_ray.py``, whose writers and checks are reused), so every sampled
window is checked against what was written, whatever shard it came from.
"""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import sys
from collections import Counter

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

import test_ray  # noqa: E402 - after the skip: its writers and checks
from test_ray import (  # noqa: E402
    GAMMA,
    LENGTHS,
    action,
    check_bulk_writes,
    check_transitions,
    obs,
    stored_steps,
    write_stepwise,
    write_vectorized,
)

from replaybuf import (  # noqa: E402
    ArgumentError,
    ArgumentTypeError,
    CheckpointKindError,
    CorruptCheckpointError,
    EpisodeStateError,
    IndexOutOfRangeError,
    NoCheckpointError,
    ReplayBufError,
)
from replaybuf.integrations.ray import (  # noqa: E402
    ShardedEpisodeReplayBuffer,
    ShardUnavailableError,
)

OPTIONS = {"storage": "tensor", "num_cpus": 0}  # actors take no CPU: 2 cores, many actors


@ray.remote(num_cpus=0)
class Collector:
    """A collector process writing through a sharded handle it received pickled."""

    async def collect(self, buf: ShardedEpisodeReplayBuffer, writer: int, vectorized: bool):
        write = write_vectorized if vectorized else write_stepwise
        return await write(buf, writer)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance for this module; test modules ship by value."""
    modules = [sys.modules[__name__], test_ray]
    for module in modules:
        ray.cloudpickle.register_pickle_by_value(module)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 * 1024**2,
        namespace="replaybuf-sharded-tests",
    )
    try:
        yield
    finally:
        ray.shutdown()
        for module in modules:
            ray.cloudpickle.unregister_pickle_by_value(module)


async def until_dead(actor) -> None:
    """Return once ``actor`` is dead (``ray.kill`` lands a little later)."""
    for _ in range(200):
        try:
            await actor.mass.remote("steps")
        except ray.exceptions.RayActorError:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{actor} is still alive 10 s after it was killed")


async def test_collectors_write_while_a_learner_samples_then_epochs_and_checkpoints(
    ray_cluster, tmp_path
):
    collectors = [Collector.remote(), Collector.remote()]
    home = tmp_path / "sharded"
    buf = await ShardedEpisodeReplayBuffer.create(
        3, 600, max_episodes_per_shard=32, directory=home, seed=0, **OPTIONS
    )
    lengths = {(w, e): n for w, ns in LENGTHS.items() for e, n in enumerate(ns)}
    total = sum(lengths.values())
    try:
        refs = [c.collect.remote(buf, w, w == 1) for w, c in enumerate(collectors)]
        remote_writes = asyncio.gather(*refs)
        own_writes = asyncio.ensure_future(write_stepwise(buf, 2))
        await buf.wait_for_steps(10)
        sampled = 0
        while not (remote_writes.done() and own_writes.done()):
            check_transitions(await buf.sample_n_step(32, n=3, gamma=GAMMA), lengths, 3)
            sampled += 32
        done = [*await remote_writes, await own_writes]
        ids = {(w, e): eid for w, eps in enumerate(done) for e, eid, _ in eps}
        assert sampled > 0
        assert sorted(ids) == sorted(lengths)
        assert len(set(ids.values())) == len(ids)  # global ids are unique

        # Every step once, in the shards its episodes went to, and whole episodes back.
        stats = await buf.stats()
        assert stats["steps"] == stats["valid_steps"] == total
        assert stats["episodes"] == len(lengths)
        assert stats["num_shards"] == 3
        assert sum(s["episodes"] for s in stats["shards"]) == len(lengths)
        assert min(s["episodes"] for s in stats["shards"]) >= 3  # round-robin spreads them
        expected = Counter((w, e, t) for (w, e), n in lengths.items() for t in range(n))
        assert await stored_steps(buf) == expected
        for (w, e), eid in ids.items():
            episode = await buf.get_episode(eid)
            assert episode["action"].tolist() == [action(w, e, t) for t in range(lengths[w, e])]
            assert int(episode["episode_id"]) == eid
        check_transitions(await buf.sample_n_step(256, n=2, gamma=GAMMA), lengths, 2)
        windows = await buf.sample_sequences(16, 3)
        for row in range(16):
            writer, episode, t0, _ = windows["observation"][row, 0].tolist()
            assert windows["episode_id"][row, 0] == ids[int(writer), int(episode)]
            steps = [action(int(writer), int(episode), int(t0) + t) for t in range(3)]
            assert windows["action"][row].tolist() == steps
        warmed = await buf.sample_sequences(16, 3, burn_in=2)  # 2 steps before each start
        assert warmed.batch_size == (16, 5)
        assert warmed["is_burn_in"].tolist() == [[True, True, False, False, False]] * 16
        for row in range(16):
            writer, episode, t0, _ = warmed["observation"][row, 2].tolist()
            for j in range(5):
                t = int(t0) + j - 2
                assert bool(warmed["mask"][row, j]) == (t >= 0)
                if t >= 0:
                    assert warmed["action"][row, j] == action(int(writer), int(episode), t)

        # Epochs: each step exactly once per epoch, shuffled across shards, batches full.
        seen: Counter = Counter()
        sizes = []
        async for batch in buf.iterate_epochs(10, n_epochs=2):
            sizes.append(batch.batch_size[0])
            check_transitions(batch, lengths, 1)
            seen.update(tuple(int(v) for v in row[:3]) for row in batch["observation"].tolist())
        assert seen == Counter({key: 2 for key in expected})
        assert sizes == ([10] * (total // 10) + [total % 10]) * 2
        epochs = buf.iterate_epochs(30)
        assert len({int(i) % 3 for i in (await anext(epochs))["episode_id"]}) > 1
        await epochs.aclose()  # leaving early drops the shards' iterators

        # Checkpoint, restore onto 3 new shards: the same state.
        assert await buf.save_checkpoint() == home
        manifest = json.loads((home / "SHARDS.json").read_text())
        assert manifest["num_shards"] == 3
        assert manifest["generation"] == 1
        await buf.save_checkpoint()  # generation 2 replaces 1, whose folders are removed
        assert sorted(p.name for p in (home / "shard-0").iterdir()) == ["g000002"]
        episodes = {key: await buf.get_episode(eid) for key, eid in ids.items()}
        restored = await ShardedEpisodeReplayBuffer.open(home, storage="tensor", num_cpus=0)
        try:
            again = await restored.stats()
            for key in ("episodes", "steps", "valid_steps", "terminated", "truncated", "agents"):
                assert again[key] == stats[key], key
            assert [s["steps"] for s in again["shards"]] == [s["steps"] for s in stats["shards"]]
            assert await stored_steps(restored) == expected
            for key, eid in ids.items():
                assert (await restored.get_episode(eid) == episodes[key]).all(), key

            # A shard that dies names itself at the next call.
            ray.kill(restored.actors[2], no_restart=True)
            await until_dead(restored.actors[2])
            with pytest.raises(ShardUnavailableError, match=r"stats: shard 2 of 3 is gone") as e:
                await restored.stats()
            assert e.value.shard == 2
            assert isinstance(e.value, ReplayBufError)
        finally:
            await restored.close()
    finally:
        await buf.close()
        for collector in collectors:
            ray.kill(collector)


def chi_square_bound(df: int) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


async def test_samples_are_uniform_over_the_steps_of_shards_of_very_different_sizes(ray_cluster):
    buf = await ShardedEpisodeReplayBuffer.create(3, 400, seed=1, **OPTIONS)
    try:
        ids = [await buf.start_episode() for _ in range(3)]
        length = {eid: (4, 30, 150)[eid % 3] for eid in ids}  # shard 0: 4 steps, 2: 150
        for eid in ids:
            for t in range(length[eid]):
                await buf.append_observation_action_reward(eid, torch.tensor([eid, t]), t, 0.0)
            await buf.end_episode(eid, "terminated", torch.tensor([eid, -1]))
        counts: Counter = Counter()
        rounds = 60
        for _ in range(rounds):
            batch = await buf.sample_n_step(256)
            assert torch.equal(batch["episode_id"], batch["observation"][:, 0])
            counts.update(map(tuple, batch["observation"].tolist()))
        steps = [(eid, t) for eid in ids for t in range(length[eid])]
        assert set(counts) == set(steps)
        mean = rounds * 256 / len(steps)
        chi2 = sum((counts[s] - mean) ** 2 / mean for s in steps)
        assert chi2 < chi_square_bound(len(steps) - 1), chi2
        # And the first rows of a batch are as uniform as the whole (rows are shuffled).
        heads = Counter()
        for _ in range(20):
            heads.update(int(e) % 3 for e in (await buf.sample_n_step(256))["episode_id"][:64])
        assert heads[0] < heads[1] < heads[2]
        distinct = await buf.sample_n_step(184, replace=False)
        assert len(set(map(tuple, distinct["observation"].tolist()))) == 184
    finally:
        await buf.close()


async def test_priorities_route_to_shards_and_weights_follow_the_union(ray_cluster, tmp_path):
    home = tmp_path / "per"
    buf = await ShardedEpisodeReplayBuffer.create(
        2,
        200,
        directory=home,
        seed=2,
        prioritized=True,
        alpha=0.5,
        beta=0.6,
        max_restarts=1,
        **OPTIONS,
    )
    try:
        eids = [await buf.start_episode() for _ in range(4)]
        for t in range(10):
            await buf.append_batch(eids, torch.zeros(4, 2) + t, torch.arange(4), torch.ones(4))
        for eid in eids:
            await buf.end_episode(eid, "truncated", torch.zeros(2))
        index = torch.cat([b["index"] async for b in buf.iterate_epochs(16)])
        assert index.numel() == 40
        assert index.unique().numel() == 40
        priority = torch.arange(1, 41, dtype=torch.float64)  # p_i for the i-th id
        by_id = dict(zip(index.tolist(), priority.tolist(), strict=True))
        assert await buf.update_priorities(index, priority) == 40
        weights = {i: (p + 1e-6) ** 0.5 for i, p in by_id.items()}
        smallest = min(weights.values())
        batch = await buf.sample_n_step(512)
        expected = [(weights[i] / smallest) ** -0.6 for i in batch["index"].tolist()]
        assert batch["weight"].double().tolist() == pytest.approx(expected, rel=1e-5)
        share = sum(weights[i] for i in by_id if i % 2 == 0) / sum(weights.values())
        assert abs(float((batch["index"] % 2 == 0).double().mean()) - share) < 0.08

        # Bad input: clear errors naming the argument.
        with pytest.raises(IndexOutOfRangeError, match="index: id -1") as e:
            await buf.update_priorities(torch.tensor([-1]), 1.0)
        assert e.value.argument == "index"
        with pytest.raises(ArgumentError, match="priority must have one value per index"):
            await buf.update_priorities(index[:3], [1.0])
        with pytest.raises(EpisodeStateError, match=r"episode_id 1000001 \(shard 1 of 2") as e:
            await buf.append_observation_action_reward(1_000_001, torch.zeros(2), 0, 0.0)
        assert e.value.argument == "episode_id"
        with pytest.raises(ArgumentTypeError, match="episode_id must be an int"):
            await buf.end_episode("7", "terminated", torch.zeros(2))

        # A restarted shard comes back from its last checkpoint; what came after is lost.
        await buf.save_checkpoint()
        before = (await buf.stats())["shards"]
        late = await buf.start_episode()  # written after the checkpoint
        shard = late % 2
        await buf.append_observation_action_reward(late, torch.zeros(2), 0, 0.0)
        ray.kill(buf.actors[shard], no_restart=False)
        unavailable: set[int | None] = set()
        for _ in range(400):  # until the restarted actor answers, loaded from the checkpoint
            try:
                after = (await buf.stats())["shards"]
                if await buf.actors[shard].start.remote() is not None:
                    break
            except ShardUnavailableError as error:
                unavailable.add(error.shard)
            except ray.exceptions.RayActorError:
                pass  # the direct actor call, while the actor restarts
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the killed shard did not come back")
        assert unavailable <= {shard}  # if a call failed meanwhile, it named the shard
        assert after[shard]["steps"] == before[shard]["steps"]
        assert after[shard]["episodes"] == before[shard]["episodes"]
        assert (await buf.sample_n_step(64))["weight"].max() <= 1
        copy = pickle.loads(pickle.dumps(buf))
        assert copy.num_shards == 2
        assert (await copy.stats())["steps"] == 40
    finally:
        await buf.close()


async def test_bad_arguments_and_checkpoints_are_refused_clearly(tmp_path):
    with pytest.raises(ArgumentError, match="num_shards must be an int >= 1, got 0") as e:
        await ShardedEpisodeReplayBuffer.create(0, 100)
    assert e.value.argument == "num_shards"
    with pytest.raises(TypeError, match="unexpected keyword argument 'storag'"):
        await ShardedEpisodeReplayBuffer.create(2, 100, storag="tensor")
    with pytest.raises(NoCheckpointError, match=r"SHARDS\.json is missing"):
        await ShardedEpisodeReplayBuffer.open(tmp_path)
    with pytest.raises(ArgumentError, match="needs max_steps_per_shard"):
        await ShardedEpisodeReplayBuffer.open(tmp_path, num_shards=2)
    manifest = {
        "format": "replaybuf.sharded",
        "format_version": 1,
        "kind": "ShardedEpisodeReplayBuffer",
        "shard_kind": "EpisodeReplayBuffer",
        "num_shards": 2,
        "generation": 1,
        "shards": ["shard-0/g000001", "shard-1/g000001"],
        "max_steps_per_shard": 100,
    }
    (tmp_path / "SHARDS.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointKindError, match="a checkpoint of 2 shards, num_shards=3"):
        await ShardedEpisodeReplayBuffer.open(tmp_path, num_shards=3)
    with pytest.raises(CorruptCheckpointError, match=r"shard 0's checkpoint .* is missing"):
        await ShardedEpisodeReplayBuffer.open(tmp_path)
    for k in range(2):
        (tmp_path / f"shard-{k}/g000001").mkdir(parents=True)
        (tmp_path / f"shard-{k}/g000001/MANIFEST.json").write_text('{"kind": "ReplayBuffer"}')
    with pytest.raises(CheckpointKindError, match="shard 0 holds a checkpoint of kind"):
        await ShardedEpisodeReplayBuffer.open(tmp_path)
    (tmp_path / "SHARDS.json").write_text(json.dumps({**manifest, "kind": "ReplayBuffer"}))
    with pytest.raises(CheckpointKindError, match="of kind 'ReplayBuffer'"):
        await ShardedEpisodeReplayBuffer.open(tmp_path)
    (tmp_path / "SHARDS.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="not a readable JSON manifest"):
        await ShardedEpisodeReplayBuffer.open(tmp_path)
    assert obs(0, 0, 0).shape == (4,)  # the reused writers' observation layout


def test_packed_batches_merge_as_their_tensordicts_would():
    """The one-pass merge of packed shard batches gives the rows, ids and weights (and the
    shuffle) of slicing, globalizing, rescaling and merging their TensorDicts; text fields
    leave it to the TensorDicts."""
    from tensordict import NonTensorStack, TensorDict

    from replaybuf.integrations.ray.packing import pack_batch, unpack_batch
    from replaybuf.integrations.ray.shard_routing import (
        globalize,
        merge,
        merge_packed,
        rescale_weights,
    )

    def batch(rows: int, tail: tuple[int, ...], seed: int) -> TensorDict:
        g = torch.Generator().manual_seed(seed)
        shape = (rows, *tail)
        return TensorDict(
            {
                "observation": torch.randn(*shape, 3, generator=g),
                "next": {"reward": torch.randn(*shape, generator=g).to(torch.bfloat16)},
                "done": torch.rand(*shape, generator=g) < 0.5,
                "episode_id": torch.randint(0, 50, shape, generator=g),
                "index": torch.randint(0, 500, shape, generator=g),
                "weight": torch.rand(*shape, generator=g),
            },
            batch_size=shape,
        )

    for tail in ((), (4,)):
        for takes in ([(0, 7, 1.0)], [(0, 7, 1.0), (1, 5, 0.37)], [(0, 3, 0.8), (0, 2, 0.8)]):
            parts = [
                (pack_batch(batch(9, tail, i)), rows, s, f) for i, (s, rows, f) in enumerate(takes)
            ]
            fast = merge_packed(parts, 3, np.random.default_rng(5), torch.device("cpu"))
            pieces = [
                rescale_weights(globalize(unpack_batch(p)[:rows], s, 3), f)
                for p, rows, s, f in parts
            ]
            slow = merge(pieces, np.random.default_rng(5))
            assert fast is not None
            assert fast.batch_size == slow.batch_size
            assert set(fast.keys(True, True)) == set(slow.keys(True, True))
            for key in slow.keys(True, True):
                assert fast[key].dtype == slow[key].dtype, key
                assert torch.equal(fast[key], slow[key]), key
            fast["observation"][0] = 0  # owns writable memory
    texts = batch(4, (), 0)
    texts["note"] = NonTensorStack(*"abcd")
    packed = [(pack_batch(texts), 4, 0, 1.0), (pack_batch(texts), 2, 1, 1.0)]
    assert merge_packed(packed, 2, np.random.default_rng(0), torch.device("cpu")) is None


async def test_bulk_calls_deal_episodes_round_robin_and_end_them_per_shard(ray_cluster):
    buf = await ShardedEpisodeReplayBuffer.create(
        3, 200, max_episodes_per_shard=16, seed=0, **OPTIONS
    )
    try:
        first = await buf.start_episode()  # the round-robin goes on from where it was
        ids = await buf.start_episodes(4)
        assert [eid % 3 for eid in ids] == [(first + 1 + i) % 3 for i in range(4)]
        await buf.end_episodes(ids, "truncated", torch.zeros(4, 4))
        await check_bulk_writes(buf, 1)
        with pytest.raises(ArgumentError, match="statuses"):  # checked before any round trip
            await buf.end_episodes([5, 6], ["terminated"], torch.zeros(2, 4))
        with pytest.raises(EpisodeStateError, match=r"episode_ids \[3001\] \(shard 1 of 3\)"):
            await buf.end_episodes([3001], "terminated", torch.zeros(1, 4))
    finally:
        await buf.close()
