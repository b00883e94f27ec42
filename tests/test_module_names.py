"""Every submodule imports as a module: no package attribute (such as a re-exported function)
shadows a submodule of the same name, so ``import replaybuf.x.y as m`` gives the module."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

import replaybuf


def _submodules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(replaybuf.__path__, "replaybuf."):
        if info.name.endswith("__main__"):  # runs the command line when imported
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional extra that is not installed (sb3, ray, ...)
            continue
        names.append(info.name)
    return names


SUBMODULES = _submodules()


def test_the_walk_sees_the_package():
    assert "replaybuf.collecting" in SUBMODULES
    assert "replaybuf.buffers.ring" in SUBMODULES


@pytest.mark.parametrize("name", SUBMODULES)
def test_a_submodule_is_its_parents_attribute(name):
    module = importlib.import_module(name)
    assert isinstance(module, types.ModuleType)
    parent, _, last = name.rpartition(".")
    assert getattr(importlib.import_module(parent), last) is module


@pytest.mark.parametrize("name", SUBMODULES)
def test_import_as_gives_the_module(name):
    namespace: dict = {}
    exec(f"import {name} as m", namespace)  # resolves through the parent's attribute
    assert namespace["m"] is importlib.import_module(name)


def test_collect_is_still_the_function():
    from replaybuf import collect
    from replaybuf.collecting import collect as defined

    assert collect is defined is replaybuf.collect
    assert callable(collect)
    assert not isinstance(collect, types.ModuleType)
