"""Triton kernels behind the CUDA backend (imported only by ``kvtrail.kernels.cuda`` when Triton imports).

Same definitions as ``mixing`` and ``adler``; buffers are passed as a tensor of base addresses and
read in place at ``base + page * item_len``. Digest words are 64-bit loads when every buffer base and
item length is a multiple of 8 (``ALIGNED``), otherwise each word is assembled from its 8 bytes.
Unsigned 64-bit arithmetic wraps, as the definition needs; int64 tensors carry the bit patterns
across the launch boundary (bitcast on load and store).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Repeated from mixing.py/adler.py as plain ints (Triton types literals >= 2**63 as uint64);
# tests/kernels/test_cpu.py checks they agree.
MIX_MUL1 = 0xE955E06F22E0B661
MIX_MUL2 = 0xA460673F9EB37D65
GOLDEN = 0x9E3779B97F4A7C15
POSITION_SEED = 0x6B76643120706F73


@triton.jit
def _mix(x):
    x ^= x >> 32
    x *= 0xE955E06F22E0B661
    x ^= x >> 29
    x *= 0xA460673F9EB37D65
    return x ^ (x >> 32)


@triton.jit
def item_sums_kernel(addrs_ptr, lens_ptr, ids_ptr, keys_ptr, sums_ptr, nb, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Grid (pages, buffers): ``sums[i, b] = (a_b, c_b)`` of page ``ids[i]`` in buffer ``b``."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    page = tl.load(ids_ptr + i)
    item_len = tl.load(lens_ptr + b)
    base = tl.load(addrs_ptr + b) + page * item_len
    num_words = (item_len + 7) // 8
    acc_a = tl.zeros([BLOCK], dtype=tl.uint64)
    acc_c = tl.zeros([BLOCK], dtype=tl.uint64)
    for k0 in range(0, num_words, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        in_item = k < num_words
        if ALIGNED:
            w = tl.load(base.to(tl.pointer_type(tl.uint64)) + k, mask=in_item, other=0)
        else:
            p8 = base.to(tl.pointer_type(tl.uint8))
            w = tl.zeros([BLOCK], dtype=tl.uint64)
            for j in tl.static_range(8):
                off = k * 8 + j
                byte = tl.load(p8 + off, mask=off < item_len, other=0)
                w |= byte.to(tl.uint64) << (8 * j)
        key = tl.load(keys_ptr + k, mask=in_item, other=0).to(tl.uint64, bitcast=True)
        v = w ^ key  # masked lanes: w = key = 0, so they add nothing
        acc_a += (v & 0xFFFFFFFF) * (v >> 32)
        acc_c += w
    out = sums_ptr + (i * nb + b) * 2
    tl.store(out, tl.sum(acc_a, axis=0).to(tl.int64, bitcast=True))
    tl.store(out + 1, tl.sum(acc_c, axis=0).to(tl.int64, bitcast=True))


@triton.jit
def fold_kernel(sums_ptr, out_ptr, seed, n, nb, BLOCK_N: tl.constexpr):
    """Page digests from the item sums: ``h = mix(mix(h ^ a_b) ^ c_b)`` over buffers in order."""
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = i < n
    h = (tl.zeros([BLOCK_N], dtype=tl.int64) + seed).to(tl.uint64, bitcast=True)
    for b in range(nb):
        a = tl.load(sums_ptr + (i * nb + b) * 2, mask=live, other=0).to(tl.uint64, bitcast=True)
        c = tl.load(sums_ptr + (i * nb + b) * 2 + 1, mask=live, other=0).to(tl.uint64, bitcast=True)
        h = _mix(_mix(h ^ a) ^ c)
    tl.store(out_ptr + i, h.to(tl.int64, bitcast=True), mask=live)


@triton.jit
def adler_items_kernel(addrs_ptr, lens_ptr, ids_ptr, s_ptr, w_ptr, n, BLOCK: tl.constexpr):
    """Grid (pages, buffers): byte sum and weighted sum of item (buffer b, page ids[i]) at b*n + i."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    page = tl.load(ids_ptr + i)
    item_len = tl.load(lens_ptr + b)
    p8 = (tl.load(addrs_ptr + b) + page * item_len).to(tl.pointer_type(tl.uint8))
    acc_s = tl.zeros([BLOCK], dtype=tl.int64)
    acc_w = tl.zeros([BLOCK], dtype=tl.int64)
    for j0 in range(0, item_len, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        x = tl.load(p8 + j, mask=j < item_len, other=0).to(tl.int64)
        acc_s += x
        acc_w += x * (item_len - j)  # exact in int64 for items below 2**27 bytes
    tl.store(s_ptr + b * n + i, tl.sum(acc_s, axis=0))
    tl.store(w_ptr + b * n + i, tl.sum(acc_w, axis=0))
