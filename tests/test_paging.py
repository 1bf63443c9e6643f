"""Issue 27: weights mapped from a checkpoint file leave the process's RSS while nothing reads
them (lowering.paging.page_out: madvise MADV_PAGEOUT), and nothing of them is lost.

Real mappings: a 64 MiB file mapped as safetensors maps it (private, ``torch`` storage
from the file), resident pages counted by ``/proc/self/status`` (RssFile).
"""

from __future__ import annotations

import re

import pytest
import torch

from lowering.paging import page_out, page_out_module

SIZE = 64 * 2**20


def rss_file() -> int:
    return int(re.search(r"RssFile:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


@pytest.fixture
def mapped(tmp_path):
    """A float tensor whose storage maps a 64 MiB file privately (as a checkpoint's weights)."""
    values = torch.arange(SIZE // 4, dtype=torch.float32)
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=SIZE)
    return torch.empty(0, dtype=torch.float32).set_(storage).view(-1), values


def test_mapped_weights_leave_rss_and_read_back_unchanged(mapped):
    weights, values = mapped
    assert torch.equal(weights, values)  # every page read: resident
    before = rss_file()
    assert page_out([weights, weights[10:]]) >= SIZE - 4096  # one storage, advised once
    assert before - rss_file() > SIZE * 3 // 4
    assert torch.equal(weights, values)  # read again from the file


def test_pages_written_since_mapping_are_never_lost(mapped):
    weights, values = mapped
    weights[::1024] = -1.0  # private pages of this process now: paging out must keep them
    page_out([weights])
    expected = values.clone()
    expected[::1024] = -1.0
    assert torch.equal(weights, expected)


def test_weights_in_anonymous_memory_are_left_alone():
    module = torch.nn.Linear(1024, 1024)
    assert page_out_module(module) == 0
    assert page_out([torch.ones(3), "not a tensor"]) == 0
