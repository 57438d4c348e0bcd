"""A check's result as the command prints it: the JSON object and the text lines, each step of a trace
named by its node, action and request."""

from __future__ import annotations

from kvtrail.model.checker import CheckResult, Counterexample, Step
from kvtrail.model.properties import PROPERTIES
from kvtrail.model.state import DPAGES, TENANT, TENANTS, request_name

ROUTER_ACTIONS = ("client_abort",)
PREFILL_ACTIONS = (
    "admit",
    "reject",
    "prefill_abort",
    "forward",
    "prefill_exhausted",
    "post",
    "notify",
    "transfer_fail",
)


def node_of(action: str) -> str:
    if action in ROUTER_ACTIONS:
        return "router-0"
    if action in PREFILL_ACTIONS or action == "complete":
        return "prefill-0"
    return "decode-0"


def step_dict(n: int, st: Step, cx: Counterexample) -> dict:
    r = st.before.reqs[st.request]
    d: dict = {
        "step": n,
        "node": node_of(st.action),
        "action": st.action,
        "request": request_name(st.request),
        "tenant": TENANTS[r[TENANT]],
    }
    if st.action == "reserve":
        d["pages"] = [p + 1 for p in st.after.reqs[st.request][DPAGES]]
    elif st.action in ("post", "complete", "land"):
        chunks = st.arg if isinstance(st.arg, tuple) else (st.arg,)
        d["chunks"] = list(chunks)
        if st.action == "land":
            d["pages"] = [r[DPAGES][c] + 1 for c in chunks]
    d["violates"] = sorted({v[0] for v in st.violations})
    if n == cx.violation_at:
        d["counterexample_of"] = cx.property
    return d


def result_dict(res: CheckResult) -> dict:
    return {
        "variant": res.variant.name,
        "bounds": res.bounds.as_dict(res.variant),
        "states": res.states,
        "depth": res.depth,
        "seconds": round(res.seconds, 3),
        "violations": [
            {"property": cx.property, "trace": [step_dict(n, st, cx) for n, st in enumerate(cx.steps)]}
            for cx in res.counterexamples
        ],
    }


def result_lines(res: CheckResult) -> list[str]:
    b = res.bounds.as_dict(res.variant)
    bounds = ", ".join(f"{k} {v}" for k, v in b.items())
    lines = [
        f"variant {res.variant.name} ({res.variant.doc})",
        f"{res.states} states explored, depth {res.depth}, {res.seconds:.2f} s ({bounds})",
    ]
    if not res.exhaustive:
        lines.append("  stopped at --max-states before every state within the bounds was explored: not a proof")
    broken = {cx.property for cx in res.counterexamples}
    for prop in PROPERTIES:
        lines.append(f"  {'VIOLATED' if prop in broken else 'holds   '} {prop}")
    for cx in res.counterexamples:
        lines.append("")
        lines.append(f"counterexample of {cx.property}: {cx.detail}")
        lines.append(f"  {len(cx.steps)} steps, the property broken at step {cx.violation_at}")
        for n, st in enumerate(cx.steps):
            d = step_dict(n, st, cx)
            extra = "".join(f" {k}={d[k]}" for k in ("pages", "chunks") if k in d)
            mark = "  <-- " + ", ".join(d["violates"]) if d["violates"] else ""
            lines.append(f"  {n:3d} {d['node']:<10} {d['action']:<18} {d['request']} ({d['tenant']}){extra}{mark}")
    return lines
