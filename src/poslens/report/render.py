"""report.md and report.html (self-contained: images embedded) from sections of claims and figures.

Each analysis contributes a `Section`: a short text, its figures, and a table of `Claim`s: what the
paper says, what poslens measured, and whether the measurement supports it.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Claim:
    """One row of a claims table. holds: True (supported), False (not supported), None (context only)."""

    claim: str
    source: str
    measured: str
    holds: bool | None = None


@dataclass
class Section:
    title: str
    text: str = ""
    figures: list[tuple[Path, str]] = field(default_factory=list)  # (png path, caption)
    claims: list[Claim] = field(default_factory=list)


def _verdict(h: bool | None) -> str:
    return {True: "holds", False: "does not hold", None: "—"}[h]


def render_markdown(title: str, intro: str, sections: list[Section], root: Path) -> str:
    """Markdown with relative image links (PNG beside a PDF of the same name)."""
    out = [f"# {title}", "", intro, ""]
    summary = [c for s in sections for c in s.claims if c.holds is not None]
    out += [f"**{sum(c.holds for c in summary)} of {len(summary)} checked claims hold.**", ""]
    for s in sections:
        out += [f"## {s.title}", "", s.text, ""]
        if s.claims:
            out += ["| claim | source | measured | verdict |", "| --- | --- | --- | --- |"]
            for c in s.claims:
                cells = [c.claim, c.source, c.measured, _verdict(c.holds)]
                out.append("| " + " | ".join(x.replace("|", "\\|").replace("\n", " ") for x in cells) + " |")
            out.append("")
        for path, caption in s.figures:
            rel = Path(path).relative_to(root)
            out += [f"![{caption}]({rel.as_posix()})", "", f"*{caption}* ([PDF]({rel.with_suffix('.pdf').as_posix()}))",
                    ""]
    return "\n".join(out) + "\n"


def render_html(title: str, intro: str, sections: list[Section]) -> str:
    """One HTML file with every image embedded as base64 PNG."""
    e = html.escape
    css = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.45}"
           "table{border-collapse:collapse;margin:1em 0;font-size:.9em}td,th{border:1px solid #ccc;padding:4px 8px;"
           "vertical-align:top}th{background:#f3f3f3}.holds{color:#116611;font-weight:600}"
           ".fails{color:#aa1111;font-weight:600}figure{margin:1.5em 0}img{max-width:100%}"
           "figcaption{font-size:.9em;color:#333}")
    summary = [c for s in sections for c in s.claims if c.holds is not None]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{css}</style>"
             f"</head><body><h1>{e(title)}</h1><p>{e(intro)}</p>",
             f"<p><b>{sum(c.holds for c in summary)} of {len(summary)} checked claims hold.</b></p>"]
    for s in sections:
        parts.append(f"<h2>{e(s.title)}</h2><p>{e(s.text)}</p>")
        if s.claims:
            parts.append("<table><tr><th>claim</th><th>source</th><th>measured</th><th>verdict</th></tr>")
            for c in s.claims:
                cls = {True: "holds", False: "fails", None: ""}[c.holds]
                parts.append(f"<tr><td>{e(c.claim)}</td><td>{e(c.source)}</td><td>{e(c.measured)}</td>"
                             f"<td class='{cls}'>{_verdict(c.holds)}</td></tr>")
            parts.append("</table>")
        for path, caption in s.figures:
            data = base64.b64encode(Path(path).read_bytes()).decode()
            parts.append(f"<figure><img src='data:image/png;base64,{data}' alt='{e(caption)}'>"
                         f"<figcaption>{e(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(directory: Path, title: str, intro: str, sections: list[Section]) -> tuple[Path, Path]:
    """Write report.md and report.html into `directory`."""
    md = directory / "report.md"
    md.write_text(render_markdown(title, intro, sections, directory))
    page = directory / "report.html"
    page.write_text(render_html(title, intro, sections))
    return md, page
