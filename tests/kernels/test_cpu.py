"""CPU fast-path specifics: constants baked into cached kernels, thread-count independence."""

from __future__ import annotations

import ast
from pathlib import Path

import numba
import numpy as np
import torch

from kvtrail.kernels import adler, cpu_kernels, mixing
from kvtrail.kernels.registry import get_backend

from .conftest import random_layout


def test_kernel_constants_match_the_definition():
    assert int(cpu_kernels._M1) == mixing.MIX_MUL1
    assert int(cpu_kernels._M2) == mixing.MIX_MUL2
    assert int(cpu_kernels._GOLDEN) == mixing.GOLDEN
    assert int(cpu_kernels._POS) == mixing.POSITION_SEED
    assert int(cpu_kernels._MOD) == adler.ADLER_MOD


def test_triton_constants_match_the_definition():
    # read, not imported: Triton is not installed on CPU machines
    source = (Path(mixing.__file__).parent / "triton_kernels.py").read_text()
    consts = {
        node.targets[0].id: node.value.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
    }
    for name in ("MIX_MUL1", "MIX_MUL2", "GOLDEN", "POSITION_SEED"):
        assert consts[name] == getattr(mixing, name), name
    assert source.count(hex(mixing.MIX_MUL1).upper().replace("0X", "0x")) == 2  # constant and _mix
    assert source.count(hex(mixing.MIX_MUL2).upper().replace("0X", "0x")) == 2


def test_results_do_not_depend_on_thread_count():
    layout = random_layout(3, num_pages=50, page_size=8, row_bytes=64, seed=4)
    ids = torch.randint(0, 51, (45,), generator=torch.Generator().manual_seed(4))
    fast = get_backend("cpu")
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = (fast.page_digests(layout, ids), fast.request_digest(layout, ids), fast.adler32(layout, ids))
    finally:
        numba.set_num_threads(before)
    assert torch.equal(one[0], fast.page_digests(layout, ids))
    assert one[1:] == (fast.request_digest(layout, ids), fast.adler32(layout, ids))


def test_reads_in_place_without_copying_buffers():
    # the digest follows writes made through the original tensors after the layout was built
    layout = random_layout(1, num_pages=4, page_size=2, row_bytes=16)
    fast = get_backend("cpu")
    before = fast.page_digests(layout, [3])
    layout.buffers[1][7, 0] ^= 1  # token row 7 is in page 3
    assert fast.page_digests(layout, [3]) != before


def test_page_ids_of_any_integer_type():
    layout = random_layout(1, num_pages=9)
    fast = get_backend("cpu")
    want = fast.page_digests(layout, [9, 2])
    for ids in (np.array([9, 2], dtype=np.int32), torch.tensor([9, 2], dtype=torch.int32), (9, 2)):
        assert torch.equal(fast.page_digests(layout, ids), want)
