"""The CLI against a running service: ``--url``/``--token`` give the same output as ``--db``, a store the
service holds is one line suggesting ``--url``, and the audit and token client calls work."""

from __future__ import annotations

import json
import time

import pytest

from kvtrail.answers.client import Client
from kvtrail.audit.heads import chain_heads
from kvtrail.forensics import open_store
from kvtrail.service import tokens
from tests.conftest import run_cli
from tests.forensics.incident_fixture import build
from tests.service.conftest import ServiceProcess

WINDOW = ["--from", "2026-09-09T00:00:00Z", "--to", "2026-09-09T06:00:00Z"]
COMMANDS = [
    ["affected"],
    ["affected", "--tenant", "globex", "--exclude-tenant", "hooli=tests"],
    ["findings", "--code", "F1"],
    ["exposure"],
    ["thresholds"],
    ["exploitation"],
]


@pytest.fixture(scope="module")
def store_and_token(tmp_path_factory):
    db = tmp_path_factory.mktemp("client") / "incident.duckdb"
    build(db)
    token_id, secret, stored = tokens.new_token("operator")
    (db.parent / "tokens.txt").write_text(tokens.token_line(token_id, "operator", stored) + "\n")
    return db, secret


def test_url_gives_the_output_db_gives(store_and_token, capsys, monkeypatch):
    db, secret = store_and_token
    local = {}
    for cmd in COMMANDS:
        for fmt in ("table", "json", "csv"):
            local[(*cmd, fmt)] = run_cli(capsys, "forensics", *cmd, "--db", str(db), *WINDOW, "--format", fmt)
    audit_cmds = (("verify",), ("verify", "--json"), ("head",), ("head", "--json"))
    local_audit = {cmd: run_cli(capsys, "audit", *cmd, "--db", str(db)) for cmd in audit_cmds}
    con = open_store(db)
    heads = chain_heads(con)
    con.close()
    service = ServiceProcess(db, "--tokens", str(db.parent / "tokens.txt"))
    try:
        monkeypatch.setenv("KVTRAIL_TOKEN", secret)
        for (*cmd, fmt), expected in local.items():
            remote = run_cli(capsys, "forensics", *cmd, "--url", service.url, *WINDOW, "--format", fmt)
            assert remote == expected, (cmd, fmt)
        for cmd, (rc, out, _err) in local_audit.items():
            got = run_cli(capsys, "audit", *cmd, "--url", service.url)
            assert (got[0], rc) == (0, 0), got
            if cmd == ("verify", "--json"):  # the service adds its access log's own check
                doc = json.loads("\n".join(got[1]))
                assert doc.pop("access_log")["ok"] and doc == json.loads("\n".join(out))
            elif cmd == ("verify",):
                assert got[1][:-1] == out and got[1][-1].startswith("access log: ") and got[1][-1].endswith(", OK")
            else:
                assert got[1] == out, cmd
        deadline = time.monotonic() + 60  # the judge persists the store's findings after its first poll
        while not (persisted := Client(service.url, secret).findings_since(0)[0]).height:
            assert time.monotonic() < deadline, "the live judge persisted nothing"
            time.sleep(0.2)
        rc, lines, err = run_cli(capsys, "forensics", "watch", "--url", service.url, "--polls", "1")
        assert rc == 0 and len(lines) >= persisted.height, err
        assert {line.split()[1] for line in lines} <= set(persisted["code"].to_list()) | {"F2", "F3", "F4", "F9"}
        assert all(f"request {r} " in "\n".join(lines) for r in persisted["request_id"].to_list() if r)
        assert err[-1].startswith(f"followed {len(lines)} findings in 1 polls")
        held = run_cli(capsys, "forensics", "affected", "--db", str(db), *WINDOW)
        assert held[0] == 2 and len(held[2]) == 1 and "--url" in held[2][0]
        client = Client(service.url, secret)
        assert client.heads() == {"heads": heads}
        doc = client.verify()
        assert doc["ok"] and doc["access_log"]["ok"] and doc["access_log"]["entries"] > len(local)
        token_id, new = client.add_token("tenant:acme")
        assert any(t["token_id"] == token_id for t in client.list_tokens())
        assert client.revoke_token(token_id) is True
        bad = run_cli(capsys, "forensics", "affected", "--url", service.url, "--token", new, *WINDOW)
        assert bad[0] == 2 and "401" in bad[2][-1]
    finally:
        service.stop()


def test_a_remote_report_writes_the_same_files(store_and_token, capsys, tmp_path):
    db, secret = store_and_token
    service = ServiceProcess(db, "--tokens", str(db.parent / "tokens.txt"))
    try:
        rc, out, err = run_cli(
            capsys,
            "forensics",
            "report",
            "--url",
            service.url,
            "--token",
            secret,
            *WINDOW,
            "--out",
            str(tmp_path / "r"),
        )
    finally:
        service.stop()
    assert rc == 0, err
    assert out[0].startswith("20 affected responses") and "results digest" in out[-1]
    manifest = json.loads((tmp_path / "r" / "report.json").read_text())
    assert set(manifest["files"]) <= {p.name for p in (tmp_path / "r").iterdir()}
