"""KVPool: layout as SGLang's (buffer order, item_len), never zeroed, byte snapshots of pages."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kvtrail.serving.allocator import PageAllocator
from kvtrail.serving.kvpool import KVPool, KVPoolConfig

CFG = KVPoolConfig(num_layers=2, num_pages=8, page_size=4, num_heads=2, head_dim=16)


def _rows(n, seed, cfg=CFG):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, cfg.num_heads, cfg.head_dim, generator=g),
        torch.randn(n, cfg.num_heads, cfg.head_dim, generator=g),
    )


def _fill(pool, pages, seq_len, seed):
    """Write random K/V for positions 0..seq_len-1 in every layer; returns them per layer."""
    rows = []
    for layer in range(pool.config.num_layers):
        k, v = _rows(seq_len, seed + layer, pool.config)
        pool.write(layer, pages, np.arange(seq_len), k, v)
        rows.append((k, v))
    return rows


def test_buffers_shape_order_item_len_and_addresses():
    pool = KVPool(CFG)
    bufs = pool.buffers()
    assert len(bufs) == pool.num_buffers == 4
    # SGLang's order: every K layer, then every V layer.
    assert bufs[0] is pool.k[0] and bufs[1] is pool.k[1] and bufs[2] is pool.v[0] and bufs[3] is pool.v[1]
    for i, b in enumerate(bufs):
        assert b.shape == (9, 4, 2, 16) and b.is_contiguous() and b.dtype == torch.float32
        assert b.count_nonzero() == 0  # made with torch.zeros
        assert pool.data_ptr(i) == b.data_ptr() and pool.nbytes(i) == 9 * pool.item_len
        assert b.stride(0) * b.element_size() == pool.item_len
    assert pool.item_len == CFG.item_len == 4 * 2 * 16 * 4
    assert KVPoolConfig(1, 1, 16, 8, 128, dtype=torch.bfloat16).item_len == 16 * 8 * 128 * 2
    with pytest.raises(ValueError, match="i: buffer 4"):
        pool.data_ptr(4)


def test_write_then_gather_round_trips_in_page_table_order():
    pool = KVPool(CFG)
    pages = [5, 2, 7]
    rows = _fill(pool, pages, 10, seed=1)
    for layer, (k, v) in enumerate(rows):
        gk, gv = pool.gather(layer, pages, 10)
        assert torch.equal(gk, k) and torch.equal(gv, v)
    # Position 5 is slot 1 of the second page of the table (page 2).
    assert torch.equal(pool.k[0][2, 1], rows[0][0][5])
    assert pool.slots(pages, [0, 5, 9]).tolist() == [20, 9, 29]
    untouched = [p for p in range(CFG.num_pages + 1) if p not in pages]
    assert all(b[untouched].count_nonzero() == 0 for b in pool.buffers())


def test_pages_are_never_zeroed_on_free_or_reuse():
    pool = KVPool(CFG)
    alloc = PageAllocator(CFG.num_pages, reuse="lifo")
    a = alloc.alloc(3)
    _fill(pool, a, 12, seed=2)
    before = pool.page_bytes(a)
    alloc.free(a)
    b = alloc.alloc(3)
    assert sorted(b.tolist()) == sorted(a.tolist())  # reused at once
    # The new owner reads the old owner's K/V until it writes its own.
    assert pool.page_bytes(a) == before
    k_old, _ = pool.gather(0, a, 12)
    k_new, _ = pool.gather(0, b, 12)
    assert torch.equal(k_new, k_old[torch.as_tensor(_positions_in(a, b))])
    # A partial write replaces only the rows it covers.
    k, v = _rows(1, seed=9)
    pool.write(0, b, [0], k, v)
    gk, _ = pool.gather(0, b, 12)
    assert torch.equal(gk[0], k[0]) and torch.equal(gk[1:], k_new[1:])


def _positions_in(a, b, ps=CFG.page_size):
    """For each position of table ``b``, the position of the same slot in table ``a``."""
    where = {int(p): i for i, p in enumerate(a)}
    return [where[int(b[i // ps])] * ps + i % ps for i in range(len(b) * ps)]


def test_page_bytes_snapshot_layout_and_loopback():
    pool = KVPool(CFG)
    pages = [3, 1]
    _fill(pool, pages, 8, seed=3)
    data = pool.page_bytes(pages)
    assert len(data) == pool.num_buffers * len(pages) * pool.item_len
    # Buffer-major, then page in the order given: the stream SGLang's KV checksum digests.
    expect = b"".join(buf[p].numpy().tobytes() for buf in pool.buffers() for p in pages)
    assert data == expect
    assert zlib.adler32(data) == zlib.adler32(expect)
    assert pool.page_bytes([]) == b""
    # A loopback "transfer" into another pool at other pages gives the same bytes there.
    other = KVPool(CFG)
    other.write_page_bytes([6, 8], data)
    assert other.page_bytes([6, 8]) == data
    assert other.page_bytes([3, 1]) != data
    with pytest.raises(ValueError, match="data"):
        other.write_page_bytes([6], data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pools(dtype):
    cfg = KVPoolConfig(1, 4, 3, 2, 16, dtype=dtype)
    pool = KVPool(cfg)
    k, v = _rows(5, seed=4, cfg=cfg)
    pool.write(0, [2, 4], range(5), k, v)
    gk, gv = pool.gather(0, [2, 4], 5)
    assert gk.dtype == dtype and torch.equal(gk, k.to(dtype)) and torch.equal(gv, v.to(dtype))
    assert len(pool.page_bytes([2, 4])) == 2 * 2 * 3 * 2 * 16 * 2


def test_bad_input_names_the_field():
    pool = KVPool(CFG)
    k, v = _rows(2, seed=5)
    with pytest.raises(ValueError, match="pages: page 9 is out of range"):
        pool.write(0, [9], [0, 1], k, v)
    with pytest.raises(ValueError, match="positions"):
        pool.write(0, [1], [0, 4], k, v)
    with pytest.raises(ValueError, match="layer"):
        pool.write(2, [1], [0, 1], k, v)
    with pytest.raises(ValueError, match="k: shape"):
        pool.write(0, [1], [0, 1], k[:1], v)
    with pytest.raises(ValueError, match="seq_len"):
        pool.gather(0, [1], 5)
    for field, kwargs in (
        ("num_pages", {"num_pages": 0}),
        ("head_dim", {"head_dim": 2.5}),
        ("dtype", {"dtype": torch.int32}),
    ):
        args = {"num_layers": 1, "num_pages": 1, "page_size": 1, "num_heads": 1, "head_dim": 1, **kwargs}
        with pytest.raises(ValueError, match=field):
            KVPoolConfig(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_matches_cpu_pool():
    cpu, gpu = KVPool(CFG), KVPool(KVPoolConfig(**{**CFG.__dict__, "device": "cuda"}))
    k, v = _rows(6, seed=6)
    for pool in (cpu, gpu):
        pool.write(1, [4, 2], range(6), k, v)
    assert gpu.buffers()[1].is_cuda and gpu.page_bytes([4, 2]) == cpu.page_bytes([4, 2])
