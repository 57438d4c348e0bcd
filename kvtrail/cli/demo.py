"""``kvtrail demo``: the main job — the incident reproduced on the reference PD stack, then fixed.

It starts the stack (router, prefill and decode processes, KV moved by Mooncake over loopback TCP)
in the incident's configuration: the prefill pool holds fewer tokens than the context the router
advertises, and the engine behaves like SGLang before 0.5.20. Three tenants send traffic whose
prompts carry tenant-unique canaries, a share of them longer than the prefill pool. It prints the
responses that carried another tenant's canary (ground truth from content) beside what the audit
alone shows (evidence queries and the forensics replay's findings), then repeats in ``patched`` mode.
The DuckDB file stays for reports and dashboards.
"""

from __future__ import annotations

import sys
import time

import click
from tqdm import tqdm

from kvtrail.audit.store import connect_readonly
from kvtrail.audit.verify import verify_store
from kvtrail.forensics import AFFECTED_CODES, replay_store
from kvtrail.serving.config import StackConfig
from kvtrail.serving.stack import Stack, worker_log_path
from kvtrail.serving.traffic import TrafficConfig, run_traffic
from kvtrail.timeutil import format_utc


def demo_config(mode: str) -> StackConfig:
    # Decode's pool is small enough that pages are reused within the demo's traffic.
    return StackConfig.incident(mode=mode, decode_pool_tokens=24 * 1024, max_new_tokens=48)


def run_demo(db: str, *, seed: int = 0, requests: int = 60) -> None:
    traffic = TrafficConfig(num_requests=requests, seed=seed)
    click.echo(f"kvtrail demo: reference PD stack, audit into {db}")
    for mode in ("vulnerable", "patched"):
        cfg = demo_config(mode)
        started_ns = time.time_ns()
        t0 = time.perf_counter()
        with Stack(cfg, db) as stack:
            assert stack.url is not None, "a started stack has a router URL"
            with tqdm(total=requests, desc=mode, unit="req", file=sys.stderr, disable=None, leave=False) as bar:
                outcomes = run_traffic(stack.url, {t: k for k, t in cfg.api_keys}, traffic, bar.update)
        _report_failed_workers(stack)
        _report(db, mode, cfg, outcomes, started_ns, time.perf_counter() - t0)
    report = verify_store(db)
    verdict = "OK" if report.ok else f"FAILED: {report.first_problem}"
    click.echo(f"\naudit chain: {report.batches_checked} batches verified: {verdict}")
    click.echo(f"next: kvtrail audit stats --db {db}; kvtrail audit verify --db {db}")
    click.echo(f"(the transfer engine's own log lines are in {worker_log_path(db)})")


def _report_failed_workers(stack: Stack) -> None:
    """A worker that died mid-run: say so, with the last lines of the engine log (the likely cause)."""
    for role, code in stack.failed_workers().items():
        click.echo(f"{role} worker exited with code {code}; last lines of {stack.worker_log_path}:", err=True)
        for line in stack.worker_log_tail():
            click.echo(f"  {line}", err=True)


def _report(db: str, mode: str, cfg: StackConfig, outcomes, started_ns: int, elapsed_s: float) -> None:
    by_status: dict[int, int] = {}
    for o in outcomes:
        by_status[o.status] = by_status.get(o.status, 0) + 1
    leaks = [o for o in outcomes if o.foreign_canaries]
    click.echo(
        f"\n== {mode}: prefill pool {cfg.prefill_pool_tokens:,} tokens < advertised context "
        f"{cfg.context_tokens:,}; {len(outcomes)} requests in {elapsed_s:.1f} s; HTTP status counts "
        + ", ".join(f"{s}: {n}" for s, n in sorted(by_status.items()))
    )
    over = [o for o in outcomes if o.overlong]
    click.echo(f"   over-long prompts: {len(over)} -> statuses {sorted({o.status for o in over})}")
    click.echo(f"   ground truth (content): {len(leaks)} responses carried another tenant's canary")
    for o in leaks[:8]:
        click.echo(
            f"     {o.tenant:<8} HTTP {o.status} prompt {o.prompt_tokens:>6} tokens -> saw "
            f"{', '.join(o.foreign_canaries)}'s data"
        )
    ended_ns = time.time_ns()
    con = connect_readonly(db)
    try:
        findings = replay_store(con, started_ns, ended_ns)
    finally:
        con.close()
    # The incident's two audit-only symptoms: F2 (decode reserved more than prefill sent for one
    # transfer id) and F4 (a request a node aborted that the client still got as a 2xx).
    mismatches = [f for f in findings if f.code == "F2"]
    served = sum(1 for f in findings if f.code == "F4")
    click.echo(
        f"   audit alone: {len(mismatches)} transfers where decode reserved more than prefill sent; "
        f"{served} requests rejected by prefill yet answered 2xx"
    )
    for f in mismatches[:8]:
        click.echo(f"     request {f.request_id} ({f.tenant_id}): {f.detail}")
    _report_findings(findings, outcomes, _window_flags(db, started_ns, ended_ns))


def _window_flags(db: str, from_ns: int, to_ns: int) -> str:
    """This run's window as `kvtrail forensics findings` flags (microseconds: start down, end up)."""
    return f"--db {db} --from {format_utc(from_ns)} --to {format_utc(to_ns + 999)}"


def _report_findings(findings, outcomes, window_flags: str) -> None:
    """What the forensics replay derived from the audit alone, beside the content ground truth."""
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.code] = counts.get(f.code, 0) + 1
    affected: dict[tuple[str, str], set[str]] = {}
    checked = matched = 0
    for f in findings:
        if f.code in AFFECTED_CODES:
            victims = {t or "unknown (never written)" for t in f.victim_tenant_ids} or {"unknown"}
            affected.setdefault((f.request_id, f.tenant_id), set()).update(victims)
            checked, matched = checked + f.lineage_checked, matched + f.lineage_matched
    click.echo(
        "   forensics replay (audit only): findings "
        + (", ".join(f"{c}: {n}" for c, n in sorted(counts.items())) or "none")
        + f"; {len(affected)} affected responses (read foreign pages)"
    )
    for (rid, tenant), victims in sorted(affected.items(), key=lambda kv: str(kv[0]))[:8]:
        click.echo(f"     request {rid} ({tenant}) read pages last written for: {', '.join(sorted(victims))}")
    if checked:
        click.echo(
            f"   digest lineage: {matched} of {checked} foreign pages read carried exactly the bytes their "
            "previous writer recorded (proof of whose data it was)"
        )
    fast = [f for f in findings if f.code == "F9"]
    if fast:
        click.echo(
            f"   implausible latency (F9): {len(fast)} responses arrived faster than their prefill node "
            f"can compute the prompt, e.g. {fast[0].detail}"
        )
        # The rate is a quantile of the node's prefill samples in the window: over the whole store (this
        # run and the next) it is measured on other samples, and a response near the bound can flip.
        click.echo(
            "     (F9 judges each node against the prefill rate measured in the window: `kvtrail forensics "
            f"findings {window_flags}` repeats this count; the whole store's window measures the rate over "
            "every run in it and may count F9 differently)"
        )
    leaked = sum(1 for o in outcomes if o.foreign_canaries)
    click.echo(
        f"   side by side: content shows {leaked} cross-tenant leaks; the audit flags {len(affected)} "
        "affected responses (a superset: it also sees reads of never-written and same-tenant pages)"
    )
