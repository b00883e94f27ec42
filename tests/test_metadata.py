"""save/load: a versioned JSON metadata file, written atomically, read without running code."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from replay_helpers import ids_of, rows, unchanged

from replaybuf import InsufficientSpaceError, MetadataError, ReplayBuffer, SchemaError


def _metadata_file(path):
    return path.parent / (path.name + ".metadata")


def test_save_writes_path_dot_metadata_as_json_with_buffer_state(make_buffer, storage, tmp_path):
    buf = make_buffer(4, storage=storage)
    buf.add_batch(rows(0, 6))
    path = tmp_path / "ckpt" / "buffer"  # the parent folder is created
    buf.save(path)
    document = json.loads(_metadata_file(path).read_text())
    assert document["format"] == "replaybuf.persist.metadata"
    assert document["format_version"] == 1
    assert document["buffer"] == "ReplayBuffer"
    assert (document["buffer_size"], document["data_size"], document["pointer"]) == (4, 4, 2)
    assert document["storage"] == storage
    assert (document["device"], document["storing_device"]) == ("cpu", "cpu")
    assert document["spec"]["next.obs"] == {
        "key": ["next", "obs"],
        "shape": [4],
        "dtype": "torch.float32",
    }
    assert set(document["versions"]) == {"torch", "torchrl", "tensordict"}


def test_save_and_load_round_trip_returns_what_was_saved(make_buffer, tmp_path):
    buf = make_buffer(4)
    buf.add_batch(rows(0, 3))
    buf.save(tmp_path / "buf")
    with unchanged(buf):
        document = buf.load(tmp_path / "buf")
    assert (document["buffer_size"], document["data_size"], document["pointer"]) == (4, 3, 3)


def test_save_accepts_a_string_path(make_buffer, tmp_path):
    buf = make_buffer(4)
    buf.save(str(tmp_path / "buf"))
    assert buf.load(str(tmp_path / "buf"))["spec"] is None


def test_save_of_an_empty_buffer_round_trips_without_a_spec(make_buffer, tmp_path):
    buf = make_buffer(4)
    buf.save(tmp_path / "buf")
    other = make_buffer(2)
    other.load(tmp_path / "buf")
    assert (other.buffer_size, other.spec, len(other)) == (4, None, 0)


def test_load_into_an_empty_buffer_adopts_buffer_size_and_spec(make_buffer, storage, tmp_path):
    source = make_buffer(6, storage=storage)
    source.add_batch(rows(0, 2))
    source.save(tmp_path / "buf")
    target = make_buffer(3, storage=storage)
    target.load(tmp_path / "buf")
    assert target.buffer_size == 6
    assert target.spec == source.spec
    assert (len(target), target.pointer) == (0, 0)  # metadata holds no rows: nothing claimed
    wrong = rows(10, 1)[0]
    wrong["obs"] = torch.zeros(4, dtype=torch.float64)
    with (
        unchanged(target),
        pytest.raises(SchemaError, match=r"'obs' expected dtype torch\.float32"),
    ):
        target.add(wrong)  # checked against the adopted spec
    target.add_batch(rows(10, 7))
    assert ids_of(target.sample_all()) == list(range(11, 17))


def test_load_into_a_filled_buffer_with_matching_metadata_changes_nothing(make_buffer, tmp_path):
    buf = make_buffer(4)
    buf.add_batch(rows(0, 2))
    buf.save(tmp_path / "buf")
    buf.add_batch(rows(2, 3))
    with unchanged(buf):
        document = buf.load(tmp_path / "buf")
    assert document["data_size"] == 2  # reported, not adopted


def test_metadata_is_json_not_pickle(make_buffer, tmp_path):
    buf = make_buffer(4)
    buf.add_batch(rows(0, 2))
    buf.save(tmp_path / "buf")
    raw = _metadata_file(tmp_path / "buf").read_bytes()
    assert not raw.startswith(b"\x80")  # no pickle protocol header
    assert isinstance(json.loads(raw), dict)


def test_load_does_not_run_a_pickle_planted_as_metadata(make_buffer, tmp_path):
    import pickle

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    _metadata_file(tmp_path / "buf").write_bytes(pickle.dumps(Payload()))
    buf = make_buffer(4)
    buf.add_batch(rows(0, 2))
    with unchanged(buf), pytest.raises(MetadataError, match="is not valid JSON"):
        buf.load(tmp_path / "buf")
    assert not marker.exists()


def test_save_leaves_no_temporary_files(make_buffer, tmp_path):
    buf = make_buffer(4)
    buf.add_batch(rows(0, 2))
    for _ in range(3):
        buf.save(tmp_path / "buf")
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["buf.metadata"]


def test_a_failed_save_keeps_the_old_file_and_leaves_no_temporary_files(
    make_buffer, tmp_path, monkeypatch
):
    buf = make_buffer(4)
    buf.add_batch(rows(0, 2))
    buf.save(tmp_path / "buf")
    before = _metadata_file(tmp_path / "buf").read_bytes()
    buf.add_batch(rows(2, 1))

    def replace_fails(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", replace_fails)
    with unchanged(buf), pytest.raises(OSError, match="disk full"):
        buf.save(tmp_path / "buf")
    monkeypatch.undo()
    assert _metadata_file(tmp_path / "buf").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["buf.metadata"]


def test_loading_never_takes_rows_it_does_not_hold(tmp_path):
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor") as source:
        source.add_batch(rows(0, 4))
        source.save(tmp_path / "buf")
    with ReplayBuffer("cpu", "cpu", 4, storage="tensor") as target:
        target.load(tmp_path / "buf")
        assert len(target) == 0
        with unchanged(target), pytest.raises(ValueError, match="empty"):
            target.sample_batch(1)


def test_load_that_cannot_fit_leaves_an_empty_buffer_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import replaybuf.storage.space

    with ReplayBuffer("cpu", "cpu", 8, scratch_dir=tmp_path) as source:
        source.add({"obs": torch.zeros(3)})
        source.save(tmp_path / "meta")
    with ReplayBuffer("cpu", "cpu", 4, scratch_dir=tmp_path) as target:
        monkeypatch.setattr(replaybuf.storage.space, "free_bytes", lambda *args: 1)
        # 8 rows of obs (12 bytes) and TorchRL's int64 index column (8 bytes)
        with pytest.raises(InsufficientSpaceError, match="needs 160 bytes, 1 are free"):
            target.load(tmp_path / "meta")
        assert target.buffer_size == 4
        assert target.spec is None
