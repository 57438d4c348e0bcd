"""``GET /v1/audit/checkpoint`` on a real ``kvtrail serve --signing-key``: the store's log signed with the
service's key, read by any token (``kvtrail audit checkpoint --url``), equal to the checkpoint of the store."""

from __future__ import annotations

import httpx

from kvtrail.audit.chain import SignatureChecker, generate_keypair
from kvtrail.audit.note import parse_note, verify_log_signature
from kvtrail.audit.store import connect_readonly
from kvtrail.audit.tlog import LogView
from kvtrail.service import tokens
from tests.audit.test_tlog import _fill
from tests.conftest import run_cli
from tests.service.conftest import ServiceProcess


def test_the_service_publishes_the_signed_checkpoint_of_its_store(tmp_path, capsys):
    db = tmp_path / "svc.duckdb"
    _fill(db, 3)
    con = connect_readonly(db)
    expected = LogView(con).checkpoint()
    con.close()
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    token_id, secret, stored = tokens.new_token("tenant:t1")
    (tmp_path / "tokens.txt").write_text(tokens.token_line(token_id, "tenant:t1", stored) + "\n")
    service = ServiceProcess(db, "--tokens", str(tmp_path / "tokens.txt"), "--signing-key", str(tmp_path / "k.pem"))
    try:
        rc, out, err = run_cli(
            capsys, "audit", "checkpoint", "--url", service.url, "--token", secret, "--out", str(tmp_path / "cp")
        )
        assert rc == 0, err
        note = parse_note((tmp_path / "cp").read_bytes())
        assert note.checkpoint == expected  # a tenant's token reads it; the frontier gives the same root
        assert verify_log_signature(note, SignatureChecker.from_file(tmp_path / "k.pub"))
        r = httpx.get(f"{service.url}/v1/audit/checkpoint")
        assert r.status_code == 401  # a token is still needed
    finally:
        service.stop()
    service = ServiceProcess(db, "--tokens", str(tmp_path / "tokens.txt"))
    try:
        r = httpx.get(f"{service.url}/v1/audit/checkpoint", headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == 404 and "--signing-key" in r.text
    finally:
        service.stop()
