"""``as_dataset``: a buffer as an endless ``torch.utils.data.IterableDataset`` of batches.

Reverb's ``as_dataset(sample_batch_size, num_steps)``, for PyTorch: each item is one sampled
batch (a TensorDict), drawn from the live buffer when the loader asks for it, so writes made
between batches are seen by the next one::

    from torch.utils.data import DataLoader
    from replaybuf.buffers.dataset import as_dataset

    dataset = as_dataset(buf, 256, n=3, gamma=0.99)  # an episode buffer: 3-step transitions
    loader = dataset.loader(pin_memory=True)  # DataLoader(dataset, batch_size=None, ...)
    for step, batch in zip(range(10_000), loader):
        loss = ...

What each buffer yields:

* :class:`ReplayBuffer`: ``sample_batch(batch_size)`` (``n``, ``seq_len`` and ``gamma`` are
  refused: a ring of transitions has no episodes).
* :class:`SyncEpisodeReplayBuffer` / :class:`EpisodeReplayBuffer` (through its ``.sync`` core):
  ``sample_n_step(batch_size, n, gamma)`` (``n`` defaults to 1), or with ``seq_len``
  ``sample_sequences(batch_size, seq_len, strict=strict)``; giving both is an error.

DataLoader notes, decided here:

* ``DataLoader(dataset, batch_size=None)`` works as it is (the items are already batches).
  Torch's default ``collate_fn`` there, ``default_convert``, takes a TensorDict for a mapping
  and walks it with ``for key in data``, but a TensorDict iterates its batch dimension, so it
  fails (a ``__getitem__`` dispatch ``TypeError``) and no dataset hook reaches that call.
  Building a dataset therefore wraps torch's ``default_convert`` once, process-wide, to return
  a TensorDict unchanged; every other input goes to torch's function as before (a TensorDict
  with batch dimensions is the only input whose result changes, and it always failed).
  :meth:`ReplayDataset.loader` also sets ``collate_fn`` to :func:`keep_batch`.
* ``num_workers`` must stay 0. A worker process holds a copy of the buffer frozen at fork
  time: it would never see later writes and could serve rows overwritten since. ``loader()``
  refuses ``num_workers > 0``, iterating in a worker raises ``RuntimeError``, and the dataset
  refuses to be pickled (spawned workers). To overlap sampling with training, use
  ``prefetch=k``: a thread of the training process draws the next ``k`` batches from the live
  buffer (:mod:`replaybuf.buffers.prefetch`: same batches in the same order, up to ``k``
  batches stale).
* ``pin_memory=True`` works (each TensorDict is pinned whole, in the training process) and
  pays off with a CPU ``device`` buffer feeding a CUDA model; a buffer built with
  ``device="cuda"`` already delivers batches on the GPU (pinned, non-blocking copies).
* With an :class:`EpisodeReplayBuffer`, iterate on the thread that runs its event loop (or
  while no task uses it); a prefetch thread samples the synchronous core under its thread
  lock, which every call of the asyncio facade takes too.
* Iteration raises :class:`EmptyBufferError` while the buffer holds too little to sample; the
  dataset never ends by itself (take what you need: ``zip(range(k), loader)``). Each
  ``iter()`` of a prefetching dataset starts its own thread, which draws ahead from the
  buffer's generator: iterate one iterator, not ``next(iter(loader))`` in a loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils import collate

from replaybuf.args import NArg, check_gamma, check_n, positive_int
from replaybuf.buffers.prefetch import Prefetcher, check_depth
from replaybuf.errors import ArgumentError, ArgumentTypeError, InvalidStateError
from replaybuf.sampling.sequences import check_sequence_args

_WORKERS = (
    "a worker samples a copy of the buffer frozen at fork time, missing every later write; "
    "use num_workers=0, and prefetch=k to draw batches on a background thread"
)


def keep_batch(batch: TensorDict) -> TensorDict:
    """A DataLoader ``collate_fn`` that passes an already-sampled batch through unchanged."""
    return batch


def pass_tensordicts_through() -> None:
    """Make torch's ``default_convert`` (DataLoader's ``collate_fn`` for ``batch_size=None``)
    return a TensorDict unchanged; idempotent. Other inputs go to torch's own function."""
    convert = collate.default_convert
    if getattr(convert, "passes_tensordicts", False):
        return

    @functools.wraps(convert)
    def default_convert(data: Any) -> Any:
        if isinstance(data, TensorDictBase):
            return data  # torch's walks it as a mapping, but iterating it yields rows
        return convert(data)

    default_convert.passes_tensordicts = True  # type: ignore[attr-defined]
    collate.default_convert = default_convert  # its own recursion looks the name up here


class ReplayDataset(IterableDataset):
    """An endless iterable of batches, each ``sample()`` of a live buffer; made by a buffer's
    ``as_dataset``, which checks the arguments."""

    def __init__(
        self,
        sample: Callable[[], TensorDict],
        description: str,
        *,
        prefetch: int = 0,
        check: Callable[[], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self._sample = sample
        self.description = description
        self.prefetch = check_depth(prefetch)
        self._check = check
        self._device = device
        pass_tensordicts_through()

    def __iter__(self) -> Iterator[TensorDict]:
        """The batches; with ``prefetch=k`` a :class:`~replaybuf.buffers.prefetch.Prefetcher`
        (close it, or drop it, to stop its thread)."""
        info = get_worker_info()
        if info is not None:
            raise InvalidStateError(
                f"ReplayDataset expected to run in the training process (num_workers=0), got "
                f"DataLoader worker {info.id} of num_workers={info.num_workers}: {_WORKERS}"
            )
        if self.prefetch:
            return Prefetcher(
                self._batches(), self.prefetch, check=self._check, device=self._device
            )
        return self._batches()

    def _batches(self) -> Iterator[TensorDict]:
        while True:
            yield self._sample()

    def __getstate__(self) -> dict[str, Any]:
        raise ArgumentTypeError(
            "ReplayDataset cannot be pickled (DataLoader workers, spawn): it samples a live "
            f"buffer of this process; {_WORKERS}"
        )

    def __repr__(self) -> str:
        ahead = f", prefetch={self.prefetch}" if self.prefetch else ""
        return f"ReplayDataset({self.description}{ahead})"

    def loader(self, **kwargs: Any) -> DataLoader:
        """A ``DataLoader`` over this dataset: ``batch_size=None`` and :func:`keep_batch` as
        ``collate_fn`` unless given; other ``kwargs`` (``pin_memory``...) are passed on;
        ``num_workers > 0`` is refused."""
        workers = kwargs.get("num_workers", 0)
        if workers:
            raise ArgumentError(
                f"ReplayDataset expected num_workers=0, got num_workers={workers!r}: {_WORKERS}",
                argument="num_workers",
            )
        kwargs.setdefault("batch_size", None)
        kwargs.setdefault("collate_fn", keep_batch)
        return DataLoader(self, **kwargs)


def as_dataset(
    buffer: Any,
    batch_size: int,
    *,
    n: NArg | None = None,
    seq_len: int | None = None,
    gamma: float | None = None,
    strict: bool = True,
    layout: str | None = None,
    prefetch: int = 0,
) -> ReplayDataset:
    """An endless :class:`ReplayDataset` of ``batch_size`` batches sampled from ``buffer``.

    Episode buffers give n-step transitions (``n``, default 1; ``gamma``, default 0.99) or,
    with ``seq_len``, ``[batch_size, seq_len]`` sequences (``strict`` as in
    ``sample_sequences``). A :class:`ReplayBuffer` gives ``sample_batch``. Arguments are
    checked here; sampling errors (empty buffer, closed buffer) come from iteration. Each
    buffer builds its own dataset (its ``as_dataset`` method), so this module knows none.
    ``prefetch=k`` draws the next ``k`` batches on a background thread
    (:mod:`replaybuf.buffers.prefetch`).
    """
    check_dataset_args(batch_size, strict)
    make = getattr(type(buffer), "as_dataset", None)
    if make is None:
        raise ArgumentTypeError(
            "buffer must be a ReplayBuffer, SyncEpisodeReplayBuffer or EpisodeReplayBuffer, "
            f"got {type(buffer).__name__}"
        )
    kwargs: dict[str, Any] = {} if layout is None else {"layout": layout}  # not a ring's
    kwargs["prefetch"] = prefetch
    return make(buffer, batch_size, n=n, seq_len=seq_len, gamma=gamma, strict=strict, **kwargs)


def check_dataset_args(batch_size: Any, strict: Any) -> int:
    """``batch_size`` as an int >= 1, after checking that ``strict`` is a bool."""
    batch_size = positive_int(batch_size, "batch_size")
    if not isinstance(strict, bool):
        raise ArgumentTypeError(f"strict must be a bool, got {type(strict).__name__}")
    return batch_size


def transitions_dataset(
    sample_batch: Callable[[int], TensorDict],
    batch_size: int,
    n: Any,
    seq_len: Any,
    gamma: Any,
    **ahead: Any,
) -> ReplayDataset:
    """A ring of transitions' dataset: ``sample_batch(batch_size)``; n-step arguments refused."""
    pairs = (("n", n), ("seq_len", seq_len), ("gamma", gamma))
    given = [f"{name}={value!r}" for name, value in pairs if value is not None]
    if given:
        raise ArgumentError(
            "a ReplayBuffer samples stored transitions: expected n, seq_len and gamma unset "
            f"(n-step returns and sequences need an episode buffer), got {', '.join(given)}"
        )
    return ReplayDataset(lambda: sample_batch(batch_size), f"sample_batch({batch_size})", **ahead)


def episodes_dataset(
    sample_n_step: Callable[[int, NArg, float], TensorDict],
    sample_sequences: Callable[..., TensorDict],
    batch_size: int,
    n: Any,
    seq_len: Any,
    gamma: Any,
    strict: bool,
    longest: int,
    burn_in: int = 0,
    **ahead: Any,
) -> ReplayDataset:
    """An episode buffer's dataset: n-step transitions, or sequences with ``seq_len`` (and
    ``burn_in``); ``longest``: the buffer's ``max_steps``, which bounds ``n``; ``ahead``:
    :class:`ReplayDataset`'s ``prefetch``, ``check`` and ``device``."""
    if seq_len is None and burn_in != 0:
        raise ArgumentError(
            f"burn_in applies to sequences (give seq_len), got burn_in={burn_in!r}",
            argument="burn_in",
        )
    if seq_len is None:
        n = 1 if n is None else check_n(n, longest)
        gamma = 0.99 if gamma is None else check_gamma(gamma)
        return ReplayDataset(
            lambda: sample_n_step(batch_size, n, gamma),
            f"sample_n_step({batch_size}, n={n}, gamma={gamma})",
            **ahead,
        )
    if n is not None:
        raise ArgumentError(
            f"give n (n-step transitions) or seq_len (sequences), not both; got n={n!r} "
            f"and seq_len={seq_len!r}"
        )
    if gamma is not None:
        raise ArgumentError(f"gamma applies to n-step transitions, not sequences; got {gamma!r}")
    seq_len, burn_in = check_sequence_args(seq_len, burn_in, longest)
    return ReplayDataset(
        lambda: sample_sequences(batch_size, seq_len, strict=strict, burn_in=burn_in),
        f"sample_sequences({batch_size}, {seq_len}, strict={strict}, burn_in={burn_in})",
        **ahead,
    )
