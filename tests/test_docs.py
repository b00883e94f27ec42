"""The Python snippets of README.md and docs/*.md, and the quick start example, run as written.

A ```python block is executed; a block that cannot run in a test (a Ray cluster, a GPU) is
fenced as ```py, ```text or ```bash instead, and is not.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPETS = [
    (page.relative_to(ROOT).as_posix(), i, code)
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL))
]
# Modules from the extras (examples, sb3, ray) that a snippet uses, by what it mentions: such a
# snippet is skipped where its extra is not installed (CI installs them all).
EXTRAS = {
    "gymnasium": r"\bgymnasium\b|\bGymEnv\b",
    "stable_baselines3": r"\bstable_baselines3\b",
    "ray": r"^\s*(import|from) ray\b",
}


def test_readme_has_python_snippets() -> None:
    assert sum(page == "README.md" for page, _, _ in SNIPPETS) >= 2


def test_every_docs_page_is_linked_from_the_docs_index() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    for page in PAGES[1:]:
        if page.name != "README.md":
            assert f"({page.name})" in index, f"docs/README.md does not link {page.name}"


@pytest.mark.parametrize(
    ("page", "snippet"),
    [(page, code) for page, _, code in SNIPPETS],
    ids=[f"{page}-snippet{i}" for page, i, _ in SNIPPETS],
)
def test_snippet_runs_and_cleans_up(
    page: str, snippet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module, mentioned in EXTRAS.items():
        if re.search(mentioned, snippet, re.MULTILINE):
            pytest.importorskip(module)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # buffers' default scratch parent
    namespace: dict = {"__name__": "docs_snippet"}
    exec(compile(snippet, page, "exec"), namespace)
    assert not list(tmp_path.glob("replaybuf-*")), "the snippet left memmap files behind"


def test_quickstart_example_runs(tmp_path: Path) -> None:
    env = {**os.environ, "QUICKSTART_STEPS": "200", "TMPDIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this checkout
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
