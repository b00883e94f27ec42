"""Transparent huge pages for large CPU columns (Linux's ``madvise(MADV_HUGEPAGE)``).

Rows sampled at random from a large column miss the TLB once per base page they touch; backed
by huge pages they miss it once per huge page, so random gathers of wide rows (pixel
observations spanning several base pages) or from very many rows take less time. Written by
hand because torch offers it only process-wide (``THP_MEM_ALLOC_ENABLE=1``, read by its
allocator for every allocation) and neither numpy nor TorchRL has it. Elsewhere than Linux,
and where the system allows no huge pages, nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path
from typing import Any

import torch

_MADV_HUGEPAGE = 14  # Linux's advice number (asm-generic, the same on every architecture)
_SIZE_FILE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
_DEFAULT_SIZE = 2 << 20  # x86-64, and arm64 with 4 KiB base pages


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise`` on Linux, else None (the library does not load)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).madvise
    except (OSError, AttributeError, TypeError):
        return None


@functools.cache
def huge_page_size() -> int:
    """Bytes per transparent huge page, as the kernel reports it (2 MiB if it does not)."""
    try:
        size = int(_SIZE_FILE.read_text())
    except (OSError, ValueError):
        return _DEFAULT_SIZE
    return size if size > 0 else _DEFAULT_SIZE


def advise_huge_pages(column: torch.Tensor) -> bool:
    """Advise the kernel to back the whole huge pages inside a CPU tensor's memory with huge
    pages as they are faulted in (pages already faulted in stay as they are until the kernel
    collapses them). Returns whether the advice was taken: False elsewhere than Linux, off the
    CPU, for less than a huge page, or where the kernel refuses it.

    Call it right after allocating with ``torch.empty``: each fault then zeroes a whole huge
    page at once (the first pass through a ring pays for that; reads gain from then on).
    """
    madvise = _madvise()
    if madvise is None or column.device.type != "cpu":
        return False
    storage = column.untyped_storage()
    page = huge_page_size()
    begin = -(-storage.data_ptr() // page) * page  # the whole huge pages inside the storage
    end = (storage.data_ptr() + storage.nbytes()) // page * page
    if end <= begin:
        return False
    return madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), _MADV_HUGEPAGE) == 0
