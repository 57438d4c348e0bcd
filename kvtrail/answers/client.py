"""The CLI's side of the kvtrail service: ``--url URL --token TOKEN`` on the forensics, audit and token commands.

Tables come as Parquet (types kept exactly, with the answer's gaps, notes, warnings and exclusions in
its metadata, key ``kvtrail.answer``), so a command can rebuild the same frames the local question
returns and print the same output whether it read a store file or a service. This module sits below
``audit``, ``forensics`` and ``service`` (it imports none of them), so each CLI may use it.
"""

from __future__ import annotations

import io
import json
from typing import Any
from urllib.parse import quote

import httpx
import polars as pl
import pyarrow.parquet as pq

from kvtrail.errors import KvtrailError

TIMEOUT_S = 600.0  # a long window's replay runs as long on the service as it would locally
ANSWER_HEADER = "X-Kvtrail-Answer"
NEXT_HEADER = "X-Kvtrail-Next"
REPORT_HEADER = "X-Kvtrail-Report"
META_KEY = b"kvtrail.answer"


def read_parquet_answer(data: bytes) -> tuple[pl.DataFrame, dict]:
    """The rows and the answer metadata of a Parquet body the service sent."""
    table = pq.read_table(io.BytesIO(data))
    meta = json.loads((table.schema.metadata or {}).get(META_KEY, b"{}"))
    frame = pl.from_arrow(table.replace_schema_metadata(None))
    assert isinstance(frame, pl.DataFrame)
    return frame, meta


class Client:
    """A kvtrail service at ``url`` reached with one bearer token (``transport``: e.g. an in-process app)."""

    def __init__(self, url: str | None, token: str | None, *, transport: httpx.BaseTransport | None = None):
        if not url:
            raise KvtrailError("--url: required (or KVTRAIL_URL)")
        if not token:
            raise KvtrailError("--token: required with --url (or KVTRAIL_TOKEN)")
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=TIMEOUT_S, transport=transport
        )

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise KvtrailError(f"--url: cannot reach the service at {self.url}: {exc}") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            if not isinstance(detail, str):
                detail = "; ".join(
                    f"{'.'.join(str(x) for x in d.get('loc', ())[1:])}: {d.get('msg')}"
                    for d in detail
                    if isinstance(d, dict)
                )
            where = "--token" if r.status_code in (401, 403) else "--url"
            raise KvtrailError(f"{where}: the service answered {r.status_code}: {detail}")
        return r

    def table(self, path: str, params: dict) -> tuple[pl.DataFrame, dict]:
        """A table route's rows and answer metadata (asked as Parquet). A route that answers a tenant's
        token with one JSON document instead (``GET /v1/exposure``) gives it as one row."""
        r = self._call("GET", path, params={**_clean(params), "format": "parquet"})
        if r.headers.get("content-type", "").startswith("application/json"):
            return pl.DataFrame([r.json()]), {}
        return read_parquet_answer(r.content)

    def document(self, path: str, params: dict) -> Any:
        """A route's JSON document (a tenant's exposure, for example)."""
        return self._call("GET", path, params=_clean(params)).json()

    def findings_since(self, since: int, params: dict | None = None) -> tuple[pl.DataFrame, int]:
        """Persisted findings after the cursor ``since``, and the next cursor."""
        r = self._call("GET", "/v1/findings", params={**_clean(params or {}), "since": since, "format": "parquet"})
        return read_parquet_answer(r.content)[0], int(r.headers[NEXT_HEADER])

    def request_pages(self, request_id: str, params: dict) -> dict:
        """One request's drill-down (page ownership timeline, transfers, response, findings) in the window."""
        return self._call("GET", f"/v1/requests/{quote(request_id, safe='')}/pages", params=_clean(params)).json()

    def report(self, body: dict) -> tuple[bytes, dict]:
        """The report archive (zip) and the counts the CLI prints."""
        r = self._call(
            "POST", "/v1/reports", json={**{k: v for k, v in body.items() if v is not None}, "archive": "zip"}
        )
        return r.content, json.loads(r.headers[REPORT_HEADER])

    def verify(self, *, expect_heads: list[dict] | None = None, public_key_pem: str | None = None) -> dict:
        """``kvtrail audit verify --json``'s document, computed by the service (plus its access-log check and
        ``chain_problems``); ``expect_heads`` and ``public_key_pem`` are what ``--expect-heads`` and
        ``--public-key`` read from their files."""
        if expect_heads is None and public_key_pem is None:
            return self._call("GET", "/v1/audit/verify").json()
        return self._call(
            "POST", "/v1/audit/verify", json={"expect_heads": expect_heads, "public_key_pem": public_key_pem}
        ).json()

    def verify_report(self, manifest: dict, *, strict: bool = False) -> dict:
        """The store's part of ``verify-report`` for a report's ``report.json``: problems, notes, the store's name."""
        return self._call("POST", "/v1/reports/verify", json={"manifest": manifest, "strict": strict}).json()

    def model_violations(self, params: dict) -> dict:
        """``kvtrail model validate --json``'s document, computed by the service (``from``, ``to``)."""
        return self._call("GET", "/v1/model/violations", params=_clean(params)).json()

    def heads(self) -> dict:
        """``{"heads": [...]}`` as ``kvtrail audit head --json`` prints it."""
        return self._call("GET", "/v1/audit/heads").json()

    def checkpoint(self) -> str:
        """The service's signed checkpoint of its store's log (a C2SP signed note, as text)."""
        return self._call("GET", "/v1/audit/checkpoint").text

    def add_token(
        self,
        role: str,
        *,
        note: str = "",
        nodes: tuple[str, ...] = (),
        clusters: tuple[str, ...] = (),
        node_roles: tuple[str, ...] = (),
        expires_in_s: int | None = None,
    ) -> tuple[str, str]:
        body: dict[str, object] = {"role": role, "note": note, "nodes": list(nodes)}
        if clusters or node_roles:
            body.update(clusters=list(clusters), node_roles=list(node_roles))
        if expires_in_s is not None:
            body["expires_in_s"] = expires_in_s
        d = self._call("POST", "/v1/tokens", json=body).json()
        return d["token_id"], d["token"]

    def list_tokens(self) -> list[dict]:
        return self._call("GET", "/v1/tokens").json()

    def revoke_token(self, token_id: str) -> bool:
        return bool(self._call("DELETE", f"/v1/tokens/{token_id}").json()["revoked"])


def _clean(params: dict) -> dict:
    return {k: v for k, v in params.items() if v is not None and v != () and v != []}
