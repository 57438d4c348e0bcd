"""Every CLI command that takes ``--url`` against a real ``kvtrail serve``, with each role's token: it works
(exit 0, no traceback) or says in one line why not (exit 2); a tenant's ``affected`` and ``exposure`` show
its own table."""

from __future__ import annotations

import json

import pytest

from kvtrail.service import tokens
from tests.conftest import run_cli
from tests.forensics.incident_fixture import build
from tests.service.conftest import ServiceProcess

WINDOW = ["--from", "2026-09-09T00:00:00Z", "--to", "2026-09-09T06:00:00Z"]
TABLES = ["affected", "findings", "exposure", "thresholds", "exploitation"]
OTHERS = [
    ["forensics", "watch", "--polls", "1"],
    ["audit", "head"],
    ["audit", "verify"],
    ["token", "list"],
    ["token", "revoke", "nosuch"],
]
ROLES = ("operator", "tenant:globex", "tenant:acme", "producer")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    db = tmp_path_factory.mktemp("roles") / "incident.duckdb"
    build(db)
    secrets, lines = {}, []
    for role in ROLES:
        token_id, secret, stored = tokens.new_token(role)
        lines.append(tokens.token_line(token_id, role, stored))
        secrets[role] = secret
    (db.parent / "tokens.txt").write_text("\n".join(lines) + "\n")
    proc = ServiceProcess(db, "--tokens", str(db.parent / "tokens.txt"))
    try:
        yield proc.url, secrets, db.parent
    finally:
        proc.stop()


def _commands(out_dir):
    for name in TABLES:
        for fmt in ("table", "csv", "json"):
            yield ["forensics", name, *WINDOW, "--format", fmt]
    yield from OTHERS
    yield ["forensics", "report", *WINDOW, "--out", str(out_dir / "report")]


@pytest.mark.parametrize("role", ROLES)
def test_every_command_works_or_says_why_in_one_line(service, capsys, role):
    url, secrets, out_dir = service
    for argv in _commands(out_dir / role.replace(":", "-")):
        rc, out, err = run_cli(capsys, *argv, "--url", url, "--token", secrets[role])
        assert rc in (0, 2), (argv, rc, err)
        if rc:
            assert len(err) == 1 and err[0].startswith("error: "), (argv, err)
        assert not any("Traceback" in line for line in out + err), argv
    if role == "operator":
        assert (out_dir / "operator" / "report").is_dir()


def test_a_tenant_sees_its_own_affected_rows_and_exposure(service, capsys):
    url, secrets, _ = service
    globex, acme = secrets["tenant:globex"], secrets["tenant:acme"]
    rc, out, err = run_cli(capsys, "forensics", "affected", *WINDOW, "--url", url, "--token", globex)
    assert rc == 0, err
    rc, rows, _ = run_cli(capsys, "forensics", "affected", *WINDOW, "--url", url, "--token", globex, "--format", "json")
    requests = [r["request_id"] for r in json.loads("\n".join(rows))]
    assert requests and all(r.startswith("globex-") for r in requests)
    assert out[0].startswith(f"{len(requests)} affected response")
    assert all(any(line.startswith(r + " ") for line in out) for r in requests)
    assert "victim" not in "\n".join(out)  # whose data it read is not the tenant's to see
    rc, out, err = run_cli(capsys, "forensics", "exposure", *WINDOW, "--url", url, "--token", acme, "--format", "json")
    assert rc == 0, err
    [doc] = json.loads("\n".join(out))
    assert doc["tenant_id"] == "acme" and doc["exposed"] is True and doc["reading_responses"] > 0
    assert all(r.startswith("acme-") for r in doc["my_requests_read"])
    rc, out, err = run_cli(capsys, "forensics", "exposure", *WINDOW, "--url", url, "--token", acme)
    assert rc == 0 and out[0].startswith(
        f"acme: data of {len(doc['my_requests_read'])} requests read by {doc['reading_responses']} responses"
    ), out
