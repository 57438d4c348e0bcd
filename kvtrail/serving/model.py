"""``CopyModel``: a tiny causal transformer over byte tokens whose output shows what it attended.

No training and no downloads: the weights are built from a seed so that decoding *copies* the token
whose K/V it attends to. Tokens are bytes (0..255), so a prompt is plain text.

- K of layer ``l``, head ``h`` for token ``x`` at position ``p`` is ``rope(E[x] @ Rk[l,h], p)``; V is
  ``E[x] @ Rv[l,h]``. ``E`` is a fixed table of unit vectors, ``Rk``/``Rv`` fixed orthogonal matrices, so
  every buffer of the pool holds different bytes for the same token, as in a real model.
- Decode step ``t`` over a page table covering ``seq_len`` tokens: every head of every layer computes
  ``softmax(q k^T / sqrt(d) + bias) v`` over the gathered K/V, where the bias is 0 at position
  ``t % seq_len`` and -inf elsewhere (the copy head). The output projection undoes ``Rv`` and
  averages over layers and heads, and the logits are dot products with ``E``: the argmax is the token
  whose V the slot holds.

So the output is whatever the slots under the page table hold. If a slot holds K/V written for another
request (pages are never zeroed), the generated text contains that request's bytes; a slot never
written since the pool was made holds zeros and decodes to byte 0.

K/V depend on the token and its position only, never on other tokens, so prefill writes K/V without
running attention for every position and then computes attention for the first output token alone;
that gives exactly what full causal attention would, because no later layer reads the other outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvtrail.serving.kvpool import KVPool, KVPoolConfig

VOCAB_SIZE = 256  # byte-level tokens
_STEPS_PER_CHUNK = 256  # decode steps attended at once by generate(); bounds the score tensor


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape; ``num_layers``, ``num_heads`` and ``head_dim`` are also the pool's layout."""

    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 32
    seed: int = 0
    rope_base: float = 10_000.0

    def __post_init__(self):
        for name in ("num_layers", "num_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        # Even for rope's pairs; 16+ so 256 random unit vectors stay apart enough for 16-bit pools.
        if self.head_dim < 16 or self.head_dim % 2:
            raise ValueError(f"head_dim: must be even and >= 16, got {self.head_dim}")
        if self.rope_base <= 1:
            raise ValueError(f"rope_base: must be > 1, got {self.rope_base}")

    def pool_config(
        self, num_pages: int, page_size: int, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> KVPoolConfig:
        """The :class:`KVPoolConfig` of a pool this model can read and write."""
        return KVPoolConfig(self.num_layers, num_pages, page_size, self.num_heads, self.head_dim, dtype, device)


class CopyModel:
    """Deterministic copy-by-attention model over a :class:`KVPool` (see the module docstring)."""

    def __init__(self, config: ModelConfig = ModelConfig()):
        self.config = config
        c = config
        g = torch.Generator().manual_seed(c.seed)
        embed = torch.randn(VOCAB_SIZE, c.head_dim, generator=g)
        embed = embed / embed.norm(dim=1, keepdim=True)
        rot_k, rot_v = (
            torch.linalg.qr(torch.randn(c.num_layers, c.num_heads, c.head_dim, c.head_dim, generator=g))[0]
            for _ in range(2)
        )
        query = torch.randn(c.num_layers, c.num_heads, c.head_dim, generator=g)
        # Tables indexed [layer, token, head, :]; the output projection is [layer, head, :, token].
        k_table = torch.einsum("xd,lhde->lxhe", embed, rot_k)
        v_table = torch.einsum("xd,lhde->lxhe", embed, rot_v)
        w_out = torch.einsum("lhde,xd->lhex", rot_v, embed) / (c.num_layers * c.num_heads)
        inv_freq = c.rope_base ** (-torch.arange(0, c.head_dim // 2, dtype=torch.float64) / (c.head_dim // 2))
        self._cpu = {"k": k_table, "v": v_table, "q": query, "out": w_out, "inv_freq": inv_freq.float()}
        self._by_device: dict[torch.device, dict[str, torch.Tensor]] = {torch.device("cpu"): self._cpu}

    def prefill(self, pool: KVPool, tokens, pages, *, start: int = 0) -> int:
        """Write K/V of every token into every layer and return the first output token.

        ``tokens`` (text, bytes or ints 0..255) sit at positions ``start..start+n-1`` of the page table
        ``pages`` (``start > 0`` for a later chunk). The first output token is :meth:`decode_step`'s
        step 0 over the ``start + n`` tokens now covered, read back from the pool.
        """
        self._check_pool(pool)
        ids = _token_ids(tokens)
        if start < 0:
            raise ValueError(f"start: must be >= 0, got {start}")
        if ids.numel() == 0 and start == 0:
            raise ValueError("tokens: a prompt needs at least one token")
        w = self._weights(pool.device)
        ids = ids.to(pool.device)
        positions = torch.arange(start, start + ids.numel(), device=pool.device)
        for layer in range(self.config.num_layers):
            k = self._rope(w["k"][layer][ids], positions, w)
            pool.write(layer, pages, positions, k, w["v"][layer][ids])
        return self.decode_step(pool, pages, start + ids.numel(), 0)

    def decode_step(self, pool: KVPool, page_table, seq_len: int, step: int) -> int:
        """The token of decode step ``step``: a copy of position ``step % seq_len`` of the page table."""
        kv = self._gather(pool, page_table, seq_len)
        return int(self._attend(kv, seq_len, torch.tensor([step], device=pool.device))[0])

    def generate(self, pool: KVPool, page_table, seq_len: int, max_new_tokens: int, *, first_step: int = 0) -> bytes:
        """Steps ``first_step .. first_step + max_new_tokens - 1`` as bytes.

        The same as calling :meth:`decode_step` for each step, provided nothing writes the pool
        meanwhile: the K/V are gathered once. Loop over :meth:`decode_step` when something might.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: must be >= 0, got {max_new_tokens}")
        kv = self._gather(pool, page_table, seq_len)
        steps = torch.arange(first_step, first_step + max_new_tokens, device=pool.device)
        out = [self._attend(kv, seq_len, chunk) for chunk in steps.split(_STEPS_PER_CHUNK)]
        return bytes(torch.cat(out).cpu().tolist()) if out else b""

    def write_token(self, pool: KVPool, pages, position: int, token: int) -> None:
        """Write one token's K/V at ``position`` in every layer (decode growth, or a fault's stray write)."""
        self._check_pool(pool)
        w = self._weights(pool.device)
        ids = _token_ids([token]).to(pool.device)
        pos = torch.tensor([position], device=pool.device)
        for layer in range(self.config.num_layers):
            pool.write(layer, pages, pos, self._rope(w["k"][layer][ids], pos, w), w["v"][layer][ids])

    def _gather(self, pool: KVPool, page_table, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._check_pool(pool)
        if seq_len < 1:
            raise ValueError(f"seq_len: must be >= 1, got {seq_len}")
        out = []
        for layer in range(self.config.num_layers):
            k, v = pool.gather(layer, page_table, seq_len)
            out.append((k.float(), v.float()))
        return out

    def _attend(self, kv, seq_len: int, steps: torch.Tensor) -> torch.Tensor:
        """Tokens ``(m,)`` for decode ``steps`` ``(m,)`` over gathered per-layer K/V ``(seq_len, H, d)``."""
        device = kv[0][0].device
        w = self._weights(device)
        target = steps % seq_len
        # The copy head's bias: 0 at the target position, -inf elsewhere, over all seq_len positions.
        bias = torch.full((steps.numel(), seq_len), -math.inf, device=device)
        bias[torch.arange(steps.numel(), device=device), target] = 0.0
        qpos = seq_len + steps  # the position of the token being generated
        logits = torch.zeros(steps.numel(), VOCAB_SIZE, device=device)
        scale = 1.0 / math.sqrt(self.config.head_dim)
        for layer, (k, v) in enumerate(kv):
            q = self._rope(w["q"][layer].expand(steps.numel(), -1, -1), qpos, w)
            scores = torch.einsum("mhd,shd->hms", q, k) * scale + bias
            out = torch.einsum("hms,shd->mhd", torch.softmax(scores, dim=-1), v)
            logits += torch.einsum("mhd,hdx->mx", out, w["out"][layer])
        return logits.argmax(dim=-1)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, w: dict) -> torch.Tensor:
        """Rotary position embedding of ``x`` ``(n, H, d)`` at ``positions`` ``(n,)`` (half-split pairs)."""
        angles = positions.to(torch.float32)[:, None] * w["inv_freq"][None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def _weights(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self._by_device:
            self._by_device[device] = {name: t.to(device) for name, t in self._cpu.items()}
        return self._by_device[device]

    def _check_pool(self, pool: KVPool) -> None:
        c, p = self.config, pool.config
        for name in ("num_layers", "num_heads", "head_dim"):
            if getattr(c, name) != getattr(p, name):
                raise ValueError(f"{name}: pool has {getattr(p, name)}, model has {getattr(c, name)}")


def _token_ids(tokens) -> torch.Tensor:
    """Byte token ids (int64) from text (UTF-8), bytes, a sequence of ints or a tensor."""
    if isinstance(tokens, str):
        tokens = tokens.encode("utf-8")
    if isinstance(tokens, (bytes, bytearray)):
        return torch.from_numpy(np.frombuffer(bytes(tokens), dtype=np.uint8).astype(np.int64))
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= VOCAB_SIZE):
        raise ValueError(f"tokens: ids must lie in 0..{VOCAB_SIZE - 1}")
    return ids
