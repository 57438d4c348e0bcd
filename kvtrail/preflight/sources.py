"""Reading one preflight SOURCE: a start-up log, a saved server-info JSON, a saved metrics text, or the
``http(s)://`` URL of a running SGLang server (``/server_info`` - ``/get_server_info`` on older
versions - ``/v1/models`` and ``/metrics`` fetched from it).

A source that cannot be read, or yields no recognisable configuration at all, raises
:class:`SourceError` naming it and why.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from kvtrail.errors import KvtrailError
from kvtrail.preflight.node import NodeConfig
from kvtrail.preflight.serverinfo import is_server_info, parse_metrics, parse_server_info
from kvtrail.preflight.startlog import parse_startup_log

FETCH_TIMEOUT_S = 10.0
MAX_BYTES = 64 << 20  # a start-up log or a metrics page; anything larger is not one


class SourceError(KvtrailError):
    """A preflight source cannot be read or says nothing recognisable."""


def _looks_like_metrics(text: str) -> bool:
    head = [ln for ln in text.splitlines()[:200] if ln.strip()]
    return (
        bool(head)
        and any(ln.startswith("# TYPE ") or ln.startswith("# HELP ") for ln in head)
        and any(ln.startswith("sglang:") for ln in text.splitlines())
    )


def parse_text(text: str, source: str) -> list[NodeConfig]:
    """Nodes of one source's text, whatever its kind (JSON, metrics, log)."""
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            doc = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise SourceError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(doc, dict) or not is_server_info(doc):
            raise SourceError(f"{source}: JSON without server-info fields (max_total_num_tokens, page_size, ...)")
        nodes = parse_server_info(doc, source)
    elif _looks_like_metrics(text):
        try:
            nodes = parse_metrics(text, source)
        except ValueError as exc:
            raise SourceError(f"{source}: metrics text does not parse: {exc}") from None
    else:
        nodes = parse_startup_log(text, source)
    nodes = [n for n in nodes if not n.is_empty]
    if not nodes:
        raise SourceError(
            f"{source}: no KV pool, context length or page size found (not an SGLang start-up log, "
            "server info or metrics, or cut before the pool was allocated)"
        )
    return nodes


def _fetch(url: str) -> str | None:
    """The body of ``url``, None on HTTP 404 (an endpoint this version lacks)."""
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as resp:
            return resp.read(MAX_BYTES).decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise SourceError(f"{url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SourceError(f"{url}: cannot connect ({reason})") from None


def read_url(url: str) -> list[NodeConfig]:
    """A running server: its server info, models and metrics, merged per DP rank."""
    base = url.rstrip("/")
    info = _fetch(base + "/server_info")
    if info is None:
        info = _fetch(base + "/get_server_info")
    if info is None:
        raise SourceError(f"{url}: neither /server_info nor /get_server_info exists (not an SGLang server?)")
    nodes = parse_text(info, url)
    models = _fetch(base + "/v1/models")
    if models:
        try:
            extra = parse_text(models, url)
        except SourceError:
            extra = []
        nodes = [n.merged(extra[0]) if n.context_tokens is None and extra else n for n in nodes]
    metrics = _fetch(base + "/metrics")
    if metrics and _looks_like_metrics(metrics):
        by_rank = {m.rank: m for m in parse_metrics(metrics, url)}
        nodes = [n.merged(by_rank[n.rank]) if n.rank in by_rank else n for n in nodes]
    return nodes


def read_source(source: str) -> list[NodeConfig]:
    """The node configurations one SOURCE states."""
    if source.startswith(("http://", "https://")):
        return read_url(source)
    path = Path(source)
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise SourceError(f"{source}: cannot read ({exc.strerror or exc})") from None
    if len(data) > MAX_BYTES:
        raise SourceError(f"{source}: larger than {MAX_BYTES >> 20} MiB")
    return parse_text(data.decode("utf-8", errors="replace"), source)
