"""The PDF renders every language the Markdown and HTML render (Polish, Greek, Chinese), or says what it cannot."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from kvtrail.report import fonts, render
from kvtrail.report.fonts import PdfFonts
from tests.forensics.test_report_safety import report

NAMES = {"acme": "Zażółć gęślą jaźń", "umbrella": "Καλημέρα", "hooli": "数据泄露", "globex": "數據保護"}
IN_CI = os.environ.get("CI", "").lower() == "true"


def _pdftotext(path) -> str:
    if not shutil.which("pdftotext"):
        if IN_CI:
            pytest.fail("pdftotext is missing (Debian: poppler-utils; scripts/bootstrap.sh test installs it)")
        pytest.skip("pdftotext is not installed")
    return subprocess.run(["pdftotext", str(path), "-"], capture_output=True, text=True, check=True).stdout


def _installed() -> PdfFonts:
    found = PdfFonts.find()
    if found.sans is None or found.cjk is None:
        if IN_CI:
            pytest.fail("Unicode fonts missing (Debian: fonts-dejavu-core, fonts-wqy-microhei)")
        pytest.skip("DejaVu or CJK font not installed")
    return found


def test_pdf_shows_polish_greek_and_chinese_tenant_names(tmp_path, capsys):
    _installed()
    out = report(tmp_path, NAMES)
    text = _pdftotext(out / "report.pdf")
    for name in NAMES.values():
        assert f"Notice to {name}" in text, name
    assert "Dear Καλημέρα," in text and "数据泄露-" in text  # request ids carry the tenant
    assert "?" * 4 not in text and "no font for some characters" not in text
    assert "warning: report.pdf" not in capsys.readouterr().err


def test_a_missing_cjk_font_is_said_once_and_in_the_pdf(tmp_path, capsys, monkeypatch):
    found = _installed()
    monkeypatch.setattr(fonts, "_warned", set())
    blocks = [("h1", "Report"), ("h3", "Notice to 数据泄露"), ("p", "Dear Καλημέρα, Zażółć")]
    no_cjk = PdfFonts(found.sans, found.sans_bold, found.mono, None)
    render.pdf(blocks, tmp_path / "a.pdf", title="t", fonts=no_cjk)
    render.pdf(blocks, tmp_path / "b.pdf", title="t", fonts=no_cjk)
    err = capsys.readouterr().err
    assert err.count("warning: report.pdf: This PDF has no font for some characters (Chinese/Japanese/Korean)") == 1
    assert "fonts-wqy-microhei or fonts-noto-cjk" in err
    text = _pdftotext(tmp_path / "a.pdf")
    assert "Notice to ????" in text and "Dear Καλημέρα, Zażółć" in text
    assert "no font for some characters (Chinese/Japanese/Korean)" in text.replace("\n", " ")


def test_without_any_unicode_font_the_pdf_falls_back_to_latin1_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fonts, "_warned", set())
    blocks = [("h1", "Report \u2013 Zażółć"), ("table", ["tenant"], [["Καλη"], ["café"]])]
    render.pdf(blocks, tmp_path / "c.pdf", title="t", fonts=PdfFonts.find(dirs=(tmp_path,)))
    assert "Install fonts-dejavu-core" in capsys.readouterr().err
    text = _pdftotext(tmp_path / "c.pdf")
    assert "Report - Za?ó??" in text and "café" in text and "????" in text


def test_fonts_are_found_by_path_under_the_search_dirs(tmp_path):
    (tmp_path / "truetype" / "wqy").mkdir(parents=True)
    (tmp_path / "truetype" / "wqy" / "wqy-microhei.ttc").write_bytes(b"")
    found = PdfFonts.find(dirs=(tmp_path / "missing", tmp_path))
    assert found.sans is None and found.cjk == fonts.FontFile(tmp_path / "truetype" / "wqy" / "wqy-microhei.ttc", 0)
