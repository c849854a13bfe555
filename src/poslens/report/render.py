"""report.md and report.html (self-contained: images embedded) from sections of claims and figures.

Each analysis contributes a `Section`: a short text, its figures, and a table of `Claim`s: what the paper
says, what poslens measured, the verdict, the figure that shows it and the command that re-measures it.

Verdicts (the headline counts each kind):

* holds: the measurement supports the claim within its stated noise;
* contradicted: the measurement resolves the question and disagrees with the claim;
* erratum: a formula or number printed in the paper is wrong, but the conclusion drawn from it stands;
* not resolved: the measurement cannot decide at its noise level; the row says what would decide it;
* context: a measured fact the report shows beside the claims (not a claim; not counted).
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path

VERDICTS = ("holds", "contradicted", "erratum", "not resolved")
CONTEXT = "context"
_MIME = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}


@dataclass
class Claim:
    """One row of a claims table."""

    claim: str
    source: str
    measured: str
    verdict: str = CONTEXT  # one of VERDICTS, or CONTEXT
    figure: str = ""  # the report figure that shows it ("Figure 2", "convergence", ...)
    command: str = ""  # the command or API call that re-measures it

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS + (CONTEXT,):
            raise ValueError(f"verdict must be one of {VERDICTS + (CONTEXT,)}, got {self.verdict!r}")


@dataclass
class Section:
    title: str
    text: str = ""
    figures: list[tuple[Path, str]] = field(default_factory=list)  # (image path, caption)
    claims: list[Claim] = field(default_factory=list)


def verdict_counts(sections: list[Section]) -> dict[str, int]:
    """How many claims have each verdict (context rows excluded)."""
    out = dict.fromkeys(VERDICTS, 0)
    for s in sections:
        for c in s.claims:
            if c.verdict in out:
                out[c.verdict] += 1
    return out


def headline(sections: list[Section]) -> str:
    """'29 claims checked: 25 hold, 0 contradicted, 2 errata (conclusion stands), 2 not resolved.'"""
    n = verdict_counts(sections)
    total = sum(n.values())
    return (f"{total} claims checked: {n['holds']} hold, {n['contradicted']} contradicted, {n['erratum']} "
            f"{'erratum' if n['erratum'] == 1 else 'errata'} (a printed formula is wrong, the conclusion stands), "
            f"{n['not resolved']} not resolved at this run's noise level.")


def _provenance_lines(provenance: dict[str, str]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in provenance.items() if v]


def render_markdown(title: str, intro: str, sections: list[Section], root: Path,
                    provenance: dict[str, str] | None = None) -> str:
    """Markdown with relative image links (each image beside a PDF of the same name)."""
    out = [f"# {title}", ""]
    for k, v in _provenance_lines(provenance or {}):
        out.append(f"- **{k}**: `{v}`" if k == "command" else f"- **{k}**: {v}")
    out += ["", intro, "", f"**{headline(sections)}**", ""]
    for s in sections:
        out += [f"## {s.title}", "", s.text, ""]
        if s.claims:
            out += ["| claim | source | measured | verdict | figure | re-measure |", "|" + " --- |" * 6]
            for c in s.claims:
                cells = [c.claim, c.source, c.measured, c.verdict, c.figure, f"`{c.command}`" if c.command else ""]
                out.append("| " + " | ".join(x.replace("|", "\\|").replace("\n", " ") for x in cells) + " |")
            out.append("")
        for path, caption in s.figures:
            rel = Path(path).relative_to(root)
            out += [f"![{caption}]({rel.as_posix()})", "", f"*{caption}* ([PDF]({rel.with_suffix('.pdf').as_posix()}))",
                    ""]
    return "\n".join(out) + "\n"


CSS = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;line-height:1.45}"
       "table{border-collapse:collapse;margin:1em 0;font-size:.88em}td,th{border:1px solid #ccc;padding:4px 8px;"
       "vertical-align:top}th{background:#f3f3f3}.v-holds{color:#116611;font-weight:600}"
       ".v-contradicted{color:#aa1111;font-weight:600}.v-erratum{color:#8a5a00;font-weight:600}"
       ".v-not-resolved{color:#555;font-weight:600}.v-context{color:#777}code{font-size:.9em}"
       "figure{margin:1.5em 0}img{max-width:100%}.wide{overflow-x:auto}.wide img{max-width:none;width:auto}"
       "figcaption{font-size:.9em;color:#333}.prov td{font-size:.95em}.headline{font-size:1.1em}")


def render_html(title: str, intro: str, sections: list[Section], provenance: dict[str, str] | None = None,
                wide: set[str] | None = None) -> str:
    """One HTML file with every image embedded once (base64). Images whose stem is in `wide` are shown at their
    own size in a horizontally scrolling box (large grids stay legible)."""
    e = html.escape
    wide = wide or set()
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{CSS}</style>"
             f"</head><body><h1>{e(title)}</h1>"]
    prov = _provenance_lines(provenance or {})
    if prov:
        parts.append("<table class='prov'>" + "".join(
            f"<tr><th>{e(k)}</th><td>{'<code>' + e(v) + '</code>' if k == 'command' else e(v)}</td></tr>"
            for k, v in prov) + "</table>")
    parts.append(f"<p>{e(intro)}</p><p class='headline'><b>{e(headline(sections))}</b></p>")
    for s in sections:
        parts.append(f"<h2>{e(s.title)}</h2><p>{e(s.text)}</p>")
        if s.claims:
            parts.append("<table><tr><th>claim</th><th>source</th><th>measured</th><th>verdict</th><th>figure</th>"
                         "<th>re-measure</th></tr>")
            for c in s.claims:
                cls = "v-" + c.verdict.replace(" ", "-")
                cmd = f"<code>{e(c.command)}</code>" if c.command else ""
                parts.append(f"<tr><td>{e(c.claim)}</td><td>{e(c.source)}</td><td>{e(c.measured)}</td>"
                             f"<td class='{cls}'>{e(c.verdict)}</td><td>{e(c.figure)}</td><td>{cmd}</td></tr>")
            parts.append("</table>")
        for path, caption in s.figures:
            path = Path(path)
            data = base64.b64encode(path.read_bytes()).decode()
            box = " class='wide'" if path.stem in wide else ""
            parts.append(f"<figure><div{box}><img src='data:{_MIME[path.suffix.lower()]};base64,{data}' "
                         f"alt='{e(caption)}' id='{e(path.stem)}'></div><figcaption>{e(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(directory: Path, title: str, intro: str, sections: list[Section],
                 provenance: dict[str, str] | None = None, wide: set[str] | None = None) -> tuple[Path, Path]:
    """Write report.md and report.html into `directory`."""
    md = directory / "report.md"
    md.write_text(render_markdown(title, intro, sections, directory, provenance))
    page = directory / "report.html"
    page.write_text(render_html(title, intro, sections, provenance, wide))
    return md, page
