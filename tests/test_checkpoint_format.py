"""The checkpoint directory format: round trips, validation, no pickle, and crash safety."""

from __future__ import annotations

import ast
import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from checkpoint_crash_helper import KIND, make_tensors
from tensordict import MemoryMappedTensor

from replaybuf.errors import (
    CheckpointError,
    CheckpointKindError,
    CorruptCheckpointError,
    InsufficientSpaceError,
    NoCheckpointError,
    ReplayBufError,
    SchemaError,
    UnsafeCheckpointError,
    UnsupportedVersionError,
)
from replaybuf.persist.format import (
    CRASH_ENV,
    describe_checkpoint,
    read_checkpoint,
    recover,
    verify_checkpoint,
    write_checkpoint,
)
from replaybuf.persist.format import streams as ckpt_streams
from replaybuf.persist.format import writer as ckpt_writer
from replaybuf.persist.format.names import seal

HELPER = Path(__file__).with_name("checkpoint_crash_helper.py")
PACKAGE = Path(__file__).resolve().parents[1] / "replaybuf"


def small_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "obs": torch.randn(100, 8, generator=g),  # 3200 bytes
        "action": torch.randint(0, 5, (100,), generator=g),
        "terminated": torch.rand(100, generator=g) < 0.1,
    }


@pytest.fixture
def saved(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "ckpt", KIND, {"cursor": 7}, small_tensors())


def snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    """Size, mtime and hash of every file, to show a failed load changed nothing."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            st = path.stat()
            out[str(path.relative_to(directory))] = (
                st.st_size,
                st.st_mtime_ns,
                hashlib.sha256(path.read_bytes()).hexdigest(),
            )
    return out


def edit_manifest(directory: Path, edit) -> None:
    path = directory / "MANIFEST.json"
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(seal(document)))  # re-sealed: the checks behind the seal


def siblings(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.parent.iterdir() if p.name != directory.name)


# ---------------------------------------------------------------------------------------------
# round trips


def test_round_trip_keeps_every_dtype_shape_and_layout(tmp_path):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 4, generator=g)
    memmap = MemoryMappedTensor.from_tensor(
        torch.arange(120, dtype=torch.float32).view(12, 10), filename=tmp_path / "scratch.memmap"
    )
    tensors = {
        "f32": base,
        "f64": base.double(),
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "i64": torch.randint(-(1 << 40), 1 << 40, (5, 2), generator=g),
        "i32": torch.randint(-100, 100, (7,), dtype=torch.int32, generator=g),
        "i8": torch.randint(-128, 127, (3, 3), dtype=torch.int8, generator=g),
        "image": torch.randint(0, 256, (4, 3, 84, 84), dtype=torch.uint8, generator=g),
        "flag": torch.tensor([True, False, True, True]),
        "c64": torch.randn(3, dtype=torch.complex64, generator=g).conj(),  # a lazy conj view
        "empty": torch.empty(0, 4),
        "empty_tail": torch.empty(3, 0, dtype=torch.int16),
        "scalar": torch.tensor(2.5),
        "transposed": base.t(),  # not contiguous
        "next/obs": base + 1,  # nested name
        "memmap": memmap,
        "memmap_view": memmap[2:9, ::3],
        "grad": base.clone().requires_grad_(),
    }
    directory = write_checkpoint(tmp_path / "ckpt", KIND, {"config": {"n": 3}}, tensors)
    with read_checkpoint(directory, KIND) as checkpoint:
        assert checkpoint.meta == {"config": {"n": 3}}
        assert checkpoint.manifest["format_version"] == 2
        assert set(checkpoint.manifest["versions"]) == {"torch", "torchrl", "tensordict"}
        for name, tensor in tensors.items():
            expected = tensor.detach().resolve_conj().as_subclass(torch.Tensor)
            loaded = checkpoint.load(name)
            assert type(loaded) is torch.Tensor
            assert loaded.dtype == expected.dtype, name
            assert loaded.shape == expected.shape, name
            assert torch.equal(loaded, expected), name
            raw = (directory / "data" / f"{name}.bin").read_bytes()
            assert raw == expected.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), name


def test_load_into_streams_into_preallocated_tensors(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_streams, "CHUNK_BYTES", 64)  # rows and tensors split into many chunks
    tensors = {
        "big_rows": torch.randn(5, 40),
        "long": torch.arange(1000),
        "flag": torch.arange(9) > 4,
    }
    directory = write_checkpoint(tmp_path / "ckpt", KIND, {}, tensors)
    with read_checkpoint(directory) as checkpoint:
        target = MemoryMappedTensor.empty((5, 40), dtype=torch.float32, filename=tmp_path / "m")
        assert checkpoint.load_into("big_rows", target) is target
        assert torch.equal(target.as_subclass(torch.Tensor), tensors["big_rows"])
        strided = torch.zeros(40, 5).t()  # a non-contiguous destination
        checkpoint.load_into("big_rows", strided)
        assert torch.equal(strided, tensors["big_rows"])
        assert torch.equal(checkpoint.load("long"), tensors["long"])
        assert torch.equal(checkpoint.load("flag"), tensors["flag"])
        with pytest.raises(SchemaError, match=r"big_rows.*expected shape \(5, 40\).*got shape"):
            checkpoint.load_into("big_rows", torch.zeros(5, 41))
        with pytest.raises(SchemaError, match=r"dtype float32, got shape \(5, 40\) dtype float64"):
            checkpoint.load_into("big_rows", torch.zeros(5, 40, dtype=torch.float64))
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            checkpoint.load("nope")
    with pytest.raises(CheckpointError, match="is closed"):
        checkpoint.load("long")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_round_trip_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_streams, "CHUNK_BYTES", 1 << 10)
    tensor = torch.randn(300, 7, device="cuda")
    directory = write_checkpoint(tmp_path / "ckpt", KIND, {}, {"x": tensor, "t": tensor.t()})
    with read_checkpoint(directory) as checkpoint:
        assert torch.equal(checkpoint.load("x"), tensor.cpu())
        out = torch.empty(7, 300, device="cuda")
        checkpoint.load_into("t", out)
        assert torch.equal(out, tensor.t())


def test_overwrite_keeps_only_the_new_checkpoint(saved):
    write_checkpoint(saved, KIND, {"cursor": 8}, {"obs": torch.ones(2, 2)})
    with read_checkpoint(saved) as checkpoint:
        assert checkpoint.meta == {"cursor": 8}
        assert list(checkpoint.tensors) == ["obs"]
    assert sorted(p.name for p in (saved / "data").iterdir()) == ["obs.bin"]
    assert siblings(saved) == []


def test_an_open_checkpoint_is_a_snapshot(saved):
    with read_checkpoint(saved) as checkpoint:
        write_checkpoint(saved, KIND, {"cursor": 9}, {"obs": torch.zeros(100, 8)})
        assert torch.equal(checkpoint.load("obs"), small_tensors()["obs"])


def test_empty_folder_is_replaced_and_foreign_folders_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    write_checkpoint(tmp_path / "empty", KIND, {}, {"x": torch.ones(1)})
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(CheckpointError, match=r"is not a replaybuf checkpoint.*refusing"):
        write_checkpoint(foreign, KIND, {}, {"x": torch.ones(1)})
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file or symlink"):
        write_checkpoint(tmp_path / "file", KIND, {}, {"x": torch.ones(1)})
    assert (foreign / "cat.jpg").read_bytes() == b"meow"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "photos"]


@pytest.mark.parametrize(
    ("tensors", "meta", "error", "match"),
    [
        ({"../x": torch.ones(1)}, {}, ValueError, r"tensor name .* got '\.\./x'"),
        ({"/abs": torch.ones(1)}, {}, ValueError, "got '/abs'"),
        ({"a//b": torch.ones(1)}, {}, ValueError, "got 'a//b'"),
        ({".hidden": torch.ones(1)}, {}, ValueError, "got '.hidden'"),
        ({"": torch.ones(1)}, {}, ValueError, "got ''"),
        ({"Obs": torch.ones(1), "obs": torch.ones(1)}, {}, ValueError, "differ only in case"),
        ({"x": [1, 2]}, {}, TypeError, "tensor 'x' must be a dense torch.Tensor, got list"),
        ({"x": torch.ones(2).to_sparse()}, {}, TypeError, "dense"),
        ({"x": torch.ones(1)}, {"n": float("nan")}, ValueError, r"meta\['n'\] must be a finite"),
        ({"x": torch.ones(1)}, {"t": {3: 1}}, TypeError, r"meta\['t'\] keys must be str"),
        ({"x": torch.ones(1)}, {"o": object()}, TypeError, r"meta\['o'\] must be JSON data"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(
    tmp_path, tensors, meta, error, match
):
    with pytest.raises(error, match=match):
        write_checkpoint(tmp_path / "ckpt", KIND, meta, tensors)
    assert list(tmp_path.iterdir()) == []


def test_failed_write_keeps_the_previous_checkpoint(saved, monkeypatch):
    before = snapshot(saved)
    real = ckpt_writer._write_tensor
    calls = []

    def failing(path, tensor, durable):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, tensor, durable)

    monkeypatch.setattr(ckpt_writer, "_write_tensor", failing)
    with pytest.raises(
        CheckpointError, match=r"ckpt': writing data/action\.bin failed: .*No space left"
    ):
        write_checkpoint(saved, KIND, {"cursor": 99}, small_tensors())
    assert snapshot(saved) == before
    assert siblings(saved) == []
    monkeypatch.undo()
    write_checkpoint(saved, KIND, {"cursor": 100}, small_tensors())
    assert read_checkpoint(saved).meta == {"cursor": 100}


def test_too_little_disk_space_is_refused_before_writing(saved, monkeypatch):
    before = snapshot(saved)
    usage = shutil.disk_usage(saved.parent)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=1000))
    with pytest.raises(InsufficientSpaceError, match=r"needs .* bytes, 1,000 are free"):
        write_checkpoint(saved, KIND, {}, small_tensors())
    assert snapshot(saved) == before
    assert siblings(saved) == []


def test_durable_saves_fsync_files_folders_and_the_parent_after_the_rename(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    directory = write_checkpoint(tmp_path / "ckpt", KIND, {}, {"a/b": torch.ones(3)})
    tmp = Path(synced[0]).parents[2]
    assert synced == [
        str(tmp / "data" / "a" / "b.bin"),
        str(tmp / "data" / "a"),
        str(tmp / "data"),
        str(tmp / "MANIFEST.json"),
        str(tmp),
        str(tmp_path),  # the parent, after the rename published the checkpoint
    ]
    assert tmp.name.startswith(".ckpt.replaybuf-tmp-")
    synced.clear()
    write_checkpoint(directory, KIND, {}, {"a/b": torch.ones(3)}, durable=False)
    assert synced == []


# ---------------------------------------------------------------------------------------------
# validation of what is read


def truncate(d):
    os.truncate(d / "data/obs.bin", 1600)


def append_junk(d):
    with open(d / "data/obs.bin", "ab") as f:
        f.write(b"garbage")


def flip_byte(d):
    raw = bytearray((d / "data/obs.bin").read_bytes())
    raw[1234] ^= 0x01
    (d / "data/obs.bin").write_bytes(bytes(raw))


def symlink_file(d):
    outside = d.parent / "outside.bin"
    shutil.copy(d / "data/obs.bin", outside)
    (d / "data/obs.bin").unlink()
    (d / "data/obs.bin").symlink_to(outside)


def symlink_folder(d):
    shutil.copytree(d / "data", d.parent / "outside")
    shutil.rmtree(d / "data")
    (d / "data").symlink_to(d.parent / "outside")


def symlink_manifest(d):
    (d / "MANIFEST.json").rename(d.parent / "outside.json")
    (d / "MANIFEST.json").symlink_to(d.parent / "outside.json")


def set_entry(key, value, tensor="obs"):
    return lambda d: edit_manifest(d, lambda m: m["tensors"][tensor].__setitem__(key, value))


def rename_entry(new_name):
    return lambda d: edit_manifest(
        d, lambda m: m["tensors"].__setitem__(new_name, m["tensors"].pop("obs"))
    )


DAMAGE = {
    "truncated": (
        truncate,
        CorruptCheckpointError,
        r"data/obs\.bin: expected 3200 bytes, got 1600",
    ),
    "appended": (
        append_junk,
        CorruptCheckpointError,
        "data/obs.bin: expected 3200 bytes, got 3207",
    ),
    "flipped": (flip_byte, CorruptCheckpointError, r"data/obs\.bin: sha256 expected [0-9a-f]{64}"),
    "missing_file": (
        lambda d: (d / "data/obs.bin").unlink(),
        CorruptCheckpointError,
        r"data/obs\.bin: missing",
    ),
    "missing_manifest": (
        lambda d: (d / "MANIFEST.json").unlink(),
        NoCheckpointError,
        "no complete checkpoint in .*ckpt",
    ),
    "garbage_manifest": (
        lambda d: (d / "MANIFEST.json").write_bytes(b"\x00"),
        CorruptCheckpointError,
        r"MANIFEST\.json is not valid JSON",
    ),
    "truncated_manifest": (
        lambda d: os.truncate(d / "MANIFEST.json", 100),
        CorruptCheckpointError,
        r"MANIFEST\.json is not valid JSON",
    ),
    "other_format": (
        lambda d: (d / "MANIFEST.json").write_text('{"format": "torchrl"}'),
        CorruptCheckpointError,
        "format expected 'replaybuf.persist.format', got 'torchrl'",
    ),
    "future_version": (
        lambda d: edit_manifest(d, lambda m: m.__setitem__("format_version", 999)),
        UnsupportedVersionError,
        "format_version expected 2, got 999",
    ),
    "traversal": (
        set_entry("file", "../../etc/passwd"),
        UnsafeCheckpointError,
        r"tensor 'obs': file '\.\./\.\./etc/passwd' is not a relative path inside",
    ),
    "absolute": (
        set_entry("file", "/etc/passwd"),
        UnsafeCheckpointError,
        "file '/etc/passwd' is not a relative path inside",
    ),
    "traversal_name": (
        rename_entry("../../etc/passwd"),
        UnsafeCheckpointError,
        r"tensor '\.\./\.\./etc/passwd': the name is not a safe",
    ),
    "symlinked_file": (symlink_file, UnsafeCheckpointError, r"data/obs\.bin is a symlink"),
    "symlinked_folder": (symlink_folder, UnsafeCheckpointError, r"ckpt': data is a symlink"),
    "symlinked_manifest": (
        symlink_manifest,
        UnsafeCheckpointError,
        r"MANIFEST\.json is a symlink",
    ),
    "other_file": (
        set_entry("file", "data/action.bin"),
        CorruptCheckpointError,
        "file expected 'data/obs.bin', got 'data/action.bin'",
    ),
    "bad_dtype": (set_entry("dtype", "object"), CorruptCheckpointError, "dtype expected one of"),
    "bad_shape": (set_entry("shape", [100, -8]), CorruptCheckpointError, "shape expected a list"),
    "bad_bytes": (
        set_entry("bytes", 1600),
        CorruptCheckpointError,
        r"bytes expected 3200 \(shape \[100, 8\] x float32\), got 1600",
    ),
    "bad_sha": (set_entry("sha256", "xyz"), CorruptCheckpointError, "sha256 expected 64 hex"),
    "tensors_not_a_dict": (
        lambda d: edit_manifest(d, lambda m: m.__setitem__("tensors", [])),
        CorruptCheckpointError,
        "field 'tensors' expected a dict",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_checkpoint_is_refused_naming_the_problem(saved, monkeypatch, case):
    damage, error, match = DAMAGE[case]
    damage(saved)
    before = snapshot(saved)
    opened: list[str] = []
    real_open = os.open

    def recording_open(path, *args, **kwargs):
        opened.append(os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    with pytest.raises(error, match=match):
        read_checkpoint(saved, KIND)
    monkeypatch.undo()
    assert snapshot(saved) == before  # the loader wrote nothing
    assert not {"..", "etc", "passwd", "/etc/passwd"} & set(opened)
    symlink = {"symlinked_file": "obs.bin", "symlinked_folder": "data"}
    assert (
        symlink.get(case, "MANIFEST.json" if case == "symlinked_manifest" else None) not in opened
    )
    assert verify_checkpoint(saved) != []


def test_future_version_error_carries_the_version(saved):
    edit_manifest(saved, lambda m: m.__setitem__("format_version", 999))
    with pytest.raises(UnsupportedVersionError) as info:
        read_checkpoint(saved)
    assert info.value.version == 999
    assert isinstance(info.value, ValueError)


def test_missing_or_empty_folder_is_no_checkpoint(tmp_path):
    with pytest.raises(NoCheckpointError, match=r"no complete checkpoint in .*nothing"):
        read_checkpoint(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoCheckpointError, match="empty"):
        read_checkpoint(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):  # a FileNotFoundError too, for generic callers
        read_checkpoint(tmp_path / "empty")


def test_wrong_kind_names_both_kinds(saved):
    with pytest.raises(CheckpointKindError, match=r"holds a 'ReplayBuffer'.*expected a 'Episode"):
        read_checkpoint(saved, "EpisodeReplayBuffer")


def test_checksums_are_skipped_only_when_asked(saved):
    flip_byte(saved)
    with read_checkpoint(saved, verify=False) as checkpoint:
        checkpoint.load("obs")  # sizes still checked, hashes not
        with pytest.raises(CorruptCheckpointError, match=r"data/obs\.bin: sha256"):
            checkpoint.load("obs", verify=True)


def test_bool_bytes_other_than_zero_and_one_are_refused(saved):
    path = saved / "data/terminated.bin"
    path.write_bytes(b"\x02" * 100)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    edit_manifest(saved, lambda m: m["tensors"]["terminated"].__setitem__("sha256", digest))
    with (
        read_checkpoint(saved) as checkpoint,
        pytest.raises(CorruptCheckpointError, match="bytes other than 0 and 1"),
    ):
        checkpoint.load("terminated")


def test_read_only_checkpoint_loads_and_stays_unchanged(saved):
    before = snapshot(saved)
    for path in [saved, *saved.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        with read_checkpoint(saved, KIND) as checkpoint:
            for name, tensor in small_tensors().items():
                assert torch.equal(checkpoint.load(name), tensor)
        assert verify_checkpoint(saved) == []
        assert snapshot(saved) == before
    finally:
        for path in [saved, *saved.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)


def test_verify_lists_every_problem_and_describe_summarizes(saved):
    assert verify_checkpoint(saved) == []
    info = describe_checkpoint(saved)
    assert info["kind"] == KIND
    assert info["format_version"] == 2
    assert info["tensors"]["obs"] == {"shape": [100, 8], "dtype": "float32", "bytes": 3200}
    assert info["bytes"] == 3200 + 800 + 100
    assert info["meta"] == {"cursor": 7}
    assert info["extra_files"] == []
    truncate(saved)
    flip = bytearray((saved / "data/action.bin").read_bytes())
    flip[0] ^= 0xFF
    (saved / "data/action.bin").write_bytes(bytes(flip))
    (saved / "data/terminated.bin").unlink()
    problems = verify_checkpoint(saved)
    assert len(problems) == 3
    assert "data/obs.bin: expected 3200 bytes, got 1600" in problems[0]
    assert "data/terminated.bin: missing" in problems[1]
    assert "data/action.bin: sha256 expected" in problems[2]


# ---------------------------------------------------------------------------------------------
# no pickle


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_pickles_are_never_opened(saved, tmp_path, monkeypatch):
    control = tmp_path / "CONTROL"
    pickle.loads(pickle.dumps(Evil(control)))  # the payload is live...
    assert control.exists()
    marker = tmp_path / "MARKER"  # ...and replaybuf never triggers it
    payload = pickle.dumps(Evil(marker))
    (saved / "prefetch.pkl").write_bytes(payload)
    (saved / "other.pickle").write_bytes(payload)
    (saved / "storage/x").mkdir(parents=True)
    (saved / "storage/x/pickle.pkl").write_bytes(payload)
    torch.save(Evil(marker), saved / "transform.pt")
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(
        os, "open", lambda p, *a, **k: opened.append(os.fspath(p)) or real_open(p, *a, **k)
    )
    with read_checkpoint(saved, KIND) as checkpoint:
        for name in checkpoint.tensors:
            checkpoint.load(name)
    assert verify_checkpoint(saved) == []
    monkeypatch.undo()
    assert not [p for p in opened if p.endswith((".pkl", ".pickle", ".pt"))]
    assert describe_checkpoint(saved)["extra_files"] == [
        "other.pickle",
        "prefetch.pkl",
        "storage/x/pickle.pkl",
        "transform.pt",
    ]
    assert not marker.exists()


def test_a_pickle_posing_as_a_tensor_file_is_read_as_bytes_or_refused(saved, tmp_path):
    marker = tmp_path / "MARKER"
    payload = pickle.dumps(Evil(marker))
    (saved / "data/obs.bin").write_bytes(payload)
    with pytest.raises(CorruptCheckpointError, match=r"data/obs\.bin: expected 3200 bytes"):
        read_checkpoint(saved)

    def as_raw_bytes(m):  # a manifest forged to match: the file is still only bytes
        m["tensors"]["obs"] = {
            "file": "data/obs.bin",
            "shape": [len(payload)],
            "dtype": "uint8",
            "bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }

    edit_manifest(saved, as_raw_bytes)
    with read_checkpoint(saved) as checkpoint:
        assert checkpoint.load("obs").numpy().tobytes() == payload
    assert not marker.exists()


def test_package_source_never_unpickles():
    unsafe = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and node.module in {
                "pickle",
                "dill",
                "cloudpickle",
            }:
                unsafe += [f"{where} from {node.module} import {a.name}" for a in node.names]
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            attr = node.func.attr
            if owner in {"pickle", "dill", "cloudpickle"} and attr in {
                "load",
                "loads",
                "Unpickler",
            }:
                unsafe.append(f"{where} {owner}.{attr}")
            if owner == "torch" and attr == "load":
                safe = any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value
                    for k in node.keywords
                )
                if not safe:
                    unsafe.append(f"{where} torch.load without weights_only=True")
    assert unsafe == []


# ---------------------------------------------------------------------------------------------
# recovery


def test_recover_finishes_an_interrupted_publish_and_removes_only_its_own_siblings(saved):
    token = "0" * 32
    tmp = saved.parent / f".ckpt.replaybuf-tmp-{token}"
    shutil.copytree(saved, tmp)  # a complete new checkpoint...
    saved.rename(saved.parent / f".ckpt.replaybuf-old-{'1' * 32}")  # ...killed between renames
    unrelated = [
        saved.parent / ".ckpt.replaybuf-tmp-notahexuuid",
        saved.parent / ".other.replaybuf-tmp-" / "x",
        saved.parent / "ckpt.bak",
    ]
    for path in unrelated:
        path.mkdir(parents=True)
    actions = recover(saved)
    assert actions == [
        f"renamed .ckpt.replaybuf-tmp-{token} to ckpt",
        f"removed .ckpt.replaybuf-old-{'1' * 32}",
    ]
    assert read_checkpoint(saved).meta == {"cursor": 7}
    assert all(path.exists() for path in unrelated)
    assert recover(saved) == []


def test_recover_leaves_a_live_writers_folder_alone(saved):
    import fcntl

    live = saved.parent / f".ckpt.replaybuf-tmp-{'a' * 32}"
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert recover(saved) == []
        read_checkpoint(saved).close()
        assert live.exists()
    finally:
        os.close(fd)
    assert recover(saved) == [f"removed {live.name}"]


def test_concurrent_writers_and_readers_see_only_whole_checkpoints(tmp_path):
    directory = tmp_path / "ckpt"
    write_checkpoint(directory, KIND, {"seed": 0}, {"a": torch.zeros(64, 64)})
    done = threading.Event()
    failures: list[BaseException] = []
    reads = []

    def writer(offset: int) -> None:
        try:
            for seed in range(offset, offset + 20, 2):
                tensors = {"a": torch.full((64, 64), float(seed)), "b/c": torch.full((9,), seed)}
                write_checkpoint(directory, KIND, {"seed": seed}, tensors)
        except BaseException as exc:
            failures.append(exc)

    def reader() -> None:
        try:
            while not done.is_set():
                with read_checkpoint(directory, KIND) as checkpoint:
                    seed = checkpoint.meta["seed"]
                    for name in checkpoint.tensors:
                        assert bool((checkpoint.load(name) == seed).all()), (name, seed)
                reads.append(seed)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in (1, 2)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads + readers:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    for thread in readers:
        thread.join()
    assert failures == []
    assert reads
    assert read_checkpoint(directory).meta["seed"] in (19, 20)
    assert siblings(directory) == []


@pytest.mark.parametrize(
    ("error", "builtins"),
    [
        (CheckpointError, (RuntimeError,)),
        (NoCheckpointError, (FileNotFoundError, RuntimeError)),
        (CorruptCheckpointError, (ValueError,)),
        (UnsafeCheckpointError, (ValueError,)),
        (CheckpointKindError, (ValueError,)),
        (UnsupportedVersionError, (ValueError,)),
    ],
)
def test_checkpoint_errors_are_replaybuf_errors_and_the_builtins_callers_expect(error, builtins):
    assert issubclass(error, ReplayBufError)
    assert issubclass(error, CheckpointError)
    assert all(issubclass(error, builtin) for builtin in builtins)


# ---------------------------------------------------------------------------------------------
# crash safety: a subprocess killed while overwriting checkpoint 1 with checkpoint 2

_EXPECTED: dict[int, dict[str, torch.Tensor]] = {}


@pytest.fixture(scope="module")
def crash_server():
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    proc = subprocess.Popen(
        [sys.executable, str(HELPER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )

    def call(**request):
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f"crash helper died with {proc.poll()}"
        return json.loads(line)

    yield call
    proc.stdin.close()
    proc.wait(timeout=30)


def load_exactly_one(directory: Path) -> int:
    """The seed of the checkpoint at ``directory``, after checking every value against it."""
    with read_checkpoint(directory, KIND) as checkpoint:
        seed = checkpoint.meta["seed"]
        assert seed in (1, 2)
        expected = _EXPECTED.setdefault(seed, make_tensors(seed))
        assert sorted(checkpoint.tensors) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(checkpoint.load(name), tensor), f"{name} of seed {seed} differs"
    assert siblings(directory) == [], "orphans left after recovery"
    return seed


def state_before_recovery(directory: Path) -> str:
    names = siblings(directory)
    parts = ["D" if directory.exists() else "no D"]
    for role in ("tmp", "old"):
        found = [n for n in names if f".replaybuf-{role}-" in n]
        if found:
            complete = (directory.parent / found[0] / "MANIFEST.json").exists()
            parts.append(f"{role}{'+manifest' if complete else ''}")
    return ", ".join(parts)


CRASH_PHASES = [
    ("after_tmp_created", 1),
    ("after_data_chunk", 1),
    ("after_data_chunk:3", 1),
    ("after_data_file", 1),
    ("after_data_file:4", 1),
    ("before_manifest", 1),
    ("after_manifest", 1),
    ("after_old_renamed", 2),
    ("after_publish_rename", 2),
    ("before_old_removed", 2),
    ("during_old_removal", 2),
]


@pytest.mark.parametrize(("phase", "expected"), CRASH_PHASES)
def test_kill_at_each_phase_leaves_the_old_or_the_new_checkpoint(
    crash_server, tmp_path, phase, expected
):
    directory = tmp_path / "ckpt"
    reply = crash_server(op="save", dir=str(directory), first=1, second=2, crash_at=phase)
    assert reply["signal"] == 9, reply  # the phase was reached
    assert load_exactly_one(directory) == expected


def test_kill_at_random_moments_leaves_the_old_or_the_new_checkpoint(crash_server, tmp_path):
    durations = []
    for run in range(3):  # how long overwriting seed 1 with seed 2 takes, uninterrupted
        reply = crash_server(op="save", dir=str(tmp_path / f"calibrate{run}"), first=1, second=2)
        assert reply["exit"] == 0
        durations.append(reply["seconds"])
    save_seconds = sorted(durations)[1]
    rng = random.Random(20240601)
    outcomes = []
    for trial in range(15):
        directory = tmp_path / f"trial{trial}" / "ckpt"
        delay = rng.uniform(0, save_seconds)
        reply = crash_server(op="save", dir=str(directory), first=1, second=2, kill_after=delay)
        state = state_before_recovery(directory)
        outcomes.append((f"{delay:.3f}s", reply["signal"], state, load_exactly_one(directory)))
    print(
        f"\nan overwrite takes {save_seconds:.3f}s; (delay, signal, state before recovery, loaded):"
    )
    print("\n".join(map(str, outcomes)))


@pytest.mark.parametrize(
    ("phase", "outcome"),
    [("after_data_file:2", None), ("before_manifest", None), ("after_manifest", 2)],
)
def test_kill_during_a_first_save(crash_server, tmp_path, phase, outcome):
    directory = tmp_path / "ckpt"
    reply = crash_server(op="save", dir=str(directory), first=None, second=2, crash_at=phase)
    assert reply["signal"] == 9
    if outcome is None:
        with pytest.raises(NoCheckpointError, match=r"no complete checkpoint in .*ckpt"):
            read_checkpoint(directory, KIND)
        assert sorted(tmp_path.iterdir()) == []
    else:
        assert load_exactly_one(directory) == outcome


def test_kill_during_recovery_is_recovered_again(crash_server, tmp_path):
    directory = tmp_path / "ckpt"
    crash_server(op="save", dir=str(directory), first=1, second=2, crash_at="after_old_renamed")
    reply = crash_server(op="read", dir=str(directory), crash_at="recover_after_rename")
    assert reply["signal"] == 9
    assert state_before_recovery(directory) == "D, old+manifest"
    assert load_exactly_one(directory) == 2


def test_a_source_rewritten_while_it_streams_still_matches_its_sha256(tmp_path, monkeypatch):
    # An episode buffer's snapshot streams whole columns up to its high-water mark; free rows
    # in that range may be rewritten by appends meanwhile. Whatever bytes are hashed must be
    # the bytes written: here the source changes right after each chunk is hashed.
    source = torch.arange(4096, dtype=torch.int64)
    monkeypatch.setattr(ckpt_streams, "CHUNK_BYTES", 8 * 1024)  # 4 chunks
    original = ckpt_streams.Sha256.update

    def update_then_rewrite(self, data):
        original(self, data)
        source.add_(1)  # an append landing in a free row, mid-stream

    monkeypatch.setattr(ckpt_streams.Sha256, "update", update_then_rewrite)
    nbytes, digest = ckpt_writer._write_tensor(tmp_path / "t.bin", source, durable=False)
    written = (tmp_path / "t.bin").read_bytes()
    assert nbytes == len(written) == 4096 * 8
    assert hashlib.sha256(written).hexdigest() == digest
