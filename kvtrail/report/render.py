"""Render report blocks (see ``kvtrail.report.disclosure``) as Markdown, self-contained HTML and PDF.

Block texts are plain text, and part of it comes from outside (tenant and request ids from clients, the
operator's incident.yaml). Markdown escapes it so that no value can start a heading, a list, a link,
raw HTML or another table cell; HTML escapes every value. The PDF embeds Unicode fonts
(``kvtrail.report.fonts``) and shortens what cannot fit a page, such as a 3,000-character id,
with a middle ellipsis; the CSV/JSON files beside it keep every value whole.
"""

from __future__ import annotations

import base64
import html as _html
import io
import re
import struct
from pathlib import Path

from kvtrail.report.fonts import PdfFonts, missing_note, warn_once

_FOLD = str.maketrans(
    {
        "\u2013": "-",
        "\u2014": "-",
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2026": "...",
        "\u2192": "->",
        "\u2264": "<=",
        "\u2265": ">=",
        "\u2248": "~",
        "\u00d7": "x",
        "\u2022": "-",
    }
)
# Everything a Markdown or HTML reader may end a line on, and the other C0 controls: one space each.
_BREAKS = re.compile(r"\r\n|[\x00-\x1f\x7f\x85\u2028\u2029]")
# Inline markup anywhere in a line (code, emphasis, links, cells, strike, maths, raw HTML and entities).
_MD_ESCAPE = str.maketrans(
    {
        "\\": "\\\\",
        "`": "\\`",
        "*": "\\*",
        "_": "\\_",
        "[": "\\[",
        "]": "\\]",
        "|": "\\|",
        "~": "\\~",
        "$": "\\$",
        "#": "\\#",
        "<": "&lt;",
        ">": "&gt;",
        "&": "&amp;",
    }
)
# Markup only at the start of a line: list items ("- ", "+ ", "1. ", "1) ") and setext underlines.
_MD_LINE_START = re.compile(r"^(?:([-+=])|(\d{1,9})([.)]))")


def md_text(text: str) -> str:
    """``text`` as literal Markdown on one line: every character shows as itself and none is markup."""
    flat = _BREAKS.sub(" ", text).translate(_MD_ESCAPE).lstrip(" ")  # four leading spaces would make code
    return _MD_LINE_START.sub(lambda m: f"\\{m[1]}" if m[1] else f"{m[2]}\\{m[3]}", flat)


def _md_fence(text: str) -> str:
    """A code fence longer than any run of backticks inside ``text``, so the text cannot close it."""
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    return "`" * max(3, longest + 1)


def markdown(blocks: list[tuple]) -> str:
    """Markdown (GitHub flavour tables); every text is escaped (:func:`md_text`)."""
    e = md_text
    out = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + e(b[1]))
        elif kind == "p":
            out.append(e(b[1]))
        elif kind == "warn":
            out.append(f"> **Warning:** {e(b[1])}")
        elif kind == "mono":
            fence = _md_fence(b[1])
            out.append(f"{fence}\n{b[1]}\n{fence}")
        elif kind == "ul":
            out.append("\n".join(f"- {e(item)}" for item in b[1]))
        elif kind == "table":
            _, headers, rows = b
            lines = ["| " + " | ".join(e(h) for h in headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(e(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines) if rows else "(none)")
        elif kind == "img":
            out.append(f"{e(b[2])} (an image in report.html and report.pdf)")
        else:
            raise AssertionError(f"unknown block kind {kind!r}")
    return "\n\n".join(out) + "\n"


_CSS = """body{font-family:system-ui,Helvetica,Arial,sans-serif;max-width:70rem;margin:2rem auto;padding:0 1rem;
line-height:1.45;color:#1a1a1a}table{border-collapse:collapse;margin:.5rem 0 1rem;font-size:.85rem}
th,td{border:1px solid #bbb;padding:.2rem .45rem;text-align:left;vertical-align:top}th{background:#eee}
.warn{background:#fff3cd;border-left:.3rem solid #d39e00;padding:.5rem .8rem}pre{background:#f4f4f4;padding:.5rem}
td{word-break:break-word}h2{border-bottom:1px solid #ccc;margin-top:2rem}"""


def html(blocks: list[tuple], title: str) -> str:
    """A single self-contained HTML page; every text is escaped."""
    e = _html.escape
    out = [
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
        f"<style>{_CSS}</style></head><body>"
    ]
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            out.append(f"<{kind}>{e(b[1])}</{kind}>")
        elif kind == "p":
            out.append(f"<p>{e(b[1])}</p>")
        elif kind == "warn":
            out.append(f'<p class="warn"><strong>Warning:</strong> {e(b[1])}</p>')
        elif kind == "mono":
            out.append(f"<pre>{e(b[1])}</pre>")
        elif kind == "ul":
            out.append("<ul>" + "".join(f"<li>{e(i)}</li>" for i in b[1]) + "</ul>")
        elif kind == "table":
            _, headers, rows = b
            if not rows:
                out.append("<p>(none)</p>")
                continue
            head = "".join(f"<th>{e(h)}</th>" for h in headers)
            body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "img":
            width_px = png_size(b[1])[0] // 2  # drawn at scale 2: shown at its natural size on a screen
            data = base64.b64encode(b[1]).decode("ascii")
            out.append(
                f'<figure><img src="data:image/png;base64,{data}" alt="{e(b[2])}" '
                f'style="max-width:100%;width:{width_px}px"><figcaption>{e(b[2])}</figcaption></figure>'
            )
        else:
            raise AssertionError(f"unknown block kind {kind!r}")
    out.append("</body></html>\n")
    return "\n".join(out)


def latin1(text: str) -> str:
    """Text fpdf2's core fonts can show: common typography folded to ASCII, anything else as '?'."""
    return text.translate(_FOLD).encode("latin-1", "replace").decode("latin-1")


def _breakable(text: str, width: int = 40) -> str:
    """Long unbroken tokens (digests, id lists) get spaces so a narrow table column can wrap them."""
    words = []
    for w in text.split(" "):
        while len(w) > width:
            words.append(w[:width])
            w = w[width:]
        words.append(w)
    return " ".join(words)


def shorten(text: str, max_chars: int) -> str:
    """``text`` cut in the middle to ``max_chars`` with an ellipsis: an id keeps its start and its end."""
    if len(text) <= max_chars:
        return text
    head = (max_chars - 1) // 2
    return text[:head] + "\u2026" + text[len(text) - (max_chars - 1 - head) :]


def _fit(text: str, max_chars: int) -> str:
    """A table cell held to ``max_chars``: a list ("a, b, c") keeps whole items and says how many more there
    are (an id is never cut); other text is cut in the middle (:func:`shorten`)."""
    if len(text) <= max_chars:
        return text
    items = text.split(", ")
    kept: list[str] = []
    for item in items:
        if len(", ".join([*kept, item])) > max_chars - 14:
            break
        kept.append(item)
    if len(items) > 2 and kept:
        return ", ".join(kept) + f", \u2026 (+{len(items) - len(kept)} more)"
    return shorten(text, max_chars)


def _short_words(text: str, max_chars: int) -> str:
    return " ".join(shorten(w, max_chars) for w in text.split(" "))


_PAGE_FIT = {"h": (60, 240), "p": (160, 20_000)}  # PDF: longest word, longest text, per heading and paragraph
_CELL_LINES = 16  # at most this many lines of a table cell, so every row fits on one page
_MM_PER_PT = 0.3528


class _Glyphs:
    """What the PDF can show: characters the fonts lack become '?', and are collected for the note."""

    def __init__(self, covered: frozenset[int] | None):
        self.covered = covered

    @staticmethod
    def flat(text: str, keep_lines: bool = False) -> str:
        """Controls and line breaks as spaces (``keep_lines``: but for the line breaks of a mono block)."""
        if keep_lines:
            return "\n".join(_BREAKS.sub(" ", line) for line in re.split(r"\r\n|[\r\n]", text))
        return _BREAKS.sub(" ", text)

    def lacking(self, text: str) -> set[str]:
        if self.covered is None:
            return {c for c in text if latin1(c) == "?" and c != "?"}
        return {c for c in text if ord(c) not in self.covered and c != "\n"}

    def show(self, text: str) -> str:
        if self.covered is None:
            return latin1(text)
        return "".join(c if ord(c) in self.covered or c == "\n" else "?" for c in text)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels of a PNG, from its IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    w, h = struct.unpack(">II", data[16:24])
    return int(w), int(h)


def _texts(blocks: list[tuple]):
    for b in blocks:
        if b[0] == "img":
            yield b[2]
        elif b[0] == "ul":
            yield from b[1]
        elif b[0] == "table":
            yield from (str(c) for row in [b[1]] + b[2] for c in row)
        else:
            yield b[1]


def pdf(blocks: list[tuple], path: str | Path, title: str, fonts: PdfFonts | None = None) -> None:
    """A PDF (A4) written with fpdf2, in the Unicode fonts found on the system (``fonts``: which ones)."""
    import fpdf
    from fpdf import FPDF
    from fpdf.fonts import FontFace

    fonts = fonts or PdfFonts.find()
    doc = FPDF(format="A4")
    sans, mono, covered = fonts.install(doc)
    g = _Glyphs(covered)
    note = missing_note(set().union(*(g.lacking(g.flat(t)) for t in _texts(blocks))), fonts)
    if note:
        warn_once(note)
        blocks = blocks[:1] + [("warn", note)] + blocks[1:]
    doc.set_title(shorten(g.flat(title), 300))
    doc.set_creator("kvtrail")
    doc.set_producer(f"fpdf2 {fpdf.__version__}")
    doc.set_auto_page_break(True, margin=15)
    doc.add_page()
    width = doc.epw
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            doc.set_font(sans, "B", {"h1": 15, "h2": 12, "h3": 10}[kind])
            word, most = _PAGE_FIT["h"]
            doc.ln(2)
            doc.multi_cell(
                width,
                6,
                g.show(shorten(_short_words(g.flat(b[1]), word), most)),
                new_x="LMARGIN",
                new_y="NEXT",
                align="L",
            )
            doc.ln(1)
        elif kind in ("p", "warn", "mono"):
            doc.set_font(mono if kind == "mono" else sans, "B" if kind == "warn" else "", 9)
            doc.set_fill_color(255, 243, 205)
            text = ("WARNING: " if kind == "warn" else "") + b[1]
            word, most = _PAGE_FIT["p"]
            text = shorten(_short_words(g.flat(text, keep_lines=kind == "mono"), word), most)
            doc.multi_cell(
                width, 4.5, g.show(_breakable(text, 90)), new_x="LMARGIN", new_y="NEXT", fill=kind == "warn", align="L"
            )
            doc.set_fill_color(255, 255, 255)
            doc.ln(1.5)
        elif kind == "ul":
            doc.set_font(sans, "", 9)
            word, most = _PAGE_FIT["p"]
            for item in b[1]:
                text = shorten(_short_words(g.flat(item), word), most)
                doc.multi_cell(
                    width, 4.5, g.show("- " + _breakable(text, 90)), new_x="LMARGIN", new_y="NEXT", align="L"
                )
            doc.ln(1.5)
        elif kind == "table":
            _table(doc, g, sans, b[1], b[2], width, FontFace)
        elif kind == "img":
            _image(doc, g, sans, b[1], b[2], width)
        else:
            raise AssertionError(f"unknown block kind {kind!r}")
    doc.output(str(path))


_CELL_PAD_MM = (0.8, 1.0)  # a table cell's padding: top and bottom, left and right
_WORD_CHARS = 30  # a longer word (a digest, a long id) may wrap inside itself; a shorter one never does


def header_words(header: str) -> str:
    """A column name as the PDF's table header shows it: snake_case as words, so a narrow column wraps the
    header between its words, never inside one ("pool_covers_context" -> "pool covers context")."""
    return header.replace("_", " ")


def _column_widths(doc, sans: str, size: float, cells: list[list[str]], width: float) -> list[float] | None:
    """Column widths (mm) in which no word shorter than ``_WORD_CHARS`` is split, or None when the page is
    too narrow for that. What is left over goes to the columns whose text is longest."""
    pad = 2 * _CELL_PAD_MM[1] + 0.4
    need, want = [], []
    for i in range(len(cells[0])):
        doc.set_font(sans, "B", size)
        head = max(doc.get_string_width(w) for w in cells[0][i].split(" ") or [""])
        doc.set_font(sans, "", size)
        words = [w for row in cells[1:] for w in row[i].split(" ")]
        body = max((doc.get_string_width(w) for w in words), default=0.0)
        longest = max((doc.get_string_width(row[i][:40]) for row in cells[1:]), default=0.0)
        need.append(max(head, body) + pad)
        want.append(max(need[-1], longest + pad))
    if sum(need) > width:
        return None
    spare, wish = width - sum(need), [w - n for w, n in zip(want, need)]
    weights = wish if sum(wish) > 0 else need
    return [n + spare * w / sum(weights) for n, w in zip(need, weights)]


def _table(doc, g: _Glyphs, sans: str, headers: list[str], rows: list[list], width: float, font_face) -> None:
    size = 6.5 if len(headers) > 6 else 8
    doc.set_font(sans, "", size)
    if not rows:
        doc.multi_cell(width, 4.5, "(none)", new_x="LMARGIN", new_y="NEXT")
        return
    flat = [[g.flat(header_words(str(c))) for c in headers]] + [[g.flat(str(c)) for c in row] for row in rows]
    col_mm = _column_widths(doc, sans, size, [[g.show(_breakable(c, _WORD_CHARS)) for c in row] for row in flat], width)
    doc.set_font(sans, "", size)
    if col_mm is None:  # too many columns for the page: one paragraph per row instead
        for row in flat[1:]:
            text = "; ".join(f"{h}: {shorten(v, 200)}" for h, v in zip(flat[0], row))
            doc.multi_cell(width, 3.4, g.show(_breakable(text, 90)), new_x="LMARGIN", new_y="NEXT", align="L")
            doc.ln(0.5)
        doc.ln(2)
        return
    # A cell is held to what fits _CELL_LINES lines at one em a character, half of that for word wrap, so
    # that every row fits on one page.
    em_mm = size * _MM_PER_PT  # no glyph of these fonts is much wider than one em
    limits = [max(1, int((mm - 2 * _CELL_PAD_MM[1]) / em_mm)) * _CELL_LINES // 2 for mm in col_mm]
    heading = font_face(emphasis="BOLD", fill_color=(235, 235, 235))
    with doc.table(
        width=width,
        col_widths=tuple(col_mm),
        line_height=3.4,
        text_align="LEFT",
        padding=_CELL_PAD_MM,
        headings_style=heading,
    ) as table:
        for row in flat:
            r = table.row()
            for cell, most in zip(row, limits):
                r.cell(g.show(_breakable(_fit(cell, most), _WORD_CHARS)))
    doc.ln(2)


def _image(doc, g: _Glyphs, sans: str, png: bytes, caption: str, width: float) -> None:
    """A figure at most the text width wide (drawn at scale 2: 96 dpi on screen, 192 in print), captioned."""
    w_px, h_px = png_size(png)
    w_mm = min(width, w_px / 2 * 25.4 / 96)
    h_mm = w_mm * h_px / w_px
    if doc.get_y() + h_mm + 8 > doc.page_break_trigger:
        doc.add_page()
    doc.image(io.BytesIO(png), x=doc.l_margin, w=w_mm, h=h_mm)
    doc.set_font(sans, "", 8)
    doc.multi_cell(width, 4, g.show(g.flat(caption)), new_x="LMARGIN", new_y="NEXT", align="L")
    doc.ln(2)
