"""report.md and report.html from sections: one self-contained page that works offline.

The page opens with the provenance header, a banner stating the scale of each real-model measurement against the
paper's, one headline per ledger (each paper counted apart) and a summary block: one line per claim, grouped by
section, with its verdict, key number and a link to its row. Then each section: its text, its claims (the tests
behind each verdict, the paper's printed number beside ours, the command that re-measures it), context and
figures. Heatmaps with data are drawn by a small inline script (no network): zoom with the mouse wheel, drag to
pan, double-click to reset, hover for the value and its standard error; cells large enough (a small map, or
zoomed in) print their value. Static images stay for the Markdown and the PDFs.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from pathlib import Path

import numpy as np

from poslens.io.writing import write_text
from poslens.report.claims import PAPERS, Claim, LedgerCount, ledgers
from poslens.report.robustness import robustness_line
from poslens.report.section import Figure, Panel, Section

_MIME = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}
e = html.escape


def prose(text: str) -> str:
    """Escaped text with its `code spans` (the Markdown report's backticks) as <code>, and its Markdown links to a
    page inside the report ([text](models/x/page.html), a relative .html or .md path) as links."""
    parts = re.split(r"(`[^`]+`)", e(text))
    return "".join(f"<code>{p[1:-1]}</code>" if k % 2 else
                   re.sub(r"\[([^\]]+)\]\(([\w./-]+\.(?:html|md))\)", r"<a href='\2'>\1</a>", p)
                   for k, p in enumerate(parts))


def all_claims(sections: list[Section]) -> list[Claim]:
    return [c for s in sections for c in s.claims]


def on_models(sections: list[Section]) -> set[str]:
    """The ids of the rows measured on trained models (those of a section that runs models)."""
    return {c.id for s in sections if s.models for c in s.claims}


def section_ledgers(sections: list[Section]) -> dict[str, LedgerCount]:
    """The ledgers of the sections' rows, each counting the rows on exact or simulated quantities and the rows on
    trained models apart."""
    return ledgers(all_claims(sections), on_models(sections))


def headlines(sections: list[Section]) -> list[str]:
    """One line per ledger: 'Kim et al. (2025): 41 claims; on exact or simulated quantities 20: 19 hold, ...'."""
    return [led.headline() for led in section_ledgers(sections).values()]


def titles(ledger: str) -> str:
    """The titles of the papers a ledger counts, quoted ('' for poslens's own checks), shown beside its headline."""
    return "; ".join(f"\u201c{p.title}\u201d" for p in PAPERS.values() if p.ledger == ledger and ledger != "poslens")


def _where(c: Claim) -> str:
    p = PAPERS[c.paper]
    return f"{p.authors} ({p.year}), {c.where}" if c.paper != "poslens" else f"poslens, {c.where}"


def verdict_rule() -> list[str]:
    """The numbered items of the verdict rule as `poslens.report.claims`' docstring writes them (the one written
    rule; the report quotes it, so the two cannot differ), each on one line, Markdown emphasis removed."""
    from poslens.report import claims

    items: list[str] = []
    for line in (claims.__doc__ or "").split("The rule", 1)[1].splitlines()[1:]:
        text = line.strip()
        if re.match(r"\d+\. ", text):
            items.append(text.split(". ", 1)[1])
        elif text and items:
            items[-1] += " " + text
        elif items:  # the blank line after the list ends it
            break
    return [x.replace("**", "") for x in items]


def paper_rows(sections: list[Section]) -> list[tuple[Section, Claim]]:
    """The rows whose paper prints a number (`Claim.paper_number`), in report order: the first screen's table."""
    return [(s, c) for s in sections for c in s.claims if c.paper_number]


def our_scale(s: Section) -> str:
    """The scale of a row's measurement, in a few words: the trained or real models of its section (the scale
    banner says which), else exact or simulated quantities."""
    if s.scale:
        return f"the models of “{s.title}” (scale above)"
    return "exact or simulated quantities (the parameter-free stack)"


# ---------------------------------------------------------------- Markdown


def _cell(x: str) -> str:
    return x.replace("|", "\\|").replace("\n", " ")


def render_markdown(title: str, intro: str, sections: list[Section], root: Path,
                    provenance: dict[str, str] | None = None) -> str:
    """Markdown with relative image links (each image beside a PDF of the same name)."""
    out = [f"# {title}", ""]
    for k, v in (provenance or {}).items():
        if v:
            out.append(f"- **{k}**: `{v}`" if k == "command" else f"- **{k}**: {v.replace(chr(10), '; ')}")
    out += ["", intro, ""]
    if (provenance or {}).get("size", "").startswith("quick"):
        out += [f"**Quick run.** {provenance['size']}", ""]
    scales = [s.scale for s in sections if s.scale]
    if scales:
        out += ["**Scale.** " + " ".join(scales), ""]
    out += [f"- **{led.headline()}** {titles(name)}".rstrip()
            for name, led in section_ledgers(sections).items()] + [""]
    out += ["**The verdict rule** (every row's verdict follows from its tests by it):", ""]
    out += [f"{k}. {item}" for k, item in enumerate(verdict_rule(), 1)] + [""]
    rows = paper_rows(sections)
    if rows:
        out += ["**The papers' numbers beside ours**", "", "| claim | figure | the paper | here | scale | verdict |",
                "|" + " --- |" * 6]
        out += ["| " + " | ".join(_cell(x) for x in (f"[{c.claim}](#{c.id}) ({_where(c)})", c.figure,
                                                        c.paper_number, c.key_line(), our_scale(s), c.verdict)) + " |"
                for s, c in rows] + ["", "The papers print a number for these rows; the other rows compare with a "
                                     "figure or a statement of the paper.", ""]
    for s in sections:
        if not s.claims:
            continue
        out.append(f"**{s.title}**")
        out += [f"- {c.verdict}: [{c.claim}](#{c.id}) ({c.key_line()})" for c in s.claims]
        out.append("")
    for s in sections:
        out += [f"## {s.title}", "", s.text, ""]
        if s.scale:
            out += [f"*Scale: {s.scale}*", ""]
        if s.claims:
            out += ["| claim | test | verdict | paper | figure | re-measure |", "|" + " --- |" * 6]
            for c in s.claims:
                tests = "; ".join(f"{role}: {t.text()}" if role != "claim" else t.text() for role, t in c.all_tests())
                claim = f"<a id='{c.id}'></a>{c.claim} ({_where(c)})" + (f". {c.measured}" if c.measured else "")
                verdict = c.verdict + "".join(f": {x}" for x in (c.resolve_line(), c.scale_line()) if x) + (
                    f". Robust to the machine: {robustness_line(c)}" if robustness_line(c) else "")
                cells = [claim, tests, verdict, c.paper_number, c.figure, f"`{c.command}`" if c.command else ""]
                out.append("| " + " | ".join(_cell(x) for x in cells) + " |")
            out.append("")
        if s.context:
            out += ["Also measured (no verdict):", ""] + [f"- {a}: {b}" for a, b in s.context] + [""]
        for f in s.figures:
            rel = Path(f.path).relative_to(root)
            warn = f"**{f.warning}** " if f.warning else ""
            pdf = f" ([PDF]({rel.with_suffix('.pdf').as_posix()}))" if _has_pdf(f.path) else ""
            out += [f"![{f.caption}]({rel.as_posix()})", "", f"*{warn}{f.caption}*{pdf}", ""]
    return "\n".join(out) + "\n"


def _has_pdf(image: str | Path) -> bool:
    """Whether the vector PDF of a figure was written beside its image (`reproduce --no-pdf` writes none)."""
    return Path(image).with_suffix(".pdf").is_file()


# ---------------------------------------------------------------- HTML

CSS = """
body{font-family:system-ui,sans-serif;max-width:1240px;margin:2em auto;padding:0 1em;line-height:1.45;color:#111}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}td,th{border:1px solid #ccc;padding:3px 8px;
vertical-align:top;text-align:left}th{background:#f3f3f3}code{font-size:.86em;overflow-wrap:anywhere}
.v{display:inline-block;min-width:7.2em;font-weight:600}.v-holds{color:#116611}.v-contradicted{color:#aa1111}
.v-erratum{color:#8a5a00}.v-not-resolved{color:#555}.v-ambiguous{color:#7a2a9a}.v-finding{color:#0b5c8a}
.v-holds-at-this-scale{color:#4f7f1f}.v-fails-at-this-scale{color:#c0561a}
.banner{background:#fff7e0;border:1px solid #e8c36a;padding:.6em 1em;margin:1em 0}
.summary{background:#f7f7f7;border:1px solid #ddd;padding:.5em 1em;margin:1em 0;font-size:.92em}
.summary h3{font-size:1em;margin:.7em 0 .2em}.summary div{margin:.1em 0}.summary .key{color:#333}
.rule{font-size:.82em;margin:.6em 0;color:#222}.rule ol{margin:.2em 0 .2em 1.4em;padding:0}
.rule summary{cursor:pointer}.papers{font-size:.84em}.papers caption{text-align:left;font-weight:600;
padding:.2em 0}
.ledgers li{font-weight:600}.ledgers .title{font-weight:400;color:#444}
.claim{border-left:4px solid #ccc;padding:.3em .8em;margin:.9em 0}
.claim.c-holds{border-color:#4a4}.claim.c-contradicted{border-color:#c33}.claim.c-erratum{border-color:#c90}
.claim.c-ambiguous{border-color:#a5c}.claim.c-finding{border-color:#38c}
.claim.c-holds-at-this-scale{border-color:#9c6}.claim.c-fails-at-this-scale{border-color:#e8904a}
.claim p{margin:.25em 0}
.claim ul{margin:.2em 0 .2em 1.2em;padding:0}.where{color:#555;font-size:.9em}.note{color:#333;font-size:.93em}
figure{margin:1.5em 0}img{max-width:100%}.wide{overflow-x:auto}.wide img{max-width:none;width:auto}
figcaption{font-size:.92em;color:#222}.warn{color:#a40;font-weight:600}
.hm-grid{display:grid;gap:10px 14px}.hm{position:relative}.hm canvas.m{width:100%;aspect-ratio:1;
image-rendering:pixelated;cursor:crosshair;border:1px solid #bbb;display:block;box-sizing:border-box}
.hm .ax{display:grid;grid-template-columns:24px minmax(0,1fr)}.hm canvas.ya{width:24px;height:100%}
.hm canvas.xa{width:100%;height:15px}
.hm .t{font-size:.8em;margin-bottom:2px}.hm .cb{display:flex;align-items:center;gap:4px;font-size:.72em}
.hm .cb span.bar{flex:1;height:8px}.tip{position:fixed;pointer-events:none;background:#222;color:#fff;
padding:2px 6px;font-size:12px;border-radius:3px;display:none;z-index:9}
"""

F16_SAFE = 60_000.0  # below float16's largest finite value (65,504), so rounding cannot overflow
F16_NORMAL = 2.0**-14  # float16's smallest normal value: below it an entry holds fewer significant digits
# The significant digits a (normal) float16 entry always holds: its rounding error, at most 2^-11 of its magnitude,
# stays under half a unit in the last printed digit while 10^digits <= 2^10; 3 (the page's hover and cell labels).
F16_DIGITS = math.floor(10 * math.log10(2))

# Heatmaps: data are float16 (IEEE half, little endian) of the entries j <= i, row by row, base64, divided by a
# power of two (vs, ss) where the largest |entry| would overflow float16 or the smallest would fall below its normal
# range; NaN is blank. Values print with the significant digits float16 holds (F16_DIGITS; fewer for an entry
# stored below the normal range, where its absolute precision is scale * 2^-24), so that no printed digit is noise.
SCRIPT = """
(function(){
var LABEL=30,DIGITS=__DIGITS__;
var tip=document.createElement('div');tip.className='tip';document.body.appendChild(tip);
var luts={};document.querySelectorAll('script.poslens-cmap').forEach(function(el){var hex=el.textContent,lut=[];
 for(var k=0;k<256;k++)lut.push([parseInt(hex.substr(6*k,2),16),parseInt(hex.substr(6*k+2,2),16),
 parseInt(hex.substr(6*k+4,2),16)]);luts[el.dataset.name]=lut;});
function half(h){var s=(h&0x8000)?-1:1,x=(h>>10)&31,f=h&1023;
 if(x===0)return s*Math.pow(2,-14)*f/1024; if(x===31)return f?NaN:s*Infinity;
 return s*Math.pow(2,x-15)*(1+f/1024);}
function unpack(b64,n,s){if(!b64)return null;var bin=atob(b64),out=new Float32Array(n*n).fill(NaN),p=0;
 for(var i=0;i<n;i++)for(var j=0;j<=i;j++){out[i*n+j]=s*half(bin.charCodeAt(p)|(bin.charCodeAt(p+1)<<8));p+=2;}
 return out;}
function held(a,s){if(!(a>0)||a/s>=Math.pow(2,-14))return DIGITS;
 return Math.min(DIGITS,Math.floor(Math.log10(a))-Math.ceil(Math.log10(s*Math.pow(2,-24)))+1);}
function fmt(v,s,short){if(!isFinite(v))return 'blank';var a=Math.abs(v),k=held(a,s);if(a===0)return '0';
 if(k<1)return '~'+v.toExponential(0);var t=(a<1e-3||a>=1e4)?v.toExponential(k-1):v.toPrecision(k);
 return short?Number(t).toString():t;}
document.querySelectorAll('.hm').forEach(function(el){
 var d=JSON.parse(el.querySelector('script').textContent),n=d.n,vs=d.vs||1,ss=d.ss||1,val=unpack(d.v,n,vs),
 se=unpack(d.se,n,ss),lut=luts[d.cm];
 var img=document.createElement('canvas');img.width=n;img.height=n;var ic=img.getContext('2d'),
 id=ic.createImageData(n,n);
 for(var q=0;q<n*n;q++){var v=val[q],o=4*q;if(!isFinite(v)){id.data[o+3]=0;continue;}
  var t=Math.max(0,Math.min(255,Math.round(255*(v-d.lo)/((d.hi-d.lo)||1)))),c=lut[t];
  id.data[o]=c[0];id.data[o+1]=c[1];id.data[o+2]=c[2];id.data[o+3]=255;}
 ic.putImageData(id,0,0);
 var cv=el.querySelector('canvas.m'),cx=cv.getContext('2d'),view={x:0,y:0,s:n},drag=null,
 xa=el.querySelector('canvas.xa'),ya=el.querySelector('canvas.ya');
 function axis(ax,along){var dpr=window.devicePixelRatio||1,w=ax.clientWidth*dpr|0,h=ax.clientHeight*dpr|0;
  ax.width=w;ax.height=h;var g=ax.getContext('2d'),len=along?w:h,raw=view.s/5,
  p=Math.pow(10,Math.floor(Math.log10(raw))),
  step=Math.max(1,[1,2,5,10].map(function(k){return k*p;}).filter(function(k){return k>=raw;})[0]);
  g.fillStyle='#333';g.strokeStyle='#333';g.font=(10*dpr)+'px sans-serif';
  g.textAlign=along?'center':'right';g.textBaseline=along?'top':'middle';
  for(var k=Math.ceil((view.x0+1)/step)*step;k<=view.x0+view.s;k+=step){if(k<1)continue;
   var at=(k-0.5-view.x0)/view.s*len;g.beginPath();
   if(along){g.moveTo(at,0);g.lineTo(at,3*dpr);g.stroke();g.fillText(k,at,4*dpr);}
   else{g.moveTo(w,at);g.lineTo(w-3*dpr,at);g.stroke();g.fillText(k,w-4*dpr,at);}}}
 function axes(){view.x0=view.x;axis(xa,true);view.x0=view.y;axis(ya,false);}
 function draw(){axes();var px=cv.clientWidth*(window.devicePixelRatio||1)|0;cv.width=px;cv.height=px;
  cx.imageSmoothingEnabled=false;cx.fillStyle='#fff';cx.fillRect(0,0,px,px);
  cx.drawImage(img,view.x,view.y,view.s,view.s,0,0,px,px);
  var c=px/view.s,dpr=window.devicePixelRatio||1;if(c<LABEL*dpr)return;var cells=[],w=0,fs=Math.min(c/3,15*dpr);
  cx.font=fs+'px sans-serif';cx.textAlign='center';cx.textBaseline='middle';
  for(var i=Math.floor(view.y);i<Math.min(n,Math.ceil(view.y+view.s));i++)
   for(var j=Math.floor(view.x);j<=Math.min(i,Math.ceil(view.x+view.s)-1);j++){var v=val[i*n+j];
    if(!isFinite(v))continue;var s=fmt(v,vs,true);w=Math.max(w,cx.measureText(s).width);
    cells.push([i,j,v,s]);}
  if(w>0.9*c)cx.font=(fs*0.9*c/w)+'px sans-serif';
  cells.forEach(function(q){var t=Math.max(0,Math.min(255,Math.round(255*(q[2]-d.lo)/((d.hi-d.lo)||1)))),
   rgb=lut[t];cx.fillStyle=(0.299*rgb[0]+0.587*rgb[1]+0.114*rgb[2])<128?'#fff':'#000';
   cx.fillText(q[3],(q[1]-view.x+0.5)*c,(q[0]-view.y+0.5)*c);});}
 function cell(ev){var r=cv.getBoundingClientRect();return [view.y+(ev.clientY-r.top)/r.height*view.s,
  view.x+(ev.clientX-r.left)/r.width*view.s];}
 cv.addEventListener('mousemove',function(ev){
  if(drag){var r=cv.getBoundingClientRect(),k=view.s/r.width;view.x=Math.max(0,Math.min(n-view.s,
   drag[2]-(ev.clientX-drag[0])*k));view.y=Math.max(0,Math.min(n-view.s,drag[3]-(ev.clientY-drag[1])*k));draw();}
  var c=cell(ev),i=Math.floor(c[0]),j=Math.floor(c[1]);if(i<0||j<0||i>=n||j>=n){tip.style.display='none';return;}
  var v=val[i*n+j];tip.textContent='query i='+(i+1)+', key j='+(j+1)+': '+fmt(v,vs)+
   (se&&isFinite(v)?' \\u00b1 '+fmt(se[i*n+j],ss)+' (SE)':'');
  tip.style.left=(ev.clientX+12)+'px';tip.style.top=(ev.clientY+12)+'px';tip.style.display='block';});
 cv.addEventListener('mouseleave',function(){tip.style.display='none';drag=null;});
 cv.addEventListener('mousedown',function(ev){drag=[ev.clientX,ev.clientY,view.x,view.y];ev.preventDefault();});
 window.addEventListener('mouseup',function(){drag=null;});
 cv.addEventListener('wheel',function(ev){ev.preventDefault();var c=cell(ev),f=ev.deltaY<0?0.8:1.25,
  s=Math.max(4,Math.min(n,view.s*f));view.x=Math.max(0,Math.min(n-s,c[1]-(c[1]-view.x)*s/view.s));
  view.y=Math.max(0,Math.min(n-s,c[0]-(c[0]-view.y)*s/view.s));view.s=s;draw();},{passive:false});
 cv.addEventListener('dblclick',function(){view={x:0,y:0,s:n};draw();});
 window.addEventListener('resize',draw);draw();});
})();
""".replace("__DIGITS__", str(F16_DIGITS))


def colormap_hex(name: str) -> str:
    import matplotlib

    c = matplotlib.colormaps[name](np.linspace(0, 1, 256))[:, :3]
    return bytes((c * 255).round().astype(np.uint8).ravel()).hex()




def _f16_scale(finite: np.ndarray) -> float:
    """The power of two to divide |entries| `finite` by: the largest brought within float16's range (below
    F16_SAFE), or the smallest above 0 lifted towards its normal range (F16_NORMAL) as far as the largest allows;
    1 when they fit as they are."""
    nonzero = finite[finite > 0]
    if not nonzero.size:
        return 1.0
    big, small = float(nonzero.max()), float(nonzero.min())
    if big > F16_SAFE:
        return 2.0 ** math.ceil(math.log2(big / F16_SAFE))
    if small < F16_NORMAL:
        return 2.0 ** -min(math.ceil(math.log2(F16_NORMAL / small)), math.floor(math.log2(F16_SAFE / big)))
    return 1.0


def _pack(m: np.ndarray | None) -> tuple[str, float]:
    """The entries j <= i of an [n, n] map as little-endian float16, row by row, base64, and the power of two they
    were divided by (`_f16_scale`: to fit float16's range, largest finite 65,504, and keep small entries in its
    normal range; 1 when they fit)."""
    if m is None:
        return "", 1.0
    n = m.shape[-1]
    tri = np.concatenate([m[i, : i + 1] for i in range(n)]).astype(np.float64)
    scale = _f16_scale(np.abs(tri[np.isfinite(tri)]))
    return base64.b64encode((tri / scale).astype("<f2").tobytes()).decode(), scale


def _panel_html(p: Panel) -> str:
    lo, hi = p.limits
    (v, vs), (se, ss) = _pack(p.values), _pack(p.se)
    spec = {"n": int(p.values.shape[-1]), "lo": float(lo), "hi": float(hi), "v": v, "vs": vs, "se": se, "ss": ss,
            "cm": p.cmap}
    return (f"<div class='hm'><div class='t'>{e(p.title)}</div><div class='ax'><canvas class='ya'></canvas>"
            "<canvas class='m'></canvas><span></span><canvas class='xa'></canvas></div>"
            f"<div class='cb'><span>{lo:.3g}</span><span class='bar' style='background:linear-gradient(to right,"
            f"{_gradient(p.cmap)})'></span><span>{hi:.3g}</span></div>"
            f"<script type='application/json'>{json.dumps(spec)}</script></div>")


def _figure_html(f: Figure, root: Path) -> str:
    path = Path(f.path)
    warn = f"<span class='warn'>{e(f.warning)}</span> " if f.warning else ""
    rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
    if f.panels:
        cols = min(f.ncols, len(f.panels))
        body = (f"<div class='hm-grid' style='grid-template-columns:repeat({cols},minmax(0,1fr))'>"
                + "".join(_panel_html(p) for p in f.panels) + "</div>")
        with_se = sum(p.se is not None for p in f.panels)
        hover = ("the value and its standard error" if with_se == len(f.panels) else
                 "the value (exact: no standard error)" if not with_se else
                 "the value and, in the panels that have one, its standard error (the others are exact)")
        how = (" Rows: query i (left axis), columns: key j (bottom axis), both from 1. Interactive: wheel to zoom "
               "(cells large enough "
               f"print their value), drag to pan, double-click to reset, hover for {hover}. "
               f"Static image: {rel}{' (and .pdf)' if _has_pdf(path) else ''}.")
    else:
        data = base64.b64encode(path.read_bytes()).decode()
        box = " class='wide'" if f.wide else ""
        body = (f"<div{box}><img src='data:{_MIME[path.suffix.lower()]};base64,{data}' alt='{e(f.caption)}' "
                f"id='{e(path.stem)}'></div>")
        how = ""
    return (f"<figure id='fig-{e(path.stem)}'>{body}<figcaption>{warn}{prose(f.caption)}{e(how)}</figcaption>"
            "</figure>")


def figure_of(ref: str, figures: list[Figure]) -> Figure | None:
    """The figure a claim's `figure` reference points to: 'Figure N...' is a figure whose caption opens with
    'Figure N' (the paper's numbering), the one whose title or file name has the words after it ('Figure 2, row
    profiles': the profiles) when several do; any other reference quotes a figure's title (up to its first comma)."""
    paper = re.match(r"Figure (\d+)\b[,:]?\s*(.*)", ref)
    if paper:
        number = rf"Figure {paper.group(1)}\b"
        of = [f for f in figures if re.match(number, f.caption) or re.search(number, f.title)]
        words = [w for w in re.findall(r"[a-z]+", paper.group(2).lower()) if len(w) > 3]
        for f in of:
            name = f"{f.title} {f.stem}".lower()
            if words and all(w.rstrip("s") in name for w in words):
                return f
        return of[0] if of else None
    for f in figures:
        if ref and ref.split(", ")[0].lower() in f.title.lower():
            return f
    return None


def _figure_link(c: Claim, figures: list[Figure]) -> str:
    """A row's figure reference, linked to the figure when the section has it."""
    f = figure_of(c.figure, list(figures)) if c.figure else None
    return f"<a href='#fig-{e(f.stem)}'>{e(c.figure)}</a>" if f else e(c.figure)


def _claim_html(c: Claim, figures: list[Figure] = (), scope_said: bool = False) -> str:
    """One row. scope_said: a row above in the section has the same scope, so its rule-4 sentence is not repeated."""
    v = c.verdict
    tests = "".join(f"<li>{'' if role == 'claim' else '<i>' + e(role) + ':</i> '}{e(t.text())}</li>"
                    for role, t in c.all_tests())
    parts = [f"<div class='claim c-{v.replace(' ', '-')}' id='{e(c.id)}'>",
             f"<p><span class='v v-{v.replace(' ', '-')}'>{e(v)}</span> <b>{e(c.claim)}</b> "
             f"<span class='where'>({e(_where(c))})</span></p>"]
    if c.readings:
        parts.append("<p class='note'>The wording admits several readings: " + "; ".join(
            f"({k}) {e(r.text)}: <b>{e(rv)}</b>" for k, (r, rv) in enumerate(zip(c.readings, c.reading_verdicts()), 1))
            + ".</p>")
    listed = c.all_tests()
    if len(listed) > 6:  # many tests of one statistic (one per layer): a compact table
        how = {t.interval for _, t in listed}
        tests = "".join(f"<tr><td>{e(t.statistic)}</td><td>{e(t.key())}</td><td>{e(t.needs())}</td>"
                        f"<td>{e(t.outcome())}</td></tr>" for _, t in listed)
        parts.append("<table class='tests'><tr><th>statistic</th><th>value [interval]</th><th>the claim needs</th>"
                     f"<th>outcome</th></tr>{tests}</table>"
                     + (f"<p class='note'>Intervals: {e(how.pop())}.</p>" if len(how) == 1 else ""))
    else:
        parts.append(f"<ul>{tests}</ul>")
    if c.measured:
        parts.append(f"<p class='note'>{prose(c.measured)}</p>")
    if c.paper_number:
        parts.append(f"<p class='note'><b>The paper:</b> {e(c.paper_number)}</p>")
    if c.scope and scope_said:
        parts.append("<p class='note'><b>Scope:</b> as for the rows above.</p>")
    elif c.scope:
        parts.append(f"<p class='note'><b>Scope:</b> the claim is about {e(c.scope)}; a failure at this scale reads "
                     "fails at this scale, not contradicted, and a pass holds at this scale: it says only that the "
                     "pattern is seen at this scale too.</p>")
    if c.scale_line():
        parts.append(f"<p class='note'><b>At this scale:</b> {prose(c.scale_line())}.</p>")
    if c.resolve_line():
        parts.append(f"<p class='note'><b>What would resolve it:</b> {prose(c.resolve_line())}</p>")
    if robustness_line(c):
        parts.append(f"<p class='note'><b>Robust to the machine:</b> {prose(robustness_line(c))}</p>")
    tail = []
    if c.figure:
        tail.append(f"figure: {_figure_link(c, figures)}")
    if c.command:
        tail.append(f"re-measure: <code>{e(c.command)}</code>")
    if tail:
        parts.append(f"<p class='note'>{' &middot; '.join(tail)}</p>")
    parts.append("</div>")
    return "".join(parts)


def render_html(title: str, intro: str, sections: list[Section], root: Path,
                provenance: dict[str, str] | None = None) -> str:
    """One HTML file: images embedded once (base64), heatmap data inline, no network access."""
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{CSS}</style></head>"
           f"<body><h1>{e(title)}</h1>"]
    prov = [(k, v) for k, v in (provenance or {}).items() if v]
    short = [f"{k}: {v}" for k, v in prov if k in ("command", "source", "date", "total time")]
    if short:
        out.append(f"<p class='where'>{e(' · '.join(short))} (<a href='#provenance'>full provenance</a>)</p>")
    size = dict(prov).get("size", "")
    if size.startswith("quick"):  # the first screen says that this is a quick run, and what that means
        out.append(f"<p class='banner'><b>Quick run.</b> {e(size)}</p>")
    out.append("<ul class='ledgers'>" + "".join(
        f"<li>{e(led.headline())} <span class='title'>{e(titles(name))}</span></li>"
        for name, led in section_ledgers(sections).items()) + "</ul>")
    out.append("<details open class='rule'><summary><b>The verdict rule</b>: every row's verdict follows from its "
               "tests by it (no verdict is typed by hand)</summary><ol>"
               + "".join(f"<li>{prose(item)}</li>" for item in verdict_rule()) + "</ol></details>")
    rows = paper_rows(sections)
    if rows:
        out.append("<table class='papers'><caption>The papers' numbers beside ours</caption><tr><th>claim</th>"
                   "<th>figure</th><th>the paper</th><th>here (statistic, value [interval], what the claim needs)"
                   "</th><th>scale here</th><th>verdict</th></tr>" + "".join(
                       f"<tr><td><a href='#{e(c.id)}'>{e(c.claim)}</a> <span class='where'>({e(_where(c))})</span>"
                       f"</td><td>{_figure_link(c, s.figures)}</td><td>{e(c.paper_number)}</td>"
                       f"<td>{e(c.key_line())}</td><td>{e(our_scale(s))}</td><td><span class='v "
                       f"v-{c.verdict.replace(' ', '-')}'>{e(c.verdict)}</span></td></tr>" for s, c in rows)
                   + "</table><p class='where'>The papers print a number for these rows; the other rows compare "
                   "with a figure or a statement of the paper, linked from each row.</p>")
    scales = [s.scale for s in sections if s.scale]
    if scales:
        out.append("<div class='banner'><b>Scale of the real-model measurements.</b> " + " ".join(map(e, scales))
                   + "</div>")
    out.append("<div class='summary'>")
    for s in sections:
        if s.claims:
            out.append(f"<h3>{e(s.title)}</h3>" + "".join(
                f"<div><span class='v v-{c.verdict.replace(' ', '-')}'>{e(c.verdict)}</span> "
                f"<a href='#{e(c.id)}'>{e(c.claim)}</a> <span class='key'>({e(c.key_line())})</span></div>"
                for c in s.claims))
    out.append("</div>")
    out.append(f"<p>{prose(intro)}</p>")
    if prov:
        out.append("<table class='prov' id='provenance'>" + "".join(
            f"<tr><th>{e(k)}</th><td>{'<code>' + e(v) + '</code>' if k == 'command' else _lines(v)}</td></tr>"
            for k, v in prov) + "</table>")
    for s in sections:
        out.append(f"<h2 id='sec-{e(s.name)}'>{e(s.title)}</h2><p>{prose(s.text)}</p>")
        if s.scale:
            out.append(f"<p class='banner'>{e(s.scale)}</p>")
        out += [_claim_html(c, s.figures, scope_said=any(b.scope == c.scope for b in s.claims[:k]))
                for k, c in enumerate(s.claims)]
        if s.context:
            out.append("<p><b>Also measured</b> (shown beside the claims, no verdict):</p><ul>"
                       + "".join(f"<li>{prose(a)}: {prose(b)}</li>" for a, b in s.context) + "</ul>")
        out += [_figure_html(f, root) for f in s.figures]
    cmaps = sorted({p.cmap for s in sections for f in s.figures for p in f.panels})
    out += [f"<script type='text/plain' class='poslens-cmap' data-name='{e(c)}'>{colormap_hex(c)}</script>"
            for c in cmaps]
    out.append(f"<script>{SCRIPT}</script>")
    out.append("</body></html>")
    return "\n".join(out)


def _lines(text: str) -> str:
    return "<br>".join(e(x) for x in text.split("\n"))


def _gradient(name: str) -> str:
    hexes = colormap_hex(name)
    return ",".join(f"#{hexes[6 * k:6 * k + 6]}" for k in range(0, 256, 32)) + f",#{hexes[-6:]}"


def write_report(directory: Path, title: str, intro: str, sections: list[Section],
                 provenance: dict[str, str] | None = None) -> tuple[Path, Path]:
    """Write report.md and report.html into `directory`."""
    md = directory / "report.md"
    write_text(md, render_markdown(title, intro, sections, directory, provenance))  # complete, or one line
    page = directory / "report.html"
    write_text(page, render_html(title, intro, sections, directory, provenance))
    return md, page
