"""The numba kernels behind the CPU backend (imported only by ``kvtrail.kernels.cpu``).

They read the KV buffers in place: a buffer is passed as its base address, and a page's bytes are
viewed with ``carray`` at ``base + page * item_len`` (no gather, no copy). Page ids are range-checked
in the kernels before any page is read; the Python side must keep the tensors alive during a call.

Few kernels, ``cache=True``: the first call compiles (a few seconds), later processes load the
machine code from ``__pycache__``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.extending import intrinsic

# The constants are repeated here, not imported: numba bakes globals into the cached machine code
# and only re-compiles when this file changes, so a constant edited in mixing.py or adler.py alone
# would leave stale kernels. tests/kernels/test_cpu.py checks both copies agree.
_U = np.uint64
_M1 = _U(0xE955E06F22E0B661)  # mixing.MIX_MUL1
_M2 = _U(0xA460673F9EB37D65)  # mixing.MIX_MUL2
_GOLDEN = _U(0x9E3779B97F4A7C15)  # mixing.GOLDEN
_POS = _U(0x6B76643120706F73)  # mixing.POSITION_SEED
_LO32 = _U(0xFFFFFFFF)
_MOD = _U(65521)  # adler.ADLER_MOD
_ADLER_LANES = 32
# Items up to this size are prefetched one step ahead (see digest_pages): measured 1.5-2x faster at
# 128-1024 B items, no gain or a few % slower from 2 KiB up, where the hardware prefetcher keeps up.
_PREFETCH_MAX_ITEM = 1024
# 2048 chunks of 32 bytes keep every per-lane running sum below 2**32 (255 * 2048 * 2049 / 2 < 2**29)
_ADLER_BLOCK_CHUNKS = 2048


def _pointer_intrinsic(elem):
    @intrinsic
    def as_pointer(typingctx, addr):
        sig = types.CPointer(elem)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return as_pointer


@intrinsic
def _prefetch(typingctx, addr):
    """A read prefetch of the cache line at ``addr`` (llvm.prefetch; never faults)."""
    sig = types.void(types.int64)

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        )
        builder.call(fn, [builder.inttoptr(args[0], i8p), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


_u8_ptr = _pointer_intrinsic(types.uint8)
_u64_ptr = _pointer_intrinsic(types.uint64)


@njit(nogil=True, cache=True)
def _mix(x):
    x ^= x >> _U(32)
    x *= _M1
    x ^= x >> _U(29)
    x *= _M2
    return x ^ (x >> _U(32))


@njit(nogil=True, cache=True)
def _word_sums_bytes(addr, item_len, keys):
    # Unaligned or odd-length items: assemble each little-endian word from bytes, zero-padding the last.
    x = carray(_u8_ptr(addr), (item_len,))
    a = _U(0)
    c = _U(0)
    for k in range((item_len + 7) // 8):
        w = _U(0)
        for j in range(min(8, item_len - 8 * k)):
            w |= _U(x[8 * k + j]) << _U(8 * j)
        v = w ^ keys[k]
        a += (v & _LO32) * (v >> _U(32))
        c += w
    return a, c


@njit(nogil=True, cache=True)
def _word_sums_8(base, item_len, ids, i0, keys, scratch):
    # Eight pages of one buffer in lockstep: a single page stream leaves the core waiting on memory;
    # eight independent streams keep enough reads in flight (measured 2.5x on scattered 8 KiB items).
    # A short last group repeats its last page; the caller ignores the repeats.
    n = ids.shape[0]
    nw = item_len // 8
    i1, i2, i3 = min(i0 + 1, n - 1), min(i0 + 2, n - 1), min(i0 + 3, n - 1)
    i4, i5, i6, i7 = min(i0 + 4, n - 1), min(i0 + 5, n - 1), min(i0 + 6, n - 1), min(i0 + 7, n - 1)
    w0 = carray(_u64_ptr(base + ids[i0] * item_len), (nw,))
    w1 = carray(_u64_ptr(base + ids[i1] * item_len), (nw,))
    w2 = carray(_u64_ptr(base + ids[i2] * item_len), (nw,))
    w3 = carray(_u64_ptr(base + ids[i3] * item_len), (nw,))
    w4 = carray(_u64_ptr(base + ids[i4] * item_len), (nw,))
    w5 = carray(_u64_ptr(base + ids[i5] * item_len), (nw,))
    w6 = carray(_u64_ptr(base + ids[i6] * item_len), (nw,))
    w7 = carray(_u64_ptr(base + ids[i7] * item_len), (nw,))
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _U(0)
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = _U(0)
    for k in range(nw):
        key = keys[k]
        x0, x1, x2, x3, x4, x5, x6, x7 = w0[k], w1[k], w2[k], w3[k], w4[k], w5[k], w6[k], w7[k]
        v0, v1, v2, v3 = x0 ^ key, x1 ^ key, x2 ^ key, x3 ^ key
        v4, v5, v6, v7 = x4 ^ key, x5 ^ key, x6 ^ key, x7 ^ key
        a0 += (v0 & _LO32) * (v0 >> _U(32))
        a1 += (v1 & _LO32) * (v1 >> _U(32))
        a2 += (v2 & _LO32) * (v2 >> _U(32))
        a3 += (v3 & _LO32) * (v3 >> _U(32))
        a4 += (v4 & _LO32) * (v4 >> _U(32))
        a5 += (v5 & _LO32) * (v5 >> _U(32))
        a6 += (v6 & _LO32) * (v6 >> _U(32))
        a7 += (v7 & _LO32) * (v7 >> _U(32))
        c0 += x0
        c1 += x1
        c2 += x2
        c3 += x3
        c4 += x4
        c5 += x5
        c6 += x6
        c7 += x7
    scratch[0], scratch[1], scratch[2], scratch[3] = a0, c0, a1, c1
    scratch[4], scratch[5], scratch[6], scratch[7] = a2, c2, a3, c3
    scratch[8], scratch[9], scratch[10], scratch[11] = a4, c4, a5, c5
    scratch[12], scratch[13], scratch[14], scratch[15] = a6, c6, a7, c7


@njit(nogil=True, cache=True)
def _prefetch_items(base, item_len, ids, lo, hi):
    for i in range(lo, hi):
        start = base + ids[i] * item_len
        for off in range(0, item_len, 64):
            _prefetch(start + off)


@njit(parallel=True, nogil=True, cache=True)
def digest_pages(addrs, item_lens, aligned, ids, num_pages, keys, seed, out):
    """Page digests into ``out`` (uint64); returns (sum of position terms, count of bad page ids)."""
    n = ids.shape[0]
    nb = addrs.shape[0]
    groups = (n + 7) // 8
    scratch = np.empty((groups, 16), np.uint64)
    bad = 0
    total = _U(0)
    # One parallel region, one work item per 8 pages through every buffer: each fork/join on a busy
    # machine waits for its slowest thread, so the kernel forks once.
    for q in prange(groups):
        i0 = q * 8
        m = min(8, n - i0)
        group_bad = 0
        for g in range(m):
            if ids[i0 + g] < 0 or ids[i0 + g] > num_pages:
                group_bad += 1
        if group_bad:
            bad += group_bad
        else:
            row = scratch[q]
            for g in range(m):
                out[i0 + g] = seed
            for b in range(nb):
                # Small items are short streams the hardware prefetcher barely starts on: ask for the
                # next step's items (next buffer, or the next group's first) while these are summed.
                if b + 1 < nb and item_lens[b + 1] <= _PREFETCH_MAX_ITEM:
                    _prefetch_items(addrs[b + 1], item_lens[b + 1], ids, i0, i0 + m)
                elif b + 1 == nb and item_lens[0] <= _PREFETCH_MAX_ITEM:
                    _prefetch_items(addrs[0], item_lens[0], ids, min(i0 + 8, n), min(i0 + 16, n))
                if aligned[b]:
                    _word_sums_8(addrs[b], item_lens[b], ids, i0, keys, row)
                else:
                    for g in range(m):
                        row[2 * g], row[2 * g + 1] = _word_sums_bytes(
                            addrs[b] + ids[i0 + g] * item_lens[b], item_lens[b], keys
                        )
                for g in range(m):
                    out[i0 + g] = _mix(_mix(out[i0 + g] ^ row[2 * g]) ^ row[2 * g + 1])
            for g in range(m):
                total += _mix(out[i0 + g] ^ _mix(_U(i0 + g) * _GOLDEN + _POS))
    return total, bad


@njit(nogil=True, cache=True)
def _adler_sums(x, item_len):
    # Returns (sum x_j, sum (item_len - j) x_j), both mod 65521. The byte-serial Adler recurrence is
    # latency-bound; instead 32 lanes keep S_j (bytes of lane j so far) and Q_j (running sum of S_j
    # after each 32-byte chunk), which vectorises: a block's weighted sum is 32*sum(Q) - sum(j*S_j).
    s = _U(0)
    w = _U(0)
    lane_s = np.zeros(_ADLER_LANES, np.uint32)
    lane_q = np.zeros(_ADLER_LANES, np.uint32)
    pos = 0
    while item_len - pos >= _ADLER_LANES:
        chunks = min((item_len - pos) // _ADLER_LANES, _ADLER_BLOCK_CHUNKS)
        lane_s[:] = 0
        lane_q[:] = 0
        for ch in range(chunks):
            o = pos + _ADLER_LANES * ch
            for j in range(_ADLER_LANES):
                lane_s[j] += x[o + j]
                lane_q[j] += lane_s[j]
        bs = _U(0)
        bq = _U(0)
        bj = _U(0)
        for j in range(_ADLER_LANES):
            bs += _U(lane_s[j])
            bq += _U(lane_q[j])
            bj += _U(j) * _U(lane_s[j])
        block_len = _U(_ADLER_LANES * chunks)
        w = (w + block_len * s + _U(_ADLER_LANES) * bq - bj) % _MOD
        s = (s + bs) % _MOD
        pos += _ADLER_LANES * chunks
    for j in range(pos, item_len):
        s = (s + _U(x[j])) % _MOD
        w = (w + s) % _MOD
    return s, w


@njit(parallel=True, nogil=True, cache=True)
def adler_items(addrs, item_lens, ids, num_pages, out_s, out_w):
    """Per-item byte and weighted sums, items buffer-major; returns the count of bad page ids."""
    n = ids.shape[0]
    nb = addrs.shape[0]
    bad = 0
    for t in prange(nb * n):
        p = ids[t % n]
        if p < 0 or p > num_pages:
            bad += 1  # checked item by item, before the item's bytes are read
        else:
            b = t // n
            x = carray(_u8_ptr(addrs[b] + p * item_lens[b]), (item_lens[b],))
            out_s[t], out_w[t] = _adler_sums(x, item_lens[b])
    return bad


@njit(parallel=True, nogil=True, cache=True)
def tag_scan(table, ids, held):
    """(mismatching pages, bad page ids) of a request, in parallel; nothing is collected."""
    mismatched = 0
    bad = 0
    for i in prange(ids.shape[0]):
        p = ids[i]
        if p < 0 or p >= table.shape[0]:
            bad += 1
        elif table[p] != held[i]:
            mismatched += 1
    return mismatched, bad


@njit(nogil=True, cache=True)
def tag_collect(table, ids, held, out):
    """Write mismatching page ids to ``out`` (as many as fit); returns (how many, bad page ids). Serial."""
    k = 0
    bad = 0
    for i in range(ids.shape[0]):
        p = ids[i]
        if p < 0 or p >= table.shape[0]:
            bad += 1
        elif table[p] != held[i] and k < out.shape[0]:
            # bounded: tags bumped by another thread since a scan must not write past ``out``
            out[k] = p
            k += 1
    return k, bad
