"""Tokens: salted hashes, constant-time checks, roles, revocation, the token file, the access log chain
and the ``kvtrail token`` commands."""

from __future__ import annotations

import subprocess
import sys
import time

import duckdb
import pytest
from click.testing import CliRunner

from kvtrail.cli.token import token as token_cli
from kvtrail.errors import KvtrailError
from kvtrail.service import access, tokens


@pytest.fixture
def con():
    c = duckdb.connect()
    tokens.ensure_tables(c)
    yield c
    c.close()


def test_a_token_authenticates_until_revoked_and_only_its_hash_is_stored(con):
    token_id, secret = tokens.add_token(con, "tenant:acme", note="acme's auditor")
    who = tokens.authenticate(con, secret)
    assert who == tokens.Principal(token_id, "tenant", "acme", ())
    stored = con.execute("SELECT hash FROM api_tokens").fetchone()[0]
    assert secret not in stored and secret.split("_", 2)[2] not in stored and stored.startswith("pbkdf2-sha256$")
    assert tokens.authenticate(con, secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
    assert tokens.authenticate(con, "kvt_000000000000_nothing") is None
    assert tokens.authenticate(con, "") is None and tokens.authenticate(con, "Bearer x y") is None
    assert tokens.revoke_token(con, token_id) is True
    assert tokens.authenticate(con, secret) is None
    assert tokens.revoke_token(con, token_id) is False
    with pytest.raises(ValueError, match="token_id"):
        tokens.revoke_token(con, "ffffffffffff")


@pytest.mark.parametrize("random_part", ["_leading", "mid_dle_", "__", "-_-"])
def test_a_secret_whose_random_part_holds_underscores_authenticates(con, monkeypatch, random_part):
    # token_urlsafe draws from A-Z a-z 0-9 - _, so a fresh secret may begin with or hold "_"
    monkeypatch.setattr(tokens.secrets, "token_urlsafe", lambda n: random_part * 8)
    token_id, secret = tokens.add_token(con, "operator")
    assert secret == f"kvt_{token_id}_{random_part * 8}"
    assert tokens.authenticate(con, secret).token_id == token_id
    stored = con.execute("SELECT hash FROM api_tokens").fetchone()[0]
    assert random_part * 8 not in stored
    assert tokens.authenticate(con, f"kvt_{token_id}_{random_part * 7}") is None


def test_two_tokens_of_one_role_have_different_salts(con):
    a, b = (tokens.add_token(con, "operator")[0] for _ in range(2))
    salts = {r[0].split("$")[2] for r in con.execute("SELECT hash FROM api_tokens").fetchall()}
    assert a != b and len(salts) == 2


@pytest.mark.parametrize("role", ["admin", "tenant:", "tenant:a b", "tenant:a:b", "Operator"])
def test_bad_roles_are_refused_naming_the_field(con, role):
    with pytest.raises(ValueError, match="^role:"):
        tokens.add_token(con, role)


def test_only_producer_tokens_are_bound_to_nodes(con):
    _, secret = tokens.add_token(con, "producer", nodes=("decode-0", "prefill-0", "decode-0"))
    assert tokens.authenticate(con, secret).nodes == ("decode-0", "prefill-0")
    with pytest.raises(ValueError, match="^node:"):
        tokens.add_token(con, "operator", nodes=("decode-0",))


def test_token_changes_are_chained_in_the_access_log_and_an_edit_breaks_the_chain(con):
    token_id, _ = tokens.add_token(con, "operator")
    tokens.revoke_token(con, token_id)
    access.append(
        con,
        access.AccessEntry(
            token_id, "operator", "GET", "/v1/affected", {"from": "2026-09-09", "token": "leaked-secret"}, 200
        ),
    )
    rows = con.execute("SELECT method, path, query FROM access_log ORDER BY entry_no").fetchall()
    assert [r[:2] for r in rows] == [("TOKEN", "add"), ("TOKEN", "revoke"), ("GET", "/v1/affected")]
    assert "leaked-secret" not in rows[2][2] and "2026-09-09" in rows[2][2]
    good = access.verify_access_log(con)
    assert good.ok and good.entries == 3 and len(good.head_digest) == 64
    con.execute("UPDATE access_log SET status = 403 WHERE entry_no = 1")
    bad = access.verify_access_log(con)
    assert not bad.ok and bad.first_bad == 1 and "digest" in bad.reason
    con.execute("UPDATE access_log SET status = 200 WHERE entry_no = 1")
    assert access.verify_access_log(con).ok
    con.execute("DELETE FROM access_log WHERE entry_no = 1")
    gone = access.verify_access_log(con)
    assert not gone.ok and gone.first_bad == 1


def test_the_token_file_holds_no_secret_and_loads_idempotently(con, tmp_path):
    tid, secret, stored = tokens.new_token("producer", nodes=("prefill-0",))
    tid2, secret2, stored2 = tokens.new_token("tenant:acme")
    path = tmp_path / "tokens.txt"
    path.write_text(
        "# fleet tokens\n\n"
        + tokens.token_line(tid, "producer", stored, nodes=("prefill-0",), note="node 0")
        + "\n"
        + tokens.token_line(tid2, "tenant:acme", stored2)
        + "  # acme\n"
    )
    assert secret not in path.read_text() and secret2 not in path.read_text()
    assert tokens.load_token_file(con, path) == 2
    assert tokens.authenticate(con, secret) == tokens.Principal(tid, "producer", None, ("prefill-0",))
    tokens.revoke_token(con, tid2)
    assert tokens.load_token_file(con, path) == 0
    assert tokens.authenticate(con, secret2) is None  # a revoked token stays revoked


@pytest.mark.parametrize(
    "line, reason",
    [
        ("zz operator pbkdf2-sha256$1$00$00", "line 2: expected"),
        ("abcdefabcdef operator nothash", "hash"),
        ("abcdefabcdef boss pbkdf2-sha256$1$" + "00" * 16 + "$" + "00" * 32, "role"),
        ("abcdefabcdef operator pbkdf2-sha256$1$" + "00" * 16 + "$" + "00" * 32 + " colour=red", "unknown field"),
    ],
)
def test_a_bad_token_file_line_is_named_and_nothing_is_added(con, tmp_path, line, reason):
    tid, _, stored = tokens.new_token("operator")
    path = tmp_path / "tokens.txt"
    path.write_text(tokens.token_line(tid, "operator", stored) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=reason):
        tokens.load_token_file(con, path)
    assert tokens.list_tokens(con) == []


def test_a_token_file_cannot_replace_a_stored_hash(con, tmp_path):
    tid, _ = tokens.add_token(con, "operator")
    _, _, other = tokens.new_token("operator")
    path = tmp_path / "tokens.txt"
    path.write_text(tokens.token_line(tid, "operator", other) + "\n")
    with pytest.raises(ValueError, match="another hash"):
        tokens.load_token_file(con, path)


def test_token_commands_add_list_revoke(tmp_path):
    db = str(tmp_path / "s.duckdb")
    runner = CliRunner()
    added = runner.invoke(token_cli, ["add", "--db", db, "--role", "tenant:acme", "--note", "auditor"])
    assert added.exit_code == 0, added.output
    secret = added.output.splitlines()[-1]
    token_id = secret.split("_")[1]
    listed = runner.invoke(token_cli, ["list", "--db", db])
    assert token_id in listed.output and "tenant:acme" in listed.output and "active" in listed.output
    assert secret not in listed.output
    assert runner.invoke(token_cli, ["revoke", token_id, "--db", db]).exit_code == 0
    assert "revoked" in runner.invoke(token_cli, ["list", "--db", db]).output
    file = tmp_path / "tokens.txt"
    made = runner.invoke(token_cli, ["add", "--file", str(file), "--role", "producer", "--node", "prefill-0"])
    line = file.read_text()
    assert made.output.splitlines()[-1] not in line and "producer" in line and "nodes=prefill-0" in line
    bad = runner.invoke(token_cli, ["add", "--db", db, "--role", "root"])
    assert isinstance(bad.exception, KvtrailError) and "--role" in str(bad.exception)


def test_token_add_on_a_store_a_service_holds_says_so_and_suggests_url(tmp_path):
    db = tmp_path / "s.duckdb"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from kvtrail.audit.store import AuditStore; "
            f"s = AuditStore({str(db)!r}); print('open', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        result = CliRunner().invoke(token_cli, ["add", "--db", str(db), "--role", "operator"])
        assert isinstance(result.exception, KvtrailError)
        message = str(result.exception)
        assert "\n" not in message and "running service" in message and "--url" in message
    finally:
        holder.kill()
        holder.wait(10)


def test_verified_tokens_expire_are_bounded_and_keep_no_secret():
    from kvtrail.service.auth import VerifiedTokens
    from kvtrail.service.tokens import Principal

    v = VerifiedTokens(ttl_s=0.05, size=2)
    who = Principal("abc", "operator", None, ())
    v.put("kvt_abc_secret", who)
    assert v.get("kvt_abc_secret") == who and v.get("kvt_abc_other") is None
    assert all(b"secret" not in k for k in v._known)  # only the secret's SHA-256
    time.sleep(0.06)
    assert v.get("kvt_abc_secret") is None  # past its ttl: checked against the store again
    for i in range(3):
        v.put(f"kvt_{i}", who)
    assert v.get("kvt_0") is None and v.get("kvt_2") == who
    v.clear()
    assert v.get("kvt_2") is None


# ---- expiry, bindings beyond the node name, the list's separators ------------------------------------


def test_an_expired_token_is_refused_and_an_unexpired_one_works(con):
    now = time.time_ns()
    _, old = tokens.add_token(con, "operator", binding=tokens.Binding(expires_ns=now - 1))
    tid, fresh = tokens.add_token(con, "operator", binding=tokens.Binding(expires_ns=now + 3600 * 10**9))
    assert tokens.authenticate(con, old) is None
    assert tokens.authenticate(con, fresh) == tokens.Principal(tid, "operator", None, expires_ns=now + 3600 * 10**9)
    [row] = [t for t in tokens.list_tokens(con) if t.token_id == tid]
    assert row.expires_ns == now + 3600 * 10**9


def test_the_verified_cache_drops_a_token_the_moment_it_expires():
    from kvtrail.service.auth import VerifiedTokens

    v = VerifiedTokens(ttl_s=60)
    v.put("kvt_abc_secret", tokens.Principal("abc", "operator", None, expires_ns=time.time_ns() + 50_000_000))
    assert v.get("kvt_abc_secret") is not None
    time.sleep(0.06)
    assert v.get("kvt_abc_secret") is None  # well within the cache's ttl


@pytest.mark.parametrize(
    "text, ns",
    [
        ("30m", 1800 * 10**9),
        ("12h", 43_200 * 10**9),
        ("90d", 90 * 86_400 * 10**9),
        ("2w", 14 * 86_400 * 10**9),
        ("3600s", 3600 * 10**9),
    ],
)
def test_durations(text, ns):
    assert tokens.parse_duration(text) == ns


@pytest.mark.parametrize("text", ["", "0d", "12", "1y", "-5m", "1.5h", "99999999w"])
def test_bad_durations_name_the_option(text):
    with pytest.raises(ValueError, match="^expires-in: "):
        tokens.parse_duration(text)


def test_bindings_are_checked_and_only_for_producers(con):
    with pytest.raises(ValueError, match="^node-role: 'cache' is not one of"):
        tokens.add_token(con, "producer", binding=tokens.Binding(("d0",), node_roles=("cache",)))
    with pytest.raises(ValueError, match="^cluster: only a producer token"):
        tokens.add_token(con, "operator", binding=tokens.Binding(clusters=("c1",)))
    tid, secret = tokens.add_token(con, "producer", binding=tokens.Binding(("d0",), ("c1",), ("decode",)))
    assert tokens.authenticate(con, secret) == tokens.Principal(tid, "producer", None, ("d0",), ("c1",), ("decode",))


def test_the_token_file_carries_bindings_and_expiry(con, tmp_path):
    binding = tokens.Binding(("d0",), ("c1",), ("decode",), time.time_ns() + 10**12)
    tid, secret, stored = tokens.new_token("producer", binding=binding)
    path = tmp_path / "tokens.txt"
    path.write_text(tokens.token_line(tid, "producer", stored, binding=binding) + "\n")
    assert "clusters=c1" in path.read_text() and "node_roles=decode" in path.read_text()
    assert tokens.load_token_file(con, path) == 1
    assert tokens.authenticate(con, secret) == tokens.Principal(
        tid, "producer", None, ("d0",), ("c1",), ("decode",), binding.expires_ns
    )


def test_a_store_from_before_expiry_gets_the_new_columns_empty(tmp_path):
    c = duckdb.connect(str(tmp_path / "old.duckdb"))
    c.execute(
        f"CREATE TABLE {tokens.TABLE} (token_id VARCHAR PRIMARY KEY, role VARCHAR NOT NULL, "
        "tenant_id VARCHAR, nodes VARCHAR[] NOT NULL, note VARCHAR NOT NULL, hash VARCHAR NOT NULL, "
        "created_ns BIGINT NOT NULL, revoked_ns BIGINT)"
    )
    tid, secret, stored = tokens.new_token("operator")
    c.execute(f"INSERT INTO {tokens.TABLE} VALUES (?, 'operator', NULL, [], '', ?, 1, NULL)", [tid, stored])
    tokens.ensure_tables(c)
    assert tokens.authenticate(c, secret) == tokens.Principal(tid, "operator", None)
    c.close()


def test_token_add_expires_in_and_list_separates_fields_with_real_tabs(tmp_path):
    db = str(tmp_path / "s.duckdb")
    runner = CliRunner()
    added = runner.invoke(
        token_cli,
        [
            "add",
            "--db",
            db,
            "--role",
            "producer",
            "--node",
            "decode-0",
            "--cluster",
            "c1",
            "--node-role",
            "decode",
            "--expires-in",
            "12h",
            "--note",
            "dec\tode",
        ],
    )
    assert added.exit_code == 0, added.output
    listed = runner.invoke(token_cli, ["list", "--db", db]).output.splitlines()
    [line] = listed
    assert "\\x09" not in line.replace("dec\\x09ode", "")  # the note's own tab stays escaped, not the separators
    fields = line.split("\t")
    assert len(fields) == 6, fields
    assert fields[1:3] == ["producer", "decode-0 cluster=c1 role=decode"]
    assert fields[4].startswith("active, expires 20") and fields[5] == "dec\\x09ode"
    bad = runner.invoke(token_cli, ["add", "--db", db, "--role", "operator", "--expires-in", "soon"])
    assert isinstance(bad.exception, KvtrailError) and str(bad.exception).startswith("--expires-in: ")


def test_token_list_fields_are_separated_by_tabs_not_escaped_ones(tmp_path):
    db = str(tmp_path / "s.duckdb")
    runner = CliRunner()
    assert runner.invoke(token_cli, ["add", "--db", db, "--role", "tenant:acme", "--note", "x"]).exit_code == 0
    [line] = runner.invoke(token_cli, ["list", "--db", db]).output.splitlines()
    assert "\\x09" not in line and len(line.split("\t")) == 6 and line.split("\t")[1] == "tenant:acme"
