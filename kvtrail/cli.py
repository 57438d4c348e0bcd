"""The ``kvtrail`` command: one subcommand group per area (``kvtrail audit ...``) plus ``kvtrail demo``,
``kvtrail serve`` and ``kvtrail simulate`` (the fleet trace simulator).

Bad input ends with one line on stderr and exit code 2; a failed check (e.g. a broken chain) with 1.
"""

from __future__ import annotations

import sys

import click
import duckdb

from kvtrail import __version__
from kvtrail.audit.cli import audit
from kvtrail.errors import KvtrailError
from kvtrail.forensics.cli import forensics
from kvtrail.sim.fleet.config import config_defaults


@click.group()
@click.version_option(__version__, prog_name="kvtrail")
def cli() -> None:
    """kvtrail: audit and forensics of KV-cache page ownership in LLM serving."""


cli.add_command(audit)
cli.add_command(forensics)


@cli.command()
@click.option("--db", default="kvtrail.duckdb", show_default=True, type=click.Path(dir_okay=False),
              help="DuckDB audit store to write (created if missing; a rerun appends).")
@click.option("--seed", default=0, show_default=True, help="Seed of the generated traffic.")
@click.option("--requests", default=60, show_default=True, type=click.IntRange(1), help="Requests per mode.")
def demo(db: str, seed: int, requests: int) -> None:
    """The main job: reproduce the incident on the reference PD stack, audit it, then run the fixed engine."""
    from kvtrail.demo import run_demo

    run_demo(db, seed=seed, requests=requests)


@cli.command()
@click.option("--db", default="kvtrail.duckdb", show_default=True, type=click.Path(dir_okay=False),
              help="DuckDB audit store to write.")
@click.option("--mode", type=click.Choice(["vulnerable", "patched"]), default="patched", show_default=True)
@click.option("--incident", is_flag=True, help="Start from the incident's shape (prefill pool < context).")
@click.option("--prefill-pool-tokens", type=click.IntRange(1), help="Prefill KV pool size in tokens.")
@click.option("--decode-pool-tokens", type=click.IntRange(1), help="Decode KV pool size in tokens.")
@click.option("--context-tokens", type=click.IntRange(1), help="Context length the router advertises.")
@click.option("--page-size", type=click.IntRange(1), help="Tokens per KV page.")
@click.option("--max-new-tokens", type=click.IntRange(1), help="Largest max_tokens a request may ask for.")
@click.option("--reuse", type=click.Choice(["lowest", "lifo"]), help="Page reuse order of the allocators.")
@click.option("--fault", "faults", multiple=True, type=click.Choice(["premature_free", "late_write", "double_alloc", "corrupt_transfer"]),
              help="Enable a fault injection (repeatable).")
def serve(db: str, mode: str, incident: bool, faults: tuple[str, ...], **sizes) -> None:
    """Run the reference PD stack (router, prefill, decode) until interrupted; prints the router's URL.

    Defaults come from StackConfig (or StackConfig.incident() with --incident).
    """
    import time

    from kvtrail.serving.config import Faults, StackConfig
    from kvtrail.serving.stack import Stack

    changes = {k: v for k, v in sizes.items() if v is not None}
    changes.update(mode=mode, faults=Faults(**{f: True for f in faults}))
    try:
        cfg = (StackConfig.incident if incident else StackConfig)(**changes)
    except ValueError as exc:
        raise KvtrailError(str(exc)) from None
    with Stack(cfg, db) as stack:
        click.echo(f"router: {stack.url}/v1/completions  (API keys: {', '.join(k for k, _ in cfg.api_keys)}); "
                   f"audit: {db}; Ctrl-C stops")
        try:
            while all(p.is_alive() for p in stack.procs.values()):
                time.sleep(0.5)
            click.echo("a worker exited; stopping", err=True)
        except KeyboardInterrupt:
            click.echo("stopping")
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the flush short


_FLEET = config_defaults()
# FleetConfig fields whose flag is not simply --field-name.
_FLEET_FLAGS = {"rate_per_s": "--rate", "start_ns": "--start", "cache_namespaces": "--no-cache-namespaces"}


def _fleet_flag(field: str) -> str:
    return _FLEET_FLAGS.get(field, "--" + field.replace("_", "-"))


@cli.command()
@click.option("--db", required=True, type=click.Path(dir_okay=False),
              help="DuckDB audit store to write (created if missing).")
@click.option("--seed", type=int, default=_FLEET["seed"], show_default=True, help="Seed of the simulated traffic.")
@click.option("--nodes", type=click.IntRange(1), help="Shorthand for --prefill-nodes N --decode-nodes N.")
@click.option("--prefill-nodes", type=click.IntRange(1), default=_FLEET["prefill_nodes"], show_default=True,
              help="Prefill nodes (one producer each).")
@click.option("--decode-nodes", type=click.IntRange(1), default=_FLEET["decode_nodes"], show_default=True,
              help="Decode nodes (one producer each).")
@click.option("--vulnerable-prefill-nodes", type=click.IntRange(0), default=_FLEET["vulnerable_prefill_nodes"],
              show_default=True, help="Prefill nodes running the engine with the placeholder bug (0.5.19).")
@click.option("--hours", type=click.FloatRange(0, min_open=True), default=_FLEET["hours"], show_default=True,
              help="Simulated hours of arrivals.")
@click.option("--rate", type=click.FloatRange(0, min_open=True), default=_FLEET["rate_per_s"], show_default=True,
              help="Requests per second, whole fleet (Poisson).")
@click.option("--tenants", type=click.IntRange(1), default=_FLEET["tenants"], show_default=True,
              help="Tenants; tenant k sends with weight 1/(k+1).")
@click.option("--page-size", type=click.IntRange(1), default=_FLEET["page_size"], show_default=True,
              help="Tokens per KV page.")
@click.option("--prefill-pool-tokens", type=click.IntRange(1), default=_FLEET["prefill_pool_tokens"],
              show_default=True, help="KV pool of every prefill node, in tokens.")
@click.option("--decode-pool-tokens", type=click.IntRange(1), default=_FLEET["decode_pool_tokens"],
              show_default=True, help="KV pool of every decode node, in tokens.")
@click.option("--context-tokens", type=click.IntRange(1), default=_FLEET["context_tokens"], show_default=True,
              help="Context length every node advertises (longer prompts get HTTP 400 at the router).")
@click.option("--max-new-tokens", type=click.IntRange(1), default=_FLEET["max_new_tokens"], show_default=True,
              help="Largest generation budget a client asks for.")
@click.option("--bugs", default=",".join(_FLEET["bugs"]), show_default=True,
              help="Comma-separated bug classes to plant (placeholder, use_after_free, late_write, double_alloc, "
                   "cross_tenant_prefix) or 'none'; cross_tenant_prefix means --no-cache-namespaces.")
@click.option("--plants-per-hour", type=click.FloatRange(0), default=_FLEET["plants_per_hour"], show_default=True,
              help="Arming rate of each of use_after_free, late_write and double_alloc.")
@click.option("--no-cache-namespaces", is_flag=True,
              help="One prefix cache for all tenants: cross-tenant hits happen (planted as cross_tenant_prefix).")
@click.option("--target-page-events", type=click.IntRange(0), default=_FLEET["target_page_events"],
              show_default=True, help="Stop arrivals once this many page-events were generated (0: use --hours).")
@click.option("--cluster", default=_FLEET["cluster"], show_default=True, help="Cluster name of the producers.")
@click.option("--start", help="Simulated start, ISO 8601 UTC [default: 2026-09-01T00:00:00Z; with --append, "
                              "1 s after the cluster's last stored event].")
@click.option("--append", is_flag=True, help="Add a run to a store that already holds this cluster.")
@click.option("--truth", type=click.Path(dir_okay=False), help="Ground-truth JSON to write [default: DB.truth.json].")
def simulate(db: str, nodes: int | None, bugs: str, rate: float, no_cache_namespaces: bool, start: str | None,
             append: bool, truth: str | None, **knobs) -> None:
    """Simulate a PD fleet's audit record (no model): churning per-node page pools, long prompts, tenants,
    prefix-cache sharing and planted bugs, written through the normal ingest path, plus a ground truth.

    Defaults come from kvtrail.sim.fleet.config.FleetConfig. Refuses a store that already holds the
    cluster unless --append is given.
    """
    import dataclasses

    from kvtrail.audit.store import AuditStore
    from kvtrail.sim.fleet.config import FAULT_CLASSES, PLANT_CLASSES, FleetConfig, write_fleet
    from kvtrail.timeutil import format_utc, parse_utc

    ctx = click.get_current_context()
    if nodes is not None:
        explicit = [f"--{n.replace('_', '-')}" for n in ("prefill_nodes", "decode_nodes")
                    if ctx.get_parameter_source(n) != click.core.ParameterSource.DEFAULT]
        if explicit:
            raise KvtrailError(f"--nodes: give either --nodes or {' / '.join(explicit)}")
        knobs["prefill_nodes"] = knobs["decode_nodes"] = nodes
    names = [b.strip() for b in bugs.split(",") if b.strip() and b.strip() != "none"]
    for name in names:
        if name not in PLANT_CLASSES:
            raise KvtrailError(f"--bugs: {name!r} is not one of {', '.join(PLANT_CLASSES)} (or 'none')")
    knobs.update(rate_per_s=rate, bugs=tuple(b for b in FAULT_CLASSES if b in names),
                 cache_namespaces=not (no_cache_namespaces or "cross_tenant_prefix" in names))
    if start is not None:
        knobs["start_ns"] = parse_utc(start, field="--start")
    try:
        cfg = FleetConfig(**knobs)
    except ValueError as exc:
        field, _, reason = str(exc).partition(": ")
        raise KvtrailError(f"{_fleet_flag(field)}: {reason}" if reason else str(exc)) from None
    truth_path = truth or f"{db}.truth.json"
    with AuditStore(db) as store:
        held, last_ns = store.con.execute(
            "SELECT count(DISTINCT p.producer_id), max(b.max_wall_ns) FROM producers p "
            "LEFT JOIN batches b USING (producer_id) WHERE p.cluster = ?", [cfg.cluster]).fetchone()
        if held and not append:
            raise KvtrailError(f"--db: {db} already holds cluster {cfg.cluster!r} ({held} producers); "
                               "pass --append to add a run, or --cluster NAME")
        if held and start is None and last_ns is not None:
            cfg = dataclasses.replace(cfg, start_ns=(last_ns // 1_000_000_000 + 1) * 1_000_000_000)
        instance = f"{format_utc(cfg.start_ns)}-s{cfg.seed}"
        if store.con.execute("SELECT count(*) FROM producers WHERE cluster = ? AND instance = ?",
                             [cfg.cluster, instance]).fetchone()[0]:
            raise KvtrailError(f"--start: cluster {cfg.cluster!r} already holds the run with seed {cfg.seed} "
                               f"starting at {format_utc(cfg.start_ns)}; change --seed or --start")
        s = write_fleet(cfg, store, truth_path)
    statuses = ", ".join(f"{k}: {v:,}" for k, v in s.responses.items())
    plants = ", ".join(f"{k} {v}" for k, v in s.plants.items()) or "none"
    click.echo(f"simulated cluster {cfg.cluster!r}: {cfg.prefill_nodes} prefill + {cfg.decode_nodes} decode nodes "
               f"+ router, {format_utc(s.from_ns)} .. {format_utc(s.to_ns)}")
    click.echo(f"  producers {s.producers}, events {s.events:,}, page-events {s.page_events:,}, "
               f"requests {s.requests:,} (HTTP {statuses})")
    click.echo(f"  plants: {plants}; affected requests: {s.affected}")
    click.echo(f"  elapsed {s.elapsed_s:.1f} s ({s.page_events / max(s.elapsed_s, 1e-9) / 1e6:.1f} M page-events/s); "
               f"ground truth: {truth_path}")


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
    except duckdb.IOException as exc:
        # Typically another process holds the store's write lock, or the path is unwritable.
        click.echo(f"error: cannot use the store: {str(exc).splitlines()[0]}", err=True)
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
