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


@pytest.fixture(scope="module")
def tiny(bench, tmp_path_factory):
    """One run of the suite in its tiny mode (seconds), shared by the tests that read it."""
    scratch = tmp_path_factory.mktemp("suite")
    threads = torch.get_num_threads()
    try:
        report = bench["suite"].run(bench["suite"].TINY, scratch)
    finally:
        torch.set_num_threads(threads)  # the suite runs single-threaded
    return report, scratch


@pytest.mark.slow
def test_tiny_suite_runs_every_section(bench, tiny, tmp_path):
    suite = bench["suite"]
    report, scratch = tiny
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
    assert not list(scratch.glob("replaybuf-*"))  # every buffer closed


@pytest.mark.slow
def test_tiny_suite_judges_scaling_by_the_ratio_at_every_size(bench, tiny):
    """W1 and W2 (tensor, memmap) are timed beside their floor at every stored size, and each
    row passes iff every size's ratio of medians is within 1.2x; the ratios are in its text."""
    suite, peers = bench["suite"], bench["peers"]
    report, _ = tiny
    sc = report["scaling_steps"]
    sizes = list(suite.TINY.scale_sizes)
    assert sc["sizes"] == sizes
    assert sc["nstep"]["skipped"] == {}  # tiny sizes always fit
    rows = {r.workload: r for r in suite.rows_of(report)}
    sources = {"W1": sc["points"], "W2": sc["nstep"]["points"]}
    found = 0
    for workload, points in sources.items():
        for kind in (peers.RB_TENSOR, peers.RB_MEMMAP):
            storage = kind.split()[1]
            (name,) = [
                n
                for n in rows
                if n.startswith(f"scaling: {workload} ") and n.endswith(f", {storage}")
            ]
            row = rows[name]
            assert sorted(points) == sizes
            ratios = [
                (points[s][kind]["median"] / points[s][kind]["items"])
                / (points[s][peers.FLOOR]["median"] / points[s][peers.FLOOR]["items"])
                for s in sizes
            ]
            assert row.ratio == pytest.approx(max(ratios))
            assert row.ok is all(r <= 1.2 for r in ratios)
            assert row.target.startswith("<=1.2x the floor at every size")
            for s, r in zip(sizes, ratios, strict=True):
                assert f"{suite.count(s)} {r:.2f}x" in row.target
            found += 1
    assert found == 4
    # the episode-count row is still judged by its spread
    (episodes,) = [n for n in rows if n.startswith("scaling: n-step sample")]
    assert rows[episodes].target.startswith("max/min <=1.3x")


def point(floor_us: float, ours_us: float) -> dict:
    """A fake interleaved result: the floor's and replaybuf's median seconds per call."""
    return {
        name: {"median": us * 1e-6, "min": us * 1e-6, "items": 1, "runs": [us * 1e-6]}
        for name, us in (("floor", floor_us), ("replaybuf tensor", ours_us))
    }


def test_scaling_verdict_follows_the_floor_not_the_spread(bench):
    """A floor that grows 5x over the sizes does not fail replaybuf growing with it; one size
    over 1.2x fails the row even when the spread is flat; an untimed size is a FAIL that says
    why."""
    verdict = bench["suite"].scaling_verdict
    sizes = [10_000, 100_000, 1_000_000, 10_000_000]
    growing = {s: point(20 * 2**i, 22 * 2**i) for i, s in enumerate(sizes)}  # 8x spread, 1.1x
    ok, text = verdict(growing, "replaybuf tensor", sizes, {})
    assert ok
    assert text == "<=1.2x the floor at every size: 10k 1.10x, 100k 1.10x, 1M 1.10x, 10M 1.10x"
    flat = {s: point(50, 50) for s in sizes} | {1_000_000: point(50, 61)}  # 1.22x at 1M
    ok, text = verdict(flat, "replaybuf tensor", sizes, {})
    assert not ok
    assert "1M 1.22x" in text
    partial = {s: growing[s] for s in sizes[:3]}
    ok, text = verdict(partial, "replaybuf tensor", sizes, {10_000_000: "needs ~5 GiB RAM"})
    assert not ok
    assert text.endswith("10M not timed (needs ~5 GiB RAM)")


def test_scaling_nstep_says_which_sizes_do_not_fit(bench, tmp_path, monkeypatch):
    suite = bench["suite"]
    monkeypatch.setattr(suite, "memory_available", lambda: 0)  # no memory free
    out = suite.scaling_nstep(suite.TINY, tmp_path)
    assert out["points"] == {}
    assert set(out["skipped"]) == set(suite.TINY.scale_sizes)
    assert all("GiB RAM" in why for why in out["skipped"].values())


def test_nstep_memory_estimate_covers_what_is_built(bench, tmp_path):
    """The memory guard's estimate is at least what the episodes, floor and buffer hold."""
    suite, peers = bench["suite"], bench["peers"]
    count, length = 20, 100
    eps = peers.random_episodes(count, length)
    held = sum(t.numel() * t.element_size() for t in (eps.obs, eps.action, eps.reward))
    floor = peers.floor_nstep(eps, 3, 0.99, 256)
    built, _ = peers.replaybuf_nstep(eps, 3, 0.99, 256, tmp_path)
    try:
        need = suite.nstep_bytes(count, length)
        assert need["ram"] >= held + floor.stored_bytes + built.stored_bytes
        assert need["disk"] >= built.stored_bytes
    finally:
        built.close()


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
