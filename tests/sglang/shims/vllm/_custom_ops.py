"""``rotary_embedding`` with vLLM's semantics (in place on query and key), in plain torch. Test-only."""

from __future__ import annotations

import torch


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    pos = positions.flatten()
    cos, sin = cos_sin_cache.index_select(0, pos).float().chunk(2, dim=-1)  # [tokens, rot/2] each
    rot = cos.shape[-1] * 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for x in (query, key):
        if x is None:
            continue
        v = x.view(pos.shape[0], -1, head_size)
        r = v[..., :rot].float()
        if is_neox:
            x1, x2 = r[..., : rot // 2], r[..., rot // 2 :]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        v[..., :rot] = out.to(x.dtype)
