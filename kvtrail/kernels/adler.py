"""Adler-32 arithmetic for the SGLang-compatible KV checksum (``--disaggregation-enable-kv-checksum``).

SGLang 0.5.23 (``adler32_strided_checksum``) makes one item per (buffer, page) at
``base + page * item_len`` with length ``item_len``, in the order "for each buffer in order
(K layers, then V layers), for each page in request order", takes the Adler-32 of every item and
combines them in order with

    A = A_l + A_r - 1,   B = B_l + B_r + len_r * (A_l - 1)   (mod 65521)

so the result equals ``zlib.adler32`` of the concatenated bytes; an empty set gives 1.

The backends do not combine pairwise. Each item ``i`` (length ``L_i``) is reduced to its byte sum
``s_i = sum_j x_j`` and weighted sum ``w_i = sum_j (L_i - j) x_j`` (both mod 65521); then, with
``N`` the total length and ``R_i`` the bytes after item ``i``,

    A = 1 + sum_i s_i,   B = N + sum_i (w_i + R_i * s_i)   (mod 65521)

which is the same number (expand ``B`` of the concatenation byte by byte) computed in one
vectorised pass on any device. ``adler32_combine`` is the pairwise rule, kept for tests and callers
that hold per-item Adler-32 values.
"""

from __future__ import annotations

import torch

ADLER_MOD = 65521


def adler32_combine(adler_left: int, adler_right: int, len_right: int) -> int:
    """Adler-32 of ``left + right`` from the Adler-32 of each part and the right part's length."""
    a_l, b_l = adler_left & 0xFFFF, adler_left >> 16
    a_r, b_r = adler_right & 0xFFFF, adler_right >> 16
    a = (a_l + a_r - 1) % ADLER_MOD
    b = (b_l + b_r + (len_right % ADLER_MOD) * (a_l - 1)) % ADLER_MOD
    return (b << 16) | a


def item_adler32(byte_sum: int, weighted_sum: int, length: int) -> int:
    """Adler-32 of one item from its byte sum and weighted sum (as the pairwise rule consumes)."""
    a = (1 + byte_sum) % ADLER_MOD
    b = (length + weighted_sum) % ADLER_MOD
    return (b << 16) | a


def adler32_from_item_sums(byte_sums: torch.Tensor, weighted_sums: torch.Tensor, item_lens: torch.Tensor) -> int:
    """Adler-32 of the concatenation of items given per item ``s_i``, ``w_i`` and ``L_i``.

    All three are 1-D int64 tensors in concatenation order on one device; the sums may be given
    already reduced mod 65521 or not (as long as they are non-negative and fit int64).
    """
    if byte_sums.numel() == 0:
        return 1
    m = ADLER_MOD
    s = byte_sums.to(torch.int64) % m
    w = weighted_sums.to(torch.int64) % m
    lens = item_lens.to(device=s.device, dtype=torch.int64)
    total = int(lens.sum())
    after = (total - torch.cumsum(lens, 0)) % m  # R_i: bytes after item i
    # each term < m + m*m < 2**33, so the int64 sum is exact for up to 2**30 items
    a = (1 + int(s.sum())) % m
    b = (total + int((w + after * s).sum())) % m
    return (b << 16) | a
