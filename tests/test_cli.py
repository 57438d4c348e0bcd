"""The CLI: exit codes (bad input 2, failed check 1), one-line errors, every command and flag documented."""

import json
from pathlib import Path

import click
import pytest

from kvtrail.cli import cli, main
from tests.conftest import alloc, config

ROOT = Path(__file__).resolve().parents[1]


def _jsonl(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(path)


def test_ingest_verify_head_stats(tmp_path, capsys):
    db = str(tmp_path / "a.duckdb")
    f = _jsonl(tmp_path / "ev.jsonl", [config(0), alloc(1, [1, 2, 3])])
    assert main(["audit", "ingest", "--db", db, f]) == 0
    assert "stored 2 events, 3 page-events in 1 runs" in capsys.readouterr().out
    assert main(["audit", "verify", "--db", db]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["audit", "head", "--db", db]) == 0
    assert "prefill-0" in capsys.readouterr().out
    assert main(["audit", "stats", "--db", db]) == 0
    assert "pages_allocated" in capsys.readouterr().out


def test_bad_file_exits_2_with_one_line_and_stores_nothing(tmp_path, capsys):
    db = str(tmp_path / "a.duckdb")
    good = _jsonl(tmp_path / "good.jsonl", [config(0)])
    bad = _jsonl(tmp_path / "bad.jsonl", [alloc(1, [1]), alloc(2, [999])])
    assert main(["audit", "ingest", "--db", db, good, bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "bad.jsonl: event 1 (pages_allocated): field 'pages': page id 999 out of pool" in err[0]
    assert main(["audit", "ingest", "--db", db, bad]) == 2  # still nothing of bad.jsonl stored
    assert main(["audit", "verify", "--db", db, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["events_checked"] == 1


def test_unparseable_file_rejects_before_writing_anything(tmp_path, capsys):
    db = tmp_path / "a.duckdb"
    good = _jsonl(tmp_path / "good.jsonl", [config(0)])
    (tmp_path / "broken.jsonl").write_text("{nope\n")
    assert main(["audit", "ingest", "--db", str(db), good, str(tmp_path / "broken.jsonl")]) == 2
    assert "line 1 is not valid JSON" in capsys.readouterr().err
    assert not db.exists()


def test_tampered_store_exits_1_naming_the_link(tmp_path, capsys):
    import duckdb

    db = str(tmp_path / "a.duckdb")
    main(["audit", "ingest", "--db", db, _jsonl(tmp_path / "e.jsonl", [config(0), alloc(1, [4])])])
    con = duckdb.connect(db)
    con.execute("UPDATE page_runs SET page_start = 5")
    con.close()
    capsys.readouterr()
    assert main(["audit", "verify", "--db", db]) == 1
    assert "FAILED: first problem: producer" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["audit", "verify", "--db", "missing.duckdb"], "store not found"),
        (["audit", "prune", "--db", "x.duckdb", "--before", "last tuesday"], "--before"),
        (["audit", "hold", "release", "--db", "x.duckdb", "7"], "store not found"),
        (["audit", "nosuch"], "No such command"),
    ],
)
def test_bad_arguments_exit_2(tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    if "prune" in argv:
        main(["audit", "ingest", "--db", "x.duckdb", _jsonl(tmp_path / "e.jsonl", [config(0)])])
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_signed_ingest_and_verify(tmp_path, capsys):
    db, priv, pub = str(tmp_path / "a.duckdb"), str(tmp_path / "k.pem"), str(tmp_path / "k.pub")
    assert main(["audit", "keygen", "--private", priv, "--public", pub]) == 0
    assert main(["audit", "keygen", "--private", priv, "--public", pub]) == 2  # never overwrites a key
    f = _jsonl(tmp_path / "e.jsonl", [config(0)])
    assert main(["audit", "ingest", "--db", db, "--signing-key", priv, f]) == 0
    assert main(["audit", "verify", "--db", db, "--public-key", pub]) == 0


@pytest.mark.slow
def test_demo_reproduces_the_incident_then_the_fix(tmp_path, capsys):
    db = str(tmp_path / "demo.duckdb")
    assert main(["demo", "--db", db, "--requests", "16", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    vulnerable, patched = out.split("== patched")
    assert "== vulnerable" in vulnerable and "verified: OK" in patched
    assert "over-long prompts:" in vulnerable
    assert "0 responses carried another tenant's canary" in patched
    assert "0 transfers where decode reserved more than prefill sent" in patched
    assert "0 affected responses" in patched and "F2:" in vulnerable and "F4:" in vulnerable


def _commands(group, prefix=()):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        path = prefix + (name,)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, path)
        else:
            yield path, cmd


def test_every_command_and_flag_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for path, cmd in _commands(cli):
        line = "kvtrail " + " ".join(path)
        assert line in readme, f"README does not document `{line}`"
        for param in cmd.params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("--"):
                    assert opt in readme, f"README does not document {opt} of `{line}`"


def test_version_loads_no_command_group():
    """`kvtrail --version` imports the root only: each group's module (and pandas, DuckDB) on first use."""
    import subprocess
    import sys

    heavy = ("kvtrail.cli.audit", "kvtrail.cli.forensics", "kvtrail.cli.stack", "duckdb", "pandas", "pyarrow", "numpy")
    code = (
        "import sys; from kvtrail.cli import main; code = main(['--version']); "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in ('duckdb', 'pandas', 'pyarrow', 'numpy') "
        f"or m in {heavy!r})); sys.exit(code)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    version, loaded = out.splitlines()
    assert version.startswith("kvtrail, version ")
    assert loaded == "[]"


def test_every_command_group_loads_on_first_use_with_its_name():
    ctx = click.Context(cli)
    names = cli.list_commands(ctx)
    assert {"audit", "demo", "forensics", "serve", "stack", "simulate", "token"} <= set(names)
    for name in names:
        cmd = cli.get_command(ctx, name)
        assert isinstance(cmd, click.Command) and cmd.name == name
    assert cli.get_command(ctx, "no-such-command") is None
    assert main(["no-such-command"]) == 2


def test_the_demo_names_the_window_its_f9_count_was_judged_in(capsys):
    """F9 depends on the prefill rate measured in the window: the demo prints the flags that repeat its
    count, a window (in the CLI's microseconds) that covers the run's nanoseconds whole."""
    demo = pytest.importorskip("kvtrail.cli.demo")
    from kvtrail.forensics.findings import make_finding
    from kvtrail.timeutil import parse_utc

    from_ns, to_ns = 1_796_292_650_442_262_938, 1_796_292_745_000_000_001
    flags = demo._window_flags("k.duckdb", from_ns, to_ns)
    args = flags.split()
    assert args[:2] == ["--db", "k.duckdb"]
    start, end = parse_utc(args[args.index("--from") + 1]), parse_utc(args[args.index("--to") + 1])
    assert start <= from_ns and end >= to_ns and end - start < to_ns - from_ns + 2_000
    fast = make_finding(
        "F9",
        node="prefill-0",
        request_id="r1",
        tenant_id="acme",
        victim_request_ids=(),
        victim_tenant_ids=(),
        pages=(),
        first_ns=from_ns,
        last_ns=from_ns,
        evidence=(),
        detail="TTFT 20 ms for 13080 tokens to prefill",
    )
    demo._report_findings([fast], [], flags)
    out = capsys.readouterr().out
    assert "implausible latency (F9): 1 responses" in out
    assert f"`kvtrail forensics findings {flags}` repeats this count" in out
    demo._report_findings([], [], flags)
    assert "repeats this count" not in capsys.readouterr().out
