"""SGLang start-up logs to node configurations, across the versions' formats.

What is read (the message, wherever it sits in the line):
- the pool: ``KV Cache is allocated. [dtype: ..,] #tokens: N, ...`` (MHA prints K and V sizes, MLA one
  ``KV size``; a label may precede it; several lines per rank for draft models or sliding-window
  sub-pools), the scheduler summary's ``max_total_num_tokens=N`` (older: ``max_total_num_token=N``),
  and the warning ``KV pool holds N tokens, fewer than --context-length L``;
- the context: ``context_len=N`` of the scheduler summary, or that warning's ``--context-length L``;
- the page size, role, integrity flags and version from the printed server arguments.

What is not read, though it looks alike: ``K size: .. V size: ..`` without ``#tokens``, host-memory or
hierarchical-cache pools, ``KV Cache VA upper bound`` and no-op pools, ``max_total_tokens=`` (the CLI
cap, often ``None``), ``max_prefill_tokens``, ``max_req_input_len``, ``context_length=`` of the server
arguments (the CLI value, ``None`` unless set) and any ``max_context_length``.

The rank comes from the text before the message: ``[date time(.ms) DP1 PP0 TP3 EP0]`` (any subset, the
date optional), older ``Rank N:`` and ``[gpu_id=N]``, or nothing (a single GPU). Text pasted before the
bracket (a container or pod name) is ignored. Every TP/PP/EP rank of one DP rank shares one pool (not
summed); each DP rank is its own node. A scheduler summary that wrapped onto the next line is joined.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from kvtrail.preflight.node import ROLES, NodeConfig

_TAG = re.compile(r"\b(DP|PP|ATTN_CP|MOE_DP|TP|EP)(\d+)\b")
_OLD_RANK = re.compile(r"(?:\bRank (\d+):|\[gpu_id=(\d+)\])")
# A line that starts a new record (so a wrapped summary does not swallow it): a bracketed prefix,
# a timestamp, or an old-style rank.
_STARTS_RECORD = re.compile(r"^\s*(?:\[|\d{4}-\d{2}-\d{2}|Rank \d+:)")
_KV_ALLOC = re.compile(r"KV Cache is allocated\.\s*(?:dtype:\s*[\w.]+,\s*)?#tokens:\s*(\d+)")
_HOST = re.compile(r"\b(?:host|hicache|hierarchical|cpu offload)\b", re.IGNORECASE)
_SUMMARY_POOL = re.compile(r"(?<![\w.])max_total_num_tokens?=(\d+)\b")
_SUMMARY_CONTEXT = re.compile(r"(?<![\w.])context_len=(\d+)\b")
_SUMMARY_REQS = re.compile(r"(?<![\w.])max_running_requests=(\d+)\b")
_WARNING = re.compile(r"KV pool holds (\d+) tokens, fewer than --context-length (\d+)")
_SUMMARY_END = re.compile(r"available_(?:gpu|cpu)_mem=")
_ARG_PAGE = re.compile(r"(?<![\w.])page_size=(\d+)\b")
_ARG_MODE = re.compile(r"(?<![\w.])disaggregation_mode=['\"]?(prefill|decode|null)\b")
_ARG_CHECKSUM = re.compile(r"(?<![\w.])disaggregation_enable_kv_checksum=(True|False)\b")
_ARG_CANARY = re.compile(r"(?<![\w.])kv_canary=(None|False|True|'[^']*'|\"[^\"]*\")")
_VERSION = re.compile(
    r"\bsglang(?:\s+version)?\s*(?:==|:|=|\s)\s*v?(\d+\.\d+\.\d+(?:\.?post\d+|rc\d+)?)\b", re.IGNORECASE
)
_PREFILL_BATCH = re.compile(r"\bPrefill batch[.,]")
_DECODE_BATCH = re.compile(r"\bDecode batch[.,]")


def _rank(prefix: str) -> tuple[str | None, str | None]:
    """(DP tag, label) of the rank printed before the message; TP ranks of older versions as ``TPn``."""
    tags = {name: int(n) for name, n in _TAG.findall(prefix)}
    if not tags:
        m = _OLD_RANK.search(prefix)
        if m:
            tags = {"TP": int(m.group(1) or m.group(2))}
    if not tags:
        return None, None
    dp = f"DP{tags['DP']}" if "DP" in tags else None
    return dp, " ".join(f"{k}{v}" for k, v in tags.items())


def _joined(lines: Iterable[str]) -> list[str]:
    """Lines with a wrapped scheduler summary joined back to one."""
    out: list[str] = []
    pending = 0
    for raw in lines:
        line = raw.rstrip("\r\n")
        if pending and line.strip() and not _STARTS_RECORD.match(line):
            # cut inside a word or after "=" (a terminal's wrap): glue; after a separator: one space
            glue = " " if out[-1].endswith((",", " ")) else ""
            out[-1] = out[-1].rstrip() + glue + line.strip()
            pending -= 1
            if _SUMMARY_END.search(out[-1]):
                pending = 0
            continue
        out.append(line)
        pending = 2 if _SUMMARY_POOL.search(line) and not _SUMMARY_END.search(line) else 0
    return out


class _Group:
    """What one DP rank's lines said."""

    def __init__(self) -> None:
        self.pools: dict[str, set[int]] = {}  # rank label -> pool sizes it printed (KV Cache lines)
        self.summary_pool: int | None = None
        self.context: int | None = None
        self.warning_pool: int | None = None
        self.max_reqs: int | None = None
        self.labels: set[str] = set()


def parse_startup_log(text: str, source: str) -> list[NodeConfig]:
    """Node configurations (one per DP rank) from an SGLang start-up log; [] when it holds none."""
    groups: dict[str | None, _Group] = {}
    args: dict[str, object] = {}
    saw_prefill = saw_decode = False
    for line in _joined(text.splitlines()):
        saw_prefill |= bool(_PREFILL_BATCH.search(line))
        saw_decode |= bool(_DECODE_BATCH.search(line))
        _server_args(line, args)
        pool_m, warn_m = _KV_ALLOC.search(line), _WARNING.search(line)
        sum_m = _SUMMARY_POOL.search(line)
        ctx_m = _SUMMARY_CONTEXT.search(line) if sum_m else None
        first = min((m.start() for m in (pool_m, warn_m, sum_m) if m), default=None)
        if first is None:
            continue
        dp, label = _rank(line[:first])
        g = groups.setdefault(dp, _Group())
        if label:
            g.labels.add(label)
        if pool_m and not _HOST.search(re.split(r"[\]:|]", line[: pool_m.start()])[-1]):
            g.pools.setdefault(label or "", set()).add(int(pool_m.group(1)))
        if sum_m:
            g.summary_pool = int(sum_m.group(1))
            if ctx_m:
                g.context = int(ctx_m.group(1))
            reqs = _SUMMARY_REQS.search(line)
            if reqs:
                g.max_reqs = int(reqs.group(1))
        if warn_m:
            g.warning_pool = int(warn_m.group(1))
            g.context = g.context if g.context is not None else int(warn_m.group(2))
    role = args.get("role")
    if role is None and saw_prefill != saw_decode:
        role = "prefill" if saw_prefill else "decode"
    return [_node(source, dp, g, args, role) for dp, g in sorted(groups.items(), key=lambda kv: _order(kv[0]))]


def _order(dp: str | None) -> int:
    return -1 if dp is None else int(dp[2:])


def _label(dp: str | None, labels: set[str]) -> str | None:
    """The group's name: its DP tag and lowest TP rank (``TP0``, ``DP1 TP0``), else its lowest label."""
    tps = sorted(int(n) for label in labels for name, n in _TAG.findall(label) if name == "TP")
    if tps:
        return " ".join(x for x in (dp, f"TP{tps[0]}") if x)
    if not labels:
        return dp
    return min(labels, key=lambda label: (tuple(int(n) for _, n in _TAG.findall(label)), label))


def _node(source: str, dp: str | None, g: _Group, args: dict, role: object) -> NodeConfig:
    notes: list[str] = []
    candidates = {p for ps in g.pools.values() for p in ps}
    if g.summary_pool is not None:
        candidates.add(g.summary_pool)
    if g.warning_pool is not None:
        candidates.add(g.warning_pool)
    pool = min(candidates) if candidates else None
    if len(candidates) > 1:
        notes.append(
            f"the log states several pool sizes ({', '.join(map(str, sorted(candidates)))}): the smallest is used"
        )
    return NodeConfig(
        source=source,
        rank=_label(dp, g.labels),
        role=role if role in ROLES else None,
        pool_tokens=pool,
        context_tokens=g.context,
        page_size=args.get("page_size"),
        version=args.get("version"),
        max_running_requests=g.max_reqs,
        checksum_enabled=args.get("checksum"),
        canary_enabled=args.get("canary"),
        config_source="startup_log",
        notes=tuple(notes),
    )


def _server_args(line: str, args: dict[str, object]) -> None:
    """Values of the printed server arguments (``server_args=ServerArgs(...)``) and the version line."""
    for key, rx, conv in (("page_size", _ARG_PAGE, int),):
        m = rx.search(line)
        if m and key not in args:
            args[key] = conv(m.group(1))
    m = _ARG_MODE.search(line)
    if m and m.group(1) in ROLES:
        args["role"] = m.group(1)
    m = _ARG_CHECKSUM.search(line)
    if m:
        args["checksum"] = m.group(1) == "True"
    m = _ARG_CANARY.search(line)
    if m:
        args["canary"] = m.group(1).strip("'\"").lower() not in ("none", "false", "", "off")
    m = _VERSION.search(line)
    if m and "version" not in args:
        args["version"] = m.group(1)
