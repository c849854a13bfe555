"""report.md / report.html: verdict kinds and headline, provenance header, embedded images that decode."""

import base64
import io
import re

import numpy as np
import pytest
from PIL import Image

from poslens import plotting
from poslens.report.render import Claim, Section, headline, verdict_counts, write_report

IMG = re.compile(r"<img src='data:(image/(?:png|jpeg));base64,([A-Za-z0-9+/=]+)'[^>]*id='([^']+)'")


def html_images(page: str) -> list[tuple[str, Image.Image]]:
    """(id, decoded image) for every embedded image; raises if one does not decode."""
    out = []
    for mime, data, ident in IMG.findall(page):
        img = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        img.load()  # decodes every pixel, not just the header
        assert img.format == {"image/png": "PNG", "image/jpeg": "JPEG"}[mime]
        out.append((ident, img))
    return out


def check_report_images(directory) -> list[str]:
    """Every <img> in report.html decodes, each figure is embedded exactly once, and every figure file the
    report lists is there; returns the ids."""
    page = (directory / "report.html").read_text()
    images = html_images(page)
    assert page.count("<img ") == len(images)
    ids = [i for i, _ in images]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    for i, img in images:
        assert img.width > 50 and img.height > 50, i
    md = (directory / "report.md").read_text()
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):
        assert (directory / link).is_file(), link
    return ids


def test_claim_rejects_an_unknown_verdict():
    with pytest.raises(ValueError, match="verdict"):
        Claim("c", "s", "m", "does not hold")


def test_headline_counts_each_kind_and_skips_context():
    s = Section("t", claims=[Claim("a", "s", "m", "holds"), Claim("b", "s", "m", "erratum"),
                             Claim("c", "s", "m", "not resolved"), Claim("d", "s", "m", "holds"),
                             Claim("e", "s", "m")])
    assert verdict_counts([s]) == {"holds": 2, "contradicted": 0, "erratum": 1, "not resolved": 1}
    assert headline([s]).startswith("4 claims checked: 2 hold, 0 contradicted, 1 erratum")


def test_report_embeds_each_real_figure_once_with_provenance(tmp_path):
    rng = np.random.default_rng(0)
    m = np.tril(rng.random((12, 12)))
    small = plotting.save(plotting.map_grid([m, m], ["layer 1", "layer 2"]), tmp_path / "figures", "small")[0]
    big = plotting.save(plotting.map_grid([m] * 12, [f"layer {k}" for k in range(1, 13)], ncols=6),
                        tmp_path / "figures", "big", formats=("jpg", "pdf"))[0]
    sec = Section("S", "text", [(small, "small grid"), (big, "big grid")],
                  [Claim("x < 1", "Section 1", "x = 0.5", "holds", "small", "poslens something --flag")])
    prov = {"command": "poslens reproduce --quick", "versions": "poslens 0.1.0", "seed": "0", "date": "d",
            "machine": "m"}
    write_report(tmp_path, "T", "intro", [sec], prov, wide={"big"})
    assert check_report_images(tmp_path) == ["small", "big"]
    page = (tmp_path / "report.html").read_text()
    for value in prov.values():
        assert value in page
    assert "<div class='wide'><img src='data:image/jpeg" in page  # big grid at its own size
    assert "1 claims checked: 1 hold" in page
    md = (tmp_path / "report.md").read_text()
    assert "`poslens reproduce --quick`" in md and "(figures/big.jpg)" in md and "(figures/big.pdf)" in md


def test_offdiag_limits_ignore_a_constant_diagonal():
    """An l2-normalised map has 1 on the diagonal; its pattern lives off it, so the limits must too."""
    m = np.tril(np.full((6, 6), 0.1) + 0.01 * np.arange(6)[None, :])
    np.fill_diagonal(m, 1.0)
    m[np.triu_indices(6, 1)] = np.nan
    lo, hi = plotting.offdiag_limits(m)
    assert (lo, hi) == pytest.approx((0.1, 0.14))
