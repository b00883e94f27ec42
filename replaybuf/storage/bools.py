"""Bool values stored as 0 or 1 by the fast paths that assign through numpy.

A bool array or tensor may hold any nonzero byte for True (a uint8 buffer viewed as bool).
The general path stores 0 or 1 (torch's bool copies do), but numpy's bool-to-bool assignment
copies the bytes as they are, and a stored True byte of 2 reads differently from a 1 to
anything that looks at the bytes (a view as uint8, a checkpoint's digest, a compiled kernel).
The per-step and chunk fast paths therefore assign into a bool column's bytes as uint8:
numpy's cast from bool to uint8 stores 0 or 1, and costs nothing on the other fields.
"""

from __future__ import annotations

import numpy as np


def assign_view(column: np.ndarray) -> np.ndarray:
    """What values checked against ``column`` (a numpy view of a storage or staging column)
    are assigned into: its bytes as uint8 for a bool column, else ``column`` itself. Only bool
    values (arrays, numpy scalars, Python bools) may go into a bool column's view."""
    return column.view(np.uint8) if column.dtype == np.bool_ else column
