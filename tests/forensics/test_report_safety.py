"""Hostile ids and incident files: escaped Markdown, a PDF that never crashes on long ids, a refused incident.yaml."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import pytest
from markdown_it import MarkdownIt

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.cli import main
from kvtrail.errors import KvtrailError
from kvtrail.report import render
from kvtrail.report.context import MAX_FILE_BYTES, load_context
from tests.forensics import incident_fixture as fx

WINDOW = ["--from", "2026-09-09T00:00:00Z", "--to", "2026-09-09T06:00:00Z"]
HOSTILE = "evil\n# Injected\n<script>alert(1)</script>[x](http://e)\r| a |"
OK_YAML = "organisation: O\ncontact: {email: a@b.c}\n"


def build_named(path, names: dict[str, str]) -> None:
    """The incident of ``incident_fixture`` with tenants renamed (request ids follow: ``<tenant>-<n>``)."""
    inc = fx.Incident()
    for minute, tenant, tokens in fx.BASELINE:
        inc.request(minute, names.get(tenant, tenant), tokens)
    last = None
    for minute, tenant in sorted(fx.LONG_IN_WINDOW):
        if last is None or minute - last > 3:
            inc.request(minute - 3, names.get("acme", "acme"), fx.SHORT_ACME)
            inc.request(minute - 2, names.get("umbrella", "umbrella"), fx.SHORT)
        inc.request(minute, names.get(tenant, tenant), fx.LONG, fx.RESEARCHER_KEY if tenant == "initech" else None)
        last = minute
    with AuditStore(path) as store:
        store.append(from_dicts(inc.events))


def report(tmp_path, names: dict[str, str], *extra: str, db_name: str = "s.duckdb"):
    db, out = tmp_path / db_name, tmp_path / "out"
    build_named(db, names)
    assert main(["forensics", "report", "--db", str(db), *WINDOW, "--out", str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    return report(
        tmp_path_factory.mktemp("hostile"),
        {"mallory": HOSTILE, "umbrella": "x*y_z`w~v$u"},
        db_name="my $(store).duckdb",
    )


def _cells(line: str) -> list[str]:
    """A Markdown table row split on its unescaped pipes (a pipe after an even run of backslashes)."""
    return re.split(r"(?<!\\)(?:\\\\)*\|", line.strip())[1:-1]


def test_markdown_has_no_injected_heading_html_or_link(hostile):
    md = (hostile / "report.md").read_text()
    assert "<script" not in md and not re.search(r"^#+ Injected", md, re.M)
    tokens = MarkdownIt("commonmark").enable(["table", "strikethrough"]).parse(md)
    kinds = {t.type for t in tokens} | {c.type for t in tokens for c in t.children or []}
    assert not kinds & {"html_block", "html_inline", "link_open", "s_open", "em_open", "code_inline"}, kinds
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert not [h for h in headings if h.startswith("Injected")]
    html = MarkdownIt("commonmark").render(md)
    assert "<h3>Notice to evil # Injected &lt;script&gt;alert(1)&lt;/script&gt;[x](http://e) | a |</h3>" in html


def test_markdown_tables_keep_their_columns(hostile):
    md = (hostile / "report.md").read_text()
    tables = [block.splitlines() for block in md.split("\n\n") if block.startswith("| ")]
    assert len(tables) > 8 and any("evil" in "".join(t) for t in tables)
    for lines in tables:
        assert {len(_cells(line)) for line in lines} == {len(_cells(lines[0]))}, lines[0]
    html = MarkdownIt("commonmark").enable("table").render(md)
    assert "<td>evil # Injected &lt;script&gt;alert(1)&lt;/script&gt;[x](http://e) | a |</td>" in html
    assert "<td>x*y_z`w~v$u</td>" in html


@pytest.mark.parametrize(
    "text,shown",
    [
        ("- item", "\\- item"),
        ("1. first", "1\\. first"),
        ("    code", "code"),
        ("a\r\nb\tc", "a b c"),
        ("&amp; <b>", "&amp;amp; &lt;b&gt;"),
        ("## x ##", "\\#\\# x \\#\\#"),
        ("![i](u)", "!\\[i\\](u)"),
    ],
)
def test_md_text(text, shown):
    assert render.md_text(text) == shown


def test_mono_fence_outlasts_backticks():
    md = render.markdown([("mono", "a\n````\n# b")])
    assert md.startswith("`````\n") and md.rstrip().endswith("`````")
    assert not [t for t in MarkdownIt("commonmark").parse(md) if t.type == "heading_open"]


def test_the_verify_command_quotes_the_store_name_for_a_shell(hostile):
    md = (hostile / "report.md").read_text()
    assert "\nkvtrail forensics verify-report REPORT_DIR --db 'my $(store).duckdb'\n" in md


def test_html_escapes_hostile_ids(hostile):
    html = (hostile / "report.html").read_text()
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_long_ids_do_not_crash_the_pdf_and_stay_whole_in_csv_json(tmp_path):
    tenant, other = "t" * 1500, "r" * 3000  # the second also makes request ids over 3,000 characters
    out = report(tmp_path, {"mallory": tenant, "acme": other})
    assert (out / "report.pdf").read_bytes().startswith(b"%PDF")
    affected = json.loads((out / "affected_responses.json").read_text())
    assert tenant in {r["tenant_id"] for r in affected}
    assert any(other in v for r in affected for v in r["victim_tenants"])
    assert other in (out / "exposed_tenants.csv").read_text()
    if shutil.which("pdftotext"):
        text = subprocess.run(
            ["pdftotext", str(out / "report.pdf"), "-"], capture_output=True, text=True, check=True
        ).stdout
        assert "\u2026" in text and "t" * 1500 not in text.replace("\n", "")


def test_a_table_too_wide_for_the_page_becomes_lines(tmp_path):
    headers = ["recipient \\ victim"] + [f"victim-{i}" for i in range(80)]
    render.pdf([("h1", "x"), ("table", headers, [["a"] + ["1 / 2"] * 80])], tmp_path / "w.pdf", title="x")
    assert (tmp_path / "w.pdf").stat().st_size > 1000
    assert render.shorten("abcdefghij", 5) == "ab\u2026ij" and render.shorten("abc", 5) == "abc"


BAD_FILES = [
    (OK_YAML + "detected_at: 9999-12-31T23:59:59Z\n", "field 'detected_at': 9999-12-31T23:59:59+00:00 is outside"),
    (OK_YAML + "declared_at: '9999-01-01T00:00:00Z'\n", "field 'declared_at': 9999-01-01T00:00:00+00:00 is outside"),
    (OK_YAML + "timeline:\n  - {at: 2300-01-01T00:00:00Z, what: x}\n", "field 'timeline[0].at': 2300-01-01"),
    (OK_YAML + "detected_at: 2026-02-30T00:00:00Z\n", "field 'detected_at': not an ISO 8601 UTC time"),
    (
        OK_YAML + "detection: !!python/object/apply:os.system ['true']\n",
        "field 'detection': unsupported YAML tag '!!python/object/apply:os.system'",
    ),
    (OK_YAML + "title: !!int x\n", "field 'title': unsupported YAML tag '!!int'"),
    (OK_YAML + "measures_taken: &m [a]\nremediation: *m\n", "field 'measures_taken': YAML anchors and aliases"),
    (OK_YAML + "timeline: " + "[" * 50 + "]" * 50 + "\n", "nested deeper than 16 levels"),
    (OK_YAML + '"bad\\nkey": 1\n', "field 'bad\\nkey': unknown field"),
    ((OK_YAML + "title: caf\xe9\n").encode("latin-1"), "incident.yaml: not UTF-8 text (byte 0xe9 at offset"),
    (OK_YAML + "#" * MAX_FILE_BYTES + "\n", "incident.yaml: larger than the limit of 1 MiB"),
    # the probe: a key named twice was kept silently (the last value won); a 5,000-digit integer was a traceback
    (OK_YAML + "title: first\ntitle: second\n", "incident.yaml: line 4: duplicate key 'title'"),
    (OK_YAML + "contact: {name: a, name: b}\n", "duplicate key 'contact'"),
    (
        "organisation: Org\ncontact: {name: a, email: a@example.org, name: b}\n",
        "incident.yaml: line 2: duplicate key 'name'",
    ),
    (OK_YAML + "detected_at: " + "9" * 5000 + "\n", "an integer of 5000 characters is too long"),
]


def _billion_laughs(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return OK_YAML + "\n".join(lines) + "\n"


@pytest.mark.parametrize("content,needle", BAD_FILES + [(_billion_laughs(), "YAML anchors and aliases")])
def test_bad_incident_file_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, content, needle):
    db = tmp_path / "s.duckdb"
    fx.build(db)
    bad = tmp_path / "incident.yaml"
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(KvtrailError, match=re.escape(needle)):
        load_context(bad)
    capsys.readouterr()
    started = time.monotonic()
    out = tmp_path / "out"
    assert main(["forensics", "report", "--db", str(db), *WINDOW, "--out", str(out), "--context", str(bad)]) == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_a_plain_string_tag_and_times_up_to_2261_are_accepted(tmp_path):
    good = tmp_path / "incident.yaml"
    good.write_text(OK_YAML + "title: !!str 5\nfixed_at: 2261-12-31T23:59:59Z\n")
    ctx = load_context(good)
    assert ctx.title == "5" and ctx.fixed_at == 9_214_646_399 * 10**9


def test_a_window_beyond_2261_is_refused_before_anything_is_written(tmp_path, capsys):
    db, out = tmp_path / "s.duckdb", tmp_path / "out"
    fx.build(db)
    assert (
        main(["forensics", "report", "--db", str(db), "--from", "2026-09-09", "--to", "9999-12-31", "--out", str(out)])
        == 2
    )
    assert "--to: 9999-12-31T00:00:00+00:00 is outside the times kvtrail can represent" in capsys.readouterr().err
    assert not out.exists()
