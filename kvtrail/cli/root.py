"""The ``kvtrail`` command: one subcommand group per area (``kvtrail audit ...``) plus ``kvtrail demo``,
``kvtrail serve`` (the audit service), ``kvtrail stack`` (the reference PD stack) and ``kvtrail simulate``
(the fleet trace simulator).

Bad input ends with one line on stderr and exit code 2; a failed check (e.g. a broken chain) with 1.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import click

from kvtrail import __version__
from kvtrail.cli.lazy import LazyGroup
from kvtrail.errors import KvtrailError, StoreError
from kvtrail.service.config import BANNER, ServeConfig
from kvtrail.serving.deadlines import ReadTimeouts

# Each command group's module is imported when the command runs (or --help lists it): `kvtrail --version`
# and a mistyped name pay for click, not for pandas, pyarrow, numba and DuckDB.
_LAZY = {
    "audit": "kvtrail.cli.audit:audit",
    "dashboard": "kvtrail.cli.dashboard:dashboard",
    "forensics": "kvtrail.cli.forensics:forensics",
    "lake": "kvtrail.cli.lake:lake",
    "model": "kvtrail.cli.model:model",
    "preflight": "kvtrail.cli.preflight:preflight",
    "simulate": "kvtrail.cli.simulate:simulate",
    "stack": "kvtrail.cli.stack:stack",
    "token": "kvtrail.cli.token:token",
    "witness": "kvtrail.cli.witness:witness",
}


@click.group(cls=LazyGroup, lazy=_LAZY)
@click.version_option(__version__, prog_name="kvtrail")
def cli() -> None:
    """kvtrail: audit and forensics of KV-cache page ownership in LLM serving."""


@cli.command()
@click.option(
    "--db",
    default="kvtrail.duckdb",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="DuckDB audit store to write (created if missing; a rerun appends).",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the generated traffic.")
@click.option("--requests", default=60, show_default=True, type=click.IntRange(1), help="Requests per mode.")
def demo(db: str, seed: int, requests: int) -> None:
    """The main job: reproduce the incident on the reference PD stack, audit it, then run the fixed engine.

    SIGTERM stops it like Ctrl-C: the running stack drains and flushes its audit, then it exits (code 2).
    """
    from kvtrail.cli.demo import run_demo
    from kvtrail.signals import interrupt_on_stop_signals

    with interrupt_on_stop_signals():
        run_demo(db, seed=seed, requests=requests)


_SERVE_DEFAULTS = ServeConfig()


@cli.command()
@click.option(
    "--db",
    default="kvtrail.duckdb",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="DuckDB audit store the service owns (created if missing).",
)
@click.option("--host", default=_SERVE_DEFAULTS.host, show_default=True, help="Address to bind.")
@click.option(
    "--port",
    default=_SERVE_DEFAULTS.port,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port to bind; 0 lets the OS pick one (the first line of output names it).",
)
@click.option(
    "--tokens",
    "tokens_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Token file whose tokens the store gains at start (see 'kvtrail token add --file').",
)
@click.option(
    "--max-body-bytes",
    default=_SERVE_DEFAULTS.max_body_bytes,
    show_default=True,
    type=click.IntRange(1),
    help="Largest ingest request body; larger ones get HTTP 413.",
)
@click.option(
    "--drain-timeout-s",
    default=_SERVE_DEFAULTS.drain_timeout_s,
    show_default=True,
    type=click.FloatRange(0),
    help="On SIGINT/SIGTERM: how long to wait for requests in flight.",
)
@click.option(
    "--judge-interval-s",
    default=_SERVE_DEFAULTS.judge_interval_s,
    show_default=True,
    type=click.FloatRange(0, 3600),
    help="Least time between two live-judge polls while batches stream "
    "in: the bound on its lag; longer leaves ingest more CPU (docs/service.md).",
)
@click.option(
    "--otlp-endpoint",
    default=None,
    metavar="URL",
    help="Export findings (log records) and one span per judged response to this OTLP/HTTP receiver "
    "(base URL, e.g. http://127.0.0.1:4318); needs the 'otel' extra (docs/alerts.md).",
)
@click.option(
    "--query-concurrency",
    default=_SERVE_DEFAULTS.query_limits.per_token,
    show_default=True,
    type=click.IntRange(1, 1024),
    help="Queries one token may have running at once.",
)
@click.option(
    "--query-queue",
    default=_SERVE_DEFAULTS.query_limits.queue_per_token,
    show_default=True,
    type=click.IntRange(0, 100_000),
    help="Queries of one token waiting beyond those; more get HTTP 429 with Retry-After.",
)
@click.option(
    "--header-timeout-s",
    default=_SERVE_DEFAULTS.read_timeouts.header_s,
    show_default=True,
    type=click.FloatRange(0, 3600, min_open=True),
    help="How long a client has to send a request's headers; HTTP 408 and closed past it.",
)
@click.option(
    "--body-timeout-s",
    default=_SERVE_DEFAULTS.read_timeouts.body_s,
    show_default=True,
    type=click.FloatRange(0, 3600, min_open=True),
    help="How long a client has to send a request's body after its headers; HTTP 408 and closed past it.",
)
@click.option(
    "--metrics-token",
    is_flag=True,
    help="GET /metrics needs an operator or metrics token (its series name every node; without it, bind "
    "where tenants cannot reach).",
)
@click.option(
    "--signing-key",
    type=click.Path(exists=True, dir_okay=False),
    help="Ed25519 private key (PEM) that signs the log's checkpoints at GET /v1/audit/checkpoint.",
)
@click.option(
    "--judge-horizon-s",
    default=_SERVE_DEFAULTS.judge_horizon_s,
    show_default=True,
    type=click.IntRange(10, 86_400),
    help="History time after a request's last event when the live judge forgets it (no page naming it); "
    "bounds its memory (docs/service.md).",
)
@click.option(
    "--memory-limit-mb",
    default=_SERVE_DEFAULTS.memory_limit_mb,
    show_default=True,
    type=click.IntRange(64, 2**24),
    help="DuckDB's buffer pool in MB (its own default is 80% of RAM); part of the memory bound in docs/service.md.",
)
def serve(
    db: str,
    host: str,
    port: int,
    tokens_file: str | None,
    max_body_bytes: int,
    drain_timeout_s: float,
    judge_interval_s: float,
    otlp_endpoint: str | None,
    query_concurrency: int,
    query_queue: int,
    header_timeout_s: float,
    body_timeout_s: float,
    metrics_token: bool,
    signing_key: str | None,
    memory_limit_mb: int,
    judge_horizon_s: int,
) -> None:
    """Run the audit service (HTTP ingest, live judge, query API) until SIGINT or SIGTERM.

    The first line of output is `kvtrail service listening on http://HOST:PORT`. On either signal it
    stops accepting, commits the batches in flight, judges them, closes the store and exits 0. A store
    another process holds is refused with one line and exit code 1.
    """
    try:
        from kvtrail.service.server import run_service
    except ImportError as exc:  # FastAPI and uvicorn come with an extra, not the base install
        raise KvtrailError(f"kvtrail serve needs FastAPI and uvicorn (the 'serving' extra): {exc}") from None
    try:
        run_service(
            db,
            ServeConfig(
                host=host,
                port=port,
                max_body_bytes=max_body_bytes,
                drain_timeout_s=drain_timeout_s,
                judge_interval_s=judge_interval_s,
                otlp_endpoint=otlp_endpoint,
                query_limits=replace(
                    _SERVE_DEFAULTS.query_limits, per_token=query_concurrency, queue_per_token=query_queue
                ),
                read_timeouts=ReadTimeouts(header_timeout_s, body_timeout_s),
                metrics_token=metrics_token,
                signing_key=signing_key,
                memory_limit_mb=memory_limit_mb,
                judge_horizon_s=judge_horizon_s,
            ),
            tokens_file=tokens_file,
            ready=lambda url: click.echo(BANNER.format(url=url)),
        )
    except StoreError as exc:
        if "in use by another process" not in str(exc):
            raise
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(1) from None
    except OSError as exc:  # the address is taken or not ours to bind
        click.echo(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", err=True)
        raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="kvtrail", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return 2
    except click.Abort:
        click.echo("aborted", err=True)
        return 2
    except KvtrailError as exc:
        click.echo(f"error: {exc}", err=True)
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:
        # DuckDB is imported by the commands that open a store; an error of it needs it loaded.
        duckdb = sys.modules.get("duckdb")
        if duckdb is None or not isinstance(exc, duckdb.IOException):
            raise
        # Typically another process holds the store's write lock, or the path is unwritable.
        click.echo(f"error: cannot use the store: {str(exc).splitlines()[0]}", err=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
