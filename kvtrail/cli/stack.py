"""``kvtrail stack``: the reference PD stack (router, prefill, decode) run by hand until SIGINT or SIGTERM."""

from __future__ import annotations

import click

from kvtrail.errors import KvtrailError
from kvtrail.serving.config import Faults, StackConfig

_STACK_DEFAULTS = StackConfig()


@click.command()
@click.option(
    "--db",
    default="kvtrail.duckdb",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="DuckDB audit store to write.",
)
@click.option("--mode", type=click.Choice(["vulnerable", "patched"]), default="patched", show_default=True)
@click.option("--incident", is_flag=True, help="Start from the incident's shape (prefill pool < context).")
@click.option("--prefill-pool-tokens", type=click.IntRange(1), help="Prefill KV pool size in tokens.")
@click.option("--decode-pool-tokens", type=click.IntRange(1), help="Decode KV pool size in tokens.")
@click.option("--context-tokens", type=click.IntRange(1), help="Context length the router advertises.")
@click.option("--page-size", type=click.IntRange(1), help="Tokens per KV page.")
@click.option("--max-new-tokens", type=click.IntRange(1), help="Largest max_tokens a request may ask for.")
@click.option("--reuse", type=click.Choice(["lowest", "lifo"]), help="Page reuse order of the allocators.")
@click.option(
    "--fault",
    "faults",
    multiple=True,
    type=click.Choice(["premature_free", "late_write", "double_alloc", "corrupt_transfer"]),
    help="Enable a fault injection (repeatable).",
)
@click.option(
    "--audit-flush-interval-s",
    type=click.FloatRange(0, min_open=True),
    default=_STACK_DEFAULTS.recorder.flush_interval_s,
    show_default=True,
    help="How often each process commits its audit events: the most a killed stack can lose of "
    "each producer's newest events (verify reports such an unclean end with this bound).",
)
@click.option(
    "--drain-timeout-s",
    type=click.FloatRange(0),
    default=_STACK_DEFAULTS.drain_timeout_s,
    show_default=True,
    help="On SIGINT/SIGTERM: how long to wait for requests in flight.",
)
def stack(
    db: str,
    mode: str,
    incident: bool,
    faults: tuple[str, ...],
    audit_flush_interval_s: float,
    drain_timeout_s: float,
    **sizes,
) -> None:
    """Run the reference PD stack (router, prefill, decode) until SIGINT (Ctrl-C) or SIGTERM; prints the router's URL.

    On either signal it stops accepting, drains the requests in flight, flushes every process's audit and
    exits 0. If a worker process or the store process dies it stops the stack and exits 1 with one line naming
    it, so a supervisor restarts it; without its store the router answers 503 and /health says the audit is
    degraded (docs/service.md). Defaults come from StackConfig (or StackConfig.incident() with --incident).
    """
    from dataclasses import replace

    from kvtrail.serving.stack import Stack
    from kvtrail.signals import interrupt_on_stop_signals

    changes = {k: v for k, v in sizes.items() if v is not None}
    changes.update(mode=mode, faults=Faults(**{f: True for f in faults}), drain_timeout_s=drain_timeout_s)
    try:
        changes["recorder"] = replace(_STACK_DEFAULTS.recorder, flush_interval_s=audit_flush_interval_s)
        cfg = (StackConfig.incident if incident else StackConfig)(**changes)
    except ValueError as exc:
        raise KvtrailError(str(exc)) from None
    failed: dict[str, int] = {}
    with interrupt_on_stop_signals(), Stack(cfg, db) as stack:
        workers = ", ".join(f"{role} pid {p.pid}" for role, p in stack.procs.items())
        workers += f", store pid {stack.store.pid if stack.store else '-'}"
        click.echo(
            f"router: {stack.url}/v1/completions  (API keys: {', '.join(k for k, _ in cfg.api_keys)}); "
            f"audit: {db}; workers: {workers}; Ctrl-C or SIGTERM stops"
        )
        try:
            stack.wait_for_worker_exit()
            failed = stack.failed_workers() or {
                role: p.exitcode or 0 for role, p in stack.procs.items() if not p.is_alive()
            }
            if stack.store is not None and not stack.store.alive():
                failed.setdefault("store", stack.store.exitcode or 0)
            what = ", ".join(
                f"{'store process' if role == 'store' else role + ' worker'} exited with code {code}"
                for role, code in failed.items()
            )
            click.echo(f"kvtrail stack: {what}; stopping the stack (worker log: {stack.worker_log_path})", err=True)
        except KeyboardInterrupt:
            click.echo("stopping")
    if failed:
        raise SystemExit(1)
