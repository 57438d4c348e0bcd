"""``kvtrail audit verify --url`` with ``--expect-heads`` / ``--public-key`` and ``kvtrail forensics
verify-report --url``: the same output and exit codes as the local forms, passing and failing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrail.audit.chain import generate_keypair
from kvtrail.service import tokens
from tests.conftest import run_cli
from tests.forensics.incident_fixture import build
from tests.service.conftest import ServiceProcess

WINDOW = ["--from", "2026-09-09T00:00:00Z", "--to", "2026-09-09T06:00:00Z"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A store, an operator token file, saved heads (good and forked), a key pair and a report, with the
    local forms' results taken before a service holds the store."""
    d = tmp_path_factory.mktemp("remote_verify")
    db = d / "incident.duckdb"
    build(db)
    token_id, secret, stored = tokens.new_token("operator")
    (d / "tokens.txt").write_text(tokens.token_line(token_id, "operator", stored) + "\n")
    generate_keypair(d / "signing.pem", d / "public.pem")
    return d, db, secret


def _local(capsys, d: Path, db: Path) -> dict:
    rc, out, err = run_cli(capsys, "audit", "head", "--db", str(db), "--json")
    assert rc == 0, err
    (d / "heads.json").write_text("\n".join(out))
    heads = json.loads("\n".join(out))
    heads["heads"][0]["digest"] = "00" * 32  # a rewritten chain: the store no longer reaches this head
    (d / "forked.json").write_text(json.dumps(heads))
    rc, _, err = run_cli(capsys, "forensics", "report", "--db", str(db), *WINDOW, "--out", str(d / "report"))
    assert rc == 0, err
    cases = {
        "heads": ("audit", "verify", "--expect-heads", str(d / "heads.json")),
        "heads-json": ("audit", "verify", "--expect-heads", str(d / "heads.json"), "--json"),
        "forked": ("audit", "verify", "--expect-heads", str(d / "forked.json")),
        "forked-json": ("audit", "verify", "--expect-heads", str(d / "forked.json"), "--json"),
        "unsigned": ("audit", "verify", "--public-key", str(d / "public.pem")),
        "report": ("forensics", "verify-report", str(d / "report")),
    }
    return {name: (cmd, run_cli(capsys, *cmd, "--db", str(db))) for name, cmd in cases.items()}


def test_remote_verify_commands_match_the_local_forms(prepared, capsys, monkeypatch):
    d, db, secret = prepared
    local = _local(capsys, d, db)
    assert local["heads"][1][0] == 0 and local["forked"][1][0] == 1 and local["report"][1][0] == 0
    assert local["unsigned"][1][0] == 1  # the fixture's batches carry no signature
    service = ServiceProcess(db, "--tokens", str(d / "tokens.txt"))
    try:
        monkeypatch.setenv("KVTRAIL_TOKEN", secret)
        for name, (cmd, (rc, out, _err)) in local.items():
            got_rc, got, err = run_cli(capsys, *cmd, "--url", service.url)
            assert got_rc == rc, (name, got, err)
            if name.endswith("-json"):  # the service adds its access log's own check
                doc = json.loads("\n".join(got))
                assert doc.pop("access_log")["ok"] and doc == json.loads("\n".join(out)), name
            elif cmd[0] == "audit":
                assert got[:-1] == out and got[-1].startswith("access log: "), (name, got, out)
            else:
                assert got == out, (name, got, out)
        (d / "report" / "report.md").write_text("edited\n")  # a report file changed after it was written
        rc, out, _ = run_cli(capsys, "forensics", "verify-report", str(d / "report"), "--url", service.url)
        assert rc == 1 and "FAILED: file report.md: modified since the report was written" in out
        manifest = json.loads((d / "report" / "report.json").read_text())
        manifest["results_digest"] = "ff" * 32
        (d / "report" / "report.json").write_text(json.dumps(manifest))
        rc, out, _ = run_cli(capsys, "forensics", "verify-report", str(d / "report"), "--url", service.url)
        assert rc == 1 and any(line.startswith("FAILED: results digest differs") for line in out), out
        rc, _, err = run_cli(capsys, "forensics", "verify-report", str(d / "report"), "--db", str(db))
        assert rc == 2 and "--url" in err[-1]  # the store a service holds: the local form suggests --url
    finally:
        service.stop()
