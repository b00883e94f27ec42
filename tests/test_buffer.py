"""ReplayBuffer: writes, ring semantics, sampling, introspection and lifecycle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from replay_helpers import ACTION_DIM, OBS_DIM, ids_of, rows, transition
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

import replaybuf.buffers.ring
from replaybuf import BufferClosedError, FieldSpec, ReplayBuffer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ----------------------------------------------------------------- writes
def test_add_stores_one_transition_per_call(make_buffer, storage):
    buf = make_buffer(8, storage=storage)
    for k in range(3):
        buf.add(transition(k))
    assert len(buf) == 3
    assert ids_of(buf.sample_all()) == [0, 1, 2]


def test_add_batch_stores_every_row_in_order(make_buffer, storage):
    buf = make_buffer(8, storage=storage)
    buf.add_batch(rows(0, 3))
    buf.add_batch(rows(3, 2))
    assert len(buf) == 5
    assert ids_of(buf.sample_all()) == [0, 1, 2, 3, 4]


def test_add_accepts_a_dict_of_tensors_arrays_and_python_numbers(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    buf.add({"obs": np.ones(3, dtype=np.float32), "reward": 1.5, "done": True, "step": 7})
    buf.add({"obs": torch.zeros(3), "reward": 2, "done": False, "step": np.int64(8)})
    stored = buf.sample_all()
    assert stored["obs"].dtype == torch.float32
    assert torch.equal(stored["obs"], torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert stored["reward"].dtype == torch.float32
    assert stored["reward"].tolist() == [1.5, 2.0]
    assert stored["done"].tolist() == [True, False]
    assert stored["step"].dtype == torch.int64
    assert stored["step"].tolist() == [7, 8]


def test_add_batch_accepts_a_dict_of_numpy_arrays(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    buf.add_batch(
        {
            "obs": np.arange(6, dtype=np.float32).reshape(3, 2),
            "done": np.array([True, False, True]),
            "next": {"obs": np.zeros((3, 2), dtype=np.float32)},
        }
    )
    stored = buf.sample_all()
    assert torch.equal(stored["obs"], torch.arange(6.0).reshape(3, 2))
    assert stored["done"].tolist() == [True, False, True]
    assert stored["next", "obs"].shape == (3, 2)


def test_add_batch_and_add_mix_on_the_same_spec(make_buffer, storage):
    buf = make_buffer(8, storage=storage)
    buf.add_batch(rows(0, 2))
    buf.add({"obs": torch.full((OBS_DIM,), 2.0), **_rest_of_row(2)})
    assert ids_of(buf.sample_all()) == [0, 1, 2]


def _rest_of_row(k: int) -> dict:
    return {
        "action": torch.full((ACTION_DIM,), -float(k)),
        "reward": k / 2,
        "done": k % 2 == 0,
        "next": {"obs": torch.full((OBS_DIM,), k + 1.0)},
    }


def test_nested_keys_are_stored_and_returned_nested(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    buf.add_batch(
        TensorDict({"a": {"b": {"c": torch.arange(3.0)}}, "x": torch.ones(3)}, batch_size=[3])
    )
    stored = buf.sample_all()
    assert torch.equal(stored["a", "b", "c"], torch.arange(3.0))
    assert ("a", "b", "c") in buf.spec


def test_a_dict_may_hold_nested_tensordicts(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    buf.add({"obs": torch.zeros(3), "next": TensorDict({"obs": torch.ones(3)}, batch_size=[])})
    buf.add_batch({"obs": torch.zeros(2, 3), "next": TensorDict({"obs": torch.ones(2, 3)}, [2])})
    assert len(buf) == 3
    assert torch.equal(buf.sample_all()["next", "obs"], torch.ones(3, 3))


def test_add_batch_of_zero_rows_changes_nothing(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    buf.add_batch(rows(0, 0))
    assert len(buf) == 0
    assert buf.spec is None
    buf.add({"other": torch.zeros(2)})  # the empty batch did not fix the spec
    assert len(buf) == 1


def test_add_stores_a_copy_not_the_callers_tensor(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    batch = rows(0, 2)
    buf.add_batch(batch)
    batch["obs"].fill_(99.0)
    assert ids_of(buf.sample_all()) == [0, 1]
    assert "index" not in batch


def test_add_stores_detached_values_of_tensors_that_require_grad(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    obs = torch.ones(2, 3, requires_grad=True)
    buf.add_batch({"obs": obs * 2})
    stored = buf.sample_all()["obs"]
    assert not stored.requires_grad
    assert torch.equal(stored, torch.full((2, 3), 2.0))


def test_writes_after_the_first_store_detached_values_of_tensors_that_require_grad(
    make_buffer, storage
):
    # Once the spec is fixed, exact batches skip to_leaves (FieldSpec.match): still detached.
    buf = make_buffer(4, storage=storage)
    buf.add_batch({"obs": torch.zeros(1, 3)})
    obs = torch.ones(2, 3, requires_grad=True)
    buf.add_batch(TensorDict({"obs": obs * 2}, batch_size=[2]))
    buf.add({"obs": obs[0] * 3})
    stored = buf.sample_all()["obs"]
    assert not stored.requires_grad
    assert stored.tolist() == [[0.0] * 3, [2.0] * 3, [2.0] * 3, [3.0] * 3]


def test_exact_writes_skip_the_general_conversion_and_check(make_buffer, storage, monkeypatch):
    buf = make_buffer(8, storage=storage)
    buf.add_batch(rows(0, 2))

    def general_path(*args, **kwargs):
        raise AssertionError("an exact write took the general path")

    monkeypatch.setattr(replaybuf.buffers.ring, "to_leaves", general_path)
    monkeypatch.setattr(FieldSpec, "check", general_path)
    buf.add_batch(rows(2, 3))  # a TensorDict
    buf.add_batch(rows(5, 2).to_dict())  # a nested dict of tensors
    buf.add(transition(7))
    assert ids_of(buf.sample_all()) == list(range(8))
    monkeypatch.undo()
    buf.add_batch({**rows(8, 2).to_dict(), "reward": np.array([4.0, 4.5], np.float32)})
    assert ids_of(buf.sample_all()) == list(range(2, 10))  # numpy: the general path


def test_add_batch_accepts_non_contiguous_tensors(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    obs = torch.arange(12.0).reshape(3, 4).t()  # [4, 3], not contiguous
    buf.add_batch({"obs": obs})
    assert torch.equal(buf.sample_all()["obs"], obs)


# ----------------------------------------------------------------- ring semantics
def test_wrap_around_overwrites_the_oldest_and_pointer_holds_the_oldest(make_buffer, storage):
    buf = make_buffer(5, storage=storage)
    for k in range(7):
        buf.add(transition(k))
    assert len(buf) == 5
    assert buf.pointer == 2
    assert ids_of(buf.sample_by_index([buf.pointer])) == [2]  # slot `pointer` holds the oldest
    assert ids_of(buf.sample_by_index(range(5))) == [5, 6, 2, 3, 4]  # slots in storage order
    assert ids_of(buf.sample_all()) == [2, 3, 4, 5, 6]  # oldest first


def test_pointer_is_the_next_slot_before_the_buffer_is_full(make_buffer, storage):
    buf = make_buffer(5, storage=storage)
    assert buf.pointer == 0
    buf.add_batch(rows(0, 3))
    assert buf.pointer == 3
    buf.add_batch(rows(3, 2))
    assert buf.pointer == 0
    assert len(buf) == 5


def test_add_batch_larger_than_capacity_keeps_the_newest_rows(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    buf.add_batch(rows(0, 1))
    buf.add_batch(rows(1, 10))
    assert len(buf) == 4
    assert buf.pointer == 11 % 4
    assert ids_of(buf.sample_all()) == [7, 8, 9, 10]
    assert ids_of(buf.sample_by_index([buf.pointer])) == [7]


def test_slot_layout_does_not_depend_on_how_writes_are_chunked(make_buffer, storage):
    one_by_one = make_buffer(4, storage=storage)
    one_batch = make_buffer(4, storage=storage)
    for k in range(1, 11):
        one_by_one.add(transition(k))
    one_batch.add_batch(rows(1, 10))
    assert one_by_one.pointer == one_batch.pointer == 2
    slots = range(4)
    assert ids_of(one_batch.sample_by_index(slots)) == ids_of(one_by_one.sample_by_index(slots))
    assert len(one_batch.memory) == 4


def test_add_batch_exactly_the_capacity_replaces_everything(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    buf.add_batch(rows(0, 3))
    buf.add_batch(rows(3, 4))
    assert buf.pointer == 3
    assert ids_of(buf.sample_all()) == [3, 4, 5, 6]


@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(1, 9),
    chunks=st.lists(st.integers(0, 13), max_size=6),
    storage_kind=st.sampled_from(["memmap", "tensor"]),
)
def test_ring_keeps_the_newest_capacity_rows_oldest_first(capacity, chunks, storage_kind):
    written: list[int] = []
    with ReplayBuffer("cpu", "cpu", capacity, storage=storage_kind, seed=0) as buf:
        for count in chunks:
            buf.add_batch(rows(len(written), count))
            written.extend(range(len(written), len(written) + count))
            kept = written[-capacity:]
            assert len(buf) == len(kept)
            assert buf.pointer == len(written) % capacity
            if kept:
                assert ids_of(buf.sample_all()) == kept
            if len(kept) == capacity:
                assert ids_of(buf.sample_by_index([buf.pointer])) == [kept[0]]


# ----------------------------------------------------------------- sampling
def test_sample_batch_returns_batch_size_stored_rows_on_device(make_buffer, storage):
    buf = make_buffer(8, storage=storage)
    buf.add_batch(rows(0, 5))
    batch = buf.sample_batch(32)
    assert batch.batch_size == torch.Size([32])
    assert batch.device == torch.device("cpu")
    assert set(ids_of(batch)) <= set(range(5))


@pytest.mark.parametrize("bf16", [False, True], ids=["numpy-dtypes", "with-bfloat16"])
def test_sample_batch_gathers_in_numpy_what_index_select_gathers(
    make_buffer, storage, bf16, monkeypatch
):
    """On the CPU a batch is gathered in numpy (a bfloat16 field, which numpy lacks, sends it
    through torch.index_select). Two buffers fed and seeded alike, one with its numpy views
    hidden: the same batches, and changing a batch leaves storage as it was."""
    data = rows(0, 6)
    if bf16:
        data["half"] = data["reward"].to(torch.bfloat16)
    bufs = [make_buffer(8, storage=storage) for _ in range(2)]
    for buf in bufs:
        buf.add_batch(data)
    monkeypatch.setattr(bufs[1]._slots, "_host_views", {})
    for _ in range(3):
        got, want = (buf.sample_batch(64) for buf in bufs)
        assert list(got.keys(include_nested=True)) == list(want.keys(include_nested=True))
        for key in want.keys(include_nested=True, leaves_only=True):
            assert got[key].dtype == want[key].dtype, key
            assert torch.equal(got[key], want[key]), key
            got[key].zero_()
    assert torch.equal(bufs[0].sample_by_index(list(range(6)))["obs"], data["obs"])


def test_sample_batch_draws_with_replacement_beyond_the_stored_count(make_buffer, storage):
    buf = make_buffer(8, storage=storage)
    buf.add_batch(rows(0, 2))
    assert sorted(set(ids_of(buf.sample_batch(64)))) == [0, 1]


def test_sample_batch_after_wrap_only_returns_live_rows(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    buf.add_batch(rows(0, 11))
    assert set(ids_of(buf.sample_batch(200))) == {7, 8, 9, 10}


def test_sample_batch_is_roughly_uniform(make_buffer):
    buf = make_buffer(10, storage="tensor")
    buf.add_batch(rows(0, 10))
    counts = np.bincount(ids_of(buf.sample_batch(20_000)), minlength=10)
    # 2,000 expected per row; 5 standard deviations is about 212
    assert np.all(np.abs(counts - 2000) < 250), counts


def test_sample_random_is_an_alias_of_sample_batch(make_buffer):
    a = make_buffer(8, seed=3)
    b = make_buffer(8, seed=3)
    a.add_batch(rows(0, 8))
    b.add_batch(rows(0, 8))
    assert ids_of(a.sample_random(16)) == ids_of(b.sample_batch(16))


def test_same_seed_gives_the_same_batches(make_buffer, storage):
    a = make_buffer(16, storage=storage, seed=42)
    b = make_buffer(16, storage=storage, seed=42)
    for buf in (a, b):
        buf.add_batch(rows(0, 16))
    for _ in range(3):
        assert ids_of(a.sample_batch(10)) == ids_of(b.sample_batch(10))


def test_different_seeds_give_different_batches(make_buffer, storage):
    a = make_buffer(1000, storage=storage, seed=1)
    b = make_buffer(1000, storage=storage, seed=2)
    for buf in (a, b):
        buf.add_batch(rows(0, 1000))
    assert ids_of(a.sample_batch(50)) != ids_of(b.sample_batch(50))


def test_sample_by_index_accepts_list_tuple_range_tensor_and_array(make_buffer, storage):
    buf = make_buffer(8, storage=storage)
    buf.add_batch(rows(0, 6))
    assert ids_of(buf.sample_by_index([4, 0, 4])) == [4, 0, 4]
    assert ids_of(buf.sample_by_index(range(1, 4))) == [1, 2, 3]
    assert ids_of(buf.sample_by_index(torch.tensor([5, 2]))) == [5, 2]
    assert ids_of(buf.sample_by_index(torch.tensor([3], dtype=torch.int32))) == [3]
    assert ids_of(buf.sample_by_index(np.array([1, 2]))) == [1, 2]
    assert ids_of(buf.sample_by_index(np.arange(4)[::-1])) == [3, 2, 1, 0]  # a reversed view
    assert ids_of(buf.sample_by_index((5, 1))) == [5, 1]


def test_sample_by_index_of_no_indices_returns_an_empty_batch(make_buffer):
    buf = make_buffer(4)
    buf.add_batch(rows(0, 2))
    assert buf.sample_by_index([]).batch_size == torch.Size([0])


def test_sample_by_index_fields_with_one_field_returns_a_tensor(make_buffer, storage):
    buf = make_buffer(8, storage=storage)
    buf.add_batch(rows(0, 4))
    reward = buf.sample_by_index_fields([3, 1], ["reward"])
    assert isinstance(reward, torch.Tensor)
    assert reward.tolist() == [1.5, 0.5]


def test_sample_by_index_fields_returns_a_tuple_in_the_order_asked(make_buffer, storage):
    buf = make_buffer(8, storage=storage)
    buf.add_batch(rows(0, 4))
    reward, obs, done = buf.sample_by_index_fields(range(2), ["reward", "obs", "done"])
    assert reward.tolist() == [0.0, 0.5]
    assert torch.equal(obs, rows(0, 2)["obs"])
    assert done.tolist() == [True, False]


def test_sample_by_index_fields_accepts_nested_names_as_tuples_or_dotted(make_buffer, storage):
    buf = make_buffer(8, storage=storage)
    buf.add_batch(rows(0, 4))
    as_tuple = buf.sample_by_index_fields([2], [("next", "obs")])
    dotted, action = buf.sample_by_index_fields([2], ["next.obs", "action"])
    assert torch.equal(as_tuple, torch.full((1, OBS_DIM), 3.0))
    assert torch.equal(dotted, as_tuple)
    assert torch.equal(action, torch.full((1, ACTION_DIM), -2.0))


def test_sample_all_returns_every_stored_row_oldest_first(make_buffer, storage):
    buf = make_buffer(6, storage=storage)
    buf.add_batch(rows(0, 4))
    assert ids_of(buf.sample_all()) == [0, 1, 2, 3]
    buf.add_batch(rows(4, 5))
    assert ids_of(buf.sample_all()) == [3, 4, 5, 6, 7, 8]


# ----------------------------------------------------------------- introspection
def test_len_size_data_size_buffer_size_and_pointer_agree(make_buffer, storage):
    buf = make_buffer(5, storage=storage)
    assert (len(buf), buf.size, buf.data_size, buf.buffer_size, buf.pointer) == (0, 0, 0, 5, 0)
    buf.add_batch(rows(0, 3))
    assert (len(buf), buf.size, buf.data_size, buf.buffer_size, buf.pointer) == (3, 3, 3, 5, 3)
    buf.add_batch(rows(3, 4))
    assert (len(buf), buf.size, buf.data_size, buf.buffer_size, buf.pointer) == (5, 5, 5, 5, 2)


def test_stats_reports_size_capacity_pointer_storage_devices_and_bytes(make_buffer, storage):
    buf = make_buffer(10, storage=storage)
    empty = buf.stats()
    assert empty["bytes"] == 0
    buf.add_batch(rows(0, 12))
    stats = buf.stats()
    assert {"size", "capacity", "pointer", "storage", "device", "storing_device", "bytes"} <= set(
        stats
    )
    assert stats["size"] == 10
    assert stats["capacity"] == 10
    assert stats["pointer"] == 2
    assert stats["storage"] == storage
    assert stats["device"] == "cpu"
    assert stats["storing_device"] == "cpu"
    row_bytes = 4 * (OBS_DIM + ACTION_DIM + 1 + OBS_DIM) + 1  # float32 fields + bool done
    assert stats["bytes"] >= 10 * row_bytes


def test_auto_storage_on_cpu_keeps_a_small_buffer_in_ram_from_its_first_write(tmp_path):
    with ReplayBuffer("cpu", "cpu", 4, scratch_dir=tmp_path) as buf:
        assert buf.stats()["storage"] == "auto"  # the size is known at the first write
        buf.add(transition(0))
        assert buf.stats()["storage"] == "tensor"  # see tests/test_storage_defaults.py


def test_devices_may_be_given_as_torch_devices(tmp_path):
    with ReplayBuffer(torch.device("cpu"), torch.device("cpu"), 4, scratch_dir=tmp_path) as buf:
        buf.add(transition(0))
        assert buf.sample_batch(2).device == torch.device("cpu")


def test_objectrl_positional_arguments_still_work(tmp_path):
    with ReplayBuffer("cpu", "cpu", 4, False, scratch_dir=tmp_path) as buf:
        assert buf.buffer_size == 4


def test_memory_is_a_torchrl_buffer_whose_len_agrees(make_buffer, storage):
    buf = make_buffer(5, storage=storage)
    assert isinstance(buf.memory, TensorDictReplayBuffer)
    assert len(buf.memory) == 0
    buf.add_batch(rows(0, 3))
    assert len(buf.memory) == len(buf) == 3
    buf.add_batch(rows(3, 9))
    assert len(buf.memory) == len(buf) == 5


# ----------------------------------------------------------------- reset and lifecycle
def test_reset_empties_the_buffer_and_forgets_the_spec(make_buffer, storage):
    buf = make_buffer(5, storage=storage)
    buf.add_batch(rows(0, 7))
    buf.reset()
    assert (len(buf), buf.pointer, buf.buffer_size, buf.spec) == (0, 0, 5, None)
    buf.add({"other": torch.zeros(2)})
    assert len(buf) == 1


def test_reset_with_a_size_resizes_the_buffer(make_buffer, storage):
    buf = make_buffer(5, storage=storage)
    buf.add_batch(rows(0, 5))
    buf.reset(buffer_size=3)
    assert (len(buf), buf.buffer_size) == (0, 3)
    buf.add_batch(rows(10, 4))
    assert ids_of(buf.sample_all()) == [11, 12, 13]
    assert buf.stats()["capacity"] == 3


def test_reset_logs_a_warning_only_when_asked_and_only_when_it_collects(
    tmp_path, caplog, monkeypatch
):
    """ObjectRL's print_gc_warning: the collector runs only after creating storage raised
    OSError (then once more), and only a buffer made with the flag logs it."""
    for flag in (True, False):
        with ReplayBuffer("cpu", "cpu", 2, flag, scratch_dir=tmp_path) as buf:
            buf.reset()  # no collection: nothing to log
            real, failed = buf._slots.reset, []

            def flaky(*args, real=real, failed=failed):
                if not failed:
                    failed.append(1)
                    raise OSError(12, "Cannot allocate memory")
                real(*args)

            monkeypatch.setattr(buf._slots, "reset", flaky)
            buf.reset()
    messages = [r.getMessage() for r in caplog.records if r.name == "replaybuf"]
    assert messages == [
        "ReplayBuffer ran the garbage collector after: [Errno 12] Cannot allocate memory"
    ]


def test_close_is_idempotent_and_later_use_raises_buffer_closed(make_buffer, storage):
    buf = make_buffer(4, storage=storage)
    buf.add_batch(rows(0, 2))
    buf.close()
    buf.close()
    with pytest.raises(BufferClosedError, match="closed"):
        buf.add(transition(2))
    with pytest.raises(BufferClosedError, match="closed"):
        buf.sample_batch(1)
    with pytest.raises(BufferClosedError, match="closed"):
        buf.stats()
    with pytest.raises(BufferClosedError, match="closed"):
        _ = buf.memory
    assert (len(buf), buf.pointer) == (2, 2)  # the counters are untouched


def test_context_manager_closes_the_buffer(tmp_path, storage):
    with ReplayBuffer("cpu", "cpu", 4, storage=storage, scratch_dir=tmp_path) as buf:
        buf.add_batch(rows(0, 2))
        assert len(buf) == 2
    with pytest.raises(BufferClosedError):
        buf.sample_all()


def test_repr_names_size_capacity_and_storage(make_buffer):
    buf = make_buffer(4)
    buf.add(transition(0))
    assert repr(buf) == (
        "ReplayBuffer(size=1, buffer_size=4, storage='memmap', storing_device=cpu, device=cpu)"
    )


# ----------------------------------------------------------------- CUDA
@pytest.mark.gpu
@cuda
def test_cpu_storage_serves_correct_batches_on_cuda_through_pinned_memory(tmp_path):
    with ReplayBuffer("cuda", "cpu", 64, scratch_dir=tmp_path, seed=0) as buf:
        buf.add_batch(rows(0, 64))
        batches = [buf.sample_batch(32) for _ in range(5)]  # reuses the pinned staging buffers
        torch.cuda.synchronize()
        for batch in batches:
            assert batch.device.type == "cuda"
            assert set(ids_of(batch.to("cpu"))) <= set(range(64))
        assert ids_of(buf.sample_all().to("cpu")) == list(range(64))
        obs, done = buf.sample_by_index_fields([5, 6], ["obs", "done"])
        assert obs.device.type == "cuda"
        assert done.tolist() == [False, True]


@pytest.mark.gpu
@cuda
def test_cuda_storage_defaults_to_tensor_storage_and_samples_on_cuda():
    with ReplayBuffer("cuda", "cuda", 16, seed=0) as buf:
        assert buf.stats()["storage"] == "tensor"
        assert buf.stats()["storing_device"].startswith("cuda")
        buf.add_batch(rows(0, 20))
        batch = buf.sample_batch(8)
        assert batch.device.type == "cuda"
        assert set(ids_of(batch.to("cpu"))) <= set(range(4, 20))
        assert ids_of(buf.sample_all().to("cpu")) == list(range(4, 20))


@pytest.mark.gpu
@cuda
def test_cuda_storage_takes_cpu_input_and_same_seed_gives_same_batches():
    a = ReplayBuffer("cuda", "cuda", 32, seed=5)
    b = ReplayBuffer("cuda", "cuda", 32, seed=5)
    with a, b:
        a.add_batch(rows(0, 32))
        b.add_batch(rows(0, 32).to("cuda"))
        assert ids_of(a.sample_batch(16).to("cpu")) == ids_of(b.sample_batch(16).to("cpu"))


@pytest.mark.gpu
@cuda
def test_pinned_path_stays_correct_across_many_batch_shapes(tmp_path):
    with ReplayBuffer("cuda", "cpu", 64, scratch_dir=tmp_path, seed=0) as buf:
        for count in range(1, 25):  # more shapes than the staging cache keeps
            buf.add_batch(rows(count * 100, 1))
            expected = [k * 100 for k in range(1, count + 1)]
            assert ids_of(buf.sample_all().to("cpu")) == expected
            picked = buf.sample_by_index(list(range(count)))
            assert ids_of(picked.to("cpu")) == expected[:count]
        first, second = buf.sample_batch(16), buf.sample_batch(16)
        torch.cuda.synchronize()
        assert set(ids_of(first.to("cpu"))) | set(ids_of(second.to("cpu"))) <= set(expected)


@pytest.mark.gpu
@cuda
def test_cuda_storage_serves_complete_batches_on_the_cpu():
    with ReplayBuffer("cpu", "cuda", 4096, seed=0) as buf:
        buf.add_batch(rows(0, 4096))
        for _ in range(20):  # read at once, without any synchronization
            batch = buf.sample_batch(1024)
            assert batch.device == torch.device("cpu")
            ids_of(batch)  # checks every field of every row against its id
        assert ids_of(buf.sample_all()) == list(range(4096))


@pytest.mark.parametrize("prioritized", [False, True])
def test_a_cpu_buffer_works_alike_under_another_default_device(tmp_path, prioritized):
    """Numbers the buffer converts, indices and priorities given as lists, and the buffer's
    own tensors are made on the CPU, not on torch's default device (a trainer may call
    ``torch.set_default_device("cuda")``; the meta device stands in for it here): two buffers
    fed and seeded alike, one built and used inside the context (its tensor inputs made
    outside), give the same batches and the same priorities."""

    def made() -> ReplayBuffer:
        return ReplayBuffer(
            "cpu",
            "cpu",
            64,
            storage="tensor",
            scratch_dir=tmp_path,
            seed=0,
            prioritized=prioritized,
        )

    first = {"obs": torch.arange(120.0).reshape(40, 3), "reward": torch.arange(40.0)}
    chunk = {"obs": torch.ones(5, 3), "reward": torch.full((5,), 2.0)}
    one = {"obs": torch.zeros(3), "reward": 3.0}  # a Python number: converted by the buffer

    def use(buf: ReplayBuffer) -> list[TensorDict]:
        buf.add_batch(first)  # tensors made outside the context: those go in as they are
        buf.add_batch(chunk)
        buf.add(one)
        out = [buf.sample_batch(8), buf.sample_by_index([1, 2, 45]), buf.sample_all()]
        out.append(next(iter(buf.create_epoch_iterator(8))))
        if prioritized:
            ids = out[0]["index"].tolist()
            assert buf.update_priorities(ids, [float(i % 5) for i in range(8)]) == 8
            out.append(buf.sample_batch(8))
        return out

    bufs = [made()]
    want = use(bufs[0])
    with torch.device("meta"):  # built and used inside the context
        bufs.append(made())
        got = use(bufs[1])
    for g, w in zip(got, want, strict=True):
        assert g.device == torch.device("cpu")
        leaves = list(w.keys(include_nested=True, leaves_only=True))
        assert list(g.keys(include_nested=True, leaves_only=True)) == leaves
        for key in leaves:
            assert torch.equal(g[key], w[key]), key
    bufs[0].close()
    bufs[1].close()
