"""Event model v1: the one source of truth for what an audit event is.

An event is an envelope (schema version, producer identity, sequence number, clocks, kind, request
identity) plus the payload fields its kind allows. Every representation derives from the tables
below: the Arrow batch schema (:mod:`kvtrail.audit.batch`), the DuckDB tables
(:mod:`kvtrail.audit.store`), the JSON Schema shipped in the package and ``docs/events.md``.

No prompt or output content is ever part of an event: ids, counts, page ids and digests only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)

ROLES = ("prefill", "decode", "unified", "router")
ALLOC_PURPOSES = ("prefill_extend", "decode_reservation", "decode_growth", "prefix_hit", "host_restore")
FREE_REASONS = ("finish", "abort", "retract", "eviction", "deferred_release")
WRITE_SOURCES = ("forward", "transfer_in", "restore")
# What each value of an enum field means where its name alone does not say it; docs/events.md and the
# JSON Schema render these. Keys are field names, then values, in the field's order of choices.
VALUE_DOCS: dict[str, dict[str, str]] = {
    "status": {
        "ok": "All reserved KV landed and decode accepted it.",
        "failed": "The transfer failed part-way: fewer tokens may have landed than were reserved or sent.",
        "mismatch": "Decode's check (length or checksum) found a difference between what was sent and what landed.",
        "aborted": "The request was aborted while its transfer was in flight.",
        "timeout": "Decode gave up waiting for the transfer.",
        "unverified": "Decode committed the transfer but cannot show what landed (its transfer metadata is not "
        "this request's: prefill without kvtrail's plugin, or another room's slot). `num_tokens` is "
        "0 (nothing proven), `pages` the pages the transfer may have written: their writer is "
        "unknown from then on (a read of them is judged like a read of never-written pages).",
    },
}
TRANSFER_STATUSES = tuple(VALUE_DOCS["status"])
GAP_REASONS = ("buffer_full", "invalid", "encode_error", "writer_error", "transport", "hook_error")


@dataclass(frozen=True)
class FieldSpec:
    """One column of the event model.

    ``type`` is one of: ``str``, ``int32``, ``int64``, ``uint64``, ``bool``, ``enum`` (a string
    restricted to ``choices``), ``pages`` (ordered page ids, int32 >= 0), ``u64list`` (unsigned
    64-bit digests, one per page), ``i64list`` (signed 64-bit block hashes, one per page).
    """

    name: str
    type: str
    doc: str
    choices: tuple[str, ...] = ()
    minimum: int | None = None

    @property
    def is_list(self) -> bool:
        return self.type in ("pages", "u64list", "i64list")


def _f(name, type_, doc, choices=(), minimum=None) -> FieldSpec:
    return FieldSpec(name, type_, doc, tuple(choices), minimum)


# Envelope: present on every event. Producer fields identify who recorded it; one producer instance
# numbers its events 0, 1, 2, ... with no gaps, so a missing number is a provable loss.
PRODUCER_FIELDS: tuple[FieldSpec, ...] = (
    _f("cluster", "str", "Deployment or cluster name."),
    _f("node", "str", "Node name; page ids only mean something inside one node's pool."),
    _f("role", "enum", "What the node does in PD serving.", ROLES),
    _f("engine", "str", "Serving engine name, e.g. 'sglang' or 'kvtrail-reference'."),
    _f("engine_version", "str", "Serving engine version string."),
    _f("instance", "str", "Identifies one producer lifetime (a restart is a new instance, seq restarts at 0)."),
)
ENVELOPE_FIELDS: tuple[FieldSpec, ...] = (
    _f("schema_version", "int32", "Event model version; this document describes version 1.", minimum=1),
    *PRODUCER_FIELDS,
    _f("seq", "uint64", "Per-producer sequence number: 0, 1, 2, ... with no gaps.", minimum=0),
    _f("wall_ns", "int64", "Wall-clock time, UTC, nanoseconds since the Unix epoch.", minimum=0),
    _f("mono_ns", "int64", "The producer's monotonic clock, nanoseconds (orders events within a producer).", minimum=0),
    _f("kind", "enum", "Event kind; decides which payload fields apply.", ()),  # choices filled below
)
REQUEST_FIELDS: tuple[FieldSpec, ...] = (
    _f("request_id", "str", "Request id as the serving engine knows it (SGLang rid)."),
    _f(
        "transfer_id",
        "uint64",
        "Joins the prefill and decode halves of one request (SGLang bootstrap room).",
        minimum=0,
    ),
    _f("tenant_id", "str", "Tenant (customer account) the request belongs to."),
    _f("api_key_id", "str", "Hashed API-key id (never the key itself)."),
)
PAYLOAD_FIELDS: tuple[FieldSpec, ...] = (
    # page lists
    _f("pages", "pages", "Ordered page ids the event is about (source pages for transfer_sent).", minimum=0),
    _f("dst_pages", "pages", "Destination page ids on the decode node (transfer_sent).", minimum=0),
    _f("page_digests", "u64list", "Optional per-page digests, one per entry of 'pages', same order."),
    _f(
        "block_hashes",
        "i64list",
        "Prefix-cache content keys, one per entry of 'pages' (prefix_hit; on kv_written, the keys the writer stored).",
    ),
    # allocation / free / write
    _f("purpose", "enum", "Why pages were allocated.", ALLOC_PURPOSES),
    _f("free_reason", "enum", "Why pages were freed.", FREE_REASONS),
    _f("source", "enum", "Where written KV came from.", WRITE_SOURCES),
    _f("token_start", "int64", "First token position written (inclusive).", minimum=0),
    _f("token_end", "int64", "Last token position written (exclusive).", minimum=0),
    # transfer
    _f("num_tokens", "int64", "Tokens reserved, sent or landed.", minimum=0),
    _f("digest", "uint64", "Digest over the request's transferred pages."),
    _f("digest_algo", "str", "Algorithm of 'digest' and 'page_digests', e.g. 'adler32' or 'kvtrail-page64'."),
    _f("is_last_chunk", "bool", "Whether this send completes the request's transfer."),
    _f(
        "status",
        "enum",
        "Outcome of a transfer as seen by the receiver (decode). Forensics (F2) compares what "
        "decode reserved, what prefill sent and what landed (`num_tokens` of the receipt) whatever the status; "
        "the status is evidence of whether decode detected it.",
        TRANSFER_STATUSES,
    ),
    # request lifecycle
    _f("stage", "str", "Where an abort happened, e.g. 'router', 'prefill_queue', 'transfer', 'decode'."),
    _f("abort_reason", "str", "Engine's reason for an abort or rejection (error message class, no content)."),
    _f("http_status", "int32", "HTTP status returned or planned for the client.", minimum=100),
    _f(
        "prompt_tokens", "int64", "Prompt length in tokens (for aborts: before any placeholder replaced it).", minimum=0
    ),
    _f("completion_tokens", "int64", "Completion tokens reported to the client.", minimum=0),
    _f("max_new_tokens", "int64", "Requested generation budget.", minimum=0),
    _f("ttft_ns", "int64", "Time to first token, nanoseconds.", minimum=0),
    _f("latency_ns", "int64", "End-to-end latency, nanoseconds.", minimum=0),
    _f("finish_reason", "str", "Finish reason reported to the client, e.g. 'stop', 'length', 'abort'."),
    # node configuration
    _f("pool_tokens", "int64", "KV pool capacity in tokens.", minimum=0),
    _f("pool_pages", "int64", "KV pool capacity in pages (valid page ids are 1..pool_pages; 0 is padding).", minimum=0),
    _f("page_size", "int32", "Tokens per page.", minimum=1),
    _f("context_tokens", "int64", "Context length the node advertises.", minimum=0),
    _f("max_running_requests", "int32", "Admission limit of concurrently running requests.", minimum=0),
    _f("checksum_enabled", "bool", "Per-transfer KV checksums on (SGLang --disaggregation-enable-kv-checksum)."),
    _f("canary_enabled", "bool", "KV canary on (SGLang --kv-canary)."),
    _f("deferred_release", "bool", "Deferred KV release on (pages with writes in flight are not reused)."),
    _f("page_tags", "bool", "Page ownership tags verified before attention reads."),
    _f("config_source", "str", "Where the values came from, e.g. 'server_info', 'startup_log', 'engine'."),
    _f(
        "release_timeout_ns",
        "int64",
        "How long the node holds the pages of an aborted or failed transfer before "
        "reusing them (deferred release's timeout), nanoseconds: a transfer call that lasts longer can land its "
        "writes on pages already given to another request.",
        minimum=1,
    ),
    _f(
        "transfer_batch_max_pages",
        "int64",
        "The most pages one transfer call (a Mooncake batch) moves: the bound "
        "that keeps each call shorter than the release timeout.",
        minimum=1,
    ),
    # recorder gaps
    _f("dropped_events", "int64", "Events the producer could not record.", minimum=0),
    _f("dropped_pages", "int64", "Page entries inside those events.", minimum=0),
    _f("gap_reason", "enum", "Why the events were lost.", GAP_REASONS),
    _f("detail", "str", "Free-text detail on a gap (first error message)."),
    # recorder lifecycle
    _f(
        "flush_interval_ns",
        "int64",
        "The most time an event of this recorder waits in memory before its batch is "
        "committed (the flush interval): after an unclean end, up to about this much of the producer's newest "
        "events may be lost.",
        minimum=1,
    ),
    # added later (ADDED_FIELDS): last, so an older store's tables gain them in this order
    _f(
        "digest_tokens",
        "int64",
        "Tokens the 'digest' covers (the digested range, past any prefix the receiver already held): on "
        "transfer_sent prefill's digested tokens, on transfer_received decode's. A matching digest over a token "
        "count other than what decode reserved proves nothing about the tokens it did not cover.",
        minimum=0,
    ),
    _f(
        "spec_verify_steps",
        "int64",
        "Speculative decoding: the request's verification forward passes (SGLang's spec_verify_ct).",
        minimum=0,
    ),
    _f(
        "spec_accepted_drafts",
        "int64",
        "Speculative decoding: draft tokens the target model accepted over the request, bonus tokens excluded "
        "(SGLang's spec_num_correct_drafts).",
        minimum=0,
    ),
    _f(
        "spec_proposed_drafts",
        "int64",
        "Speculative decoding: draft tokens proposed over the request (verification passes x draft tokens per "
        "pass less one). Acceptance rate = spec_accepted_drafts / spec_proposed_drafts; acceptance length = "
        "completion_tokens / spec_verify_steps.",
        minimum=0,
    ),
    # engine integrity signals
    _f("canary_slot", "int64", "KV canary: the token slot (row of the KV pool) whose canary record failed.", minimum=0),
    _f("canary_position", "int64", "KV canary: the token position the failed record holds.", minimum=0),
    _f("canary_tag", "str", "KV canary: the check that failed (SGLang's launch tag, e.g. 'HEAD_K_FULL')."),
    _f(
        "canary_reason",
        "str",
        "KV canary: why, SGLang's fail reasons joined by '+' (e.g. 'verify_chain_hash+verify_position').",
    ),
)


REQUEST_NAMES = tuple(f.name for f in REQUEST_FIELDS)
PAGE_LIST_FIELDS = ("pages", "dst_pages")


@dataclass(frozen=True)
class KindSpec:
    """One event kind: what it means, which fields it needs and which it may carry."""

    name: str
    doc: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    # Both lists must have equal length when both are present.
    same_length: tuple[tuple[str, str], ...] = field(default=())

    @property
    def allowed(self) -> frozenset[str]:
        return frozenset(self.required) | frozenset(self.optional)

    @property
    def payload(self) -> tuple[str, ...]:
        """The fields besides the request identity and the page lists, required ones first, as declared."""
        skip = (*REQUEST_NAMES, *PAGE_LIST_FIELDS)
        return tuple(n for n in (*self.required, *self.optional) if n not in skip)


_REQ = ("request_id",)
_REQ_OPT = ("transfer_id", "tenant_id", "api_key_id")

KINDS: dict[str, KindSpec] = {
    k.name: k
    for k in (
        KindSpec(
            "node_config",
            "The node's KV pool and integrity configuration; first event of every producer instance.",
            ("pool_tokens", "pool_pages", "page_size", "context_tokens"),
            (
                "max_running_requests",
                "checksum_enabled",
                "canary_enabled",
                "deferred_release",
                "page_tags",
                "config_source",
                "release_timeout_ns",
                "transfer_batch_max_pages",
            ),
        ),
        KindSpec(
            "request_received",
            "A request arrived at this node.",
            (*_REQ, "tenant_id", "prompt_tokens"),
            (*_REQ_OPT[:1], "api_key_id", "max_new_tokens"),
        ),
        KindSpec(
            "pages_allocated",
            "Pages handed to a request, in the order the request's page table uses them.",
            (*_REQ, "pages", "purpose"),
            (*_REQ_OPT, "block_hashes"),
            (("pages", "block_hashes"),),
        ),
        KindSpec(
            "pages_freed",
            "Pages returned to the pool (request_id absent for radix evictions).",
            ("pages", "free_reason"),
            (*_REQ, *_REQ_OPT),
        ),
        KindSpec(
            "kv_written",
            "KV rows of these pages were written for the request (forward pass, transfer in, restore).",
            (*_REQ, "pages", "token_start", "token_end", "source"),
            (*_REQ_OPT, "page_digests", "digest_algo", "block_hashes"),
            (("pages", "page_digests"), ("pages", "block_hashes")),
        ),
        KindSpec(
            "kv_read",
            "Attention first reads these pages for the request (page table at decode start, then each added page).",
            (*_REQ, "pages"),
            (*_REQ_OPT, "page_digests", "digest_algo"),
            (("pages", "page_digests"),),
        ),
        KindSpec(
            "transfer_reserved",
            "Decode reserved pages to receive a request's KV.",
            (*_REQ, "transfer_id", "pages", "num_tokens"),
            _REQ_OPT[1:],
        ),
        KindSpec(
            "transfer_sent",
            "Prefill sent KV from its pages into decode's pages.",
            (*_REQ, "transfer_id", "pages", "dst_pages", "num_tokens", "is_last_chunk"),
            (*_REQ_OPT[1:], "digest", "digest_algo", "digest_tokens"),
            (("pages", "dst_pages"),),
        ),
        KindSpec(
            "transfer_received",
            "KV landed on decode (or failed to).",
            (*_REQ, "transfer_id", "pages", "num_tokens", "status"),
            (*_REQ_OPT[1:], "digest", "digest_algo", "digest_tokens"),
        ),
        KindSpec(
            "request_aborted",
            "The node aborted or rejected the request.",
            (*_REQ, "stage", "abort_reason", "http_status"),
            (*_REQ_OPT, "prompt_tokens"),
        ),
        KindSpec(
            "response_sent",
            "The response as the client saw it.",
            (*_REQ, "http_status", "prompt_tokens", "completion_tokens", "latency_ns"),
            (
                *_REQ_OPT,
                "ttft_ns",
                "finish_reason",
                "spec_verify_steps",
                "spec_accepted_drafts",
                "spec_proposed_drafts",
            ),
        ),
        KindSpec(
            "recorder_gap",
            "Events this producer could not record, counted.",
            ("dropped_events", "gap_reason"),
            ("dropped_pages", "detail"),
        ),
        KindSpec(
            "recorder_started",
            "First event of a recorder instance: how long its events may wait in memory before they are committed.",
            ("flush_interval_ns",),
        ),
        KindSpec(
            "recorder_closed",
            "Last event of a clean close (its seq is the instance's last): everything the "
            "instance recorded before it was handed to the store. `dropped_events`: events its buffer "
            "dropped (full) in the instance's lifetime, each also counted by a recorder_gap. A started "
            "instance without this event that has ended (a later instance of its node, or a restart of the "
            "store's owner) ended uncleanly: its newest events may be lost.",
            (),
            ("dropped_events",),
        ),
        KindSpec(
            "kv_canary_violation",
            "The engine's KV canary found a token slot whose record does not match its position or chain "
            "(SGLang --kv-canary): `pages` is the one page holding the slot. The engine names slots, not "
            "requests: forensics attributes it to the request holding the page then.",
            ("pages", "canary_slot", "canary_tag", "canary_reason"),
            ("canary_position",),
        ),
    )
}
# Kinds the recorder writes itself, not the serving code: no recording method of the contract has their names.
RECORDER_KINDS = ("recorder_gap", "recorder_started", "recorder_closed")
# Fields added after store format 1 (each one a new nullable column of stored events). A batch in which
# such a field is null throughout hashes as format 1 did (see kvtrail.audit.chain), so the chains of
# stores written before the field existed still verify, and an old store gains the column on its next
# writable open.
ADDED_FIELDS: tuple[str, ...] = (
    "flush_interval_ns",
    "release_timeout_ns",
    "transfer_batch_max_pages",
    "digest_tokens",
    "spec_verify_steps",
    "spec_accepted_drafts",
    "spec_proposed_drafts",
    "canary_slot",
    "canary_position",
    "canary_tag",
    "canary_reason",
)
# Kinds added after store format 3 (each one a new kind table): a store an older kvtrail wrote lacks their
# tables and gains them on its next writable open ('kvtrail audit upgrade'), as with ADDED_FIELDS. New kinds
# go last, so the codes of the older ones do not change.
ADDED_KINDS: tuple[str, ...] = ("kv_canary_violation",)
KIND_NAMES = tuple(KINDS)
KIND_CODES = {name: i for i, name in enumerate(KIND_NAMES)}
# The payload tuple of one recorded event holds its kind's payload fields in this order; the recorder
# builds it and the writer scatters it into columns, both from this table (by kind name or kind code).
PAYLOAD_LAYOUT: dict[str, tuple[str, ...]] = {k.name: k.payload for k in KINDS.values()}
PAYLOAD_LAYOUT_BY_CODE: tuple[tuple[str, ...], ...] = tuple(PAYLOAD_LAYOUT[k] for k in KIND_NAMES)

ENVELOPE_FIELDS = tuple(
    FieldSpec(f.name, f.type, f.doc, KIND_NAMES, f.minimum) if f.name == "kind" else f for f in ENVELOPE_FIELDS
)
ALL_FIELDS: tuple[FieldSpec, ...] = ENVELOPE_FIELDS + REQUEST_FIELDS + PAYLOAD_FIELDS
FIELDS: dict[str, FieldSpec] = {f.name: f for f in ALL_FIELDS}
ENVELOPE_NAMES = tuple(f.name for f in ENVELOPE_FIELDS)
OPTIONAL_NAMES = tuple(f.name for f in REQUEST_FIELDS + PAYLOAD_FIELDS)

for _k in KINDS.values():
    for _name in _k.allowed:
        assert _name in FIELDS and _name not in ENVELOPE_NAMES, f"kind {_k.name}: unknown field {_name}"


@dataclass(frozen=True)
class Producer:
    """Who records: one serving process on one node. ``instance`` changes on every restart."""

    cluster: str
    node: str
    role: str
    engine: str
    engine_version: str
    instance: str

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"producer field 'role': {self.role!r} is not one of {', '.join(ROLES)}")
        for name in ("cluster", "node", "engine", "engine_version", "instance"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"producer field '{name}': must be a non-empty string")


class RequestRef(NamedTuple):
    """The identity of one request, created once when it arrives and passed to every recorder call.

    A named tuple (immutable) so the writer can split a batch of them into columns in one pass.
    """

    request_id: str
    transfer_id: int | None = None
    tenant_id: str | None = None
    api_key_id: str | None = None


NO_REQUEST = RequestRef(None)  # type: ignore[arg-type]  # placeholder for events without a request
