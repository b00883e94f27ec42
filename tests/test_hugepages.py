"""replaybuf.storage.hugepages: advice for whole huge pages inside a CPU tensor, and nothing where
it
does not apply (other systems, other devices, small tensors, no libc)."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from replaybuf.storage import hugepages


@pytest.fixture(autouse=True)
def fresh_caches():
    """Each test sees the platform, libc and page size it patches."""
    hugepages._madvise.cache_clear()
    hugepages.huge_page_size.cache_clear()
    yield
    hugepages._madvise.cache_clear()
    hugepages.huge_page_size.cache_clear()


def test_the_advice_covers_exactly_the_whole_huge_pages_inside_the_tensor(monkeypatch):
    calls: list[tuple[int, int, int]] = []

    def madvise(address, size, advice) -> int:
        calls.append((address.value, size.value, advice))
        return 0

    monkeypatch.setattr(hugepages, "_madvise", lambda: madvise)
    monkeypatch.setattr(hugepages, "huge_page_size", lambda: 4096)  # small pages: a test size
    tensor = torch.empty(5 * 4096 + 100, dtype=torch.uint8)
    view = tensor[10:]  # the advice is about the storage, whatever the view
    assert hugepages.advise_huge_pages(view)
    start, stop = tensor.data_ptr(), tensor.data_ptr() + tensor.numel()
    [(address, size, advice)] = calls
    assert advice == 14
    assert address % 4096 == 0
    assert size % 4096 == 0
    assert start <= address < start + 4096  # the first whole page inside
    assert stop - 4096 < address + size <= stop  # the last whole page inside


def test_no_advice_off_linux_off_the_cpu_below_a_huge_page_or_without_libc(monkeypatch):
    big = torch.empty(3 * hugepages.huge_page_size(), dtype=torch.uint8)
    assert not hugepages.advise_huge_pages(torch.empty(16, dtype=torch.uint8))  # no whole page
    assert not hugepages.advise_huge_pages(torch.empty(3 << 20, dtype=torch.uint8, device="meta"))
    for platform in ("win32", "darwin"):
        monkeypatch.setattr(sys, "platform", platform)
        hugepages._madvise.cache_clear()
        assert not hugepages.advise_huge_pages(big)
    monkeypatch.setattr(sys, "platform", "linux")
    for error in (OSError, TypeError):

        def refuse(*args, error=error, **kwargs):
            raise error("no C library here")

        monkeypatch.setattr(ctypes, "CDLL", refuse)
        hugepages._madvise.cache_clear()
        assert not hugepages.advise_huge_pages(big)


def test_a_refused_advice_reads_false(monkeypatch):
    monkeypatch.setattr(hugepages, "_madvise", lambda: lambda *args: -1)
    assert not hugepages.advise_huge_pages(
        torch.empty(3 * hugepages.huge_page_size(), dtype=torch.uint8)
    )


def test_the_page_size_is_the_kernels_or_2_mib(monkeypatch, tmp_path):
    size_file = tmp_path / "hpage_pmd_size"
    monkeypatch.setattr(hugepages, "_SIZE_FILE", size_file)
    assert hugepages.huge_page_size() == 2 << 20  # no such file
    for text, want in (("33554432\n", 32 << 20), ("garbage", 2 << 20), ("0", 2 << 20)):
        size_file.write_text(text)
        hugepages.huge_page_size.cache_clear()
        assert hugepages.huge_page_size() == want
