"""The training examples run top to bottom in their smoke mode (tiny step counts).

Each one runs as a subprocess with this interpreter, writes its plot into ``tmp_path`` (never
into the repository) and its memmap scratch folders under a private ``TMPDIR`` that must be empty
afterwards. Skipped without the ``examples`` extra (gymnasium, matplotlib).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("matplotlib")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_example(tmp_path: Path, name: str, *flags: str) -> str:
    """Run ``examples/<name>`` with ``flags`` and ``--out-dir tmp_path/out``; its stdout."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *flags, "--out-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        # PYTHONPATH: the examples import this checkout's replaybuf, as the tests do
        env={**os.environ, "TMPDIR": str(scratch), "PYTHONPATH": str(EXAMPLES.parent)},
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert list(scratch.iterdir()) == [], "the example left files in its temp folder"
    return result.stdout


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} was not written"
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 10_000  # a drawn figure, not an empty canvas


def curve_steps(stdout: str, prefix: str = "") -> list[int]:
    return [int(s) for s in re.findall(rf"^{re.escape(prefix)}step\s+(\d+)\s", stdout, re.M)]


def test_dqn_cartpole_smoke(tmp_path: Path) -> None:
    out = run_example(
        tmp_path,
        "dqn_cartpole.py",
        *("--total-steps", "300", "--learning-starts", "100"),
        *("--eval-every", "100", "--eval-episodes", "2"),
    )
    assert re.search(r"^learning starts after \d+ env steps \(\d+ valid steps stored\)", out, re.M)
    steps = curve_steps(out)
    assert len(steps) >= 2, out
    assert steps == sorted(steps), out
    assert steps[-1] == 300, out  # a last evaluation when the budget ends
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert all(re.search(r"recent return .* eval .* ± .* wall", line) for line in lines), out
    # every collector task wrote episodes, every step of the 300 is in the buffer
    assert re.search(r"^buffer: .* from 4 collectors, (29[6-9]|300) valid steps$", out, re.M), out
    assert "solved" not in out  # 300 steps cannot balance the pole for 475
    assert_png(tmp_path / "out" / "dqn_cartpole.png")


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_dqn_cartpole_prioritized_smoke(tmp_path: Path, monkeypatch, backend: str) -> None:
    # "auto" takes the numba kernels where they load, else TorchRL's segment trees where its
    # extension loads; "torch" with REPLAYBUF_NUMBA=0 forces the numpy priority index (the
    # fallback), through the environment variables.
    monkeypatch.setenv("REPLAYBUF_PRIORITY_BACKEND", backend)
    monkeypatch.setenv("REPLAYBUF_NUMBA", "1" if backend == "auto" else "0")
    out = run_example(
        tmp_path,
        "dqn_cartpole.py",
        *("--prioritized", "--total-steps", "300", "--learning-starts", "100"),
        *("--eval-every", "100", "--eval-episodes", "2"),
    )
    steps = curve_steps(out)
    assert steps, out
    assert steps[-1] == 300, out
    # finite losses: the importance-weighted loss and the priority updates went through
    losses = [float(x) for x in re.findall(r"loss\s+(\S+)\s+eps", out)]
    assert losses, out
    assert all(math.isfinite(x) for x in losses), out
    assert re.search(r"^buffer: .* from 4 collectors, (29[6-9]|300) valid steps$", out, re.M), out
    # beta, annealed from 0.4 towards 1.0 over the 300 steps through set_beta, ends near 1
    found = re.search(
        r"^prioritized replay: backend (torch|torchrl-segment-tree), alpha 0.6, "
        r"beta annealed to (\S+)$",
        out,
        re.M,
    )
    assert found, out
    assert backend == "auto" or found.group(1) == backend, out
    assert 0.9 < float(found.group(2)) <= 1.0, out
    assert_png(tmp_path / "out" / "dqn_cartpole.png")


def test_sac_pendulum_smoke(tmp_path: Path) -> None:
    out = run_example(
        tmp_path,
        "sac_pendulum.py",
        *("--total-steps", "300", "--learning-starts", "100"),
        *("--eval-every", "100", "--eval-episodes", "2", "--hidden", "32"),
    )
    assert curve_steps(out) == [100, 200, 300], out
    # Pendulum's 200-step time limit ended the first episode as a truncation, not a termination
    assert "buffer: 2 episodes (1 truncated, 0 terminated, 1 in progress), 299 valid steps" in out
    assert re.search(r"^device (cpu|cuda\S*): networks and batches \(sample_n_step", out, re.M)
    assert_png(tmp_path / "out" / "sac_pendulum.png")


def test_checkpoint_resume_smoke(tmp_path: Path) -> None:
    out = run_example(
        tmp_path,
        "checkpoint_resume.py",
        *("--total-steps", "400", "--learning-starts", "100", "--eval-every", "50"),
        *("--eval-episodes", "2", "--checkpoint-every", "100", "--kill-at-step", "250"),
        *("--no-durable", "--no-reference"),  # the full run compares with a reference run too
    )
    assert "[run 1] --- SIGKILL at step >= 250 ---" in out, out
    resumed = re.search(r"^\[run 2\] resumed from ckpt-0*(\d+): step (\d+), ", out, re.M)
    assert resumed, out
    step = int(resumed.group(2))
    assert int(resumed.group(1)) == step  # LATEST named the checkpoint of that step
    assert step in (200, 300)  # the last checkpoint before the kill landed
    assert "episodes in progress continue" in out
    run2 = curve_steps(out, "[run 2] ")
    assert run2, out
    assert run2[0] > step, out  # it continued from the checkpoint, not from the start
    assert run2[-1] == 350, out
    assert "[run 2] finished: step 400" in out
    # counts decide every turn, so steps redone after the resume repeat run 1 number for number
    assert re.search(r"^run 2 redid [01] curve point\(s\) .*: identical$", out, re.M), out
    assert_png(tmp_path / "out" / "checkpoint_resume.png")
