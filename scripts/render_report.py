#!/usr/bin/env python3
"""Render a poslens report.html in headless Chromium and save screenshots, to look at it as a reader would.

    python scripts/render_report.py poslens-out/report.html [--out shots] [--width 1280] [--pages 12]

Writes shots/full.png (the whole page at --width pixels, one tall image) and shots/page-01.png ... (one
screen-height slice each, easy to view), using Debian's `chromium` package (`apt-get install -y chromium`) or
any Chromium/Chrome found on PATH (--browser to choose). Needs no Python package beyond Pillow, which
matplotlib already requires.

The page is captured in tiles of --tile pixels (the page shifted up to each tile's top, one screenshot each)
and stitched. One screenshot of a whole full-size report (50,427 px at 1280 px wide) once came back blank below
about 40,900 px. Chromium 156 (Debian 12) does not show it: one screenshot of a 60,853 px quick report, and of a
60,000 px test page, comes back whole, and the stitched tiles equal it (12 isolated rows of 60,853 differ by more
than 16 levels). The cause is not known, so every screenshot is kept to a tile.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_browser(name: str | None) -> str:
    for candidate in ([name] if name else BROWSERS):
        path = shutil.which(candidate)
        if path:
            return path
    sys.exit("render_report.py: no Chromium found; install it (Debian: apt-get install -y chromium) or pass "
             "--browser PATH")


def with_script(page: Path, script: str) -> Path:
    """A copy of `page` beside it that runs `script` after the page's own scripts (the caller removes it)."""
    probe = page.with_name(page.stem + ".probe.html")
    if probe.exists():  # never replace a file that is not ours
        print(f"render_report.py: {probe} exists; move it away (this script writes and removes a file of that name)",
              file=sys.stderr)
        raise SystemExit(2)
    probe.write_text(page.read_text().replace("</body>", f"<script>{script}</script></body>", 1))
    return probe


def page_height(browser: str, page: Path, width: int) -> int:
    """The document's scroll height at `width`, read from Chromium's DOM dump (a script writes it into the title)."""
    probe = with_script(page, "document.title='H='+document.documentElement.scrollHeight")
    try:
        dom = run(browser, ["--dump-dom", probe.as_uri()], width, 1000)
    finally:
        probe.unlink(missing_ok=True)
    marker = dom.find("<title>H=")
    if marker < 0:
        sys.exit("render_report.py: could not read the page's height from Chromium's DOM dump")
    return int(dom[marker + 9:dom.index("<", marker + 9)])


def tiles(height: int, tile: int) -> list[tuple[int, int]]:
    """(top, rows) of each tile that covers a page `height` px tall, tiles `tile` px tall: the last one starts at
    height - tile, its first rows already in the tile before it."""
    tops = list(range(0, max(height - tile, 0) + 1, tile))
    if tops[-1] + tile < height:
        tops.append(height - tile)
    return [(t, min(tile, height - t)) for t in tops]


def capture(browser: str, page: Path, width: int, height: int, tile: int, out: Path):
    """The whole page as one image, stitched from one screenshot per tile (`tiles`)."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = None
    full = Image.new("RGB", (width, height), "white")
    tile = min(tile, height)
    for k, (top, _) in enumerate(tiles(height, tile)):
        probe = with_script(page, f"document.body.style.position='relative';document.body.style.top='-{top}px';")
        shot = out / f".tile-{k:03d}.png"
        try:
            run(browser, [f"--screenshot={shot.resolve()}", probe.as_uri()], width, tile)
        finally:
            probe.unlink(missing_ok=True)
        with Image.open(shot) as img:
            full.paste(img.convert("RGB").crop((0, 0, width, tile)), (0, top))
        shot.unlink()
    return full


def run(browser: str, args: list[str], width: int, height: int) -> str:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--window-size={width},{height}",
               "--virtual-time-budget=10000", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        sys.exit(f"render_report.py: {Path(browser).name} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("report", type=Path, help="report.html to render")
    ap.add_argument("--out", type=Path, default=Path("shots"), help="folder for the screenshots (default shots)")
    ap.add_argument("--width", type=int, default=1280, help="window width in CSS pixels (default 1280)")
    ap.add_argument("--slice", type=int, default=1400, help="height of each page-NN.png slice (default 1400)")
    ap.add_argument("--pages", type=int, default=40, help="at most this many slices (default 40)")
    ap.add_argument("--tile", type=int, default=8000, help="height of each screenshot stitched into full.png "
                    "(default 8000; one screenshot taller than about 40,000 px comes back blank at its bottom)")
    ap.add_argument("--browser", help="Chromium executable (default: the first of chromium, google-chrome on PATH)")
    a = ap.parse_args(argv)
    if not a.report.is_file():
        sys.exit(f"render_report.py: {a.report}: no such file")
    browser = find_browser(a.browser)
    a.out.mkdir(parents=True, exist_ok=True)
    page = a.report.resolve()
    height = page_height(browser, page, a.width)
    full = a.out / "full.png"
    img = capture(browser, page, a.width, height, a.tile, a.out)
    img.save(full)
    n = min(a.pages, -(-img.height // a.slice))
    for k in range(n):
        img.crop((0, k * a.slice, img.width, min(img.height, (k + 1) * a.slice))).save(a.out / f"page-{k + 1:02d}.png")
    print(f"{full} ({img.width} x {img.height} px, {len(tiles(height, min(a.tile, height)))} tiles) and {n} slices "
          f"page-01.png ... in {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
