"""Every PD transfer backend's sender, and whether the plugin records its sends (``transfer_sent``).

SGLang 0.5.23 ships five backends (``--disaggregation-transfer-backend``). Mooncake, NIXL, Mori and Ascend
senders send through ``CommonKVSender.send``, which the plugin hooks (NIXL and Mori inherit it,
Mooncake's override calls it, Ascend's sender is Mooncake's subclass). The fake backend's
``FakeKVSender`` is no ``CommonKVSender`` and moves no KV at all (warm-up, health checks, tests): it
has no destination pages to record, so a node running it is named as not audited for sends (decode's
landings are then unverified). So is any backend whose sender runs another ``send`` (a new backend, or
another build), or whose hook was not patched.
"""

from __future__ import annotations

from typing import Any, Collection

from kvtrail.serving.sglang import targets as T

# Sender classes whose own ``send`` does its work through its base class's (``super().send``) on 0.5.23; the
# tests check this against SGLang's source, since these modules need their transfer engines to import. Up to
# 0.5.22 Mooncake's does not, and is hooked itself (targets.MOONCAKE_SEND), found first in its MRO.
DELEGATES = frozenset({"MooncakeKVSender"})
# Sender classes that move no KV (no destination pages to record).
MOVES_NOTHING = frozenset({"FakeKVSender"})
# The backends SGLang 0.5.23 ships and the sender class each one uses.
SENDERS = {
    "mooncake": "MooncakeKVSender",
    "nixl": "NixlKVSender",
    "mori": "MoriKVSender",
    "ascend": "AscendKVSender",
    "fake": "FakeKVSender",
}


def sender_class(backend: str) -> Any:
    """The sender class SGLang uses for ``backend`` (its own lookup, ``get_kv_class``)."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    return get_kv_class(TransferBackend(backend), KVClassType.SENDER)


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}.send"


def send_target(cls: type, hooked: Collection[str] = (T.SEND,)) -> str | None:
    """The hook target that sees ``cls().send`` among ``hooked`` (None: no hooked function runs)."""
    definers = [c for c in cls.__mro__ if "send" in c.__dict__]
    for c in definers:
        path = _path(c)
        if path in hooked:
            return path
        if c.__name__ not in DELEGATES:
            return None
    return None


def backend_gap(backend: str, missing: list[str], cls: Any = None, hooked: Collection[str] = (T.SEND,)) -> str | None:
    """Why ``backend``'s sends are not recorded (None: they are). ``missing``: targets not patched;
    ``cls``: its sender class (default: SGLang's for the backend); ``hooked``: the targets of this release."""
    if cls is None:
        try:
            cls = sender_class(backend)
        except Exception as exc:  # noqa: BLE001 - an unknown backend, or one whose module does not import
            return f"transfer backend {backend} (sender not resolved: {type(exc).__name__})"
    target = send_target(cls, hooked)
    if cls.__name__ in MOVES_NOTHING:
        return f"transfer backend {backend} ({cls.__qualname__} moves no KV: no transfer_sent)"
    if target is None:
        return f"transfer backend {backend} ({cls.__qualname__}.send not hooked: no transfer_sent)"
    if target in missing:
        return f"transfer backend {backend} ({target} not patched: no transfer_sent)"
    return None
