"""The real-model section of `poslens reproduce` (paper Section 5.2, Figures 5 and 11-16) on the embedded model.

SmolLM2-135M (shipped as a GGUF in a registry package) over the embedded corpus (poslens.engine.corpus), the
first `seq_len` tokens of each long-enough document as in the paper, once as trained and once with RoPE
disabled (an ablation that keeps every weight).

Noise-free size of the non-relative pattern. Write P for diagonal normalisation (subtract each diagonal's mean;
the attention-sink column j = 0 is left out before normalising) and E for the mean over the entries
1 <= j <= i. Batch b goes to group g = b mod G and to half h = (b div G) mod 2, so every group holds sums of two
independent halves of its sequences, with means m_a and m_b over all groups. Then

    power  = E[ P(m_a) * P(m_b) ]              (mean square of the non-relative pattern; the product of two
                                                independent means has no noise term, unlike E[P(m)^2])
    spread = E[ (m - E[m])^2 ],  m = (m_a + m_b)/2      (the map's own variance: scores' scale)
    share  = power / spread                    (fraction of the map's variance that is not relative)

each a smooth function of the pooled means, so `GroupedSums.estimate` gives a delete-one-group jackknife
interval. The pattern is resolved in a layer when the interval of `power` lies above 0 (Bonferroni-adjusted
over the layers).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from poslens import plotting
from poslens.engine.stats import Estimate, GroupedSums
from poslens.maps import as_numpy, diagonal_normalise, quantile_limits
from poslens.report.render import Claim, Section

MODEL = "smollm2-135m"
FULL_SIZE = (512, 96, 3, 16)  # seq_len, sequences, batch size, groups (each group: one batch per half)
QUICK_SIZE = (256, 16, 2, 4)
LEVEL = 0.95  # one-sided, family-wise over the layers (Bonferroni)


# ---------------------------------------------------------------- statistics (pure functions of mean maps)


def without_sink(m: torch.Tensor) -> np.ndarray:
    """[L, n, n] maps with the key-0 column (attention sink) set to NaN, float64."""
    x = as_numpy(m)
    x[..., :, 0] = np.nan
    return x


def _lower_mask(n: int) -> np.ndarray:
    mask = np.tril(np.ones((n, n), dtype=bool))
    mask[:, 0] = False
    return mask


def pattern_power(ma: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    """Per layer: E[P(m_a) P(m_b)] over 1 <= j <= i (module docstring); [L] float64."""
    pa, pb = diagonal_normalise(without_sink(ma)), diagonal_normalise(without_sink(mb))
    mask = _lower_mask(pa.shape[-1])
    return torch.as_tensor((pa * pb)[:, mask].mean(axis=-1))


def map_spread(ma: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    """Per layer: E[(m - E m)^2] over 1 <= j <= i, m = (m_a + m_b)/2; [L] float64."""
    m = (without_sink(ma) + without_sink(mb)) / 2
    v = m[:, _lower_mask(m.shape[-1])]
    return torch.as_tensor(((v - v.mean(axis=-1, keepdims=True)) ** 2).mean(axis=-1))


def noise_power(ma: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    """Per layer: E[((P(m_a) - P(m_b))/2)^2], the mean square noise of the pooled normalised map; [L]."""
    pa, pb = diagonal_normalise(without_sink(ma)), diagonal_normalise(without_sink(mb))
    return torch.as_tensor((((pa - pb) / 2) ** 2)[:, _lower_mask(pa.shape[-1])].mean(axis=-1))


def layer_statistics(sums: GroupedSums, layers: int) -> dict[str, dict]:
    """power, share and noise per layer. The intervals are two-sided at 1 - 2(1 - LEVEL)/layers, so each bound is
    a one-sided bound at 1 - (1 - LEVEL)/layers: "power > 0 in every layer" is then tested at LEVEL family-wise
    (Bonferroni)."""
    level = 1 - 2 * (1 - LEVEL) / layers
    def both(m: dict) -> torch.Tensor:  # one jackknife pass for power and share: [2, L]
        power = pattern_power(m["a"], m["b"])
        return torch.stack([power, power / map_spread(m["a"], m["b"])])

    est = sums.estimate(both, level=level)
    power, share = (Estimate(est.value[k], est.lo[k], est.hi[k], est.se[k], est.groups, est.level, est.method)
                    for k in (0, 1))
    noise = noise_power(sums.mean("a"), sums.mean("b"))
    return {"power": power, "share": share, "noise": noise, "level": level}


# ---------------------------------------------------------------- capture


def capture_groups(model, ids: torch.Tensor, batch: int, groups: int, desc: str, progress: bool) -> GroupedSums:
    """Mean score maps of every layer, kept per (group, half): batch b -> group b % G, half (b // G) % 2."""
    from poslens.engine.capture import Capture

    sums = GroupedSums(groups)
    batches = list(torch.split(ids, batch))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(batches), desc=desc, unit="batch", leave=False)
    for b, x in enumerate(batches):
        cap = Capture(model)
        with cap:
            cap.update(x)
        scores = cap.result()["scores"]  # [L, T, T], mean over the batch's sequences and heads
        sums.add("ab"[(b // groups) % 2], b % groups, scores * x.shape[0], x.shape[0])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return sums


def _cached_sums(ctx, name: str, compute) -> GroupedSums:
    """GroupedSums kept in the reproduce parts cache, so an interrupted reproduce resumes."""
    path = ctx.parts / f"{name}.safetensors"
    if path.exists():
        state = load_file(str(path))
        s = GroupedSums(int(state["sum/a"].shape[0]))
        s.load_state_dict(state)
        return s
    s = compute()
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in s.state_dict().items()}, str(tmp))
    tmp.rename(path)
    return s


# ---------------------------------------------------------------- the section


def _span(values) -> str:
    return f"{min(values):.2g}..{max(values):.2g}"


def model_section(ctx, quick: bool, size: tuple[int, ...] | None = None) -> Section:
    """SmolLM2-135M with and without RoPE. size = (seq_len, sequences[, batch, groups]); defaults FULL_SIZE or
    QUICK_SIZE."""
    from poslens.engine import corpus
    from poslens.engine.ablations import no_rope
    from poslens.engine.data import make_sequences
    from poslens.engine.models import load_model

    d = QUICK_SIZE if quick else FULL_SIZE
    size = tuple(size or d)
    seq_len, num = size[0], size[1]
    batch = size[2] if len(size) > 2 else max(1, min(d[2], num // 4))
    groups = size[3] if len(size) > 3 else max(2, min(d[3], -(-num // batch) // 2))
    model, tok = load_model(MODEL)
    ids, stats = make_sequences(tok, corpus.documents(), seq_len, num, mode="first")
    runs = {}
    t0 = time.perf_counter()
    for key, label, ctxm in (("rope", "RoPE on (as trained)", contextlib.nullcontext),
                             ("norope", "RoPE disabled", lambda: no_rope(model))):
        def compute(label=label, ctxm=ctxm):
            with ctxm():
                return capture_groups(model, ids, batch, groups, f"SmolLM2-135M, {label}", ctx.progress)

        runs[key] = _cached_sums(ctx, f"model-{key}-{seq_len}-{num}-{batch}-{groups}", compute)
    seconds = time.perf_counter() - t0
    n_layers = int(runs["rope"].mean("a").shape[0])
    st = {k: layer_statistics(s, n_layers) for k, s in runs.items()}
    means = {k: (s.mean("a") + s.mean("b")) / 2 for k, s in runs.items()}
    for k in runs:
        ctx.keep(f"model/{k}", {"scores": means[k], "power": st[k]["power"].value, "power_lo": st[k]["power"].lo,
                               "power_hi": st[k]["power"].hi, "share": st[k]["share"].value,
                               "share_lo": st[k]["share"].lo, "share_hi": st[k]["share"].hi,
                               "noise_power": st[k]["noise"]})
    level = st["rope"]["level"]
    s = Section("RoPE LLM: the non-relative pattern in a real model (Section 5.2, Figures 5, 11-16)",
                f"{MODEL} (SmolLM2-135M-Instruct, Q4_1 GGUF, float32 on the CPU), {stats['sequences']} sequences: "
                f"the first {seq_len} tokens of each of the first {stats['sequences']} documents of the embedded "
                f"corpus long enough ({stats['documents_skipped']} shorter ones skipped; docs/corpus.md), once as "
                f"trained and once with RoPE disabled; {seconds:.0f} s. Mean pre-softmax scores over sequences and "
                "heads per layer. 'Pattern' is the diagonal-normalised map without the attention-sink column; its "
                "mean square is measured noise-free as the product of two independent halves of the sequences, "
                f"with delete-one-group jackknife bounds over {groups} groups, one-sided at "
                f"{1 - (1 - level) / 2:.4f} per layer ({LEVEL:.0%} family-wise over {n_layers} layers). The paper "
                "used Llama-3.1-8B, Phi-4 and Qwen3-8B on 1,000 FineWeb-Edu sequences of 1,024 tokens; "
                "`poslens scores MODEL --data ...` measures those.")
    s.claims += _claims(st, n_layers, stats["sequences"])
    s.figures.append((_share_figure(ctx, st, n_layers), "Share of each layer's score variance that is not relative "
                      "(diagonal-normalised pattern power / map variance, sink column excluded), with "
                      f"jackknife bounds, each one-sided at {1 - (1 - level) / 2:.4f}; layers numbered from 1. A "
                      "lower bound at or below 0 means the layer is not resolved."))
    s.figures.append((_figure5(ctx, means), "Figure 5 style: layers 1-4, diagonal-normalised, attention-sink column "
                      "(key 0) blank; colour limits at the 1% and 99% quantiles of the remaining entries."))
    for k, label in (("rope", "RoPE on"), ("norope", "RoPE disabled")):
        for norm in (False, True):
            s.figures.append(_all_layers(ctx, means[k], k, label, norm))
    return s


def _claims(st: dict, n_layers: int, sequences: int) -> list[Claim]:
    out = []
    later = range(1, n_layers)
    for key in ("rope", "norope"):
        p = st[key]["power"]
        lo, hi, v = p.lo.numpy(), p.hi.numpy(), p.value.numpy()
        resolved = [ell + 1 for ell in later if lo[ell] > 0]
        unresolved = [ell + 1 for ell in later if not lo[ell] > 0]
        rms = np.sqrt(np.clip(v, 0, None))
        noise = np.sqrt(st[key]["noise"].numpy())
        sh = st[key]["share"]
        measured = (f"pattern power above 0 (lower bound > 0) in {len(resolved)} of {len(later)} layers after "
                    f"the first{'' if not unresolved else ' (not in layers ' + ', '.join(map(str, unresolved)) + ')'}"
                    f"; layer 1: [{lo[0]:.2g}, {hi[0]:.2g}]. Pattern RMS {_span(rms[1:])} vs the pooled map's "
                    f"noise RMS {_span(noise[1:])}; non-relative share of the variance, median over later layers "
                    f"{np.median(sh.value.numpy()[1:]):.3f}")
        if key == "norope":  # no paper claim: an ablation shown beside the claim, with its numbers
            if unresolved:
                measured += (f". In the unresolved layers the upper bounds reach at most "
                             f"{max(hi[ell - 1] for ell in unresolved):.2g} (RoPE on, same layers: estimates "
                             f"{_span([st['rope']['power'].value.numpy()[ell - 1] for ell in unresolved])})")
            out.append(Claim("with RoPE disabled (same weights, causal mask only): where a non-relative pattern is "
                             "resolved", "ablation (poslens; no claim in the paper)", measured, "context",
                             "model_pattern_share, Figure 5",
                             "poslens reproduce (API: poslens.report.model_report.layer_statistics)"))
            continue
        if not unresolved:
            verdict = "holds"
        else:
            verdict = "not resolved"
            half = (hi - lo) / 2
            need = [sequences * (half[ell - 1] / v[ell - 1]) ** 2 for ell in unresolved if v[ell - 1] > 0]
            measured += (". More sequences would resolve it (the bounds shrink as 1/sqrt(sequences)): "
                         + (f"about {max(need):,.0f} for the weakest of these layers at its present estimate"
                            if len(need) == len(unresolved) else "some of these layers estimate 0 or below, so "
                            "no count follows from them") + f"; this run used {sequences}")
        out.append(Claim("as trained (RoPE): a non-relative pattern is present in every layer after the first",
                         "Section 5.2, Figure 5", measured, verdict, "model_pattern_share, Figure 5",
                         "poslens reproduce (API: poslens.report.model_report.layer_statistics)"))
    sh = st["rope"]["share"]
    ratio = np.sqrt(np.clip(sh.value.numpy()[1:], 0, None))
    out.append(Claim("the non-relative pattern is not negligible next to the scores (paper: [-1, 1] against "
                     "scores in [-10, 10], about a tenth)", "Section 5.2",
                     f"RMS of the pattern / RMS of the score map around its mean, layers 2-{n_layers}: median "
                     f"{np.median(ratio):.2f} (range {_span(ratio)}); a range ratio and an RMS ratio differ, so this "
                     "row is shown as context, not scored"))
    return out


# ---------------------------------------------------------------- figures


def _share_figure(ctx, st: dict, n_layers: int):
    xs = np.arange(1, n_layers + 1)
    series, errs = {}, {}
    for key, label in (("rope", "RoPE on"), ("norope", "RoPE disabled")):
        sh = st[key]["share"]
        v, lo, hi = sh.value.numpy(), sh.lo.numpy(), sh.hi.numpy()
        series[label] = v
        errs[label] = np.stack([v - lo, hi - v])
    fig = plotting.line_plot(xs, series, "layer (1 = first)", "non-relative share of score variance",
                             "SmolLM2-135M: non-relative pattern per layer", errors=errs)
    fig.axes[0].axhline(0, color="0.3", lw=0.8)
    return ctx.save(fig, "model_pattern_share")


def _normalised(m) -> np.ndarray:
    return diagonal_normalise(without_sink(m))


def _figure5(ctx, means: dict):
    maps, titles, rows = [], [], []
    for key, label in (("rope", "RoPE on"), ("norope", "RoPE disabled")):
        for ell, m in enumerate(_normalised(means[key][:4])):
            maps.append(m)
            titles.append(f"{label}, layer {ell + 1}")
        rows.append(label)
    fig = plotting.map_grid(maps, titles, ncols=4, limits="quantile", row_labels=rows,
                            suptitle="SmolLM2-135M: diagonal-normalised mean scores, layers 1-4 (Figure 5 style)")
    return ctx.save(fig, "figure5")


def _all_layers(ctx, mean, key: str, label: str, normalised: bool):
    maps = _normalised(mean) if normalised else as_numpy(mean)
    what = "diagonal-normalised, sink column blank" if normalised else "mean pre-softmax scores"
    lims = [quantile_limits(m if normalised else m[_lower_mask(m.shape[-1])]) for m in maps]
    fig = plotting.map_grid(list(maps), [f"layer {ell + 1}" for ell in range(len(maps))], ncols=5, limits=lims,
                            suptitle=f"SmolLM2-135M, {label}: {what}", panel_size=2.2)
    stem = f"model_{key}_{'normalised' if normalised else 'scores'}"
    cap = (f"SmolLM2-135M, {label}: {what}, all layers (Figures {'14-16' if normalised else '11-13'} style); colour "
           "limits per panel at the 1% and 99% quantiles" + ("" if normalised else " of the entries j >= 1 (the "
                                                             "sink column is far outside them)") + ".")
    return ctx.save(fig, stem, big=True), cap
