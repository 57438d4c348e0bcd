"""The definition of kvtrail's page digest (``kvd1``): constants, mixing, word keys, request combine.

Every backend computes exactly this; the pure-torch forms here are the reference, the fast paths
are tested against them.

**Page digest.** For one page ``p`` and each buffer ``b`` of the layout in order (K of every layer,
then V of every layer), take the page's ``item_len`` bytes at ``base_b + p * item_len_b`` as
little-endian 64-bit words ``w_0 .. w_{m-1}`` (``m = ceil(item_len / 8)``; a last partial word is
zero-padded). With ``v_k = w_k ^ key_k`` and per-position keys
``key_k = mix64(KEY_SEED + (k + 1) * GOLDEN)`` (the same for every buffer):

    a_b = sum_k lo32(v_k) * hi32(v_k)   (mod 2**64)
    c_b = sum_k w_k                      (mod 2**64)

then ``h = mix64(PAGE_SEED ^ page_bytes)`` and, buffer by buffer, ``h = mix64(mix64(h ^ a_b) ^ c_b)``.
The page digest is the final ``h``. ``c_b`` changes by the word difference whenever exactly one word
changes, so any change confined to one 8-byte word is never lost in the sums; the keyed products
make the sums depend on where each word sits, so moved rows and swapped words change ``a_b``; the
chained ``mix64`` binds buffer order. Sums are order-free inside a buffer, which is what lets the
fast paths read pages in any order and many pages at once.

**Request digest.** Over the page digests ``d_0 .. d_{n-1}`` in request order:

    S = sum_i mix64(d_i ^ mix64(POSITION_SEED + i * GOLDEN))   (mod 2**64)
    request = mix64(mix64(REQUEST_SEED ^ n) ^ S)

so each page is bound to its position (swaps change it) and the count is bound (truncation
changes it); a single changed page digest always changes ``S``.

``mix64(x)``: ``x ^= x >> 32; x *= MIX_MUL1; x ^= x >> 29; x *= MIX_MUL2; x ^= x >> 32``, all
mod 2**64 (a bijection, so a changed input always changes the output).

This is an integrity check against faults and bugs (bit flips, stale or misplaced pages, short
transfers), not a MAC: the constants are public and an adversary can construct collisions.
``mix64`` is a multiply-xorshift finaliser with constants chosen for this package: over every
(input bit, output bit) pair, the flip probability was within 0.012 of 1/2 on 50,000 random and
50,000 counter inputs (sampling noise is ~0.01 there; tests/kernels/test_mixing.py re-checks it).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from kvtrail.kernels.layout import KernelError

MASK64 = (1 << 64) - 1
MIX_MUL1 = 0xE955E06F22E0B661
MIX_MUL2 = 0xA460673F9EB37D65
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: consecutive multiples are well spread
KEY_SEED = 0x6B76643120776F72  # "kvd1 wor"
PAGE_SEED = 0x6B7664312070616E  # "kvd1 pag"
POSITION_SEED = 0x6B76643120706F73  # "kvd1 pos"
REQUEST_SEED = 0x6B76643120726571  # "kvd1 req"
LO32 = 0xFFFFFFFF


def signed(x: int) -> int:
    """A 64-bit pattern as the int64 value torch and numpy int64 hold it."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def unsigned(x: int) -> int:
    return x & MASK64


def mix64(x: int) -> int:
    """The finaliser on Python ints (the specification the tensor forms follow)."""
    x &= MASK64
    x ^= x >> 32
    x = (x * MIX_MUL1) & MASK64
    x ^= x >> 29
    x = (x * MIX_MUL2) & MASK64
    return x ^ (x >> 32)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    # int64 tensors shift arithmetically; masking the sign-extended bits gives the logical shift.
    return (x >> s) & ((1 << (64 - s)) - 1)


_M1 = signed(MIX_MUL1)
_M2 = signed(MIX_MUL2)


def mix64_torch(x: torch.Tensor) -> torch.Tensor:
    """``mix64`` elementwise on int64 bit patterns (int64 multiply wraps mod 2**64)."""
    x = x ^ _lsr(x, 32)
    x = x * _M1
    x = x ^ _lsr(x, 29)
    x = x * _M2
    return x ^ _lsr(x, 32)


def word_keys_torch(num_words: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``key_k = mix64(KEY_SEED + (k + 1) * GOLDEN)`` for ``k < num_words``, as int64 bit patterns."""
    k = torch.arange(1, num_words + 1, dtype=torch.int64, device=device)
    return mix64_torch(k * signed(GOLDEN) + signed(KEY_SEED))


@lru_cache(maxsize=8)
def _key_table(num_words: int) -> np.ndarray:
    table = word_keys_torch(num_words).numpy().view(np.uint64)
    table.flags.writeable = False
    return table


def word_keys(num_words: int) -> np.ndarray:
    """The same keys as a read-only uint64 numpy array (for the CPU kernels), at least ``num_words`` long."""
    # Keys only depend on the position, so one table rounded up to a power of two serves every length.
    return _key_table(max(1024, 1 << max(0, num_words - 1).bit_length()))


def position_keys_torch(count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    i = torch.arange(count, dtype=torch.int64, device=device)
    return mix64_torch(i * signed(GOLDEN) + signed(POSITION_SEED))


def page_seed(page_bytes: int) -> int:
    """The digest state before the first buffer."""
    return mix64(PAGE_SEED ^ page_bytes)


def finish_request(count: int, term_sum: int) -> int:
    """The request digest from the page count and ``S`` (the wrapped sum of position terms)."""
    return mix64(mix64(REQUEST_SEED ^ count) ^ unsigned(term_sum))


def combine_page_digests(digests: torch.Tensor) -> int:
    """The request digest of page digests in request order (int64 bit patterns, any device)."""
    if digests.dim() != 1:
        raise KernelError("digests", f"must be 1-D, got shape {tuple(digests.shape)}")
    n = digests.numel()
    terms = mix64_torch(digests.to(torch.int64) ^ position_keys_torch(n, digests.device))
    return finish_request(n, int(terms.sum()) if n else 0)
