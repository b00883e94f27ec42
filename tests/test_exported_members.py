"""``replaybuf.__all__`` is honest: every listed name exists and every public name is listed."""

from __future__ import annotations

import types

import replaybuf


def test_every_name_in_all_exists():
    missing = [name for name in replaybuf.__all__ if not hasattr(replaybuf, name)]
    assert missing == []


def test_all_has_no_duplicates():
    assert len(replaybuf.__all__) == len(set(replaybuf.__all__))


def test_every_public_name_is_in_all():
    public = {
        name
        for name, value in vars(replaybuf).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert sorted(public - set(replaybuf.__all__)) == []


def test_the_transition_buffer_and_its_errors_are_exported():
    expected = {"ReplayBuffer", "SchemaError", "EmptyBufferError", "MetadataError"}
    assert expected <= set(replaybuf.__all__)
    assert {"InsufficientSpaceError", "BufferClosedError", "ReplayBufError"} <= set(
        replaybuf.__all__
    )


def test_exported_classes_claim_the_public_module():
    for name in replaybuf.__all__:
        value = getattr(replaybuf, name)
        if isinstance(value, type):
            assert value.__module__.startswith("replaybuf"), name
