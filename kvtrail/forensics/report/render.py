"""Render report blocks (see ``kvtrail.forensics.report.disclosure``) as Markdown, self-contained HTML and PDF.

Markdown is the primary text; HTML escapes every value; the PDF uses fpdf2's core fonts, which only
know Latin-1, so text is folded to it first (dashes, quotes and arrows to ASCII look-alikes).
"""

from __future__ import annotations

import html as _html
from pathlib import Path

_FOLD = str.maketrans({"\u2013": "-", "\u2014": "-", "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                       "\u2026": "...", "\u2192": "->", "\u2264": "<=", "\u2265": ">=", "\u2248": "~", "\u00d7": "x",
                       "\u2022": "-"})


def _md_cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def markdown(blocks: list[tuple]) -> str:
    """Markdown (GitHub flavour tables)."""
    out = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + b[1])
        elif kind == "p":
            out.append(b[1])
        elif kind == "warn":
            out.append(f"> **Warning:** {b[1]}")
        elif kind == "mono":
            out.append(f"```\n{b[1]}\n```")
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in b[1]))
        elif kind == "table":
            _, headers, rows = b
            lines = ["| " + " | ".join(_md_cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines) if rows else "(none)")
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
    out = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{e(title)}</title>"
           f"<style>{_CSS}</style></head><body>"]
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            out.append(f"<{kind}>{e(b[1])}</{kind}>")
        elif kind == "p":
            out.append(f"<p>{e(b[1])}</p>")
        elif kind == "warn":
            out.append(f"<p class=\"warn\"><strong>Warning:</strong> {e(b[1])}</p>")
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
        else:
            raise AssertionError(f"unknown block kind {kind!r}")
    out.append("</body></html>\n")
    return "\n".join(out)


def latin1(text: str) -> str:
    """Text the PDF core fonts can show: common typography folded to ASCII, anything else as '?'."""
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


def pdf(blocks: list[tuple], path: str | Path, title: str) -> None:
    """A PDF (A4) written with fpdf2."""
    import fpdf
    from fpdf import FPDF
    from fpdf.fonts import FontFace

    doc = FPDF(format="A4")
    doc.set_title(latin1(title))
    doc.set_creator("kvtrail")
    doc.set_producer(f"fpdf2 {fpdf.__version__}")
    doc.set_auto_page_break(True, margin=15)
    doc.add_page()
    width = doc.epw
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            doc.set_font("Helvetica", "B", {"h1": 15, "h2": 12, "h3": 10}[kind])
            doc.ln(2)
            doc.multi_cell(width, 6, latin1(b[1]), new_x="LMARGIN", new_y="NEXT")
            doc.ln(1)
        elif kind in ("p", "warn", "mono"):
            doc.set_font("Courier" if kind == "mono" else "Helvetica", "B" if kind == "warn" else "", 9)
            doc.set_fill_color(255, 243, 205)
            text = ("WARNING: " if kind == "warn" else "") + b[1]
            doc.multi_cell(width, 4.5, latin1(_breakable(text, 90)), new_x="LMARGIN", new_y="NEXT",
                           fill=kind == "warn", align="L")
            doc.set_fill_color(255, 255, 255)
            doc.ln(1.5)
        elif kind == "ul":
            doc.set_font("Helvetica", "", 9)
            for item in b[1]:
                doc.multi_cell(width, 4.5, latin1("- " + _breakable(item, 90)), new_x="LMARGIN", new_y="NEXT",
                               align="L")
            doc.ln(1.5)
        elif kind == "table":
            _, headers, rows = b
            doc.set_font("Helvetica", "", 6.5 if len(headers) > 6 else 8)
            if not rows:
                doc.multi_cell(width, 4.5, "(none)", new_x="LMARGIN", new_y="NEXT")
                continue
            cells = [[latin1(_breakable(str(c), 30)) for c in row] for row in [headers] + rows]
            # Columns get width by their longest word-wrapped content, within bounds, so a reason or a
            # detail column is wide and a count column narrow.
            widths = tuple(min(max(len(r[i]) for r in cells), 40) + 6 for i in range(len(headers)))
            with doc.table(width=width, col_widths=widths, line_height=3.4, text_align="LEFT",
                           headings_style=FontFace(emphasis="BOLD", fill_color=(235, 235, 235))) as table:
                for row in cells:
                    r = table.row()
                    for cell in row:
                        r.cell(cell)
            doc.ln(2)
        else:
            raise AssertionError(f"unknown block kind {kind!r}")
    doc.output(str(path))
