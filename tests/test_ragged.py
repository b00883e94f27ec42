"""Ragged and non-tensor fields: token ids, text, bytes and JSON-like values per step.

Step t of episode e holds text ``"e<e> t<t>"``, token ids :func:`tokens` (a length that
varies with t), a JSON-like tool call :func:`tool` and bytes :func:`blob`; the final
observation is ``"e<e> end <T>"`` with tokens ``[e, T, -1]``. Every sampled value thus names
the episode and step it came from, so each batch is checked against that rule, the slow
obvious way, over random episode layouts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack

from replaybuf import (
    CorruptCheckpointError,
    EpisodeReplayBuffer,
    Field,
    ReplayBuffer,
    SchemaError,
    SyncEpisodeReplayBuffer,
)
from replaybuf.persist.format.names import seal
from replaybuf.storage import RaggedColumn
from replaybuf.storage.ragged import Ragged

SPEC = {
    "observation": {"text": "text", "tokens": Field.ragged(torch.int64)},
    "extras": {"tool": "json", "blob": "bytes"},
}


def tokens(e: int, t: int) -> list[int]:
    return [e] * (t % 4) + [t]


def final_tokens(e: int, steps: int) -> list[int]:
    return [e, steps, -1]


def tool(e: int, t: int) -> Any:
    return None if t % 3 == 0 else {"name": f"tool{e}", "args": list(range(t % 3)), "ok": t > 1}


def blob(e: int, t: int) -> bytes:
    return bytes([e % 256, t % 256]) * (t % 3)


def reward(e: int, t: int) -> float:
    return ((5 * e + t) % 7 - 3) / 4  # exact in float32


def observation(e: int, t: int) -> dict[str, Any]:
    return {"text": f"e{e} t{t}", "tokens": tokens(e, t)}


def final_observation(e: int, steps: int) -> dict[str, Any]:
    return {"text": f"e{e} end {steps}", "tokens": final_tokens(e, steps)}


def append(buf: SyncEpisodeReplayBuffer, e: int, t: int) -> None:
    extras = {"tool": tool(e, t), "blob": blob(e, t)}
    buf.append_observation_action_reward(e, observation(e, t), t, reward(e, t), extras)


def rows_of(value: Any) -> list[list[int]]:
    """A nested jagged tensor's or a padded tensor's rows as lists."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return [row.tolist() for row in value.unbind()]
    return [row.tolist() for row in value]


def padded_rows(value: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    return [row[: int(n)].tolist() for row, n in zip(value, lengths, strict=True)]


def token_rows(td: Any, group: str) -> list[list[int]]:
    """The token rows under ``group``, nested or padded (with their lengths)."""
    if (group, "tokens_length") in td.keys(include_nested=True):
        return padded_rows(td[group, "tokens"], td[group, "tokens_length"])
    return rows_of(td[group, "tokens"])


# ------------------------------------------------------------------------ the reference layout
class Layout:
    """What the buffer should hold: every episode's steps and how it ended (a slow model)."""

    def __init__(self) -> None:
        self.steps: dict[int, int] = {}
        self.ended: dict[int, int | None] = {}  # steps at the end (None: in progress)


def play(buf: SyncEpisodeReplayBuffer, program: list[tuple[int, int]]) -> Layout:
    """Run ``program``: (0, _) starts an episode, (1, k) appends to the k-th running one,
    (2, k) ends it (zero-step episodes included)."""
    layout = Layout()
    running: list[int] = []
    for op, k in program:
        if op == 0 or not running:
            e = buf.start_episode(f"agent{len(running) % 2}")
            layout.steps[e], layout.ended[e] = 0, None
            running.append(e)
        elif op == 1:
            e = running[k % len(running)]
            append(buf, e, layout.steps[e])
            layout.steps[e] += 1
        else:
            e = running.pop(k % len(running))
            buf.end_episode(e, "terminated", final_observation(e, layout.steps[e]))
            layout.ended[e] = layout.steps[e]
    return layout


def check_episode(buf: SyncEpisodeReplayBuffer, e: int, layout: Layout) -> None:
    ep = buf.get_episode(e)
    steps = layout.steps[e]
    assert int(ep["length"]) == steps
    texts = [f"e{e} t{t}" for t in range(steps)]
    toks = [tokens(e, t) for t in range(steps)]
    if layout.ended[e] is not None:
        texts.append(f"e{e} end {steps}")
        toks.append(final_tokens(e, steps))
    if not texts and buf.spec is None:  # nothing written yet: no fields to show
        assert "observation" not in ep
        return
    assert ep["observation", "text"] == texts
    assert token_rows(ep, "observation") == toks
    if steps:
        assert ep["tool"] == [tool(e, t) for t in range(steps)]
        assert ep["blob"] == [blob(e, t) for t in range(steps)]
        assert ep["action"].tolist() == list(range(steps))


def check_n_step(batch: Any, layout: Layout, n: int, gamma: float, padded: bool) -> None:
    ids, starts = batch["episode_id"].tolist(), batch["start_step"].tolist()
    actual = batch["actual_n"].tolist()
    texts, next_texts = batch["observation", "text"], batch["next_observation", "text"]
    if padded:
        toks = padded_rows(batch["observation", "tokens"], batch["observation", "tokens_length"])
        next_toks = padded_rows(
            batch["next_observation", "tokens"], batch["next_observation", "tokens_length"]
        )
    else:
        toks = rows_of(batch["observation", "tokens"])
        next_toks = rows_of(batch["next_observation", "tokens"])
    for i, (e, t, m) in enumerate(zip(ids, starts, actual, strict=True)):
        # The last observation stored: the final one, or (in progress) the last step's.
        last = layout.steps[e] if layout.ended[e] is not None else layout.steps[e] - 1
        assert e in layout.steps
        assert 0 <= t < last
        assert m == min(n, last - t)
        end = t + m
        assert texts[i] == f"e{e} t{t}"
        assert toks[i] == tokens(e, t)
        assert batch["tool"][i] == tool(e, t)
        assert batch["blob"][i] == blob(e, t)
        if end < layout.steps[e]:
            assert next_texts[i] == f"e{e} t{end}"
            assert next_toks[i] == tokens(e, end)
        else:
            assert layout.ended[e] == layout.steps[e]
            assert next_texts[i] == f"e{e} end {end}"
            assert next_toks[i] == final_tokens(e, end)
        expected = sum(gamma**j * reward(e, t + j) for j in range(m))
        assert math.isclose(float(batch["reward"][i]), expected, rel_tol=1e-5, abs_tol=1e-6)


programs = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 7)), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=programs,
    storage=st.sampled_from(["tensor", "memmap"]),
    n=st.integers(1, 3),
    form=st.sampled_from(["nested", "padded"]),
    prioritized=st.booleans(),
)
def test_ragged_fields_round_trip_through_every_read_over_random_layouts(
    program: list[tuple[int, int]], storage: str, n: int, form: str, prioritized: bool
) -> None:
    with SyncEpisodeReplayBuffer(
        12, storage=storage, spec=SPEC, ragged=form, seed=1, prioritized=prioritized
    ) as buf:
        layout = play(buf, program)
        live = set(buf._core.episodes)
        for e in live:
            check_episode(buf, e, layout)
        for episode in buf.sample_episodes(3):
            assert int(episode["episode_id"]) in live
        if len(buf):
            batch = buf.sample_n_step(16, n=n, gamma=0.5)
            check_n_step(batch, layout, n, 0.5, form == "padded")
            seq = buf.sample_sequences(4, 3, strict=False)
            check_sequences(seq, layout)


def check_sequences(seq: Any, layout: Layout) -> None:
    mask = seq["mask"]
    for b in range(seq.batch_size[0]):
        e = int(seq["episode_id"][b, 0])
        t0 = int(seq["start_step"][b]) if "start_step" in seq else None
        for j in range(seq.batch_size[1]):
            text = seq["observation", "text"][b][j]
            if not bool(mask[b, j]):
                assert text is None
                assert int(seq["observation", "tokens_length"][b, j]) == 0
                continue
            t = int(text.split(" t")[1])
            assert text == f"e{e} t{t}"
            assert t0 is None or t == t0 + j
            length = int(seq["observation", "tokens_length"][b, j])
            assert seq["observation", "tokens"][b, j, :length].tolist() == tokens(e, t)
            assert seq["tool"][b][j] == tool(e, t)


def test_nested_and_padded_batches_hold_the_same_rows() -> None:
    program = [(0, 0), (1, 0), (1, 0), (0, 0), (1, 1), (1, 0), (2, 0), (1, 0)] * 2
    got = {}
    for form in ("nested", "padded"):
        with SyncEpisodeReplayBuffer(40, spec=SPEC, ragged=form, seed=3) as buf:
            play(buf, program)
            batch = buf.sample_n_step(8, n=2)
            if form == "nested":
                got[form] = rows_of(batch["observation", "tokens"])
            else:
                value = batch["observation", "tokens"]
                got[form] = padded_rows(value, batch["observation", "tokens_length"])
                assert value.shape[1] == max(len(r) for r in got[form])  # padded to the longest
    assert got["nested"] == got["padded"]


# ------------------------------------------------------------------------ the ragged column
@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 15), st.integers(0, 700)), min_size=1, max_size=80
    ),
    budget=st.sampled_from([None, 3000]),
)
def test_the_ragged_column_keeps_every_live_row_through_compaction_and_growth(
    ops: list[tuple[bool, int, int]], budget: int | None
) -> None:
    column = RaggedColumn(16, (), torch.int32, "tensor", torch.device("cpu"), None, "f", budget)
    model: dict[int, list[int]] = {}
    for i, (write, row, length) in enumerate(ops):
        if write:
            values = [(i * 7919 + j) % 1000 for j in range(length)]
            data = Ragged(torch.tensor(values, dtype=torch.int32), torch.tensor([length]))
            column.write(np.array([row]), data)
            model[row] = values
        else:
            column.release(np.array([row]))
            model.pop(row, None)
        assert column.live == sum(map(len, model.values()))
        assert column.head <= column.tokens
    rows = np.arange(16)
    taken = column.take(rows, torch.device("cpu"))
    assert [r.tolist() for r in taken.split()] == [model.get(r, []) for r in range(16)]
    values, offsets = column.state_rows(16)
    copy = RaggedColumn(16, (), torch.int32, "tensor", torch.device("cpu"), None, "g")
    copy.load_rows(values, offsets)
    assert [r.tolist() for r in copy.take(rows, torch.device("cpu")).split()] == [
        model.get(r, []) for r in range(16)
    ]


@pytest.mark.parametrize("reserve", [None, 210_000])
def test_stored_bytes_are_within_a_tenth_of_the_values_plus_eight_bytes_a_step(
    tmp_path: Path, reserve: int | None
) -> None:
    """Filled 50 rows at a time (episodes), a full column's arena is within 1.1x of its
    values, whether it grew or was sized once from ``reserve``."""
    rows = 5000
    column = RaggedColumn(
        rows, (), torch.int32, "memmap", torch.device("cpu"), tmp_path, "t", reserve
    )
    lengths = np.random.default_rng(0).integers(1, 400, rows)
    for at in range(0, rows, 50):
        part = torch.from_numpy(lengths[at : at + 50])
        values = torch.zeros(int(part.sum()), dtype=torch.int32)
        column.write(np.arange(at, at + 50), Ragged(values, part))
    own = int(lengths.sum()) * 4
    assert column.spans.nbytes == 8 * rows
    assert column.nbytes - column.spans.nbytes <= 1.1 * own, column.nbytes / own


def test_memmap_arenas_live_in_the_buffers_scratch_folder_and_go_with_it(tmp_path: Path) -> None:
    buf = SyncEpisodeReplayBuffer(50, storage="memmap", spec=SPEC, scratch_dir=tmp_path)
    play(buf, [(0, 0)] + [(1, 0)] * 30 + [(2, 0)])
    assert list(tmp_path.rglob("ragged-*")), "the arenas are memmap files in the scratch folder"
    buf.close()
    assert not list(tmp_path.iterdir())


def test_eviction_frees_the_evicted_episodes_values() -> None:
    with SyncEpisodeReplayBuffer(10, spec=SPEC) as buf:
        layout = play(buf, [(0, 0)] + [(1, 0)] * 8 + [(2, 0)] + [(0, 0)] + [(1, 0)] * 8)
        column = buf._core.slots.ragged[("observation", "tokens")]
        live = set(buf._core.episodes)
        rows = [len(tokens(e, t)) for e in live for t in range(layout.steps[e])] + [
            3 for e in live if layout.ended[e] is not None
        ]
        assert column.live == sum(rows)


# ------------------------------------------------------------------------ inference and input
def test_text_token_lists_and_tool_dicts_are_inferred_at_the_first_step() -> None:
    with SyncEpisodeReplayBuffer(20) as buf:
        e = buf.start_episode()
        buf.append_observation_action_reward(e, "You see a door.", 0, 1.0, {"call": {"a": "b"}})
        spec = buf.spec
        assert spec is not None
        assert spec[("observation",)].kind == "text"
        assert spec[("extras", "call", "a")].kind == "text"  # a dict of fields, each inferred
        buf.append_observation_action_reward(e, "You open it.", 1, 0.0, {"call": {"a": "c"}})
        buf.end_episode(e, "terminated", "The end.")
        ep = buf.get_episode(e)
        assert ep["observation"] == ["You see a door.", "You open it.", "The end."]


def test_lists_of_numbers_are_tensors_of_their_shape() -> None:
    with SyncEpisodeReplayBuffer(20) as buf:
        e = buf.start_episode()
        buf.append_observation_action_reward(e, [1, 2, 3], [0.5, 1], 1.0)
        assert buf.spec[("observation",)].shape == (3,)
        assert buf.spec[("observation",)].kind == "fixed"
        buf.append_observation_action_reward(e, (4, 5, 6), [1.5, 2], 1.0)
        buf.end_episode(e, "truncated", np.array([7, 8, 9]))
        assert buf.get_episode(e)["observation"].tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_a_shape_that_varies_in_an_undeclared_field_says_how_to_declare_it() -> None:
    with SyncEpisodeReplayBuffer(20) as buf:
        e = buf.start_episode()
        buf.append_observation_action_reward(e, {"ids": [3]}, 0, 1.0)
        with pytest.raises(SchemaError, match=r"observation\.ids.*spec=.*Field\.ragged"):
            buf.append_observation_action_reward(e, {"ids": [5, 9]}, 0, 1.0)
        assert buf.stats()["steps"] == 1


def test_non_tensor_data_tuples_none_and_object_arrays_are_stored() -> None:
    spec = {"observation": "json", "extras": {"note": "text"}}
    with SyncEpisodeReplayBuffer(20, spec=spec) as buf:
        e = buf.start_episode()
        values = [
            NonTensorData({"obs": [1, 2, 3]}),
            (1, "two", None),
            None,
            np.array([1, "a"], dtype=object),
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        ]
        for t, value in enumerate(values):
            buf.append_observation_action_reward(e, value, t, 0.0, {"note": NonTensorData("n")})
        buf.end_episode(e, "terminated", {"done": True})
        got = buf.get_episode(e)["observation"]
    assert got == [
        {"obs": [1, 2, 3]},
        [1, "two", None],  # JSON has no tuples
        None,
        [1, "a"],
        values[4],
        {"done": True},
    ]


class Reduces:
    def __reduce__(self) -> Any:
        return (print, ("executed",))


BAD = [
    ("a lambda", lambda: 0, "function"),
    ("a __reduce__ object", Reduces(), "Reduces"),
    ("a set", {1, 2}, "set"),
    ("NaN", {"x": float("nan")}, "nan"),
    ("infinity", [1.0, float("inf")], "inf"),
    ("a non-str key", {1: "a"}, "dict key 1"),
]


@pytest.mark.parametrize(("label", "value", "named"), BAD, ids=[b[0] for b in BAD])
def test_values_json_cannot_carry_are_refused_and_leave_the_buffer_as_it_was(
    label: str, value: Any, named: str
) -> None:
    with SyncEpisodeReplayBuffer(20, spec={"extras": {"tool": "json"}}, seed=0) as buf:
        e = buf.start_episode()
        buf.append_observation_action_reward(e, [0.0], 0, 1.0, {"tool": [1]})
        before = (
            buf.stats(),
            buf._generator.get_state().clone(),
            buf._core.slots.ragged[("extras", "tool")].live,
        )
        with pytest.raises(SchemaError, match=rf"extras\.tool.*{named}"):
            buf.append_observation_action_reward(e, [1.0], 1, 1.0, {"tool": value})
        after = (
            buf.stats(),
            buf._generator.get_state(),
            buf._core.slots.ragged[("extras", "tool")].live,
        )
        assert before[0] == after[0]
        assert torch.equal(before[1], after[1])
        assert before[2] == after[2]
        buf.end_episode(e, "terminated", [2.0])
        assert buf.get_episode(e)["tool"] == [[1]]


def test_cycles_and_invalid_utf8_are_refused() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with SyncEpisodeReplayBuffer(20, spec={"observation": "text", "extras": {"j": "json"}}) as buf:
        e = buf.start_episode()
        with pytest.raises(SchemaError, match=r"extras\.j.*cycle"):
            buf.append_observation_action_reward(e, "ok", 0, 1.0, {"j": cycle})
        with pytest.raises(SchemaError, match=r"observation.*UTF-8"):
            buf.append_observation_action_reward(e, "bad \udc80", 0, 1.0, {"j": 1})
        with pytest.raises(SchemaError, match=r"observation.*expected text \(str\), got bytes"):
            buf.append_observation_action_reward(e, b"\xff", 0, 1.0, {"j": 1})
        assert buf.stats()["steps"] == 0
        assert buf.spec is None


def test_the_transition_buffer_refuses_ragged_fields_by_name() -> None:
    with pytest.raises(SchemaError, match=r"spec field 'obs'.*fixed-shape.*episode buffers"):
        ReplayBuffer("cpu", "cpu", 8, spec={"obs": "text"})
    with ReplayBuffer("cpu", "cpu", 8) as ring, pytest.raises(TypeError, match="episode buffer"):
        ring.add({"obs": "text"})


# ------------------------------------------------------------------------ checkpoints
def build(tmp_path: Path, storage: str = "memmap") -> SyncEpisodeReplayBuffer:
    buf = SyncEpisodeReplayBuffer(30, storage=storage, spec=SPEC, scratch_dir=tmp_path, seed=5)
    z = buf.start_episode()
    buf.end_episode(z, "truncated", final_observation(z, 0))  # a zero-step episode
    play(buf, [(0, 0), (1, 0), (1, 0), (0, 0), (1, 1), (1, 0), (2, 0), (1, 0), (1, 0)] * 3)
    return buf


@pytest.mark.parametrize("storage", ["memmap", "tensor"])
def test_checkpoints_and_state_dicts_carry_ragged_fields(tmp_path: Path, storage: str) -> None:
    with build(tmp_path, storage) as buf:
        buf.save_checkpoint(tmp_path / "ck")
        state = buf.state_dict()
        expected = {e: buf.get_episode(e) for e in buf._core.episodes}
        draws = buf.sample_n_step(8, n=2)
    for load in ("checkpoint", "state"):
        if load == "checkpoint":
            copy = SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ck", scratch_dir=tmp_path)
        else:
            copy = SyncEpisodeReplayBuffer(30, storage=storage, scratch_dir=tmp_path)
            copy.load_state_dict(state)
        with copy:
            assert copy._core.declared is not None or load == "state"
            for e, ep in expected.items():
                got = copy.get_episode(e)
                assert got["observation", "text"] == ep["observation", "text"]
                assert token_rows(got, "observation") == token_rows(ep, "observation")
                if int(ep["length"]):
                    assert got["tool"] == ep["tool"]
                    assert got["blob"] == ep["blob"]
            again = copy.sample_n_step(8, n=2)
            assert again["observation", "text"] == draws["observation", "text"]  # the sampler too


def tamper(ck: Path, name: str, tensor: torch.Tensor) -> None:
    """Replace tensor ``name``'s file with ``tensor``, with a matching manifest entry (so only
    replaybuf's own checks can catch it, not the checksum)."""
    import hashlib

    manifest = json.loads((ck / "MANIFEST.json").read_text())
    entry = manifest["tensors"][name]
    raw = tensor.contiguous().numpy().tobytes()
    (ck / entry["file"]).write_bytes(raw)
    entry.update(
        shape=list(tensor.shape),
        dtype=str(tensor.dtype).removeprefix("torch."),
        bytes=len(raw),
        sha256=hashlib.sha256(raw).hexdigest(),
    )
    (ck / "MANIFEST.json").write_text(json.dumps(seal(manifest)))


def bad_offsets(offsets: torch.Tensor, values: int) -> list[tuple[str, torch.Tensor, str]]:
    decreasing = offsets.clone()
    decreasing[3] = decreasing[2] - 1
    past = offsets.clone()
    past[-1] = values + 5
    negative = offsets.clone()
    negative[0] = -1
    return [
        ("decreasing", decreasing, "non-decreasing"),
        ("past the values", past, "run from 0 to"),
        ("out of range", negative, "run from 0 to"),
        ("a float dtype", offsets.double(), "expected int64"),
        ("one short", offsets[:-1].clone(), r"shape \["),
    ]


@pytest.mark.parametrize("case", range(5))
def test_tampered_offsets_are_refused(tmp_path: Path, case: int) -> None:
    with build(tmp_path) as buf:
        buf.save_checkpoint(tmp_path / "ck")
        state = buf.state_dict()
    names = [n for n in state["tensors"] if n.startswith("ragged/") and n.endswith("/offsets")]
    assert names
    name = names[0]
    offsets, values = state["tensors"][name], state["tensors"][name.replace("offsets", "values")]
    _, bad, message = bad_offsets(offsets, values.shape[0])[case]
    tamper(tmp_path / "ck", name, bad)
    with pytest.raises(CorruptCheckpointError, match=message):
        SyncEpisodeReplayBuffer.load_checkpoint(tmp_path / "ck", scratch_dir=tmp_path)
    state["tensors"][name] = bad
    target = SyncEpisodeReplayBuffer(30, scratch_dir=tmp_path)
    with pytest.raises(CorruptCheckpointError, match=message):
        target.load_state_dict(state)
    assert target.stats()["episodes"] == 0  # refused: the buffer as it was
    target.close()


def test_stored_text_that_is_not_utf8_or_json_is_refused_on_load(tmp_path: Path) -> None:
    with build(tmp_path) as buf:
        state = buf.state_dict()
    spec = buf.spec
    assert spec is not None
    for key in (("observation", "text"), ("extras", "tool")):
        name = f"ragged/{spec.ragged_keys.index(key)}/values"
        broken = {**state, "tensors": dict(state["tensors"])}
        values = broken["tensors"][name].clone()
        values[0] = 0xFF  # never a byte of UTF-8
        broken["tensors"][name] = values
        with (
            SyncEpisodeReplayBuffer(30) as target,
            pytest.raises(CorruptCheckpointError, match="not valid"),
        ):
            target.load_state_dict(broken)


# ------------------------------------------------------------------------ the other front doors
@pytest.mark.asyncio
async def test_the_asyncio_buffer_takes_a_spec_and_returns_text() -> None:
    buf = EpisodeReplayBuffer(20, spec={"observation": "text"}, ragged="padded")
    e = await buf.start_episode()
    await buf.append_observation_action_reward(e, "hello", 0, 1.0)
    await buf.end_episode(e, "terminated", "bye")
    batch = await buf.sample_n_step(2)
    assert batch["observation"] == ["hello", "hello"]
    assert batch["next_observation"] == ["bye", "bye"]
    await buf.close()


def test_torchrl_layout_carries_ragged_fields() -> None:
    with SyncEpisodeReplayBuffer(20, spec=SPEC, layout="torchrl") as buf:
        layout = play(buf, [(0, 0), (1, 0), (1, 0), (2, 0)])
        batch = buf.sample_n_step(4)
        e = int(batch["episode_id"][0])
        assert batch["observation", "text"][0].startswith(f"e{e} t")
        assert batch["next", "observation", "text"][0].startswith(f"e{e}")
        assert isinstance(batch.get(("next", "observation", "text")), NonTensorStack)
        assert layout.steps[e] == 2


def as_list(value: Any) -> list[Any]:
    """A per-row stack of objects (or an empty one) as a list."""
    return value if isinstance(value, list) else value.tolist()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs, form=st.sampled_from(["nested", "padded"]))
def test_torchrl_episodes_carry_ragged_fields_over_random_layouts(
    program: list[tuple[int, int]], form: str
) -> None:
    with SyncEpisodeReplayBuffer(400, spec=SPEC, ragged=form) as buf:
        layout = play(buf, program)
        for e, steps in layout.steps.items():
            ended = layout.ended[e] is not None
            kept = steps if ended else max(steps - 1, 0)  # transitions with an obs after
            texts = [f"e{e} t{t}" for t in range(steps)]
            toks = [tokens(e, t) for t in range(steps)]
            if ended:
                texts.append(f"e{e} end {steps}")
                toks.append(final_tokens(e, steps))
            td = buf.get_episode(e, layout="torchrl")
            assert td.batch_size == (kept,)
            if kept == 0:  # no transition yet (or ever: a zero-step episode)
                assert td["next", "done"].shape == (0, 1)
                continue
            assert td["step"].tolist() == list(range(kept))
            assert td["episode_id"].tolist() == [e] * kept
            assert as_list(td["observation", "text"]) == texts[:kept]
            assert as_list(td["next", "observation", "text"]) == texts[1 : kept + 1]
            assert token_rows(td, "observation") == toks[:kept]
            assert token_rows(td["next"], "observation") == toks[1 : kept + 1]
            assert as_list(td["tool"]) == [tool(e, t) for t in range(kept)]
            assert as_list(td["blob"]) == [blob(e, t) for t in range(kept)]
            assert td["action"].tolist() == list(range(kept))
            rewards = [reward(e, t) for t in range(kept)]
            assert td["next", "reward"].squeeze(-1).tolist() == rewards
            done = [ended and t == kept - 1 for t in range(kept)]
            assert td["next", "done"].squeeze(-1).tolist() == done
            assert td["next", "terminated"].squeeze(-1).tolist() == done


@pytest.mark.parametrize("form", ["nested", "padded"])
def test_a_torchrl_episode_of_a_lone_ragged_or_text_observation(form: str) -> None:
    spec = {"observation": Field.ragged(torch.int64)}
    with (
        SyncEpisodeReplayBuffer(20, spec=spec, ragged=form) as tok,
        SyncEpisodeReplayBuffer(20, ragged=form) as text,
    ):
        for buf, obs, final in ((tok, [[1], [2, 3], [4, 5, 6]], [7]), (text, ["a", "bc"], "d")):
            e = buf.start_episode()
            for t, o in enumerate(obs):
                buf.append_observation_action_reward(e, o, t, 1.0)
            buf.end_episode(e, "truncated", final)
            td = buf.get_episode(e, layout="torchrl")
            rows = [*obs, final]
            if buf is text:
                assert td["observation"] == rows[:-1]
                assert td["next", "observation"] == rows[1:]
            elif form == "padded":
                assert padded_rows(td["observation"], td["observation_length"]) == rows[:-1]
                nxt = td["next"]
                assert padded_rows(nxt["observation"], nxt["observation_length"]) == rows[1:]
            else:
                assert rows_of(td["observation"]) == rows[:-1]
                assert rows_of(td["next", "observation"]) == rows[1:]
            assert td["next", "truncated"].squeeze(-1).tolist()[-1] is True


def test_frame_stack_refuses_a_ragged_observation_by_name() -> None:
    with pytest.raises(SchemaError, match=r"spec\['observation.text'\] must be a fixed-shape"):
        SyncEpisodeReplayBuffer(20, frame_stack=4, spec=SPEC)
    with SyncEpisodeReplayBuffer(20, frame_stack=4) as buf:
        e = buf.start_episode()
        with pytest.raises(TypeError, match="'observation' expected a tensor"):
            buf.append_observation_action_reward(e, "text", 0, 1.0)
        assert len(buf) == 0
        assert buf.spec is None
    spec = {"observation": torch.zeros(3), "extras": {"note": "text"}}
    with SyncEpisodeReplayBuffer(20, frame_stack=2, spec=spec) as buf:  # ragged extras: fine
        e = buf.start_episode()
        buf.append_observation_action_reward(e, torch.ones(3), 0, 1.0, {"note": "hi"})
        assert buf.get_episode(e)["note"] == ["hi"]


def test_a_bad_ragged_form_is_named() -> None:
    with pytest.raises(ValueError, match="ragged must be one of"):
        SyncEpisodeReplayBuffer(10, ragged="jagged")


def test_the_llm_agents_example_runs_checkpoints_and_resumes(tmp_path: Path) -> None:
    """The example in its smoke mode: both phases run, the resumed buffer holds every step."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    scratch, out = tmp_path / "tmp", str(tmp_path / "out")
    scratch.mkdir()
    result = subprocess.run(
        [sys.executable, str(root / "examples" / "llm_agents.py"), "--smoke", "--out-dir", out],
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(scratch), "PYTHONPATH": str(root)},
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "phase 2 (resumed): 8 episodes" in result.stdout
    assert (tmp_path / "out" / "llm-buffer" / "MANIFEST.json").is_file()
    assert list(scratch.iterdir()) == []


def test_ragged_batches_cross_to_and_from_a_ray_actor_intact() -> None:
    """Ray's packing of a batch: nested tensors as values and offsets, objects as objects."""
    from replaybuf.integrations.ray.packing import pack_batch, unpack_batch

    with SyncEpisodeReplayBuffer(40, spec=SPEC, seed=0) as buf:
        play(buf, [(0, 0), (1, 0), (1, 0), (1, 0), (2, 1)])
        batch = buf.sample_n_step(6, n=2)
        sequences = buf.sample_sequences(2, 2, strict=False)
    for original in (batch, sequences):
        again = unpack_batch(pack_batch(original))
        assert again["observation", "text"] == original["observation", "text"]
        assert again["tool"] == original["tool"]
    assert rows_of(unpack_batch(pack_batch(batch))["observation", "tokens"]) == rows_of(
        batch["observation", "tokens"]
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("device", "storing_device", "storage"),
    [("cuda", "cuda", "tensor"), ("cuda", "cpu", "memmap"), ("cpu", "cuda", "tensor")],
)
def test_ragged_fields_on_every_placement_with_a_gpu(
    device: str, storing_device: str, storage: str
) -> None:
    program = [(0, 0), (1, 0), (1, 0), (0, 0), (1, 1), (1, 0), (2, 0), (1, 0), (2, 0)] * 3
    with SyncEpisodeReplayBuffer(
        30, device=device, storing_device=storing_device, storage=storage, spec=SPEC, seed=0
    ) as buf:
        layout = play(buf, program)
        batch = buf.sample_n_step(16, n=2, gamma=0.5)
        assert batch["observation", "tokens"].device.type == torch.device(device).type
        cpu = batch.cpu() if device == "cuda" else batch
        check_n_step(cpu, layout, 2, 0.5, padded=False)
        for e in buf._core.episodes:
            check_episode(buf, e, layout)


def test_an_epoch_delivers_every_steps_text_and_tokens_once() -> None:
    with SyncEpisodeReplayBuffer(60, spec=SPEC, seed=0) as buf:
        layout = play(buf, [(0, 0), (1, 0), (1, 0), (0, 0), (1, 1), (1, 0), (2, 0), (2, 0)] * 2)
        seen = []
        for batch in buf.iterate_epochs(3, n=2):
            texts = batch["observation", "text"]
            for i, tokens_row in enumerate(rows_of(batch["observation", "tokens"])):
                e, t = int(batch["episode_id"][i]), int(batch["start_step"][i])
                assert texts[i] == f"e{e} t{t}"
                assert tokens_row == tokens(e, t)
                seen.append((e, t))
    valid = [
        (e, t)
        for e, steps in layout.steps.items()
        for t in range(steps if layout.ended[e] is not None else steps - 1)
    ]
    assert sorted(seen) == sorted(valid)
