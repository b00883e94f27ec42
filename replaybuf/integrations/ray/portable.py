"""Errors raised in the Ray buffer actor, carried to the client as their own class and fields.

An exception crosses Ray pickled; one whose class does not unpickle (its ``__init__`` wants more
arguments than its ``args``) travels as a :class:`PortableError` and is rebuilt on the client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast


class PortableError(Exception):
    """Carries an exception whose class does not unpickle (its ``__init__`` wants more args)."""

    def rebuild(self) -> BaseException:
        """The original exception's class, message and attributes, built without ``__init__``."""
        cls, args, state = self.args
        for new in (cls.__new__, BaseException.__new__):  # MemoryError's own refuses subclasses
            try:
                error = new(cls)
            except TypeError:
                continue
            error.args = args
            error.__dict__.update(state)
            return error
        return RuntimeError(f"{cls.__module__}.{cls.__qualname__}: {args}")


@contextlib.contextmanager
def portable_errors() -> Iterator[None]:
    """Let an error raised in the actor reach the client as its own class, message and fields."""
    try:
        yield
    except Exception as error:
        try:
            # What unpickling would do (an exception pickles as its __reduce__), without
            # unpickling anything: replaybuf never calls pickle.loads (test_checkpoint_format).
            # An exception's __reduce__ is a tuple (object's may be a str).
            rebuild, args = cast("tuple[Any, ...]", error.__reduce__())[:2]
            rebuild(*args)
        except Exception:
            raise PortableError(type(error), error.args, dict(vars(error))) from error
        raise
