"""Unicode fonts for the PDF report, found on the system: DejaVu Sans (Latin, Greek, Cyrillic) and a CJK font.

fpdf2's built-in fonts know Latin-1 only and print every other letter as '?', so two Chinese tenant names
would read the same. Debian ships the fonts used here (``fonts-dejavu-core``; ``fonts-wqy-microhei`` or
``fonts-noto-cjk``; ``scripts/bootstrap.sh`` installs them). A character no installed font has is shown
as '?' in the PDF, and said so: once on stderr and in a note at the top of the PDF.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

SEARCH_DIRS = ("/usr/share/fonts", "/usr/local/share/fonts")
# (file under a search dir, font number inside a .ttc collection), best first
SANS = (("truetype/dejavu/DejaVuSans.ttf", 0),)
SANS_BOLD = (("truetype/dejavu/DejaVuSans-Bold.ttf", 0),)
MONO = (("truetype/dejavu/DejaVuSansMono.ttf", 0),)
CJK = (
    ("truetype/wqy/wqy-microhei.ttc", 0),
    ("opentype/noto/NotoSansCJK-Regular.ttc", 0),
    ("truetype/wqy/wqy-zenhei.ttc", 0),
    ("truetype/arphic/uming.ttc", 0),
)
_CJK_RANGES = (
    (0x1100, 0x11FF),
    (0x2E80, 0x9FFF),
    (0xA960, 0xA97F),
    (0xAC00, 0xD7FF),
    (0xF900, 0xFAFF),
    (0xFE30, 0xFE4F),
    (0xFF00, 0xFFEF),
    (0x20000, 0x3FFFF),
)
_warned: set[str] = set()  # notes already printed by this process


@dataclass(frozen=True)
class FontFile:
    """One font file, and which font of a collection (.ttc) to use."""

    path: Path
    number: int = 0


@dataclass(frozen=True)
class PdfFonts:
    """The fonts the PDF uses; ``None`` where none is installed (``sans`` None: fpdf2's Latin-1 Helvetica)."""

    sans: FontFile | None
    sans_bold: FontFile | None
    mono: FontFile | None
    cjk: FontFile | None

    @classmethod
    def find(cls, dirs: tuple[str | Path, ...] = SEARCH_DIRS) -> PdfFonts:
        """The first installed candidate for each role, looked up under ``dirs``."""

        def first(candidates: tuple[tuple[str, int], ...]) -> FontFile | None:
            for d in dirs:
                for name, number in candidates:
                    if (Path(d) / name).is_file():
                        return FontFile(Path(d) / name, number)
            return None

        return cls(first(SANS), first(SANS_BOLD), first(MONO), first(CJK))

    def install(self, doc) -> tuple[str, str, frozenset[int] | None]:
        """Register the fonts with an ``fpdf.FPDF``; returns (text family, mono family, code points covered,
        None meaning Latin-1 only)."""
        if self.sans is None:
            return "Helvetica", "Courier", None
        doc.add_font("kvsans", "", self.sans.path, collection_font_number=self.sans.number)
        bold = self.sans_bold or self.sans
        doc.add_font("kvsans", "B", bold.path, collection_font_number=bold.number)
        mono = self.mono or self.sans
        doc.add_font("kvmono", "", mono.path, collection_font_number=mono.number)
        fallbacks = ["kvsans"]
        if self.cjk is not None:
            doc.add_font("kvcjk", "", self.cjk.path, collection_font_number=self.cjk.number)
            fallbacks.append("kvcjk")
        # bold text falls back to a regular CJK face rather than to nothing
        doc.set_fallback_fonts(fallbacks, exact_match=False)
        covered: set[int] = set()
        for font in doc.fonts.values():
            covered.update(font.cmap)
        return "kvsans", "kvmono", frozenset(covered)


def missing_note(chars: set[str], fonts: PdfFonts) -> str | None:
    """The note for characters no installed font has (None if there are none)."""
    if not chars:
        return None
    cjk = sorted(c for c in chars if any(lo <= ord(c) <= hi for lo, hi in _CJK_RANGES))
    other = sorted(chars - set(cjk))
    what = (["Chinese/Japanese/Korean"] if cjk else []) + [f"U+{ord(c):04X}" for c in other[:8]]
    what += [f"{len(other) - 8} more"] if len(other) > 8 else []
    hint = []
    if fonts.sans is None:
        hint.append("fonts-dejavu-core")
    if cjk and fonts.cjk is None:
        hint.append("fonts-wqy-microhei or fonts-noto-cjk")
    return (
        f"This PDF has no font for some characters ({', '.join(what)}) and shows them as '?'; report.md and "
        "report.html show them." + (f" Install {' and '.join(hint)} to render them." if hint else "")
    )


def warn_once(note: str) -> None:
    """Print ``note`` on stderr the first time this process meets it."""
    if note not in _warned:
        _warned.add(note)
        print(f"warning: report.pdf: {note}", file=sys.stderr)
