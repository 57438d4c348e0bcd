"""``kvtrail preflight``: the deploy gate on SGLang's own outputs (start-up logs, server info, metrics, URLs)."""

from __future__ import annotations

import os
from dataclasses import replace

import click

from kvtrail.preflight.record import events_of, record_to_service, record_to_store
from kvtrail.preflight.report import judge
from kvtrail.preflight.sources import SourceError, read_source


@click.command()
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="One line per node, or exactly one JSON object.",
)
@click.option(
    "--role",
    type=click.Choice(["prefill", "decode"]),
    help="The role of every node of these sources (overrides what they state).",
)
@click.option(
    "--node",
    "node_names",
    multiple=True,
    help="The node each SOURCE describes, in order (repeat once per SOURCE): its name in the table "
    "and in the recorded configuration (default: the file's stem or the URL's host:port).",
)
@click.option("--allow-unknown", is_flag=True, help="Pass a check that cannot be established (default: fail closed).")
@click.option("--db", type=click.Path(dir_okay=False), help="Also record the configurations in this store.")
@click.option(
    "--url",
    default=lambda: os.environ.get("KVTRAIL_URL"),
    help="Also record them through this kvtrail service (or KVTRAIL_URL).",
)
@click.option(
    "--token", default=lambda: os.environ.get("KVTRAIL_TOKEN"), help="Producer token for --url (or KVTRAIL_TOKEN)."
)
@click.argument("sources", nargs=-1, required=True)
def preflight(
    fmt: str,
    role: str | None,
    node_names: tuple[str, ...],
    allow_unknown: bool,
    db: str | None,
    url: str | None,
    token: str | None,
    sources: tuple[str, ...],
) -> None:
    """Check a deployment before it serves: pool >= context on every node, integrity settings equal on both
    roles, an engine with the PD admission fix, bounded transfer batches, every path of a node's page traffic
    audited by kvtrail's SGLang plugin.

    Each SOURCE is an SGLang start-up log, a saved /server_info (or /get_server_info) JSON, a saved
    /metrics text, or the http(s):// URL of a running server. Exit 0 when every check passes on every
    node; 1 when one fails or cannot be established (unless --allow-unknown); 2 when a source cannot
    be read or yields no configuration (naming it and why).
    """
    if db and url:
        raise click.UsageError("--db and --url: record into one of them")
    if url and not token:
        raise click.UsageError("--url needs --token (a producer token) or KVTRAIL_TOKEN")
    if node_names and len(node_names) != len(sources):
        raise click.UsageError(
            f"--node: give one per SOURCE, in order ({len(node_names)} for {len(sources)} source(s))"
        )
    nodes, errors = [], []
    for i, source in enumerate(sources):
        try:
            found = read_source(source)
        except SourceError as exc:
            errors.append(str(exc))
            continue
        named = node_names[i] if node_names else None
        nodes += [replace(n, role=role or n.role, node=named or n.node) for n in found]
    verdict = judge(nodes, errors, allow_unknown=allow_unknown)
    click.echo(verdict.to_json() if fmt == "json" else verdict.to_table())
    if db or url:
        events, skipped = events_of(nodes)
        for line in skipped:
            click.echo(line, err=True)
        if events and db:
            record_to_store(db, events)
        elif events and url and token:
            record_to_service(url, token, events)
        click.echo(f"recorded {len(events)} node configuration(s) in {db or url}", err=True)
    raise SystemExit(verdict.exit_code())
