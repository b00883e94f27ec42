"""``python -m replaybuf inspect / verify``, run as a user would: in a subprocess.

Each run imports torch and TorchRL (seconds), so the subprocesses are started at once by one
fixture and the tests read their results; a few extra cases call ``main`` in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replaybuf import ReplayBuffer
from replaybuf.checkpoint import write_checkpoint
from replaybuf.cli import main

OBS_FILE = "data/rows/obs.bin"


def make_checkpoint(directory: Path, scratch: Path) -> Path:
    with ReplayBuffer("cpu", "cpu", 8, storage="memmap", scratch_dir=scratch, seed=0) as buf:
        buf.add_batch(
            {
                "obs": torch.randn(11, 4),
                "action": torch.arange(11),
                "next": {"obs": torch.randn(11, 4)},
            }
        )
        return buf.save_checkpoint(directory)


def damage(directory: Path, how: str) -> Path:
    path = directory / OBS_FILE
    if how == "truncate":
        os.truncate(path, 100)
    else:
        raw = bytearray(path.read_bytes())
        raw[33] ^= 0x10
        path.write_bytes(raw)
    return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every command of this module, run concurrently, by name."""
    root = tmp_path_factory.mktemp("cli")
    scratch = root / "scratch"
    scratch.mkdir()
    good = make_checkpoint(root / "good", scratch)
    episodes = write_checkpoint(
        root / "episodes",
        "EpisodeReplayBuffer",
        {"steps": 40, "episodes_by_status": {"terminated": 3, "truncated": 1, "in_progress": 2}},
        {"steps/observation": torch.zeros(40, 3)},
    )
    truncated = damage(make_checkpoint(root / "truncated", scratch), "truncate")
    flipped = damage(make_checkpoint(root / "flipped", scratch), "flip")
    (root / "photos").mkdir()
    (root / "photos" / "cat.jpg").write_bytes(b"meow")
    commands = {
        "inspect": ["inspect", str(good)],
        "inspect_episodes": ["inspect", str(episodes)],
        "inspect_missing": ["inspect", str(root / "nothing")],
        "verify": ["verify", str(good)],
        "verify_truncated": ["verify", str(truncated)],
        "verify_flipped": ["verify", str(flipped)],
        "verify_foreign": ["verify", str(root / "photos")],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "replaybuf", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def test_inspect_prints_kind_version_fields_size_and_bytes(runs):
    result = runs["inspect"]
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "kind            ReplayBuffer" in out
    assert "format_version  1" in out
    assert "size            8 of 8" in out
    assert "pointer=3" in out
    for line in ("rows/obs  float32  [8, 4]", "rows/action  int64  [8]", "rows/next/obs"):
        assert " ".join(line.split()) in " ".join(out.split()), line
    assert "128 B" in out  # rows/obs: 8 x 4 x 4 bytes


def test_inspect_json_is_the_checkpoint_summary(tmp_path, capsys):  # in-process: cheaper
    assert main(["inspect", str(make_checkpoint(tmp_path / "ckpt", tmp_path)), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == "ReplayBuffer"
    assert summary["tensors"]["rows/obs"] == {"shape": [8, 4], "dtype": "float32", "bytes": 128}
    assert summary["meta"]["capacity"] == 8


def test_inspect_lists_episodes_by_status(runs):
    result = runs["inspect_episodes"]
    assert result.returncode == 0, result.stderr
    assert "kind            EpisodeReplayBuffer" in result.stdout
    assert "episodes        terminated 3, truncated 1, in_progress 2" in result.stdout
    assert "steps=40" in result.stdout


def test_verify_says_ok_for_a_sound_checkpoint(runs):
    result = runs["verify"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OK: ")
    assert "every sha256 checked" in result.stdout


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("verify_truncated", f"{OBS_FILE}: expected 128 bytes, got 100"),
        ("verify_flipped", f"{OBS_FILE}: sha256 expected"),
        ("verify_foreign", "no complete checkpoint in"),
    ],
)
def test_verify_fails_naming_the_damaged_file(runs, name, match):
    result = runs[name]
    assert result.returncode == 1
    assert result.stdout.startswith("FAILED: ")
    assert match in result.stdout


def test_user_errors_print_one_message_and_no_traceback(runs):
    assert runs["inspect_missing"].returncode == 1
    assert "replaybuf inspect: error: no complete checkpoint in" in runs["inspect_missing"].stderr
    for name, result in runs.items():
        assert "Traceback" not in result.stderr + result.stdout, name


def test_a_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_verify_applies_the_buffers_own_checks(tmp_path, capsys):  # in-process: cheaper
    directory = make_checkpoint(tmp_path / "ckpt", tmp_path)
    manifest = directory / "MANIFEST.json"
    document = json.loads(manifest.read_text())
    document["meta"]["size"] = 9  # every file is intact; the meta is not
    manifest.write_text(json.dumps(document))
    assert main(["verify", str(directory)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED: ")
    assert "meta 'size' expected in [0, 8], got 9" in out


def test_verify_applies_the_episode_buffers_own_checks(tmp_path, capsys):
    from replaybuf import SyncEpisodeReplayBuffer

    with SyncEpisodeReplayBuffer(20, scratch_dir=tmp_path, seed=0) as buf:
        episode = buf.start_episode()
        for t in range(4):
            buf.append_observation_action_reward(episode, torch.full((2,), float(t)), t, 1.0)
        directory = buf.save_checkpoint(tmp_path / "episodes")
    assert main(["verify", str(directory)]) == 0
    assert capsys.readouterr().out.startswith("OK: ")
    manifest = directory / "MANIFEST.json"
    document = json.loads(manifest.read_text())
    document["meta"]["valid_steps"] = 4  # files intact; the anchors hold 3
    manifest.write_text(json.dumps(document))
    assert main(["verify", str(directory)]) == 1
    assert "disagree with the episode table" in capsys.readouterr().out
