"""Does a recorded history conform to a variant? Each request's events, per role, against the transitions.

From a variant's transitions (explored exhaustively within small bounds) this derives one automaton per
request: its states are a request's own part of the model state (page ids left out), its edges the
steps the variant allows it, each labelled with what the step records on each role, in the vocabulary
of :func:`read_request` (``history.py`` writes the same events for a counterexample). A recorded
request conforms when some path of the automaton, from a request's first state to a state it has in a
finished run, records exactly its router, prefill and decode sequences, each role's in its own order
(the roles' events are not ordered against each other: they are different clocks and the model lets
steps of different nodes interleave).

The symbols (what a role recorded for the request, grouped as one model step records it):

- router: ``ok`` (a 2xx with output), ``error`` (any other answer);
- prefill: ``received``, ``marked_rejected`` (aborted in the admission queue), ``forward`` (allocation,
  write, read of the prompt), ``post`` (one ``transfer_sent``), ``released`` (freed on finish),
  ``aborted``, ``freed``;
- decode: ``reserve``, ``refused``, ``land`` (a transfer's ``transfer_in`` writes), ``commit``,
  ``commit_refused``, ``failed``, ``read`` (the reads and growth of one generation), ``aborted``, ``freed``.

Recording conventions read as the model's steps: writes landing one after another are one ``land``
(the stack records a transfer's landing as one event, the model lands each chunk); decode records a
transfer's landing when its completion arrives, after the receipt (read as the landing, then the
commit); a receipt for a request decode already let go (status ``aborted``) is the transfer-done
message the model leaves implicit, not a step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from kvtrail.model.state import DPAGES, HIT, LONG, PPAGES, R_NONE, R_OK, RESP, TENANT, State, initial, is_quiescent
from kvtrail.model.state import canonical as canonical_state
from kvtrail.model.transitions import Transitions
from kvtrail.model.variants import Bounds, Variant

ROLES = ("router", "prefill", "decode")
_LAND = ("land",)
Symbols = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]  # per role, in ROLES order
_DECODE = {
    "reserve": ("reserve",),
    "decode_refuse": ("refused",),
    "land": ("land",),
    "commit": ("commit",),
    "commit_refused": ("commit_refused",),
    "fail_received": ("failed",),
    "read": ("read",),
    "tag_refused": ("aborted",),
    "decode_abort": ("aborted",),
}
_PREFILL = {
    "reject": ("received", "marked_rejected"),
    "forward": ("forward",),
    "post": ("post",),
    "prefill_exhausted": ("aborted",),
    "transfer_fail": ("aborted", "freed"),
}


def _local(r: tuple) -> tuple:
    """A request's own part of the state, page ids left out (their count kept), tenant left out."""
    return (r[LONG],) + r[TENANT + 2 : DPAGES] + (len(r[DPAGES]), len(r[PPAGES])) + r[HIT:]


def _symbols(action: str, i: int, b: State, a: State) -> Symbols:
    """What one step of request ``i`` records per role (the events ``history.py`` writes for it)."""
    r, r2 = b.reqs[i], a.reqs[i]
    pre: tuple[str, ...] = _PREFILL.get(action, ())
    if action == "admit":
        pre = ("received", "marked_rejected") if r[LONG] else ("received",)
    elif action == "prefill_abort":
        pre = ("aborted", "freed") if r[PPAGES] else ("aborted",)
    elif action == "notify":
        pre = ("released",) if r[PPAGES] else ()
    dec: tuple[str, ...] = _DECODE.get(action, ())
    if any(b.dpool[p][0] == i and a.dpool[p][0] != i for p in r[DPAGES]):
        dec = dec + ("freed",)
    router: tuple[str, ...] = ()
    if r[RESP] == R_NONE and r2[RESP] != R_NONE:
        router = ("ok",) if r2[RESP] == R_OK else ("error",)
    return router, pre, dec


@dataclass
class RequestAutomaton:
    """A variant's steps as seen by one request: edges between its own states, labelled per role."""

    variant: Variant
    bounds: Bounds
    starts: set
    finals: set
    edges: dict  # local state -> {(symbols, next local state)}
    states: int  # global states explored

    def accepts(self, seqs: dict[str, list[str]]) -> bool:
        """Whether some path from a start to a final state records exactly ``seqs`` (role -> symbols)."""
        want = tuple(tuple(seqs.get(role, ())) for role in ROLES)
        ends = tuple(len(w) for w in want)
        todo = [(s, 0, 0, 0) for s in self.starts]
        seen = set(todo)
        while todo:
            node = todo.pop()
            local, pos = node[0], node[1:]
            if pos == ends and local in self.finals:
                return True
            for syms, nxt in self.edges.get(local, ()):
                new = []
                for k in range(3):
                    n = len(syms[k])
                    if n and want[k][pos[k] : pos[k] + n] != syms[k]:
                        if syms[k] == _LAND and pos[k] and want[k][pos[k] - 1] == "land":
                            n = 0  # another write of the same landing: recorded as one step
                        else:
                            break
                    new.append(pos[k] + n)
                else:
                    state = (nxt, new[0], new[1], new[2])
                    if state not in seen:
                        seen.add(state)
                        todo.append(state)
        return False


def request_automaton(variant: Variant, bounds: Bounds) -> RequestAutomaton:
    """Explore every state ``bounds`` allows (canonical states, breadth first) and keep each request's
    steps: from its state before to its state after, with what the step records per role."""
    reuse = bounds.reuse or variant.reuse
    trans = Transitions(variant, bounds.chunks, reuse)
    start = canonical_state(initial(bounds.requests, bounds.pages, bounds.chunks), reuse == "any")
    seen = {start}
    todo = [start]
    edges: dict = defaultdict(set)
    finals: set = set()
    while todo:
        s = todo.pop()
        if is_quiescent(s):
            finals.update(_local(r) for r in s.reqs)
        for (action, i, _arg), nxt, _viol in trans.successors(s):
            edges[_local(s.reqs[i])].add((_symbols(action, i, s, nxt), _local(nxt.reqs[i])))
            c = canonical_state(nxt, reuse == "any")
            if c not in seen:
                seen.add(c)
                todo.append(c)
    starts = {_local(r) for r in start.reqs}
    return RequestAutomaton(variant, bounds, starts, finals, dict(edges), len(seen))


def read_request(events: list[dict]) -> dict[str, list[str]]:
    """One request's recorded events (each with ``role``, ``kind`` and the fields named below, in each
    producer's order) as symbols per role."""
    out: dict[str, list[str]] = {role: [] for role in ROLES}
    for e in events:
        role, kind, seq = e["role"], e["kind"], out.get(e["role"])
        if seq is None:
            continue
        if role == "router":
            if kind == "response_sent":
                ok = 200 <= (e.get("http_status") or 0) < 300 and (e.get("completion_tokens") or 0) > 0
                seq.append("ok" if ok else "error")
        elif role == "prefill":
            _prefill(seq, e)
        else:
            _decode(seq, e)
    return out


def _prefill(seq: list[str], e: dict) -> None:
    kind = e["kind"]
    if kind == "request_received":
        seq.append("received")
    elif kind == "request_aborted":
        seq.append("marked_rejected" if e.get("stage") == "prefill_queue" else "aborted")
    elif kind in ("pages_allocated", "kv_written", "kv_read") and e.get("source") in (None, "forward"):
        if not seq or seq[-1] != "forward":
            seq.append("forward")
    elif kind == "transfer_sent":
        seq.append("post")
    elif kind == "pages_freed" and e.get("request_id") is not None:
        seq.append("released" if e.get("free_reason") == "finish" else "freed")


def _decode(seq: list[str], e: dict) -> None:
    kind, status = e["kind"], e.get("status")
    if kind == "transfer_reserved":
        seq.append("reserve")
    elif kind == "transfer_received":
        if status in ("ok", "mismatch", "unverified"):
            seq.append("commit")
        elif status == "failed":
            seq.append("failed")
        # "aborted": the done message for a request decode let go; the model keeps it implicit
    elif kind == "kv_written" and e.get("source") == "transfer_in":
        if seq and seq[-1] == "land" or len(seq) > 1 and seq[-2:] == ["land", "commit"]:
            pass  # one transfer's writes landing: one step
        elif seq and seq[-1] == "commit":  # recorded on the completion's arrival, after the receipt
            seq.insert(len(seq) - 1, "land")
        else:
            seq.append("land")
    elif kind == "kv_read":
        if not seq or seq[-1] != "read":
            seq.append("read")
    elif kind == "request_aborted":
        if seq and seq[-1] == "commit" and "mismatch" in (e.get("abort_reason") or ""):
            seq[-1] = "commit_refused"  # the receipt and the refusal are one step
        elif seq and seq[-1] == "failed":
            pass  # the failed transfer's abort is part of the receipt's step
        else:
            seq.append("aborted" if "reserve" in seq else "refused")
    elif kind == "request_received":
        pass  # decode's part starts with its reservation (or refusal)
    elif kind == "pages_freed" and e.get("request_id") is not None:
        seq.append("freed")
