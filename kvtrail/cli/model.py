"""``kvtrail model check|validate``: the PD page-ownership model checked within bounds, and its
properties as monitors over a recorded history (docs/model.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvtrail.errors import KvtrailError

_BOUNDS_DEFAULTS = {"requests": 3, "pages": 4, "chunks": 2}


@click.group()
def model() -> None:
    """The model of PD page ownership: check it, or judge a recorded history by its properties."""


@model.command()
@click.option(
    "--variant",
    required=True,
    help="vulnerable | patched | stack-vulnerable | stack-patched.",
)
@click.option(
    "--requests", default=_BOUNDS_DEFAULTS["requests"], show_default=True, type=int, help="Requests in the run."
)
@click.option("--pages", default=_BOUNDS_DEFAULTS["pages"], show_default=True, type=int, help="Pages per pool.")
@click.option("--chunks", default=_BOUNDS_DEFAULTS["chunks"], show_default=True, type=int, help="Pages per transfer.")
@click.option("--reuse", default=None, help="Page reuse order: any | lowest | lifo (default: the variant's).")
@click.option(
    "--max-states",
    default=2_000_000,
    show_default=True,
    type=click.IntRange(1),
    help="Stop the search after this many states (then exit 3 when nothing broke: not a proof).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--trace-out",
    type=click.Path(file_okay=False),
    help="Write each counterexample as events-v1 JSON lines, one file per producer (for kvtrail audit ingest).",
)
def check(
    variant: str,
    requests: int,
    pages: int,
    chunks: int,
    reuse: str | None,
    max_states: int,
    as_json: bool,
    trace_out: str | None,
) -> None:
    """Explore every state within the bounds; exit 1 with the shortest counterexample per violated property.

    Prints the states explored, the depth and the time; exit 0 when every property holds within the bounds,
    3 when the search stopped at --max-states with nothing broken (not a proof), 2 for bad input.
    """
    from kvtrail.model.checker import Checker
    from kvtrail.model.history import write_history
    from kvtrail.model.trace import result_dict, result_lines
    from kvtrail.model.variants import Bounds
    from kvtrail.model.variants import variant as variant_named

    v = variant_named(variant)
    bounds = Bounds(requests, pages, chunks, reuse)
    out_dir = Path(trace_out) if trace_out else None
    if out_dir is not None and out_dir.exists() and any(out_dir.iterdir()):
        raise KvtrailError(f"--trace-out: {trace_out} exists and is not empty")
    res = Checker(v, bounds).run(max_states=max_states)
    if as_json:
        click.echo(json.dumps(result_dict(res)))
    else:
        for line in result_lines(res):
            click.echo(line)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for n, cx in enumerate(res.counterexamples):
            for path in write_history(cx, v, bounds, out_dir, n):
                click.echo(f"wrote {path}", err=True)
    if res.counterexamples:
        sys.exit(1)
    if not res.exhaustive:
        sys.exit(3)


@model.command()
@click.option("--db", type=click.Path(dir_okay=False), help="The audit store to judge (read-only).")
@click.option("--url", envvar="KVTRAIL_URL", help="Ask a running kvtrail service instead of --db (env KVTRAIL_URL).")
@click.option("--token", "api_token", envvar="KVTRAIL_TOKEN", help="Operator API token for --url (env KVTRAIL_TOKEN).")
@click.option("--from", "from_", help="UTC start of the window (ISO 8601); the history before it is replayed.")
@click.option("--to", help="UTC end of the window (ISO 8601).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def validate(
    db: str | None, url: str | None, api_token: str | None, from_: str | None, to: str | None, as_json: bool
) -> None:
    """The model's properties as monitors over a recorded history (every producer, in seq order).

    Exit 1 listing each violation with its property and first offending event; exit 0 when the history is a
    behaviour the patched model allows. What the record cannot show is reported as coverage, not as a pass.
    """
    from kvtrail.timeutil import parse_utc

    if (db is None) == (url is None):
        raise KvtrailError("--db or --url: give exactly one")
    from_ns = parse_utc(from_, field="--from") if from_ else None
    to_ns = parse_utc(to, field="--to") if to else None
    if from_ns is not None and to_ns is not None and from_ns > to_ns:
        raise KvtrailError("--from: is after --to")
    if url is not None:
        from kvtrail.answers.client import Client

        doc = Client(url, api_token).model_violations({"from": from_, "to": to})
    else:
        from kvtrail.forensics import Window, open_store
        from kvtrail.model.validate import validate_store

        assert db is not None
        con = open_store(db)
        try:
            doc = validate_store(con, Window(from_ns, to_ns))
        finally:
            con.close()
    if as_json:
        click.echo(json.dumps({"violations": doc["violations"], "coverage": doc["coverage"]}))
    else:
        click.echo(f"{doc['events']} events judged against {len(doc['properties'])} properties")
        for v in doc["violations"]:
            f = v["first_event"]
            click.echo(
                f"VIOLATED {v['property']}: {f['producer']}:{f['seq']} node {f['node']} "
                f"request {f['request_id']}: {v['detail']}"
            )
        for c in doc["coverage"]:
            click.echo(f"cannot tell {c['property']}: {c['cannot_tell']} ({c['events']} events)")
        if not doc["violations"]:
            click.echo(
                "no violation: a behaviour the patched model allows" + (" (see coverage)" if doc["coverage"] else "")
            )
    if doc["violations"]:
        sys.exit(1)
