"""``kvtrail witness cosign|serve``: a witness of kvtrail logs (c2sp.org/tlog-witness, docs/audit-log.md).

A refusal (rollback, fork, a proof that does not verify, a checkpoint no trusted log key signed) exits 1
and cosigns nothing; bad input exits 2.
"""

from __future__ import annotations

import json
import sys

import click

from kvtrail.errors import KvtrailError

STATE = click.option(
    "--state",
    "state_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="The witness's folder: the last checkpoint it cosigned per log, refused ones, its key.",
)
LOG_KEY = click.option(
    "--log-key",
    "log_keys",
    multiple=True,
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="A log's Ed25519 public key (PEM) the witness trusts; repeat for several logs.",
)
KEY = click.option(
    "--signing-key",
    type=click.Path(exists=True, dir_okay=False),
    help="The witness's Ed25519 private key (PEM); default STATE/witness.pem, made on first use.",
)
NAME = click.option("--name", help="The witness's key name in its cosignatures (default kvtrail-witness/<key id>).")


@click.group()
def witness() -> None:
    """A witness: cosigns a log's checkpoints only while the log stays append-only."""


@witness.command()
@STATE
@LOG_KEY
@KEY
@NAME
@click.option(
    "--proof",
    type=click.Path(exists=True, dir_okay=False),
    help="Consistency proof from the last cosigned checkpoint ('kvtrail audit prove --from'); not needed "
    "for a log's first checkpoint.",
)
@click.option("--out", type=click.Path(dir_okay=False), help="Write the cosigned checkpoint here, not to stdout.")
@click.argument("checkpoint", type=click.Path(exists=True, dir_okay=False))
def cosign(
    state_dir: str,
    log_keys: tuple[str, ...],
    signing_key: str | None,
    name: str | None,
    proof: str | None,
    out: str | None,
    checkpoint: str,
) -> None:
    """Cosign CHECKPOINT and print it with the cosignature added; exit 1 on a rollback or fork."""
    from kvtrail.audit.note import load_note
    from kvtrail.audit.tlog import unb64
    from kvtrail.audit.witness import Refused, Witness

    w = Witness.open(state_dir, list(log_keys), signing_key, name)
    note = load_note(checkpoint, what="CHECKPOINT")
    old_size, path = None, []
    if proof:
        doc = _read_json(proof)
        try:
            old_size = int(doc["old_size"])
            path = [unb64(h, f"--proof {proof}: proof") for h in doc["proof"]]
            if (int(doc["new_size"]), doc["new_root"]) != (note.checkpoint.size, _b64(note.checkpoint.root)):
                raise KvtrailError(f"--proof {proof}: a proof to another tree than CHECKPOINT's")
        except (KeyError, TypeError, ValueError):
            raise KvtrailError(f"--proof {proof}: not a consistency proof of 'kvtrail audit prove --from'") from None
    try:
        line = w.add_checkpoint(note, old_size, path)
    except Refused as exc:
        click.echo(f"REFUSED: {exc}", err=True)
        sys.exit(1)
    text = note.with_signatures([line]).text()
    if out:
        from kvtrail.outputs import write_file_atomically

        def fill(tmp) -> None:
            tmp.write_text(text, encoding="utf-8")

        write_file_atomically(out, fill, force=False)
        click.echo(f"cosigned {note.checkpoint.origin} at size {note.checkpoint.size} as {w.name}: {out}", err=True)
    else:
        click.echo(text, nl=False)


def _b64(h: bytes) -> str:
    import base64

    return base64.b64encode(h).decode()


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise KvtrailError(f"--proof {path}: not readable JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise KvtrailError(f"--proof {path}: not a JSON object")
    return doc


@witness.command()
@STATE
@LOG_KEY
@KEY
@NAME
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--port", default=0, show_default=True, type=click.IntRange(0, 65535), help="Port; 0 lets the OS pick one."
)
def serve(
    state_dir: str, log_keys: tuple[str, ...], signing_key: str | None, name: str | None, host: str, port: int
) -> None:
    """Serve POST /add-checkpoint (c2sp.org/tlog-witness) until SIGINT or SIGTERM.

    The first line of output is `kvtrail witness listening on http://HOST:PORT`.
    """
    from kvtrail.audit.witness import Witness
    from kvtrail.signals import interrupt_on_stop_signals
    from kvtrail.witness.server import BANNER
    from kvtrail.witness.server import serve as run

    w = Witness.open(state_dir, list(log_keys), signing_key, name)
    with interrupt_on_stop_signals():
        try:
            run(w, host, port, lambda url: click.echo(BANNER.format(url=url) + f"\nwitness {w.name}", nl=True))
        except KeyboardInterrupt:
            pass
