"""The preflight checks: per node, pool >= context and every path of its page traffic audited; across the
deployment, integrity settings equal on both roles, an engine with the PD admission fix, bounded transfer
batches within the release timeout.

Every check is ``pass``, ``fail`` or ``unknown``. Pool vs context is checked on every node (unknown when
either number is missing: never guessed); the deployment checks apply where the sources carry the
values (a check nobody's source can answer is left out rather than reported unknown everywhere).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtrail.preflight.node import NodeConfig

# The first SGLang release with the PD admission fix (a rejected request is not transferred; #36988, #38935).
FIXED_VERSION = (0, 5, 22)
INTEGRITY = (("checksum", "checksum_enabled"), ("canary", "canary_enabled"), ("deferred_release", "deferred_release"))


@dataclass(frozen=True)
class CheckResult:
    check: str
    status: str  # pass | fail | unknown
    detail: str


def _tokens(n: int) -> str:
    return f"{n:,}"


def version_tuple(version: str) -> tuple[int, ...] | None:
    """(major, minor, patch) of a version string such as ``0.5.23.post1``; None when it has none."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if m is None else tuple(int(x or 0) for x in m.groups())


def pool_vs_context(node: NodeConfig) -> CheckResult:
    pool, ctx = node.pool_tokens, node.context_tokens
    if pool is None or ctx is None:
        missing = " and ".join(n for n, v in (("pool", pool), ("context length", ctx)) if v is None)
        return CheckResult("pool_vs_context", "unknown", f"{missing} not found in {node.source}")
    if pool < ctx:
        return CheckResult(
            "pool_vs_context",
            "fail",
            f"pool {_tokens(pool)} < context {_tokens(ctx)} tokens: one full-length request does "
            "not fit; lower --context-length or raise the pool",
        )
    return CheckResult("pool_vs_context", "pass", f"pool {_tokens(pool)} >= context {_tokens(ctx)} tokens")


def engine_version(node: NodeConfig) -> CheckResult | None:
    if node.version is None:
        return None
    have = version_tuple(node.version)
    want = ".".join(map(str, FIXED_VERSION))
    if have is None:
        return CheckResult("engine_version", "unknown", f"version {node.version!r} does not parse")
    if have < FIXED_VERSION:
        return CheckResult("engine_version", "fail", f"SGLang {node.version} predates the PD admission fix ({want})")
    return CheckResult("engine_version", "pass", f"SGLang {node.version} >= {want}")


def _integrity(node: NodeConfig, nodes: list[NodeConfig], name: str, attr: str) -> CheckResult | None:
    carriers = [n for n in nodes if n.role is not None and getattr(n, attr) is not None]
    if {n.role for n in carriers} != {"prefill", "decode"} or node.role is None:
        return None  # both roles must state it for the comparison to mean anything
    check = f"integrity_{name}"
    mine = getattr(node, attr)
    if mine is None:
        return CheckResult(check, "unknown", f"{name} not stated by {node.source}; other nodes state it")
    by_role = {r: sorted({getattr(n, attr) for n in carriers if n.role == r}) for r in ("prefill", "decode")}
    words = "; ".join(f"{r} {'/'.join('on' if v else 'off' for v in vs)}" for r, vs in by_role.items())
    if len({getattr(n, attr) for n in carriers}) > 1:
        return CheckResult(check, "fail", f"{name} differs between the roles ({words}): set it the same on both")
    return CheckResult(check, "pass", f"{name} {'enabled' if mine else 'disabled'} on both roles")


def transfer_bound(node: NodeConfig, nodes: list[NodeConfig]) -> CheckResult | None:
    """The batch bound and the release timeout are set, and the timeouts equal across the roles."""
    if not any(n.release_timeout_ns is not None or n.transfer_batch_max_pages is not None for n in nodes):
        return None
    missing = [
        w
        for w, v in (
            ("transfer batch bound", node.transfer_batch_max_pages),
            ("release timeout", node.release_timeout_ns),
        )
        if v is None
    ]
    if missing:
        return CheckResult(
            "transfer_bound",
            "fail",
            f"{' and '.join(missing)} not set on {node.source}: bound "
            "Mooncake transfer batches so no call outlasts the release timeout",
        )
    timeouts = {n.release_timeout_ns for n in nodes if n.release_timeout_ns is not None}
    assert node.release_timeout_ns is not None
    if len(timeouts) > 1:
        shown = ", ".join(f"{t / 1e9:g} s" for t in sorted(t for t in timeouts if t is not None))
        return CheckResult("transfer_bound", "fail", f"release timeouts differ across the deployment ({shown})")
    return CheckResult(
        "transfer_bound",
        "pass",
        f"batches of at most {node.transfer_batch_max_pages} pages; "
        f"release timeout {node.release_timeout_ns / 1e9:g} s",
    )


def audit_coverage(node: NodeConfig) -> CheckResult | None:
    """Whether kvtrail's SGLang plugin audits every path of this node's page traffic (left out where the source
    does not say). A path it does not audit is ``unknown``: pages moved that way are missing from the record, so
    their isolation cannot be established (``--allow-unknown`` accepts it knowingly)."""
    if node.unaudited is None:
        return None
    if node.unaudited:
        return CheckResult(
            "audit_coverage",
            "unknown",
            f"kvtrail's SGLang plugin does not audit {', '.join(node.unaudited)}: pages moved that way are missing "
            "from the record (run without it, or accept the hole with --allow-unknown)",
        )
    return CheckResult("audit_coverage", "pass", "no mode kvtrail's SGLang plugin leaves unaudited")


def check_node(node: NodeConfig, nodes: list[NodeConfig]) -> list[CheckResult]:
    """Every check that applies to ``node`` in the deployment ``nodes``."""
    out = [pool_vs_context(node)]
    for result in (
        engine_version(node),
        *(_integrity(node, nodes, n, a) for n, a in INTEGRITY),
        transfer_bound(node, nodes),
        audit_coverage(node),
    ):
        if result is not None:
            out.append(result)
    return out
