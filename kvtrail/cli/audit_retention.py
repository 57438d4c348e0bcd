"""``kvtrail audit prune`` and ``kvtrail audit hold add|list|release``: retention and legal holds."""

from __future__ import annotations

import click

from kvtrail.cli.audit_store import DB_OPTION
from kvtrail.cli.audit_store import existing as _existing
from kvtrail.timeutil import format_utc, parse_utc


@click.command(name="prune")
@DB_OPTION
@click.option("--before", "before", required=True, help="UTC time; batches entirely before it are removed.")
@click.option("--note", help="Why (kept in the prune record).")
@click.option("--dry-run", is_flag=True, help="Only count what would be removed.")
def prune_cmd(db: str, before: str, note: str | None, dry_run: bool) -> None:
    """Remove data older than --before, except data under a legal hold; the prune is recorded and chained."""
    from kvtrail.audit.retention import prune
    from kvtrail.audit.store import AuditStore

    before_ns = parse_utc(before, field="--before")
    with AuditStore(_existing(db)) as store:
        res = prune(store, before_ns, note=note, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    rec = f" (prune record {res.prune_id})" if res.prune_id else ""
    click.echo(
        f"{verb} {res.num_batches} batches, {res.num_events} events before {format_utc(before_ns)}; "
        f"kept {res.num_held_batches} batches under legal hold{rec}"
    )


@click.group()
def hold() -> None:
    """Legal holds: data they cover is never pruned."""


@hold.command("add")
@DB_OPTION
@click.option("--from", "from_", required=True, help="UTC start of the held window.")
@click.option("--to", "to", required=True, help="UTC end of the held window.")
@click.option("--tenant", help="Only this tenant's requests.")
@click.option("--node", help="Only this node.")
@click.option("--reason", required=True, help="Case or ticket reference.")
def hold_add(db: str, from_: str, to: str, tenant: str | None, node: str | None, reason: str) -> None:
    """Place a legal hold."""
    from kvtrail.audit.retention import add_hold
    from kvtrail.audit.store import AuditStore

    with AuditStore(_existing(db)) as store:
        hold_id = add_hold(
            store, parse_utc(from_, field="--from"), parse_utc(to, field="--to"), reason, tenant_id=tenant, node=node
        )
    click.echo(f"hold {hold_id} placed")


@hold.command("list")
@DB_OPTION
def hold_list(db: str) -> None:
    """List legal holds."""
    from kvtrail.audit.retention import list_holds
    from kvtrail.audit.store import AuditStore

    with AuditStore(_existing(db)) as store:
        for h in list_holds(store):
            state = f"released {format_utc(h.released_ns)}" if h.released_ns else "active"
            click.echo(
                f"{h.hold_id}\t{format_utc(h.from_ns)} .. {format_utc(h.to_ns)}\ttenant={h.tenant_id or '*'}\t"
                f"node={h.node or '*'}\t{state}\t{h.reason}"
            )


@hold.command("release")
@DB_OPTION
@click.argument("hold_id", type=int)
def hold_release(db: str, hold_id: int) -> None:
    """Release a legal hold (its data becomes prunable)."""
    from kvtrail.audit.retention import release_hold
    from kvtrail.audit.store import AuditStore

    with AuditStore(_existing(db)) as store:
        release_hold(store, hold_id)
    click.echo(f"hold {hold_id} released")
