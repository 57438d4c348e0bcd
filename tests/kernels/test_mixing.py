"""The digest definition: the three forms of mix64 agree and the finaliser avalanches."""

from __future__ import annotations

import numpy as np
import torch

from kvtrail.kernels import mixing
from kvtrail.kernels.mixing import MASK64, mix64, mix64_torch, signed, unsigned, word_keys, word_keys_torch


def test_torch_mix_equals_python_mix():
    rng = np.random.default_rng(1)
    values = [0, 1, 2, MASK64, 1 << 63, (1 << 63) - 1] + [int(v) for v in rng.integers(0, 2**63, 200)]
    values += [v | (1 << 63) for v in values]
    out = mix64_torch(torch.tensor([signed(v) for v in values], dtype=torch.int64))
    assert [unsigned(int(x)) for x in out] == [mix64(v) for v in values]


def test_mix64_is_a_bijection_on_a_sample():
    xs = torch.arange(-50_000, 50_000, dtype=torch.int64) * 7919
    assert mix64_torch(xs).unique().numel() == xs.numel()


def test_mix64_avalanche():
    # each input bit flips each output bit about half the time (counter and random inputs)
    rng = np.random.default_rng(7)
    inputs = torch.cat(
        [
            torch.arange(4000, dtype=torch.int64),
            torch.from_numpy(rng.integers(-(2**63), 2**63 - 1, 4000, dtype=np.int64)),
        ]
    )
    base = mix64_torch(inputs)
    bits = torch.arange(64, dtype=torch.int64)
    worst = 0.0
    for i in range(64):
        flipped = mix64_torch(inputs ^ signed(1 << i))
        diff = base ^ flipped
        p = ((diff.unsqueeze(1) >> bits) & 1).double().mean(0)
        worst = max(worst, float((p - 0.5).abs().max()))
    assert worst < 0.04  # sampling noise alone reaches ~0.03 at 8,000 samples


def test_word_keys_numpy_and_torch_agree():
    keys = word_keys(3000)
    assert keys.dtype == np.uint64 and keys.shape[0] >= 3000 and not keys.flags.writeable
    assert np.array_equal(keys[:3000].view(np.int64), word_keys_torch(3000).numpy())
    assert int(keys[0]) == mix64(mixing.KEY_SEED + mixing.GOLDEN)
    assert word_keys(5) is word_keys(1000)  # one cached table serves short items


def test_combine_definition():
    d = torch.tensor([signed(0xDEADBEEF), -5, 42], dtype=torch.int64)
    pos = [mix64(mixing.POSITION_SEED + i * mixing.GOLDEN) for i in range(3)]
    s = sum(mix64(unsigned(int(x)) ^ p) for x, p in zip(d, pos)) & MASK64
    want = mix64(mix64(mixing.REQUEST_SEED ^ 3) ^ s)
    assert mixing.combine_page_digests(d) == want
    assert mixing.combine_page_digests(d.flip(0)) != want
