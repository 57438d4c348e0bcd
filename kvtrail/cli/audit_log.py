"""``kvtrail audit checkpoint|prove``: the store's transparency log (docs/audit-log.md).

``checkpoint`` prints the log's signed checkpoint (a C2SP signed note); ``prove`` prints a consistency
proof between two checkpoints or the inclusion proofs of a request's batches, as JSON.
"""

from __future__ import annotations

import json

import click

from kvtrail.cli.audit_store import existing as _existing
from kvtrail.errors import KvtrailError


def _write(text: str, out: str | None) -> None:
    if out is None:
        click.echo(text, nl=False)
        return
    from kvtrail.outputs import write_file_atomically

    def fill(tmp) -> None:
        tmp.write_text(text, encoding="utf-8")

    write_file_atomically(out, fill, force=False)
    click.echo(f"wrote {out}", err=True)


@click.command()
@click.option("--db", type=click.Path(dir_okay=False), help="DuckDB audit store file (or --url).")
@click.option(
    "--url", envvar="KVTRAIL_URL", help="A running kvtrail service's checkpoint instead of --db (env KVTRAIL_URL)."
)
@click.option("--token", "api_token", envvar="KVTRAIL_TOKEN", help="Operator API token for --url.")
@click.option(
    "--signing-key",
    type=click.Path(exists=True, dir_okay=False),
    help="Ed25519 private key (PEM) that signs the checkpoint (--db); without it the note is printed unsigned.",
)
@click.option("--out", type=click.Path(dir_okay=False), help="Write the checkpoint here instead of stdout.")
def checkpoint(
    db: str | None, url: str | None, api_token: str | None, signing_key: str | None, out: str | None
) -> None:
    """Print the store's checkpoint: origin, tree size, base64 root hash, blank line, signature line."""
    if bool(db) == bool(url):
        raise KvtrailError("give one of --db or --url")
    if url:
        from kvtrail.answers.client import Client

        _write(Client(url, api_token).checkpoint(), out)
        return
    from kvtrail.audit.chain import Signer
    from kvtrail.audit.note import sign_checkpoint
    from kvtrail.audit.store import connect_readonly
    from kvtrail.audit.tlog import LogView

    signer = Signer.from_file(signing_key) if signing_key else None
    con = connect_readonly(_existing(str(db)))
    try:
        cp = LogView(con).checkpoint()
    finally:
        con.close()
    if signer is None:
        click.echo("note: no --signing-key: the checkpoint is unsigned (not a signed note)", err=True)
        _write(cp.body(), out)
    else:
        _write(sign_checkpoint(cp, signer).text(), out)


@click.command()
@click.option("--db", required=True, type=click.Path(dir_okay=False), help="DuckDB audit store file.")
@click.option("--from", "from_cp", type=click.Path(dir_okay=False), help="Older checkpoint: consistency proof from it.")
@click.option(
    "--to", "to_cp", type=click.Path(dir_okay=False), help="Newer checkpoint (default: the store's tree now)."
)
@click.option("--request", "request_id", help="Inclusion proofs of the batches holding this request's events.")
@click.option("--checkpoint", "at_cp", type=click.Path(dir_okay=False), help="With --request: prove against it.")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the proof here instead of stdout.")
def prove(
    db: str, from_cp: str | None, to_cp: str | None, request_id: str | None, at_cp: str | None, out: str | None
) -> None:
    """Print a consistency proof (--from [--to]) or a request's inclusion proofs (--request), as JSON.

    Proofs carry hashes only (RFC 9162); 'kvtrail witness cosign --proof' reads a consistency proof.
    """
    from kvtrail.audit.note import load_note
    from kvtrail.audit.store import connect_readonly
    from kvtrail.audit.tlog import LogView

    if bool(from_cp) == bool(request_id):
        raise KvtrailError("give one of --from (a consistency proof) or --request (inclusion proofs)")
    if to_cp and not from_cp:
        raise KvtrailError("--to: needs --from")
    con = connect_readonly(_existing(db))
    try:
        view = LogView(con)
        if from_cp:
            old = load_note(from_cp, what="--from").checkpoint
            new = load_note(to_cp, what="--to").checkpoint if to_cp else None
            doc = view.consistency(old, new)
        else:
            assert request_id is not None
            size = load_note(at_cp, what="--checkpoint").checkpoint.size if at_cp else None
            if size is not None and size > view.size:
                raise KvtrailError(f"--checkpoint: {size} leaves, the store's log holds {view.size}")
            rows = con.execute(
                "SELECT DISTINCT producer_id, batch_no FROM events WHERE request_id = ?", [request_id]
            ).fetchall()
            if not rows:
                raise KvtrailError(f"--request: no event of request {request_id!r} in the store")
            doc = view.inclusion([(int(p), int(b)) for p, b in rows], size)
            doc["request_id"] = request_id
    finally:
        con.close()
    _write(json.dumps(doc, indent=1) + "\n", out)


def load_checkpoint(path: str, url: str | None, public_key: str | None, witness_keys: tuple[str, ...], need: int):
    """The --checkpoint note of `audit verify`, its companions checked first (bad input: exit 2)."""
    from kvtrail.audit.note import load_note

    if url:
        raise KvtrailError("--checkpoint: checks a store file (--db), not --url")
    if not public_key:
        raise KvtrailError("--checkpoint: needs --public-key, the log's Ed25519 public key")
    if need > len(witness_keys):
        raise KvtrailError(f"--require-cosignatures: {need} needs at least {need} --witness-key")
    return load_note(path)


def check_checkpoint(doc: dict, db: str, note, public_key: str, witness_keys: tuple[str, ...], need: int) -> None:
    """Add the checkpoint's verdict to the verify document: its signature, cosignatures and the store's log."""
    from kvtrail.audit.chain import SignatureChecker
    from kvtrail.audit.note import cosigners, verify_log_signature
    from kvtrail.audit.store import connect_readonly
    from kvtrail.audit.tlog import verify_against

    cp = note.checkpoint
    problems: list[str] = []
    checker = SignatureChecker.from_file(public_key)
    if not verify_log_signature(note, checker):
        problems.append(f"no valid signature of {cp.origin} by the given public key: the checkpoint is not the log's")
    witnesses = cosigners(note, [SignatureChecker.from_file(k) for k in witness_keys])
    if len(witnesses) < need:
        problems.append(f"{len(witnesses)} trusted witness cosignature(s), {need} required")
    if not problems:
        con = connect_readonly(_existing(db))
        try:
            problems += verify_against(con, cp)
        finally:
            con.close()
    problems = [f"checkpoint: {p}" for p in problems]
    doc["checkpoint"] = {
        "origin": cp.origin,
        "tree_size": cp.size,
        "ok": not problems,
        "cosigned_by": [name for name, _t in witnesses],
    }
    doc["problems"] = doc["problems"] + problems
    doc["ok"] = doc["ok"] and not problems


def checkpoint_options(f):
    """`audit verify`'s options for a checkpoint: --checkpoint, --witness-key, --require-cosignatures."""
    for option in reversed(_CHECKPOINT_OPTIONS):
        f = option(f)
    return f


_CHECKPOINT_OPTIONS = [
    click.option(
        "--checkpoint",
        type=click.Path(dir_okay=False),
        help="A checkpoint of the store's log ('kvtrail audit checkpoint'): also fail, naming the batch, if the "
        "store no longer holds what it committed to (truncated, rewritten, forked). --public-key is then the "
        "log's key that signed it.",
    ),
    click.option(
        "--witness-key",
        "witness_keys",
        multiple=True,
        type=click.Path(exists=True, dir_okay=False),
        help="A trusted witness's Ed25519 public key (PEM); repeat for each.",
    ),
    click.option(
        "--require-cosignatures",
        type=click.IntRange(0),
        default=0,
        show_default=True,
        help="With --checkpoint: fail unless this many trusted witnesses (--witness-key) cosigned it.",
    ),
]


def print_checkpoint(doc: dict) -> None:
    cp = doc.get("checkpoint")
    if cp is not None and cp["ok"]:
        cosigned = f", cosigned by {', '.join(cp['cosigned_by'])}" if cp["cosigned_by"] else ""
        click.echo(f"OK: the store's log extends the checkpoint of {cp['tree_size']} batches{cosigned}")
    for p in doc["problems"]:
        if p.startswith("checkpoint: "):
            click.echo(f"FAILED: {p}")
