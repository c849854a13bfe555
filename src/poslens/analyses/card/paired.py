"""Paired differences between two models of a card, panel by panel, where both read the same token ids in the same
groups (one tokenizer on the same text): the difference of the two estimates with the delete-one-group jackknife
of the difference, whose leave-one-group-out values are the differences of each run's own (`engine.stats.jackknife`;
each run directory keeps them: `normalised_rms_replicates` of scores, `original/metrics_replicates` of leakage,
`replicates/loss_binned` of length). Both runs drop the same group each time, so what the two models share (the
text) cancels and the interval is narrower than the two side-by-side intervals suggest. Where the token ids differ
(another tokenizer), nothing is paired and the page says the panel is side by side only. The probe pairs by folds
(`page.paired_probe`).
"""

from __future__ import annotations

import torch

from poslens.engine.stats import jackknife

Triple = tuple[float, float, float]


def batches(meta: dict) -> dict:
    """What must agree for two runs to pair: the digest of the token ids, the batch size and the groups used."""
    return {"tokens": (meta.get("data") or {}).get("tokens_sha256"),
            "batch_size": (meta.get("config") or {}).get("batch_size"),
            "groups": (meta.get("groups") or {}).get("used")}


def pairable(a: dict, b: dict, analysis: str) -> bool:
    """Whether models a and b (page.read_model) read the same token ids in the same groups in `analysis`."""
    x, y = a["batches"].get(analysis), b["batches"].get(analysis)
    return bool(x and x["tokens"] and x == y and a["replicates"].get(analysis) is not None
                and b["replicates"].get(analysis) is not None)


def difference(va: float, ra: list[float], vb: float, rb: list[float], level: float) -> Triple:
    """(A - B, lo, hi): the jackknife of the difference from the two runs' replicates over the same groups."""
    est = jackknife(torch.tensor(va - vb, dtype=torch.float64),
                    torch.tensor(ra, dtype=torch.float64) - torch.tensor(rb, dtype=torch.float64), level)
    return float(est.value), float(est.lo), float(est.hi)


def paired_rows(a: dict, b: dict, analysis: str, values, level: float) -> list[dict[str, Triple]] | None:
    """Per row (layer or bin) of the shorter model, {column: (A - B, lo, hi)}: `values(model)` gives per row
    {column: (value, replicates)}; None when the two do not pair (`pairable`)."""
    if not pairable(a, b, analysis):
        return None
    rows_a, rows_b = values(a), values(b)
    return [{c: difference(x[c][0], x[c][1], y[c][0], y[c][1], level) for c in x}
            for x, y in zip(rows_a, rows_b)]
