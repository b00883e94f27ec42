"""Pure index and return math: n-step windows, discounts, epoch plans, importance weights.

Imports torch and numpy only: never torchrl, asyncio, storage or any other replaybuf layer.
"""

from replaybuf.core.epochs import epoch_batches, epoch_order, num_batches
from replaybuf.core.index import (
    END_NONE,
    END_TERMINATED,
    END_TRUNCATED,
    full_sequence_starts,
    full_sequence_starts_by_jumps,
    jump_levels,
    jump_tables,
    nstep_windows,
    sequence_rows,
    sequence_rows_by_jumps,
    stack_rows,
    stack_windows,
)
from replaybuf.core.nstep import (
    bootstrap_discount,
    compute_discounted_return,
    discount_powers,
    host_powers,
    reward_powers,
    torch_reward_powers,
    window_return,
)
from replaybuf.core.weights import compute_importance_weights, sequence_priority

__all__ = [
    "END_NONE",
    "END_TERMINATED",
    "END_TRUNCATED",
    "bootstrap_discount",
    "compute_discounted_return",
    "compute_importance_weights",
    "discount_powers",
    "epoch_batches",
    "epoch_order",
    "full_sequence_starts",
    "full_sequence_starts_by_jumps",
    "host_powers",
    "jump_levels",
    "jump_tables",
    "nstep_windows",
    "num_batches",
    "reward_powers",
    "sequence_priority",
    "sequence_rows",
    "sequence_rows_by_jumps",
    "stack_rows",
    "stack_windows",
    "torch_reward_powers",
    "window_return",
]
