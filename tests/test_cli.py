"""``python -m replaybuf inspect / verify``, run as a user would: in a subprocess.

Each run imports torch and TorchRL (seconds), so the subprocesses are started at once by one
fixture and the tests read their results; a few extra cases call ``main`` in-process.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import replaybuf
from replaybuf import ReplayBuffer, cli
from replaybuf.cli import main
from replaybuf.persist.format import write_checkpoint
from replaybuf.persist.format.names import seal

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
    assert "format_version  2" in out
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
    manifest.write_text(json.dumps(seal(document)))
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
    manifest.write_text(json.dumps(seal(document)))
    assert main(["verify", str(directory)]) == 1
    assert "index/anchors' expected shape [4]" in capsys.readouterr().out  # from valid_steps


# ----------------------------------------------------------------- populate
def populate(out: Path, *extra: str, steps: int = 60) -> list[str]:
    return ["populate", "--env", "CartPole-v1", "--steps", str(steps), "--out", str(out), *extra]


def test_populate_writes_a_checkpoint_that_inspect_reads(tmp_path, capsys):
    pytest.importorskip("gymnasium")
    out = tmp_path / "populated"
    assert main(populate(out, "--num-envs", "2", "--seed", "0", steps=120)) == 0
    printed = capsys.readouterr()
    assert "collected 120 steps" in printed.out
    assert "saved 120 steps in " in printed.out
    assert "collect:" not in printed.err  # no progress bar: stderr is not a terminal here
    assert main(["inspect", str(out)]) == 0
    inspected = capsys.readouterr().out
    assert "kind            EpisodeReplayBuffer" in inspected
    assert "steps=120, valid_steps=120" in inspected
    assert "in_progress 0" in inspected
    assert main(["verify", str(out)]) == 0


def test_populate_loads_back_as_an_episode_buffer(tmp_path, capsys):
    pytest.importorskip("gymnasium")
    from replaybuf import SyncEpisodeReplayBuffer

    out = tmp_path / "runs" / "starter"  # missing parents are created by the save
    args = populate(out, "--num-envs", "3", "--seed", "1", "--max-episode-steps", "10")
    assert main(args) == 0
    assert "collected 60 steps" in capsys.readouterr().out
    with SyncEpisodeReplayBuffer.load_checkpoint(out, scratch_dir=tmp_path) as buf:
        stats = buf.stats()
        assert len(buf) == 60
        assert stats["in_progress"] == 0
        assert stats["agents"].keys() == {"env-0", "env-1", "env-2"}
        assert all(int(e["length"]) <= 10 for e in buf.sample_episodes(100))


def test_populate_refuses_to_replace_a_checkpoint_without_force(tmp_path, capsys):
    pytest.importorskip("gymnasium")
    out = tmp_path / "starter"
    assert main(populate(out, "--seed", "0")) == 0
    before = (out / "MANIFEST.json").read_bytes()
    capsys.readouterr()
    assert main(populate(out, steps=30)) == 2
    assert "--out: " in capsys.readouterr().err
    assert (out / "MANIFEST.json").read_bytes() == before
    assert main(populate(out, "--force", steps=30)) == 0
    assert "collected 30 steps" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("make_out", "match"),
    [
        (lambda tmp: tmp / "file.txt" / "ckpt", "--out: .*file.txt is not a folder"),
        (lambda tmp: tmp / "file.txt", "--out: .*file.txt exists and is not a folder"),
        (lambda tmp: tmp / "photos", "--out: .*photos is a non-empty folder that is not a"),
    ],
)
def test_populate_refuses_an_unusable_out_and_writes_nothing(tmp_path, capsys, make_out, match):
    (tmp_path / "file.txt").write_text("keep me")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"meow")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(populate(make_out(tmp_path))) == 2
    err = capsys.readouterr().err
    assert re.search(f"replaybuf populate: error: {match}", err), err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "file.txt").read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_populate_refuses_a_read_only_parent(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert main(populate(locked / "ckpt")) == 2
    assert "--out: cannot write in" in capsys.readouterr().err


def test_populate_names_an_unknown_environment(tmp_path, capsys):
    pytest.importorskip("gymnasium")
    args = ["populate", "--env", "NoSuchEnv-v0", "--steps", "10", "--out", str(tmp_path / "x")]
    assert main(args) == 2
    assert "--env: cannot make 'NoSuchEnv-v0'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_an_interrupted_populate_writes_nothing(tmp_path, capsys, monkeypatch):
    pytest.importorskip("gymnasium")
    collect_module = importlib.import_module("replaybuf.collecting")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(collect_module, "collect", interrupted)
    assert main(populate(tmp_path / "ckpt")) == 130
    assert "replaybuf populate: interrupted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", [["--steps", "0"], ["--num-envs", "x"]])
def test_populate_bad_numbers_are_usage_errors(tmp_path, capsys, flag):
    args = ["populate", "--env", "CartPole-v1", "--steps", "5", "--out", str(tmp_path), *flag]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert f"argument {flag[0]}: expected an integer" in capsys.readouterr().err


# ----------------------------------------------------------------- bench
def test_bench_runs_the_suite_quick_mode_and_returns_its_status(tmp_path, monkeypatch, capfd):
    suite = tmp_path / "benchmarks" / "suite.py"
    suite.parent.mkdir()
    suite.write_text(
        "import os, sys\n"
        "print('| workload | replaybuf |', sys.argv[1:], os.getcwd())\n"
        "sys.exit(0 if sys.argv[1:] == ['--quick'] else 5)\n"
    )
    monkeypatch.setattr(cli, "suite_path", lambda: suite)
    assert main(["bench"]) == 0
    out = capfd.readouterr().out
    assert "| workload | replaybuf | ['--quick']" in out
    assert out.strip().endswith(str(tmp_path))  # run from the checkout's root
    suite.write_text("import sys\nsys.exit(3)\n")
    assert main(["bench"]) == 3


def test_bench_without_the_suite_says_so_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "suite_path", lambda: tmp_path / "benchmarks" / "suite.py")
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "replaybuf bench: error: no benchmark suite at " in err
    assert "source checkout" in err


def test_suite_path_is_benchmarks_suite_py_beside_the_package():
    import replaybuf

    root = Path(replaybuf.__file__).resolve().parents[1]
    assert cli.suite_path() == root / "benchmarks" / "suite.py"


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out.strip()
    assert printed == f"replaybuf {importlib.metadata.version('replaybuf')}"


def test_version_falls_back_to_the_package_version(capsys, monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"replaybuf {replaybuf.__version__}"
