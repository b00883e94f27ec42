"""The README's Python snippets and the quick start example run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
# Modules from the extras (examples, sb3, ray) that a snippet uses, by what it mentions: such a
# snippet is skipped where its extra is not installed (CI installs them all).
EXTRAS = {
    "gymnasium": r"\bgymnasium\b|\bGymEnv\b",
    "stable_baselines3": r"\bstable_baselines3\b",
    "ray": r"^\s*(import|from) ray\b",
}


def test_readme_has_python_snippets() -> None:
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_readme_snippet_runs_and_cleans_up(
    snippet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module, mentioned in EXTRAS.items():
        if re.search(mentioned, snippet, re.MULTILINE):
            pytest.importorskip(module)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # buffers' default scratch parent
    namespace: dict = {"__name__": "readme"}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert not list(tmp_path.glob("replaybuf-*")), "the snippet left memmap files behind"


def test_quickstart_example_runs(tmp_path: Path) -> None:
    env = {**os.environ, "QUICKSTART_STEPS": "200", "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "ReplayBuffer: 200 stored of 512" in result.stdout
    assert "EpisodeReplayBuffer:" in result.stdout
    assert not list(tmp_path.glob("replaybuf-*")), "the example left memmap files behind"
