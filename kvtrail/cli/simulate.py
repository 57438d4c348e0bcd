"""``kvtrail simulate``: the fleet trace simulator's command (added to the root ``kvtrail`` group).

Every flag's default comes from :class:`~kvtrail.sim.fleet.config.FleetConfig`; a config error names
the field, and is reported under the flag that sets it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from kvtrail.audit.store import AuditStore
from kvtrail.cli.progress import ticking
from kvtrail.errors import KvtrailError
from kvtrail.sim.fleet import (
    FAULT_CLASSES,
    PLANT_CLASSES,
    FleetConfig,
    FleetSummary,
    cluster_history,
    config_defaults,
    holds_run,
    write_fleet,
)
from kvtrail.timeutil import format_utc, parse_utc

_FLEET = config_defaults()
# FleetConfig fields whose flag is not simply --field-name.
_FLEET_FLAGS = {"rate_per_s": "--rate", "start_ns": "--start", "cache_namespaces": "--no-cache-namespaces"}


def _fleet_flag(field: str) -> str:
    return _FLEET_FLAGS.get(field, "--" + field.replace("_", "-"))


@click.command()
@click.option(
    "--db", required=True, type=click.Path(dir_okay=False), help="DuckDB audit store to write (created if missing)."
)
@click.option("--seed", type=int, default=_FLEET["seed"], show_default=True, help="Seed of the simulated traffic.")
@click.option("--nodes", type=click.IntRange(1), help="Shorthand for --prefill-nodes N --decode-nodes N.")
@click.option(
    "--prefill-nodes",
    type=click.IntRange(1),
    default=_FLEET["prefill_nodes"],
    show_default=True,
    help="Prefill nodes (one producer each).",
)
@click.option(
    "--decode-nodes",
    type=click.IntRange(1),
    default=_FLEET["decode_nodes"],
    show_default=True,
    help="Decode nodes (one producer each).",
)
@click.option(
    "--vulnerable-prefill-nodes",
    type=click.IntRange(0),
    default=_FLEET["vulnerable_prefill_nodes"],
    show_default=True,
    help="Prefill nodes running the engine with the placeholder bug (0.5.19).",
)
@click.option(
    "--hours",
    type=click.FloatRange(0, min_open=True),
    default=_FLEET["hours"],
    show_default=True,
    help="Simulated hours of arrivals.",
)
@click.option(
    "--rate",
    type=click.FloatRange(0, min_open=True),
    default=_FLEET["rate_per_s"],
    show_default=True,
    help="Requests per second, whole fleet (Poisson).",
)
@click.option(
    "--tenants",
    type=click.IntRange(1),
    default=_FLEET["tenants"],
    show_default=True,
    help="Tenants; tenant k sends with weight 1/(k+1).",
)
@click.option(
    "--page-size", type=click.IntRange(1), default=_FLEET["page_size"], show_default=True, help="Tokens per KV page."
)
@click.option(
    "--prefill-pool-tokens",
    type=click.IntRange(1),
    default=_FLEET["prefill_pool_tokens"],
    show_default=True,
    help="KV pool of every prefill node, in tokens.",
)
@click.option(
    "--decode-pool-tokens",
    type=click.IntRange(1),
    default=_FLEET["decode_pool_tokens"],
    show_default=True,
    help="KV pool of every decode node, in tokens.",
)
@click.option(
    "--context-tokens",
    type=click.IntRange(1),
    default=_FLEET["context_tokens"],
    show_default=True,
    help="Context length every node advertises (longer prompts get HTTP 400 at the router).",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(1),
    default=_FLEET["max_new_tokens"],
    show_default=True,
    help="Largest generation budget a client asks for.",
)
@click.option(
    "--bugs",
    default=",".join(_FLEET["bugs"]),
    show_default=True,
    help="Comma-separated bug classes to plant (placeholder, use_after_free, late_write, double_alloc, "
    "cross_tenant_prefix) or 'none'; cross_tenant_prefix means --no-cache-namespaces.",
)
@click.option(
    "--plants-per-hour",
    type=click.FloatRange(0),
    default=_FLEET["plants_per_hour"],
    show_default=True,
    help="Arming rate of each of use_after_free, late_write and double_alloc.",
)
@click.option(
    "--no-cache-namespaces",
    is_flag=True,
    help="One prefix cache for all tenants: cross-tenant hits happen (planted as cross_tenant_prefix).",
)
@click.option(
    "--target-page-events",
    type=click.IntRange(0),
    default=_FLEET["target_page_events"],
    show_default=True,
    help="Stop arrivals once this many page-events were generated (0: use --hours).",
)
@click.option("--cluster", default=_FLEET["cluster"], show_default=True, help="Cluster name of the producers.")
@click.option(
    "--start",
    help="Simulated start, ISO 8601 UTC [default: 2026-09-01T00:00:00Z; with --append, "
    "1 s after the cluster's last stored event].",
)
@click.option("--append", is_flag=True, help="Add a run to a store that already holds this cluster.")
@click.option("--truth", type=click.Path(dir_okay=False), help="Ground-truth JSON to write [default: DB.truth.json].")
def simulate(
    db: str,
    nodes: int | None,
    bugs: str,
    rate: float,
    no_cache_namespaces: bool,
    start: str | None,
    append: bool,
    truth: str | None,
    **knobs: Any,
) -> None:
    """Simulate a PD fleet's audit record (no model): churning per-node page pools, long prompts, tenants,
    prefix-cache sharing and planted bugs, written through the normal ingest path, plus a ground truth.

    Defaults come from kvtrail.sim.fleet.config.FleetConfig. Refuses a store that already holds the
    cluster unless --append is given.
    """
    ctx = click.get_current_context()
    if nodes is not None:
        explicit = [
            f"--{n.replace('_', '-')}"
            for n in ("prefill_nodes", "decode_nodes")
            if ctx.get_parameter_source(n) != click.core.ParameterSource.DEFAULT
        ]
        if explicit:
            raise KvtrailError(f"--nodes: give either --nodes or {' / '.join(explicit)}")
        knobs["prefill_nodes"] = knobs["decode_nodes"] = nodes
    names = [b.strip() for b in bugs.split(",") if b.strip() and b.strip() != "none"]
    for name in names:
        if name not in PLANT_CLASSES:
            raise KvtrailError(f"--bugs: {name!r} is not one of {', '.join(PLANT_CLASSES)} (or 'none')")
    knobs.update(
        rate_per_s=rate,
        bugs=tuple(b for b in FAULT_CLASSES if b in names),
        cache_namespaces=not (no_cache_namespaces or "cross_tenant_prefix" in names),
    )
    if start is not None:
        knobs["start_ns"] = parse_utc(start, field="--start")
    try:
        cfg = FleetConfig(**knobs)
    except ValueError as exc:
        field, _, reason = str(exc).partition(": ")
        raise KvtrailError(f"{_fleet_flag(field)}: {reason}" if reason else str(exc)) from None
    truth_path = truth or f"{db}.truth.json"
    with AuditStore(db) as store:
        cfg = _placed_run(store, db, cfg, append=append, start_given=start is not None)
        with ticking("simulate: events stored") as ticker:
            summary = write_fleet(cfg, store, truth_path, progress=ticker.update)
    _echo_summary(cfg, summary, truth_path)


def _placed_run(store: AuditStore, db: str, cfg: FleetConfig, *, append: bool, start_given: bool) -> FleetConfig:
    """``cfg`` as it goes into ``store``: refused over a cluster already there (unless appending), started
    after the cluster's last event when appending without --start, and never a second copy of one run."""
    history = cluster_history(store, cfg.cluster)
    if history.producers and not append:
        raise KvtrailError(
            f"--db: {db} already holds cluster {cfg.cluster!r} ({history.producers} producers); "
            "pass --append to add a run, or --cluster NAME"
        )
    if history.producers and not start_given and history.next_start_ns is not None:
        cfg = dataclasses.replace(cfg, start_ns=history.next_start_ns)
    if holds_run(store, cfg):
        raise KvtrailError(
            f"--start: cluster {cfg.cluster!r} already holds the run with seed {cfg.seed} "
            f"starting at {format_utc(cfg.start_ns)}; change --seed or --start"
        )
    return cfg


def _echo_summary(cfg: FleetConfig, s: FleetSummary, truth_path: str) -> None:
    statuses = ", ".join(f"{k}: {v:,}" for k, v in s.responses.items())
    plants = ", ".join(f"{k} {v}" for k, v in s.plants.items()) or "none"
    click.echo(
        f"simulated cluster {cfg.cluster!r}: {cfg.prefill_nodes} prefill + {cfg.decode_nodes} decode nodes "
        f"+ router, {format_utc(s.from_ns)} .. {format_utc(s.to_ns)}"
    )
    click.echo(
        f"  producers {s.producers}, events {s.events:,}, page-events {s.page_events:,}, "
        f"requests {s.requests:,} (HTTP {statuses})"
    )
    click.echo(f"  plants: {plants}; affected requests: {s.affected}")
    click.echo(
        f"  elapsed {s.elapsed_s:.1f} s ({s.page_events / max(s.elapsed_s, 1e-9) / 1e6:.1f} M page-events/s); "
        f"ground truth: {truth_path}"
    )
