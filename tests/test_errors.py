"""Bad arguments and bad metadata: a clear error naming what was expected and got, nothing changed.

Schema mismatches of written data live in ``test_schema.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from replay_helpers import ids_of, rows, unchanged

from replaybuf import (
    BufferClosedError,
    EmptyBufferError,
    EpisodeStateError,
    InsufficientSpaceError,
    MetadataError,
    ReplayBufError,
    ReplayBuffer,
    SchemaError,
)


@pytest.fixture
def filled(make_buffer, storage) -> ReplayBuffer:
    buf = make_buffer(4, storage=storage)
    buf.add_batch(rows(0, 6))  # wrapped: pointer 2
    return buf


@pytest.fixture
def empty(make_buffer, storage) -> ReplayBuffer:
    return make_buffer(4, storage=storage)


# ----------------------------------------------------------------- error classes
@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (SchemaError, ValueError),
        (EmptyBufferError, ValueError),
        (MetadataError, ValueError),
        (EpisodeStateError, ValueError),
        (BufferClosedError, RuntimeError),
        (InsufficientSpaceError, MemoryError),
    ],
)
def test_every_error_is_a_replaybuf_error_and_the_builtin_callers_expect(error, builtin):
    assert issubclass(error, ReplayBufError)
    assert issubclass(error, builtin)


def test_insufficient_space_error_names_where_needed_and_free():
    err = InsufficientSpaceError("disk at /x", 2_000, 1_000)
    assert (err.where, err.needed, err.free) == ("disk at /x", 2_000, 1_000)
    assert (
        str(err) == "not enough space on disk at /x: the buffer needs 2,000 bytes, 1,000 are free"
    )


# ----------------------------------------------------------------- empty buffer
@pytest.mark.parametrize(
    "call",
    [
        lambda b: b.sample_batch(2),
        lambda b: b.sample_random(2),
        lambda b: b.sample_all(),
        lambda b: b.sample_by_index([0]),
        lambda b: b.sample_by_index_fields([0], ["obs"]),
        lambda b: b.create_epoch_iterator(2),
        lambda b: b.get_next_batch(2),
        lambda b: b.get_steps_and_iterator(1, 0, 2),
    ],
    ids=[
        "sample_batch",
        "sample_random",
        "sample_all",
        "sample_by_index",
        "sample_by_index_fields",
        "create_epoch_iterator",
        "get_next_batch",
        "get_steps_and_iterator",
    ],
)
def test_sampling_an_empty_buffer_raises_empty_buffer_error(empty, call):
    with unchanged(empty), pytest.raises(EmptyBufferError, match="the buffer is empty"):
        call(empty)


def test_sampling_after_reset_raises_empty_buffer_error(filled):
    filled.reset()
    with unchanged(filled), pytest.raises(EmptyBufferError, match="empty"):
        filled.sample_batch(1)


# ----------------------------------------------------------------- sizes
@pytest.mark.parametrize("batch_size", [0, -3])
@pytest.mark.parametrize(
    "call",
    [
        lambda b, n: b.sample_batch(n),
        lambda b, n: b.create_epoch_iterator(n),
        lambda b, n: b.calculate_num_batches(n),
        lambda b, n: b.get_steps_and_iterator(1, 0, n),
        lambda b, n: b.get_next_batch(n),
    ],
    ids=[
        "sample_batch",
        "create_epoch_iterator",
        "calculate_num_batches",
        "get_steps_and_iterator",
        "get_next_batch",
    ],
)
def test_batch_size_below_one_raises_value_error(filled, call, batch_size):
    with (
        unchanged(filled),
        pytest.raises(ValueError, match=f"batch_size must be >= 1, got {batch_size}"),
    ):
        call(filled, batch_size)


@pytest.mark.parametrize("batch_size", [2.0, "2", True, None])
def test_batch_size_that_is_not_an_int_raises_type_error(filled, batch_size):
    with unchanged(filled), pytest.raises(TypeError, match="batch_size must be an int, got"):
        filled.sample_batch(batch_size)


@pytest.mark.parametrize(("n_epochs", "error"), [(-1, ValueError), (1.5, TypeError)])
def test_bad_n_epochs_raises(filled, n_epochs, error):
    with unchanged(filled), pytest.raises(error, match="n_epochs must be"):
        filled.get_steps_and_iterator(n_epochs, 10, 2)
    with unchanged(filled), pytest.raises(error, match="n_epochs must be"):
        filled.create_epoch_iterator(2, n_epochs)


def test_create_epoch_iterator_with_zero_epochs_raises(filled):
    with unchanged(filled), pytest.raises(ValueError, match="n_epochs must be >= 1, got 0"):
        filled.create_epoch_iterator(2, 0)


def test_negative_max_iter_raises_and_keeps_the_installed_iterator(filled):
    filled.create_epoch_iterator(3, shuffle=False)
    with unchanged(filled), pytest.raises(ValueError, match="max_iter must be >= 0, got -1"):
        filled.get_steps_and_iterator(0, -1, 2)
    assert ids_of(filled.get_next_batch(2)) == [2, 3, 4]  # still the epoch, batch 3


def test_bad_batch_size_raises_even_while_an_iterator_is_installed(filled):
    filled.create_epoch_iterator(3, shuffle=False)
    with unchanged(filled), pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        filled.get_next_batch(0)
    with unchanged(filled), pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        filled.get_steps_and_iterator(0, 10, 0)
    assert ids_of(filled.get_next_batch(3)) == [2, 3, 4]


@pytest.mark.parametrize(("size", "error"), [(0, ValueError), (-5, ValueError), (2.5, TypeError)])
def test_constructor_with_bad_buffer_size_raises_and_creates_no_files(tmp_path, size, error):
    with pytest.raises(error, match="buffer_size must be"):
        ReplayBuffer("cpu", "cpu", size, scratch_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("size", [0, -1])
def test_reset_with_bad_buffer_size_raises_and_changes_nothing(filled, size):
    with (
        unchanged(filled),
        pytest.raises(ValueError, match=f"buffer_size must be >= 1, got {size}"),
    ):
        filled.reset(size)


@pytest.mark.parametrize(("seed", "error"), [(-1, ValueError), (1.5, TypeError)])
def test_bad_seed_raises_and_creates_no_files(tmp_path, seed, error):
    with pytest.raises(error, match="seed must be"):
        ReplayBuffer("cpu", "cpu", 4, scratch_dir=tmp_path, seed=seed)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------- indices and fields
@pytest.mark.parametrize(
    ("indices", "bad"),
    [([4], 4), ([0, -1], -1), (range(3, 5), 4), (torch.tensor([9]), 9), ([2, 100], 100)],
    ids=["capacity", "negative", "range", "tensor", "far"],
)
def test_index_outside_the_stored_range_raises_index_error(filled, indices, bad):
    with (
        unchanged(filled),
        pytest.raises(IndexError, match=rf"indices must lie in \[0, 4\).*got {bad}"),
    ):
        filled.sample_by_index(indices)
    with unchanged(filled), pytest.raises(IndexError, match=rf"got {bad}"):
        filled.sample_by_index_fields(indices, ["obs"])


def test_index_past_the_stored_count_but_below_capacity_raises_index_error(make_buffer, storage):
    buf = make_buffer(8, storage=storage)
    buf.add_batch(rows(0, 3))
    with unchanged(buf), pytest.raises(IndexError, match=r"\[0, 3\).*got 3"):
        buf.sample_by_index([3])


@pytest.mark.parametrize(
    ("indices", "message"),
    [
        ([0.0, 1.0], "indices must hold ints"),
        (torch.tensor([0.5]), "indices must hold integers, got dtype torch.float32"),
        (torch.tensor([True]), "indices must hold integers, got dtype torch.bool"),
        ("01", "indices must be a list, range, array or tensor of ints"),
        (3, "indices must be a list, range, array or tensor of ints, got 3"),
        (np.array([1.0]), "indices must hold integers, got dtype float64"),
        (np.array(["1"]), "indices must hold integers, got dtype <U1"),
    ],
    ids=[
        "float list",
        "float tensor",
        "bool tensor",
        "string",
        "bare int",
        "float array",
        "str array",
    ],
)
def test_indices_that_are_not_integers_raise_type_error(filled, indices, message):
    with unchanged(filled), pytest.raises(TypeError, match=message):
        filled.sample_by_index(indices)


@pytest.mark.parametrize("field", ["nope", "next.nope", ("next", "nope"), "next"])
def test_unknown_field_raises_key_error_listing_the_stored_fields(filled, field):
    with unchanged(filled), pytest.raises(KeyError, match=r"unknown field .* stored fields are \["):
        filled.sample_by_index_fields([0], ["obs", field])


@pytest.mark.parametrize("fields", ["obs", [], ()])
def test_fields_that_are_not_a_non_empty_list_raise_type_error(filled, fields):
    with unchanged(filled), pytest.raises(TypeError, match="fields must be a non-empty list"):
        filled.sample_by_index_fields([0], fields)


# ----------------------------------------------------------------- storage kinds and devices
def test_unknown_storage_kind_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match=r"storage must be one of .*'memmap'.* got 'disk'"):
        ReplayBuffer("cpu", "cpu", 4, storage="disk", scratch_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argument", ["device", "storing_device"])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tpu", "must be a torch.device or a device string, got 'tpu'"),
        ("mps", "must be 'cpu' or a CUDA device, got 'mps'"),
        (3.5, "must be a torch.device or a device string, got 3.5"),
    ],
)
def test_unknown_device_raises_value_error_naming_the_argument(tmp_path, argument, value, message):
    devices = {"device": "cpu", "storing_device": "cpu", argument: value}
    with pytest.raises(ValueError, match=f"{argument} {message}"):
        ReplayBuffer(devices["device"], devices["storing_device"], 4, scratch_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("argument", ["device", "storing_device"])
def test_cuda_without_cuda_raises_value_error(tmp_path, argument):
    devices = {"device": "cpu", "storing_device": "cpu", argument: "cuda"}
    with pytest.raises(ValueError, match=f"{argument}='cuda' asks for CUDA, but no CUDA device"):
        ReplayBuffer(devices["device"], devices["storing_device"], 4, scratch_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_that_does_not_exist_raises_value_error(tmp_path):
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=rf"device='{missing}': CUDA device \d+ does not exist"):
        ReplayBuffer(missing, "cpu", 4, scratch_dir=tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memmap_storage_on_cuda_raises_value_error():
    with pytest.raises(ValueError, match="storage='memmap' keeps rows in files on the CPU"):
        ReplayBuffer("cuda", "cuda", 4, storage="memmap")


def test_scratch_dir_that_does_not_exist_raises_value_error(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match="scratch_dir must be an existing directory, got"):
        ReplayBuffer("cpu", "cpu", 4, scratch_dir=missing)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------- metadata
def _document(buf: ReplayBuffer, path) -> dict:
    buf.save(path)
    return json.loads((path.parent / (path.name + ".metadata")).read_text())


def _write(path, document) -> None:
    text = document if isinstance(document, str) else json.dumps(document)
    (path.parent / (path.name + ".metadata")).write_text(text)


def test_loading_missing_metadata_raises_metadata_error(filled, tmp_path):
    with unchanged(filled), pytest.raises(MetadataError, match=r"buf\.metadata' does not exist"):
        filled.load(tmp_path / "buf")


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda d: '{"format": "replaybuf.persist.metadata", "format_', "is not valid JSON"),
        (lambda d: "\x00\xff garbage", "is not valid JSON"),
        (lambda d: [d], "is not a replaybuf metadata file"),
        (lambda d: {**d, "format": "torchrl"}, "is not a replaybuf metadata file"),
        (lambda d: {**d, "format_version": 99}, "format_version expected 1, got 99"),
        (lambda d: {**d, "format_version": None}, "format_version expected 1, got None"),
        (lambda d: {**d, "buffer": "EpisodeReplayBuffer"}, "buffer expected 'ReplayBuffer', got"),
        (lambda d: {**d, "buffer_size": "4"}, "'buffer_size' expected an int, got '4'"),
        (lambda d: {**d, "buffer_size": 0}, r"'buffer_size' expected >= 1, got 0"),
        (lambda d: {**d, "data_size": 5}, r"'data_size' expected in \[0, 4\], got 5"),
        (lambda d: {**d, "pointer": -7}, r"'pointer' expected in \[0, 3\], got -7"),
        (lambda d: {**d, "pointer": True}, "'pointer' expected an int, got True"),
        (lambda d: {**d, "spec": {"obs": {"dtype": "float32"}}}, "'spec' is malformed"),
        (
            lambda d: {**d, "spec": {"obs": {"key": ["obs"], "shape": [4], "dtype": "nn"}}},
            "'spec' is malformed: field 'obs': unknown dtype 'nn'",
        ),
        (lambda d: {**d, "spec": [1, 2]}, "'spec' is malformed"),
        (
            lambda d: {**d, "spec": {"obs": {"key": "obs", "shape": [4], "dtype": "float32"}}},
            r"field 'obs': key expected the name's parts, got 'obs'",
        ),
        (
            lambda d: {**d, "spec": {"a.b": {"key": ["a", "c"], "shape": [], "dtype": "bool"}}},
            r"field 'a\.b': key expected the name's parts, got \['a', 'c'\]",
        ),
        (
            lambda d: {**d, "spec": {"obs": {"key": ["obs"], "shape": [-1], "dtype": "float32"}}},
            r"field 'obs': shape expected sizes >= 0, got \[-1\]",
        ),
        (
            lambda d: {**d, "spec": {"obs": {"key": ["obs"], "shape": ["4"], "dtype": "float32"}}},
            r"field 'obs': shape expected sizes >= 0, got \['4'\]",
        ),
    ],
    ids=[
        "truncated",
        "binary",
        "not an object",
        "other format",
        "other version",
        "no version",
        "other buffer kind",
        "buffer_size not int",
        "buffer_size zero",
        "data_size above capacity",
        "negative pointer",
        "bool pointer",
        "spec entry incomplete",
        "spec unknown dtype",
        "spec not a mapping",
        "spec key not a list",
        "spec key not its name",
        "spec negative size",
        "spec size not an int",
    ],
)
@pytest.mark.parametrize("stored", [0, 6], ids=["into empty", "into filled"])
def test_loading_corrupt_or_foreign_metadata_raises_and_changes_nothing(
    make_buffer, storage, tmp_path, stored, corrupt, message
):
    buf = make_buffer(4, storage=storage)
    if stored:
        buf.add_batch(rows(0, stored))
    path = tmp_path / "buf"
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor") as source:
        source.add_batch(rows(0, 6))
        document = _document(source, path)
    _write(path, corrupt(document))
    with unchanged(buf), pytest.raises(MetadataError, match=message):
        buf.load(path)


def test_loading_metadata_of_another_capacity_into_a_filled_buffer_raises(filled, tmp_path):
    path = tmp_path / "other"
    with ReplayBuffer("cpu", "cpu", 8, storage="tensor") as other:
        other.add_batch(rows(0, 3))
        other.save(path)
    with (
        unchanged(filled),
        pytest.raises(MetadataError, match="buffer_size: metadata has 8, this buffer 4"),
    ):
        filled.load(path)


def test_loading_metadata_of_another_spec_into_a_filled_buffer_raises(filled, tmp_path):
    path = tmp_path / "other"
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor") as other:
        other.add_batch({"obs": torch.zeros(2, 4, dtype=torch.float64)})
        other.save(path)
    with (
        unchanged(filled),
        pytest.raises(MetadataError, match=r"spec: metadata has FieldSpec\(obs: float64\[4\]\)"),
    ):
        filled.load(path)


def test_every_error_survives_pickling_with_its_message_and_fields():
    # Errors cross process boundaries (Ray actors, multiprocessing): each must unpickle.
    import pickle

    import replaybuf.errors as errors

    made = {
        errors.InsufficientSpaceError: errors.InsufficientSpaceError("disk at /x", 10, 2),
        errors.UnsupportedVersionError: errors.UnsupportedVersionError(7, 1, "ckpt"),
    }
    for name in dir(errors):
        kind = getattr(errors, name)
        if isinstance(kind, type) and issubclass(kind, errors.ReplayBufError):
            error = made.get(kind) or kind("what went wrong")
            back = pickle.loads(pickle.dumps(error))
            assert type(back) is kind
            assert str(back) == str(error)
            assert back.__dict__ == error.__dict__
