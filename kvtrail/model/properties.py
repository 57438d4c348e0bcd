"""The five properties of page ownership the model is checked against (docs/model.md states them).

Four are checked on the step that could break them (a read, a post, a free, a commit); ``pages_conserved``
is an invariant of every state.
"""

from __future__ import annotations

from kvtrail.model.state import D_HOLDING, DPAGES, P_FORWARDED, P_SENDING, PPAGES, D, P, State, request_name

PROPERTIES: dict[str, str] = {
    "no_foreign_read": "a request attends only to pages whose last writer is itself, or a sealed prefix of its "
    "namespace (a page nobody wrote since the pool was created is not its own either)",
    "aborted_never_sent": "no KV is posted for a request already rejected or aborted on the sending node",
    "no_free_before_drain": "no page is freed while a write into it may still land (posted, complete at the "
    "sender but not yet visible, or still to be posted by a sender that has not stopped)",
    "transferred_equals_reserved": "decode commits a transfer only when the pages transferred equal the pages "
    "it reserved",
    "pages_conserved": "every page is free or held, never both; an exclusively held page has one holder; a "
    "request's page table names only pages it holds",
}


def pages_conserved(s: State) -> list[tuple[str, str]]:
    """The invariant's violations in state ``s`` (empty when it holds)."""
    out = []
    free = set(s.dfree)
    if len(free) != len(s.dfree):
        out.append(("pages_conserved", f"decode free list repeats a page: {list(s.dfree)}"))
    for p, (owner, _, _) in enumerate(s.dpool):
        if (owner < 0) != (p in free):
            out.append(("pages_conserved", f"decode page {p} is {'both free and held' if owner >= 0 else 'lost'}"))
    for i, r in enumerate(s.reqs):
        if r[D] in D_HOLDING:
            for p in r[DPAGES]:
                if s.dpool[p][0] != i:
                    out.append(("pages_conserved", f"{request_name(i)} reads through decode page {p} it does not hold"))
    pfree = set(s.pfree)
    for p, (holders, ns, _) in enumerate(s.ppool):
        if (holders == 0 and ns < 0) != (p in pfree):
            out.append(("pages_conserved", f"prefill page {p} is {'lost' if p not in pfree else 'free and held'}"))
    for i, r in enumerate(s.reqs):
        if r[P] in (P_FORWARDED, P_SENDING):
            for p in r[PPAGES]:
                if not s.ppool[p][0] >> i & 1:
                    out.append(("pages_conserved", f"{request_name(i)} sends from prefill page {p} it does not hold"))
    return out
