"""A random-program driver: one operation on an episode buffer and on the reference model,
then a check that they agree. Shared by the plain and the frame-stacking property tests."""

from __future__ import annotations

import pytest
import torch
from episode_helpers import (
    assert_counts_agree,
    assert_episode_record,
    assert_nstep_batch,
    assert_sequence_batch,
    batch_of,
    final_obs,
    pairs_of,
    step,
)
from reference import ReferenceBuffer

from replaybuf import EmptyBufferError, EpisodeStateError, SyncEpisodeReplayBuffer


def reference_for(buf: SyncEpisodeReplayBuffer) -> ReferenceBuffer:
    """The reference for ``buf``: its limits, its documented row budget and its stacking."""
    return ReferenceBuffer(
        buf.max_steps,
        buf.max_episodes,
        row_capacity=buf.stats()["rows"],
        frame_stack=buf.frame_stack,
        padding=buf.frame_stack_padding,
    )


class Program:
    """Applies one operation to the buffer and to the reference, then checks they agree."""

    def __init__(self, buf: SyncEpisodeReplayBuffer) -> None:
        self.buf = buf
        self.ref = reference_for(buf)
        self.ends_sampled = False  # an n-step batch held a window reaching an episode end
        # One observation is float32[3]; with frame stacking, k of them.
        self.obs_shape = (3,) if buf.frame_stack is None else (buf.frame_stack, 3)

    def running(self) -> list[int]:
        return [e for e, ep in self.ref.episodes.items() if not ep.ended]

    def both(self, buf_call, ref_call) -> None:
        """Run both; the reference refusing (no room) means the buffer must refuse unchanged."""
        before = self.buf.stats()
        try:
            ref_call()
        except ValueError:
            with pytest.raises(ValueError, match="cannot make room"):
                buf_call()
            assert self.buf.stats() == before
            return
        buf_call()

    def start(self, agent: str) -> None:
        e = self.buf.start_episode(agent)
        assert e == self.ref.start(agent)

    def append(self, pick: int, count: int = 1) -> None:
        """``count`` steps to one running episode (started first if none runs)."""
        if not self.running():
            self.start("a")
        running = self.running()
        e = running[pick % len(running)]
        for _ in range(count):
            o, a, r, x = step(e, self.ref.episodes[e].steps)
            self.both(
                lambda: self.buf.append_observation_action_reward(e, o, a, r, x),  # noqa: B023
                lambda: self.ref.append([e], [o], [a], [r], [x]),  # noqa: B023
            )

    def append_batch(self, picks: list[int], repeats: int = 1) -> None:
        """``repeats`` batches of the same episodes (a vectorized env's run of calls)."""
        for _ in range(repeats):
            running = self.running()
            ids = sorted({running[p % len(running)] for p in picks}) if running else []
            if not ids:
                return
            steps = [step(e, self.ref.episodes[e].steps) for e in ids]
            args = batch_of(steps)
            self.both(
                lambda: self.buf.append_batch(ids, *args),  # noqa: B023
                lambda: self.ref.append(ids, *(list(col) for col in zip(*steps, strict=True))),  # noqa: B023
            )

    def end(self, pick: int, status: str) -> None:
        running = self.running()
        if running:
            e = running[pick % len(running)]
            final = final_obs(e, self.ref.episodes[e].steps)
            self.both(
                lambda: self.buf.end_episode(e, status, final_observation=final),
                lambda: self.ref.end(e, status, final),
            )

    def start_many(self, count: int) -> None:
        """``start_episodes`` (at most max_episodes at once)."""
        count = min(count, self.buf.max_episodes or count)
        ids = self.buf.start_episodes(count)
        assert ids == [self.ref.start("default") for _ in range(count)]

    def end_many(self, picks: list[int], statuses: list[str]) -> None:
        """``end_episodes`` of some running episodes, a status each (or one for all)."""
        running = self.running()
        ids = sorted({running[p % len(running)] for p in picks}) if running else []
        if not ids:
            return
        each = [statuses[i % len(statuses)] for i in range(len(ids))]
        finals = [final_obs(e, self.ref.episodes[e].steps) for e in ids]
        given = each[0] if len(set(each)) == 1 else each
        self.both(
            lambda: self.buf.end_episodes(ids, given, torch.stack(finals)),
            lambda: self.ref.end_many(ids, each, finals),
        )

    def sample_all(self, n: int, gamma: float) -> None:
        if len(self.ref.valid_pairs()) == 0:
            with pytest.raises(EmptyBufferError, match="0 valid step"):
                self.buf.sample_n_step(1, n, gamma)
            return
        batch = self.buf.sample_n_step(len(self.buf) + 3, n, gamma, replace=False)
        pairs = pairs_of(batch)
        assert len(pairs) == len(set(pairs))
        assert set(pairs) == self.ref.valid_pairs()  # every valid step once, nothing evicted
        assert batch["observation"].shape[1:] == self.obs_shape
        assert_nstep_batch(batch, self.ref, n, gamma)
        self.seen(batch)

    def sample(self, n, gamma: float) -> None:
        if self.ref.valid_steps:
            batch = self.buf.sample_n_step(16, n, gamma)
            assert_nstep_batch(batch, self.ref, n, gamma)
            self.seen(batch)

    def sequences(self, length: int, strict: bool) -> None:
        if not self.ref.valid_steps:
            return
        if strict and not self.ref.sequence_starts(length):
            with pytest.raises(EmptyBufferError, match="consecutive steps"):
                self.buf.sample_sequences(4, length, strict=True)
            return
        batch = self.buf.sample_sequences(6, length, strict=strict)
        assert batch["observation"].shape == (6, length, *self.obs_shape)
        assert_sequence_batch(batch, self.ref, length)
        if strict:
            assert batch["mask"].all()

    def episode(self, pick: int) -> None:
        if not self.ref.next_id:
            return
        e = pick % self.ref.next_id
        if e in self.ref.episodes:
            assert_episode_record(self.buf.get_episode(e), self.ref, e)
        else:
            with pytest.raises(EpisodeStateError, match=f"episode {e}: it was evicted"):
                self.buf.get_episode(e)
            if e in self.ref.evicted_ids:
                o, a, r, x = step(e, 0)
                with pytest.raises(EpisodeStateError, match=f"append to episode {e}: .*evicted"):
                    self.buf.append_observation_action_reward(e, o, a, r, x)

    def sample_episodes(self, k: int) -> None:
        if not self.ref.episodes:
            with pytest.raises(EmptyBufferError, match="holds none"):
                self.buf.sample_episodes(k)
            return
        records = self.buf.sample_episodes(k)
        ids = [int(r["episode_id"]) for r in records]
        assert len(ids) == min(k, len(self.ref.episodes)) == len(set(ids))
        for record, e in zip(records, ids, strict=True):
            assert_episode_record(record, self.ref, e)

    def epochs(self, batch_size: int, n: int) -> None:
        valid = self.ref.valid_pairs()
        if not valid:
            return
        per_epoch = -(-len(valid) // batch_size)
        batches = list(self.buf.iterate_epochs(batch_size, 2, n=n, gamma=0.9))
        assert len(batches) == 2 * per_epoch
        for epoch in range(2):
            chunk = batches[epoch * per_epoch : (epoch + 1) * per_epoch]
            visited = [p for b in chunk for p in pairs_of(b)]
            assert sorted(visited) == sorted(valid)
            for b in chunk:
                assert_nstep_batch(b, self.ref, n, 0.9)
                self.seen(b)

    def seen(self, batch) -> None:
        self.ends_sampled |= bool((batch["terminated"] | batch["truncated"]).any())

    def check(self) -> None:
        assert_counts_agree(self.buf, self.ref)
