"""``kvtrail lake export|verify``: put stores into an audit lake (local or S3) and check one.

The commands live with the lake's forensics because an export writes page-state checkpoints (the
replay's state); the storage itself is :mod:`kvtrail.audit.lake`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvtrail.audit.chain import SignatureChecker, Signer
from kvtrail.audit.lake.export import export_lake
from kvtrail.audit.lake.verify import verify_lake
from kvtrail.cli.progress import replaying
from kvtrail.forensics.lake.checkpointer import write_checkpoints
from kvtrail.timeutil import parse_utc


@click.group()
def lake() -> None:
    """The audit lake: Hive-partitioned Parquet (cluster=/node=/date=/hour=) with a verifiable manifest."""


@lake.command(name="export")
@click.option("--db", required=True, type=click.Path(dir_okay=False), help="The store to export (read-only).")
@click.option("--to", "to", required=True, help="The lake: a directory or s3://BUCKET/PREFIX (AWS_* environment).")
@click.option("--since", help="Only batches ending at or after this UTC time (ISO 8601) on a producer's first export.")
@click.option(
    "--signing-key",
    type=click.Path(exists=True, dir_okay=False),
    help="Ed25519 private key (PEM): sign the lake manifest.",
)
def export_cmd(db: str, to: str, since: str | None, signing_key: str | None) -> None:
    """Export the store's batches the lake does not hold yet, with page-state checkpoints and a new manifest."""
    since_ns = parse_utc(since, field="--since") if since else None
    signer = Signer.from_file(signing_key) if signing_key else None
    # On a terminal: each producer's batches and checkpoints as lines, the events read as a count and rate.
    with replaying("lake export: events read") as ticker:
        r = export_lake(
            db,
            to,
            since_ns=since_ns,
            signer=signer,
            checkpoints=write_checkpoints,
            progress=ticker.note if ticker.shown else None,
        )
    if not r.files:
        click.echo(f"nothing new: the lake holds every batch of {Path(db).name} (manifest {r.export_no})")
        return
    click.echo(
        f"export {r.export_no}: {r.batches} batches, {r.events:,} events, {r.checkpoints} checkpoints, "
        f"{r.files} files written"
    )


@lake.command(name="verify")
@click.argument("url", metavar="DIR|URL")
@click.option(
    "--public-key", type=click.Path(exists=True, dir_okay=False), help="Also require the manifest's Ed25519 signature."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify_cmd(url: str, public_key: str | None, as_json: bool) -> None:
    """Check every file against the manifest and the batches' chain; exit 1 naming each problem."""
    checker = SignatureChecker.from_file(public_key) if public_key else None
    r = verify_lake(url, checker=checker)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "ok": r.ok,
                    "manifest": r.manifest,
                    "files_checked": r.files_checked,
                    "batches_checked": r.batches_checked,
                    "problems": r.problems,
                },
                indent=2,
            )
        )
    else:
        for p in r.problems:
            click.echo(p, err=True)
        if r.ok:
            click.echo(f"ok: manifest {r.manifest}, {r.files_checked} files, {r.batches_checked} batches verified")
    if not r.ok:
        sys.exit(1)
