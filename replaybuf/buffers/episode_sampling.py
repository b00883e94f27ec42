"""An episode buffer's n-step and sequence batches, and what every sampling call checks first.

A part of :class:`~replaybuf.buffers.episodes.SyncEpisodeReplayBuffer` (which inherits it),
kept apart so that each module holds one concern.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from replaybuf.args import NArg, check_gamma, check_n, positive_int
from replaybuf.buffers.locking import reentered, synchronized
from replaybuf.episodes import EpisodeCore
from replaybuf.errors import EmptyBufferError
from replaybuf.sampling import DeviceDraws, Paths, check_layout, choose, torchrl_transitions
from replaybuf.sampling.budget import (
    always_fits,
    ensure_batch_fits,
    sequence_bytes,
    transition_bytes,
)
from replaybuf.sampling.paths import PATHS_KEY
from replaybuf.sampling.sequences import check_sequence_args
from replaybuf.storage import FieldSpec


class EpisodeSampling:
    """Transition and sequence batches of a :class:`SyncEpisodeReplayBuffer` (which inherits
    this class)."""

    # What the buffer provides (set in SyncEpisodeReplayBuffer.__init__).
    _lock: Any
    _core: EpisodeCore
    _generator: torch.Generator
    _draws: DeviceDraws
    _paths: Paths | None
    _closed: bool
    _calling: bool
    # sample_n_step's last arguments, as given with what was read of the buffer, and their
    # checked values (n, whether TorchRL's layout): see sample_n_step.
    _nstep_checked: tuple[tuple[Any, ...], NArg, bool] | None
    device: torch.device
    storing_device: torch.device
    ragged: str
    layout: str
    max_steps: int
    min_steps: int
    frame_stack: int | None

    if TYPE_CHECKING:  # declared for the type checker; the buffer defines them

        @property
        def spec(self) -> FieldSpec | None: ...

        def _check_open(self) -> None: ...

    def _chosen_paths(self) -> Paths:
        """The sampling paths for this buffer's configuration (:mod:`replaybuf.sampling.paths`):
        the last choice while its token is current (``choose``'s own test, here to spare the
        sampling calls a call), else a new one."""
        paths = self._paths
        if paths is not None and self._core.slots.derived.get(PATHS_KEY) is paths.token:
            return paths
        self._paths = choose(
            self._core, self.device, self._generator, self._draws, paths, self.ragged
        )
        return self._paths

    def _require_steps(self, what: str) -> None:
        if self._closed:
            self._check_open()  # raises
        have = self._core.valid_steps
        need = max(1, self.min_steps)
        if have < need:
            raise EmptyBufferError(
                f"cannot {what}: {have} valid step(s) stored, need at least {need}"
                + (f" (min_steps={self.min_steps})" if self.min_steps else "")
            )
        self._core.flush()

    def _ensure_fits(self, count: int, row_bytes: int, what: str = "batch") -> None:
        """Refuse a batch the delivering or storing device has no memory for (before the
        generator draws: :mod:`replaybuf.sampling.budget`)."""
        ensure_batch_fits(count, row_bytes, (self.device, self.storing_device), what)

    def sample_n_step(
        self,
        batch_size: int,
        n: NArg = 1,
        gamma: float = 0.99,
        *,
        replace: bool = True,
        layout: str | None = None,
    ) -> TensorDict:
        """``batch_size`` n-step transitions, uniform over valid steps (distinct if not replace).

        With ``replace=False`` fewer are returned when fewer valid steps exist. ``layout``:
        ``"replaybuf"`` or ``"torchrl"`` (see :mod:`replaybuf.sampling.layout`; default: the
        buffer's).
        """
        # The lock by hand, as the per-step appends take it: a small batch's Python calls
        # cost several times their warm cost after the last batch's gather has evicted the
        # caches, so the sampling calls make as few as they can.
        lock = self._lock
        lock.acquire()
        if self._calling:  # called from code run inside another call (buffers.locking)
            lock.release()
            raise reentered("sample_n_step")
        self._calling = True
        try:
            # A call that repeats the last one's arguments (a training loop's every call) reuses
            # their checks: one comparison instead of six calls, each slow after the last
            # batch's gather has evicted the caches. Only for a plain int batch size and n and
            # a float gamma (a bool or numpy number is checked as ever), the same layouts and
            # spec, and a batch whose memory check reads nothing (always_fits).
            spec = self._core.slots.spec
            given = (batch_size, n, gamma, layout, self.layout, self.max_steps, spec)
            checked = self._nstep_checked
            if (
                checked is not None
                and checked[0] == given
                and type(batch_size) is int
                and type(n) is int
                and type(gamma) is float
            ):
                n, torchrl = checked[1], checked[2]
                self._require_steps("sample")
            else:
                self._nstep_checked = None
                batch_size = positive_int(batch_size, "batch_size")
                n, gamma = check_n(n, self.max_steps), check_gamma(gamma)
                torchrl = self._torchrl(layout)
                self._require_steps("sample")
                window = min(n[1], self.max_steps) if isinstance(n, tuple) else n
                row = transition_bytes(self._core.slots.spec, self.frame_stack or 1, window)
                ensure_batch_fits(batch_size, row, (self.device, self.storing_device))
                if (  # kept for arguments a repeat can equal only by being the same values
                    type(given[0]) is int
                    and type(given[1]) is int
                    and type(given[2]) is float
                    and (layout is None or type(layout) is str)
                    and spec is self._core.slots.spec
                    and always_fits(batch_size, row)
                ):
                    self._nstep_checked = (given, n, torchrl)
            batch = self._chosen_paths().n_step(batch_size, n, gamma, replace)
        finally:
            self._calling = False
            lock.release()
        return torchrl_transitions(batch, gamma) if torchrl else batch

    @synchronized
    def sample_sequences(
        self,
        batch_size: int,
        seq_len: int,
        *,
        strict: bool = True,
        layout: str | None = None,
        burn_in: int = 0,
    ) -> TensorDict:
        """``[batch_size, seq_len]`` runs of consecutive steps of one episode each; ``strict``,
        ``mask`` and ``burn_in``: see :mod:`replaybuf.sampling.sequences`."""
        batch_size = positive_int(batch_size, "batch_size")
        seq_len, burn_in = check_sequence_args(seq_len, burn_in, self.max_steps)
        torchrl = self._torchrl(layout)
        self._require_steps("sample sequences")
        steps = burn_in + seq_len
        what = f"batch of sequences of {steps:,} steps"
        self._ensure_fits(batch_size, sequence_bytes(self.spec, steps, self.frame_stack or 1), what)
        batch = self._chosen_paths().sequences(batch_size, seq_len, strict, burn_in)
        return torchrl_transitions(batch, None) if torchrl else batch

    def _torchrl(self, layout: str | None) -> bool:
        """Whether a batch goes out in TorchRL's layout (``layout`` None: the buffer's)."""
        return (self.layout if layout is None else check_layout(layout)) == "torchrl"
