"""benchmarks/suite.py: its core runs in a tiny mode, and its n-step checker can fail.

The checker is what makes the W2 row mean something: it must flag an n-step implementation
that runs windows into the next episode or bootstraps from a terminal observation, and pass
the correct ones (the raw floor and replaybuf). Peers that are not installed are skipped.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """The benchmark modules (benchmarks/ is a folder of scripts, not a package)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield {
            name: importlib.import_module(name)
            for name in ("harness", "peers", "nstep_check", "suite", "bench_cuda")
        }
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture
def one_thread():
    """The suite runs single-threaded; give the rest of the session its threads back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_checker_passes_the_floor_and_replaybuf(bench, tmp_path):
    check = bench["nstep_check"]
    eps = check.toy_episodes()
    floor = check.check("floor", check.floor_draw(eps), eps)
    draw, close = check.replaybuf_draw(eps, tmp_path)
    try:
        ours = check.check("replaybuf", draw, eps)
    finally:
        close()
    for report in (floor, ours):
        assert report["correct"], report["examples"]
        assert report["distinct_steps"] == eps.steps  # every toy step was drawn and checked


def test_checker_catches_windows_that_cross_episodes(bench):
    check = bench["nstep_check"]
    eps = check.toy_episodes()
    report = check.check("broken", check.floor_draw(eps, respect_ends=False), eps)
    assert not report["correct"]
    assert report["wrong"]["reward"] > 0
    assert report["wrong"]["next_obs"] > 0
    assert report["wrong"]["bootstrap"] > 0
    assert "WRONG" in check.summary(report)


@pytest.mark.parametrize(
    ("field", "mutate"),
    [
        # bootstraps from a terminated episode's final observation (done lost near the end)
        ("bootstrap", lambda got: {**got, "bootstrap": np.full_like(got["bootstrap"], 0.125)}),
        # the next observation one step too far
        ("next_obs", lambda got: {**got, "next_id": got["next_id"] + 1}),
        # an undiscounted return
        ("reward", lambda got: {**got, "reward": got["reward"] * 1.5}),
    ],
)
def test_checker_catches_each_wrong_quantity(bench, field, mutate):
    check = bench["nstep_check"]
    eps = check.toy_episodes()
    draw = check.floor_draw(eps)
    report = check.check("mutated", lambda: mutate(draw()), eps)
    assert not report["correct"]
    assert report["wrong"][field] > 0


@pytest.mark.parametrize(("peer", "module"), [("cpprb", "cpprb"), ("sb3", "stable_baselines3")])
def test_peer_checks_run(bench, peer, module):
    pytest.importorskip(module)
    check = bench["nstep_check"]
    eps = check.toy_episodes()
    draw = {"cpprb": check.cpprb_draw, "sb3": check.sb3_draw}[peer](eps)
    report = check.check(peer, draw, eps)
    assert report["checked"] == check.DRAWS * check.SAMPLE_BATCH
    assert isinstance(report["correct"], bool)


def test_torchrl_multistep_check_runs(bench):
    check = bench["nstep_check"]
    eps = check.toy_episodes()
    report = check.check("torchrl", check.torchrl_draw(eps), eps)
    assert report["checked"] > 0
    assert isinstance(report["correct"], bool)


@pytest.mark.slow
def test_tiny_suite_runs_every_section(bench, tmp_path, one_thread):
    suite = bench["suite"]
    report = suite.run(suite.TINY, tmp_path)
    rows = suite.rows_of(report)
    names = [r.workload for r in rows]
    for prefix in ("W1", "W2", "W3", "W4", "W5", "scaling", "memory"):
        assert any(n.startswith(prefix) for n in names), prefix
    assert any("against the frame floor" in n for n in names)  # frame_stack=4 beside its floor
    assert {r.verdict for r in rows} <= {"PASS", "FAIL", "-"}
    assert report["nstep_check"]["replaybuf"]["correct"]
    assert report["machine"]["cores"] >= 1
    assert len(report["machine"]["load_average"]) == 3
    assert report["versions"]["torch"] == torch.__version__
    table = suite.format_rows(rows)
    assert "PASS/FAIL" in table.splitlines()[0]
    json.dumps(report, default=str)  # the report is what --json writes
    png = tmp_path / "scaling.png"
    suite.plot(report, png)
    assert png.stat().st_size > 0
    assert not list(tmp_path.glob("replaybuf-*"))  # every buffer closed


@pytest.mark.slow
def test_cuda_bench_runs_every_section_on_the_cpu(bench, tmp_path, capsys):
    """bench_cuda.py's code paths without a GPU (``--device cpu``); on CUDA it is run by hand."""
    out = tmp_path / "bench_cuda.json"
    assert bench["bench_cuda"].main(["--tiny", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    sections = {row["section"] for row in report["rows"]}
    assert sections == {"GPU storage", "CPU memmap -> GPU", "inserts into GPU storage"}
    assert {row["verdict"] for row in report["rows"]} <= {"PASS", "FAIL", "-"}
    assert all(row["syncs"] in ("", "n/a") for row in report["rows"])  # only checked on CUDA
    assert report["gpu_storage"]["w3_bytes_per_step"]["replaybuf frame_stack=4"] < 8_000
    assert "| W1 sample_batch(256) |" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_bench_without_a_gpu_says_so(bench, capsys):
    assert bench["bench_cuda"].main(["--tiny"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
