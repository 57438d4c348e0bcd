"""A transfer's events as the cross-node rules judge them: collected per request, joined per transfer (a
bootstrap room's prefill and decode requests are one; ``docs/findings.md``, "Bootstrap rooms")."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtrail.forensics.replay.event import ReplayEvent

# A transfer's events are collected per (cluster, transfer_id, request_id, tenant_id as the event names it)
# and joined per transfer when findings are asked for (``transfers_by_request``).
TransferKey = tuple[str, int | None, str | None, str | None]


@dataclass(eq=False, slots=True)
class TransferEvents:
    """The events of one transfer_id: the latest reservation and receipt, every send in order."""

    reserved: ReplayEvent | None = None
    sent: list[ReplayEvent] = field(default_factory=list)
    received: ReplayEvent | None = None
    # the node_config in force on the reservation's / the receipt's node when it was recorded (F11)
    reserved_cfg: ReplayEvent | None = None
    received_cfg: ReplayEvent | None = None
    # a bootstrap room's pair: prefill's own request id and tenant for it (decode's names the transfer)
    prefill_request_id: str | None = None
    prefill_tenant: str | None = None


def transfers_by_request(
    legs: dict[TransferKey, TransferEvents], tenants: dict[str, str]
) -> dict[TransferKey, TransferEvents]:
    """The transfers to judge, keyed (cluster, transfer_id, request_id, tenant) by the request that names them.

    ``legs`` are the events as collected, per the tenant each event named: those of one request are one
    transfer (an event naming no tenant is of the first tenant named for its id). A bootstrap room: where one
    transfer id of a cluster has exactly one request that sent it (prefill's) and exactly one other that
    reserved or received it (decode's), both are one transfer, named by decode's request, with prefill's id
    kept (``prefill_request_id``). Anything else (two senders or receivers: a collision) stays apart.
    """
    merged: dict[TransferKey, TransferEvents] = {}
    for (cluster, tid, rid, tenant), t in legs.items():
        if tenant is None and rid is not None:
            tenant = tenants.get(rid)
        key = (cluster, tid, rid, tenant)
        cur = merged.get(key)
        merged[key] = t if cur is None else combined(cur, t)
    rooms: dict[tuple[str, int], list[TransferKey]] = {}
    for key in merged:
        if key[1] is not None:
            rooms.setdefault((key[0], key[1]), []).append(key)
    for keys in rooms.values():
        if len(keys) != 2:
            continue
        senders = [k for k in keys if merged[k].sent]
        receivers = [k for k in keys if merged[k].reserved is not None or merged[k].received is not None]
        if len(senders) != 1 or len(receivers) != 1 or senders[0] == receivers[0]:
            continue
        s, d = merged.pop(senders[0]), merged[receivers[0]]
        merged[receivers[0]] = TransferEvents(
            d.reserved,
            s.sent,
            d.received,
            d.reserved_cfg,
            d.received_cfg,
            prefill_request_id=senders[0][2],
            prefill_tenant=senders[0][3],
        )
    return merged


def combined(a: TransferEvents, b: TransferEvents) -> TransferEvents:
    """One request's transfer events from two collections: the latest reservation and receipt, every send."""
    out = TransferEvents(sent=sorted(a.sent + b.sent, key=lambda e: e.ord))
    for name in ("reserved", "received"):
        x, y = getattr(a, name), getattr(b, name)
        pick = a if y is None or (x is not None and x.ord > y.ord) else b
        setattr(out, name, getattr(pick, name))
        setattr(out, f"{name}_cfg", getattr(pick, f"{name}_cfg"))
    return out
