"""Hostile manifests: every field of every checkpoint kind's MANIFEST.json flipped to another
type, edited out of range, deleted or renamed, and the file truncated.

Each tampered checkpoint must either be refused, by ``load_checkpoint`` with a
:class:`CheckpointError` naming the field (or the file) and by ``replaybuf verify`` with exit
status 1, or load into exactly the saved state (equal ``state_dict()``, the same episodes and
the same next draws) with ``verify`` exiting 0. The manifest's own checksum refuses any edit, so
every edit runs twice: as made (the checksum catches it) and with the checksum recomputed (the
semantic checks must catch it). Extends RELIABILITY.md's L3 and L6.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from replaybuf import Field, ReplayBuffer, SyncEpisodeReplayBuffer
from replaybuf.cli import main
from replaybuf.errors import CheckpointError
from replaybuf.persist.format import MANIFEST
from replaybuf.persist.format.names import seal

Path_ = tuple[Any, ...]
RAGGED_SPEC = {
    "observation": {"text": "text", "tokens": Field.ragged(torch.int64)},
    "extras": {"tool": "json"},
}


# --------------------------------------------------------------------- the checkpoints
def ring(prioritized: bool) -> ReplayBuffer:
    buf = ReplayBuffer("cpu", "cpu", 6, seed=0, storage="tensor", prioritized=prioritized)
    for i in range(9):  # wrapped: pointer 3
        buf.add({"obs": torch.full((2,), float(i)), "next": {"reward": torch.tensor(i / 2)}})
    if prioritized:
        buf.update_priorities(torch.arange(3, 6), torch.tensor([0.5, 2.0, 1.0]))
    return buf


def episodes(**kwargs: Any) -> SyncEpisodeReplayBuffer:
    """Three episodes: ended, in progress and zero-step; with ``ragged`` text and tokens."""
    ragged = kwargs.pop("ragged", False)
    buf = SyncEpisodeReplayBuffer(
        12, storage="tensor", seed=0, spec=RAGGED_SPEC if ragged else None, **kwargs
    )

    def obs(e: int, t: int) -> Any:
        if ragged:
            return {"text": f"e{e}t{t}", "tokens": [e] * (t % 3) + [t]}
        return torch.full((2,), float(t + 10 * e))

    ids = [buf.start_episode() for _ in range(3)]
    for t in range(4):
        for e in ids[:2]:
            extras = {"tool": {"t": t}} if ragged else None
            buf.append_observation_action_reward(e, obs(e, t), t, 1.0, extras)
    buf.end_episode(ids[0], "terminated", final_observation=obs(0, 9))
    buf.end_episode(ids[2], "truncated", final_observation=obs(2, 9))
    return buf


KINDS: dict[str, Callable[[], Any]] = {
    "ring": lambda: ring(False),
    "prioritized_ring": lambda: ring(True),
    "episodes": lambda: episodes(max_episodes=5, min_steps=1),
    "prioritized_episodes": lambda: episodes(
        prioritized=True, alpha=0.5, beta=0.3, eps=0.01, layout="torchrl"
    ),
    "frame_stacked": lambda: episodes(frame_stack=2, frame_stack_padding="zero"),
    "ragged": lambda: episodes(ragged=True, max_episodes=4),
}


def is_ring(buf: Any) -> bool:
    return isinstance(buf, ReplayBuffer)


def loader(kind: str) -> Callable[[Path], Any]:
    cls = ReplayBuffer if "ring" in kind else SyncEpisodeReplayBuffer
    return cls.load_checkpoint


def draw(buf: Any) -> Any:
    """The next few batches the buffer's sampler gives (its state moves on)."""
    if is_ring(buf):
        return [buf.sample_batch(4) for _ in range(2)]
    return [buf.sample_n_step(4, n=2), buf.sample_sequences(2, 2)]


def same_batch(a: Any, b: Any) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(same_batch(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and a.is_nested:  # a ragged field: row by row
        return [x.tolist() for x in a.unbind()] == [y.tolist() for y in b.unbind()]
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool((a == b).all())
    keys = sorted(a.keys(include_nested=True, leaves_only=True), key=str)
    if keys != sorted(b.keys(include_nested=True, leaves_only=True), key=str):
        return False
    return all(
        same_batch(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in keys
    )


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["meta"] != b["meta"] or sorted(a["tensors"]) != sorted(b["tensors"]):
        return False
    return all(torch.equal(a["tensors"][n], b["tensors"][n]) for n in a["tensors"])


# Configuration a checkpoint records that nothing else in it constrains: a resealed edit to
# another valid value loads a buffer configured so, the rest of its state unchanged.
FREE = {"print_gc_warning", "min_steps", "alpha", "beta", "eps", "layout", "ragged", "declared"}
FREE |= {"storage", "device", "frame_stack", "frame_stack_padding"}
# Rows ever handed out: bounded below by the stored allocation ids, not fixed by them.
FREE |= {"allocations"}


def free_edit(path: Path_, doc: dict[str, Any]) -> dict[str, Any] | None:
    """The meta a faithful load shows after this edit of a free field, else None: a FREE
    field, ``declared`` (any part: a smaller declaration is still one), a prioritized ring's
    exponents, or an episode's agent name."""
    if len(path) < 2 or path[0] != "meta":
        return None
    agent = path[1] == "episodes" and len(path) == 4 and path[3] == 1
    if path[1] in FREE or (path[1] == "priority" and path[-1] in FREE) or agent:
        return doc["meta"]
    return None


class Saved:
    """A saved checkpoint of one kind, with what a faithful load must reproduce."""

    def __init__(self, kind: str, directory: Path) -> None:
        self.kind, self.directory = kind, directory
        with KINDS[kind]() as buf:
            buf.save_checkpoint(directory)
        self.raw = (directory / MANIFEST).read_bytes()
        self.manifest = json.loads(self.raw)
        with loader(kind)(directory) as back:
            self.state = back.state_dict()
            self.episodes = (
                None if is_ring(back) else {e: back.get_episode(e) for e in back._core.episodes}
            )
            self.draws = draw(back)

    def check_faithful(self, what: str, meta: dict[str, Any] | None = None) -> None:
        """Load; the state must be the saved one (with ``meta``, the edited configuration)."""
        with loader(self.kind)(self.directory) as back:
            expected = self.state if meta is None else {**self.state, "meta": meta}
            got = back.state_dict()
            if meta is not None and meta.get("declared") is not None:  # parsed, then rewritten
                got["meta"]["declared"] = meta["declared"]  # with defaults (checked: a spec)
            assert same_state(got, expected), f"{what}: loaded a different state"
            if self.episodes is not None and meta is None:  # frame_stack changes episodes
                for e, ep in self.episodes.items():
                    assert same_batch(back.get_episode(e), ep), f"{what}: episode {e} differs"
            if meta is None:  # beta, layout... change batches, not what is stored
                assert same_batch(draw(back), self.draws), f"{what}: the sampler differs"


@pytest.fixture(scope="module", params=list(KINDS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return Saved(request.param, tmp_path_factory.mktemp(request.param) / "ck")


# --------------------------------------------------------------------- the edits
def walk(value: Any, path: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """Every (path, value) of a JSON document, containers before what they hold."""
    if path:
        yield path, value
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        yield from walk(item, (*path, key))


def edits(value: Any) -> Iterator[tuple[str, Any]]:
    """Replacement values: another type, null, and out-of-range numbers."""
    if value is not None:
        yield "null", None
    if isinstance(value, bool):
        yield "negated", not value
        yield "int", int(value)
    elif isinstance(value, int):
        yield "str", str(value)
        for name, new in (("0", 0), ("-1", -1), ("+1", value + 1), ("-1 off", value - 1)):
            if new != value:
                yield name, new
        yield "1e30", 1e30
        yield "huge", 1 << 80
        yield "float", value + 0.5
    elif isinstance(value, float):
        yield "str", str(value)
        yield "0", 0.0
        yield "-1", -1.0
        yield "1e30", 1e30
        yield "huge", 1 << 80
    elif isinstance(value, str):
        yield "int", 7
        yield "empty", ""
        yield "changed", value + "x"
    elif isinstance(value, list):
        yield "dict", {}
        yield "empty", []
        if value:
            yield "longer", [*value, value[-1]]
    elif isinstance(value, dict):
        yield "list", []
        yield "empty", {}
    else:
        yield "int", 0


def set_at(doc: Any, path: Path_, value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def delete_at(doc: Any, path: Path_) -> None:
    for key in path[:-1]:
        doc = doc[key]
    del doc[path[-1]]


def rename_at(doc: Any, path: Path_) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1] + "_x"] = doc.pop(path[-1])


def tampered(manifest: dict[str, Any]) -> Iterator[tuple[str, Path_, dict[str, Any]]]:
    """(what, path, edited manifest) for every field and every edit of it."""
    for path, value in list(walk(manifest)):
        for name, new in edits(value):
            if json.dumps(new) == json.dumps(value):
                continue  # no edit at all
            doc = json.loads(json.dumps(manifest))
            set_at(doc, path, new)
            yield f"{name} at {path}", path, doc
        doc = json.loads(json.dumps(manifest))
        delete_at(doc, path)
        yield f"delete {path}", path, doc
        if isinstance(path[-1], str):
            doc = json.loads(json.dumps(manifest))
            rename_at(doc, path)
            yield f"rename {path}", path, doc


def verify(directory: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["verify", str(directory)])
    return status, out.getvalue() + err.getvalue()


def check_case(
    saved: Saved, what: str, path: Path_, payload: bytes, meta: dict[str, Any] | None = None
) -> str:
    """Write ``payload`` as the manifest; refused or faithful. Returns which."""
    (saved.directory / MANIFEST).write_bytes(payload)
    status, printed = verify(saved.directory)
    assert "Traceback" not in printed, f"{what}: verify printed a traceback"
    refusal: CheckpointError | None = None
    try:
        saved.check_faithful(what, meta)
    except CheckpointError as exc:
        refusal = exc
    except AssertionError:
        raise
    except Exception as exc:  # anything else is a bug the checks missed
        pytest.fail(f"{what}: load raised {type(exc).__name__}: {exc}")
    if refusal is not None:
        assert status == 1, f"{what}: load refused ({refusal}) but verify exited {status}"
        named = {str(p) for p in path[1:] if isinstance(p, str)} or {str(path[0])}
        assert MANIFEST in str(refusal) or any(n in str(refusal) for n in named), (
            f"{what}: the message names none of {named}: {refusal}"
        )
        return "refused"
    assert status == 0, f"{what}: loaded faithfully but verify exited {status}: {printed}"
    return "faithful"


@pytest.mark.parametrize("resealed", [False, True], ids=["as_edited", "checksum_recomputed"])
def test_every_manifest_field_tampered_is_refused_or_harmless(saved: Saved, resealed: bool) -> None:
    outcomes: dict[str, int] = {}
    try:
        for what, path, doc in tampered(saved.manifest):
            if resealed:
                doc = seal(doc)
            payload = json.dumps(doc, indent=1).encode()
            outcome = check_case(saved, what, path, payload, free_edit(path, doc))
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if not resealed:
                assert outcome == "refused", f"{what}: the manifest checksum let an edit through"
    finally:
        (saved.directory / MANIFEST).write_bytes(saved.raw)
    assert outcomes.get("refused", 0) > 50


def test_a_truncated_or_emptied_manifest_is_refused(saved: Saved) -> None:
    try:
        for cut in (0, 1, len(saved.raw) // 2, len(saved.raw) - 2):
            outcome = check_case(saved, f"truncated to {cut} bytes", (MANIFEST,), saved.raw[:cut])
            assert outcome == "refused"
    finally:
        (saved.directory / MANIFEST).write_bytes(saved.raw)
