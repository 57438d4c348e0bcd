"""The preflight verdict: nodes with their checks, the exit code, and the JSON and table forms."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvtrail.preflight.checks import CheckResult, check_node
from kvtrail.preflight.node import NodeConfig

EXIT_OK, EXIT_FAILED, EXIT_UNREADABLE = 0, 1, 2


@dataclass(frozen=True)
class Verdict:
    """Every node's checks and the sources that could not be read."""

    nodes: tuple[tuple[NodeConfig, tuple[CheckResult, ...]], ...]
    errors: tuple[str, ...]
    allow_unknown: bool = False

    def exit_code(self) -> int:
        if self.errors:
            return EXIT_UNREADABLE
        bad = {"fail"} if self.allow_unknown else {"fail", "unknown"}
        return EXIT_FAILED if any(c.status in bad for _, cs in self.nodes for c in cs) else EXIT_OK

    def to_json(self) -> str:
        doc = {
            "ok": self.exit_code() == EXIT_OK,
            "nodes": [
                {
                    "source": n.source,
                    "rank": n.rank,
                    "role": n.role,
                    "pool_tokens": n.pool_tokens,
                    "context_tokens": n.context_tokens,
                    "page_size": n.page_size,
                    "version": n.version,
                    "checks": [{"check": c.check, "status": c.status, "detail": c.detail} for c in cs],
                }
                for n, cs in self.nodes
            ],
            "errors": list(self.errors),
        }
        return json.dumps(doc, indent=2)

    def to_table(self) -> str:
        lines = []
        for node, checks in self.nodes:
            statuses = {c.status for c in checks}
            verdict = "FAIL" if "fail" in statuses else "UNKNOWN" if "unknown" in statuses else "PASS"
            name = " ".join(x for x in (node.role or "-", node.rank) if x)
            where = f"node {node.node}: {node.source}" if node.node else node.source
            lines.append(f"{name}  {_pool_phrase(node)}  {verdict}  ({where})")
            for c in checks:
                if c.status != "pass" or c.check != "pool_vs_context":
                    lines.append(f"    {c.check}: {c.status}: {c.detail}")
            lines.extend(f"    note: {n}" for n in node.notes)
        lines.extend(f"error: {e}" for e in self.errors)
        code = self.exit_code()
        lines.append(
            {
                EXIT_OK: "preflight: every check passed",
                EXIT_FAILED: "preflight: REFUSED (a check failed or could not be established)",
                EXIT_UNREADABLE: "preflight: REFUSED (a source could not be read)",
            }[code]
        )
        return "\n".join(lines)


def _pool_phrase(node: NodeConfig) -> str:
    pool = "?" if node.pool_tokens is None else f"{node.pool_tokens:,}"
    ctx = "?" if node.context_tokens is None else f"{node.context_tokens:,}"
    op = "?" if "?" in (pool, ctx) else ("<" if node.pool_tokens < node.context_tokens else ">=")  # type: ignore[operator]
    return f"pool {pool} {op} context {ctx} tokens"


def judge(nodes: list[NodeConfig], errors: list[str], *, allow_unknown: bool = False) -> Verdict:
    """The checks of every node against the whole deployment ``nodes``."""
    return Verdict(tuple((n, tuple(check_node(n, nodes))) for n in nodes), tuple(errors), allow_unknown)
