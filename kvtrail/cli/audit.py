"""``kvtrail audit ...``: ingest, verify, chain heads, stats, retention, backup, export/import, keys, schema."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvtrail.cli.audit_log import checkpoint, checkpoint_options, print_checkpoint, prove
from kvtrail.cli.audit_retention import hold, prune_cmd
from kvtrail.cli.audit_store import DB_OPTION
from kvtrail.cli.audit_store import existing as _existing
from kvtrail.errors import KvtrailError, ValidationError
from kvtrail.timeutil import format_utc


def _progress(total: int | None, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="batch", file=sys.stderr, disable=None, leave=False)


@click.group()
def audit() -> None:
    """The audit store: ingest events, verify the tamper-evidence chain, retention, export."""


audit.add_command(checkpoint)
audit.add_command(prune_cmd)
audit.add_command(hold)
audit.add_command(prove)


@audit.command()
@DB_OPTION
@click.option(
    "--signing-key", type=click.Path(exists=True, dir_okay=False), help="Ed25519 private key (PEM) to sign batches."
)
@click.option(
    "--init-empty",
    is_flag=True,
    help="Make kvtrail's tables in an existing DuckDB file that holds none (a missing --db is created "
    "without it; an empty one is refused without it, being what a copy taken without its WAL "
    "looks like).",
)
@click.argument("files", nargs=-1, required=True, type=click.Path(allow_dash=True))
def ingest(db: str, signing_key: str | None, init_empty: bool, files: tuple[str, ...]) -> None:
    """Ingest event files: JSON lines (.jsonl, '-' for stdin) or Arrow IPC streams (.arrow). One file = one batch.

    A missing --db is created; an existing one must be a kvtrail store.
    """
    from kvtrail.audit.batch import parse_jsonl_lines, read_ipc
    from kvtrail.audit.chain import Signer
    from kvtrail.audit.store import AuditStore

    batches = []
    for name in files:  # parse everything first so a bad file rejects before anything is written
        data = sys.stdin.buffer.read() if name == "-" else _read(name)
        lines: list[int] = []  # line number of each event, for JSON lines
        try:
            if name.endswith((".arrow", ".arrows", ".ipc")):
                table = read_ipc(data) if data else None
            else:
                table, lines = parse_jsonl_lines(data)
        except KvtrailError as exc:
            raise KvtrailError(f"{name}: {exc}") from None
        if table is None or table.num_rows == 0:
            # Almost always a producer that wrote nothing or a wrong path; storing nothing silently hides it.
            raise KvtrailError(f"no events in {name}")
        batches.append((name, table, lines))
    signer = Signer.from_file(signing_key) if signing_key else None
    with AuditStore(db, signer=signer, init_empty=init_empty) as store:
        for name, table, lines in batches:
            try:
                res = store.append(table)
            except ValidationError as exc:
                raise KvtrailError(f"{name}: {exc.at_lines(lines)} (nothing from this file was stored)") from None
            except KvtrailError as exc:
                raise KvtrailError(f"{name}: {exc} (nothing from this file was stored)") from None
            click.echo(
                f"{name}: stored {res.num_events} events, {res.num_page_events} page-events "
                f"in {res.num_runs} runs, {len(res.batches)} batch(es)"
            )


def _read(name: str) -> bytes:
    try:
        return Path(name).read_bytes()
    except OSError as exc:
        raise KvtrailError(f"{name}: cannot read ({exc.strerror})") from None


URL_OPTION = click.option(
    "--url", envvar="KVTRAIL_URL", help="Ask a running kvtrail service instead of --db (env KVTRAIL_URL)."
)
TOKEN_OPTION = click.option(
    "--token", "api_token", envvar="KVTRAIL_TOKEN", help="Operator API token for --url (env KVTRAIL_TOKEN)."
)


@audit.command()
@DB_OPTION
@URL_OPTION
@TOKEN_OPTION
@click.option(
    "--public-key", type=click.Path(exists=True, dir_okay=False), help="Also check every batch's Ed25519 signature."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--expect-heads",
    type=click.Path(dir_okay=False),
    help="JSON written earlier by 'kvtrail audit head --json': also fail if a producer's chain is "
    "behind (newest batches deleted) or forked from those heads.",
)
@checkpoint_options
def verify(
    db: str,
    url: str | None,
    api_token: str | None,
    public_key: str | None,
    as_json: bool,
    expect_heads: str | None,
    checkpoint: str | None,
    witness_keys: tuple[str, ...],
    require_cosignatures: int,
) -> None:
    """Recompute the hash chain; name the first broken or missing link. Exit 1 if anything fails.

    With --expect-heads, also name each producer whose chain no longer reaches its saved head.
    With --checkpoint, also check the store's log still extends that signed checkpoint.
    With --url, the service recomputes it on its store (the JSON adds the service's access-log check).
    """
    from kvtrail.audit.heads import load_heads

    saved = load_heads(expect_heads) if expect_heads else None  # a bad file fails before the long check
    note = None
    if checkpoint is not None:
        from kvtrail.cli.audit_log import load_checkpoint

        note = load_checkpoint(checkpoint, url, public_key, witness_keys, require_cosignatures)
    elif require_cosignatures or witness_keys:
        raise KvtrailError("--require-cosignatures/--witness-key: need --checkpoint")
    if url:
        pem = _read(public_key).decode("ascii", errors="replace") if public_key else None
        doc, chain_problems = _verify_remote(url, api_token, saved, pem)
    else:
        # With --checkpoint the key is the log's: batches need not be signed with it.
        doc, chain_problems = _verify_local(db, None if note else public_key, saved)
    if note is not None:
        from kvtrail.cli.audit_log import check_checkpoint

        check_checkpoint(doc, db, note, str(public_key), witness_keys, require_cosignatures)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        _print_verify(doc, chain_problems, saved)
    if not doc["ok"] or not doc.get("access_log", {"ok": True})["ok"]:
        sys.exit(1)


def _verify_remote(
    url: str, api_token: str | None, saved: list | None, public_key_pem: str | None
) -> tuple[dict, list[str]]:
    from kvtrail.answers.client import Client

    doc = Client(url, api_token).verify(expect_heads=saved, public_key_pem=public_key_pem)
    n = doc.pop("chain_problems", len(doc["problems"]))  # the rest of the problems: saved heads not reached
    return doc, list(doc["problems"][:n])


def _verify_local(db: str, public_key: str | None, saved: list | None) -> tuple[dict, list[str]]:
    from kvtrail.audit.chain import SignatureChecker
    from kvtrail.audit.heads import compare_heads
    from kvtrail.audit.store import connect_readonly, fetch_row
    from kvtrail.audit.verify import verify_store

    checker = SignatureChecker.from_file(public_key) if public_key else None
    con = connect_readonly(_existing(db))
    total = fetch_row(con, "SELECT count(*) FROM batches")[0]
    with _progress(total, "verify") as bar:
        report = verify_store(con, checker=checker, progress=bar.update)
    head_problems = compare_heads(con, saved) if saved is not None else []
    con.close()
    return report.to_dict(head_problems=head_problems, heads_checked=len(saved or [])), [
        str(p) for p in report.problems
    ]


def _print_verify(doc: dict, chain_problems: list[str], saved: list | None) -> None:
    from kvtrail.audit.verify import UncleanEnd

    click.echo(
        f"checked {doc['batches_checked']} batches ({doc['batches_pruned']} pruned), "
        f"{doc['events_checked']} events, {doc['signatures_checked']} signatures"
    )
    for c in doc["coverage"]:
        click.echo(
            f"  {c['node']} producer {c['producer_id']}: seq {c['first_seq']}..{c['last_seq']}, "
            f"{c['stored_events']} stored, {c['pruned_events']} pruned, {c['missing_events']} missing "
            f"({c['explained_by_gaps']} reported by recorder_gap, {c['unexplained']} unexplained)"
        )
    for u in doc["unclean_ends"]:  # a coverage gap, not a broken chain: the exit code stays 0
        click.echo(f"  {UncleanEnd(**{k: v for k, v in u.items() if k != 'gap_end_ns'})}")
    if not chain_problems:
        click.echo("OK: every link and every batch digest verifies")
    else:
        click.echo(f"FAILED: first problem: {chain_problems[0]}")
        for p in chain_problems[1:10]:
            click.echo(f"  also: {p}")
    head_problems = [p for p in doc["problems"][len(chain_problems) :] if not p.startswith("checkpoint: ")]
    if saved is not None and not head_problems:
        click.echo(f"OK: the store still holds all {len(saved)} saved chain heads")
    for p in head_problems:  # every one: each names a producer whose history was cut or rewritten
        click.echo(f"FAILED: saved chain head: {p}")
    print_checkpoint(doc)
    log = doc.get("access_log")
    if log is not None:
        click.echo(
            f"access log: {log['entries']} entries, "
            + ("OK" if log["ok"] else f"FAILED at entry {log['first_bad']}: {log['reason']}")
        )


@audit.command()
@DB_OPTION
@URL_OPTION
@TOKEN_OPTION
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print {\"heads\": [...]} as JSON, the file 'kvtrail audit verify --expect-heads' reads.",
)
def head(db: str, url: str | None, api_token: str | None, as_json: bool) -> None:
    """Print each producer's chain head (last batch and digest) to anchor outside the store."""
    if url:
        from kvtrail.answers.client import Client

        heads = Client(url, api_token).heads()["heads"]
    else:
        from kvtrail.audit.heads import chain_heads
        from kvtrail.audit.store import connect_readonly

        con = connect_readonly(_existing(db))
        heads = chain_heads(con)
        con.close()
    if as_json:
        click.echo(json.dumps({"heads": heads}, indent=1))
        return
    for h in sorted(heads, key=lambda h: (h["node"], h["producer_id"])):
        click.echo(f"{h['node']}\t{h['producer_id']}\tbatch {h['batch_no']}\tseq {h['last_seq']}\t{h['digest']}")


@audit.command()
@DB_OPTION
def upgrade(db: str) -> None:
    """Bring a store an older kvtrail wrote up to this version (adds later event fields; the chain stays valid)."""
    from kvtrail.audit.store import AuditStore

    with AuditStore(_existing(db)) as store:
        added = store.upgraded
    click.echo(f"store {db}: added event field(s) {', '.join(added)}" if added else f"store {db}: already current")


@audit.command()
@DB_OPTION
def migrate(db: str) -> None:
    """Convert a store of an older format (1: one wide events table; 2: request fields in every event row)
    to this kvtrail's format in place.

    One transaction: every event moves into its kind's table, each request identity into the request
    dictionary, and the chain is verified before and after;
    anything that differs rolls back and leaves the store as it was. Take a 'kvtrail audit backup' first
    when the store matters: the conversion rewrites the file.
    """
    from kvtrail.audit.migrate import migrate_store
    from kvtrail.audit.storefile import STORE_FORMAT

    res = migrate_store(_existing(db))
    if res.from_format is None:
        click.echo(f"store {db}: already format {STORE_FORMAT}, nothing to do")
        return
    note = "OK" if res.problems == 0 else f"{res.problems} problem(s), the same as before ('kvtrail audit verify')"
    click.echo(
        f"store {db}: format {res.from_format} -> {STORE_FORMAT}: {res.events} events into "
        f"{res.kind_tables} kind tables and {res.requests} request identities in {res.seconds:.1f} s; "
        f"chain of {res.batches_checked} batches verified before and after: {note}"
    )


@audit.command()
@DB_OPTION
def stats(db: str) -> None:
    """What the store holds: events and page-events per node and kind, time span."""
    from kvtrail.audit.store import connect_readonly

    con = connect_readonly(_existing(db))
    rows = con.execute(
        "SELECT node, role, kind, count(*), sum(num_pages + num_dst_pages), min(wall_ns), max(wall_ns) "
        "FROM events_v GROUP BY ALL ORDER BY node, kind"
    ).fetchall()
    click.echo(f"{'node':<16}{'role':<9}{'kind':<20}{'events':>10}{'page-events':>14}  first .. last (UTC)")
    for node, role, kind, n, pages, t0, t1 in rows:
        click.echo(f"{node:<16}{role:<9}{kind:<20}{n:>10}{int(pages or 0):>14}  {format_utc(t0)} .. {format_utc(t1)}")


@audit.command()
@DB_OPTION
@click.option("--to", "to", required=True, type=click.Path(dir_okay=False), help="The single-file copy to write.")
@click.option("--force", is_flag=True, help="Replace an existing --to.")
@click.option(
    "--public-key",
    type=click.Path(exists=True, dir_okay=False),
    help="Also check every batch's Ed25519 signature in the copy.",
)
def backup(db: str, to: str, force: bool, public_key: str | None) -> None:
    """Copy a store (its .duckdb and .wal, live or crashed) into one checkpointed file and verify the copy.

    Use it to take a store off a machine: the .duckdb file alone may lack everything since the last
    checkpoint. Exit 1 if the copy's chain does not verify (the copy is kept).
    """
    from kvtrail.audit.backup import backup_store
    from kvtrail.audit.chain import SignatureChecker

    checker = SignatureChecker.from_file(public_key) if public_key else None
    with _progress(None, "backup") as bar:
        res = backup_store(_existing(db), to, force=force, checker=checker, progress=bar.update)
    report = res.report
    retried = f" (copied {res.attempts} times: the writer checkpointed meanwhile)" if res.attempts > 1 else ""
    click.echo(
        f"backed up {db} to {res.path}: {res.num_bytes} bytes, {res.producers} producers, "
        f"{res.batches} batches, {res.events} events{retried}"
    )
    if report.ok:
        click.echo(
            f"OK: the copy verifies ({report.batches_checked} batches, {report.events_checked} events, "
            f"{report.signatures_checked} signatures)"
        )
    else:
        click.echo(f"FAILED: the copy's chain: first problem: {report.first_problem}")
        sys.exit(1)


@audit.command()
@DB_OPTION
@click.option("--format", "fmt", type=click.Choice(["parquet"]), default="parquet", show_default=True)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory (new or empty).")
def export(db: str, fmt: str, out: str) -> None:
    """Export the whole store as an audit lake: Hive-partitioned Parquet (cluster=/node=/date=/hour=), page-state
    checkpoints and a manifest, the layout of 'kvtrail lake export' (so 'lake verify' and --lake read it)."""
    from kvtrail.audit.export import export_parquet
    from kvtrail.forensics.lake.checkpointer import write_checkpoints

    with _progress(None, "export") as bar:
        res = export_parquet(
            _existing(db), out, progress=lambda step: bar.set_postfix_str(step), checkpoints=write_checkpoints
        )
    click.echo(f"exported {res.events} events, {res.page_runs} page runs, {res.batches} batches to {out}")


@audit.command(name="import")
@DB_OPTION
@click.option("--no-verify", is_flag=True, help="Import even if the export's chain does not verify.")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
def import_cmd(db: str, no_verify: bool, src: str) -> None:
    """Import a Parquet export into a store, losslessly (the chain still verifies): an 'audit export', a lake
    'lake export' wrote, or an export of the earlier format (date=/node=, manifest.json).

    The export's chain is recomputed first, and a lake's files checked against its manifest: a tampered
    export exits 1 naming its first problem, with nothing imported (unless --no-verify).
    """
    from kvtrail.audit.export import import_parquet, verify_export

    if no_verify:
        click.echo(f"warning: importing {src} without verifying its chain (--no-verify)", err=True)
    else:
        with _progress(None, "verify export") as bar:
            report = verify_export(src, progress=bar.update)
        if not report.ok:
            click.echo(f"FAILED: the export's chain: first problem: {report.first_problem}")
            click.echo(f"nothing imported into {db} (--no-verify imports it anyway)")
            sys.exit(1)
    with _progress(None, "import") as bar:
        res = import_parquet(src, db, progress=lambda step: bar.set_postfix_str(step), verify=False)
    click.echo(f"imported {res.events} events, {res.page_runs} page runs, {res.batches} batches into {db}")


@audit.command()
@click.option(
    "--private", "private", required=True, type=click.Path(dir_okay=False), help="Where to write the private key."
)
@click.option(
    "--public", "public", required=True, type=click.Path(dir_okay=False), help="Where to write the public key."
)
def keygen(private: str, public: str) -> None:
    """Create an Ed25519 key pair for signing batch digests."""
    from kvtrail.audit.chain import generate_keypair

    for p in (private, public):
        if Path(p).exists():
            raise KvtrailError(f"{p}: already exists; refusing to overwrite a key")
    click.echo(f"key id {generate_keypair(Path(private), Path(public))}")


@audit.command()
@click.option("--markdown", is_flag=True, help="Print the field and kind tables instead of the JSON Schema.")
def schema(markdown: bool) -> None:
    """Print the event model (JSON Schema of one wire event)."""
    from kvtrail.audit.spec import json_schema, render_markdown

    click.echo(render_markdown() if markdown else json.dumps(json_schema(), indent=2))
