"""Kim et al. (2025), Section 4.2 (Figures 3 and 8) on models poslens trains: NoPE against RoPE, over seeds.

The paper trained a 1.5B decoder without positional encoding and read Figures 3 and 8 from it. Here the NoPE and
RoPE variants of the sweep the report trains anyway (`poslens sweep`, `poslens.report.sweep`: preset pe-sinks in the
full run, pe-quick with --quick; identical tokens, batches and steps; eight seeds in the full run, three with
--quick; cached) stand in for it. Each seed
is measured on held-out text, each number with a 95% interval over groups of sequences:

  Figure 3 and Figure 8 of the NoPE model (`run_intermediates`, kept in the report's parts directory), every
  statistic of its rows read from that run's run.json ((a) near-orthogonal, (a)->(b), (b)'s first column, (c),
  (c)->(d), (e) like (d), (f), (g) inverted, (h), (i), amplification over the parameter-free stack: the
  `Intermediates` summary); held-out loss of NoPE against RoPE; a linear probe of absolute position by depth (Haviv
  et al. 2022; Kazemnejad et al. 2023).

A claim is judged on the mean over seeds (`poslens.report.sweep.combine_seeds`): its interval is the t-interval over
seeds (what training makes of a model is an effect whose error bar is the spread over seeds, which one model's
interval over sequences does not see) with the seeds' own intervals over the held-out sequences added in quadrature
(every seed reads the same sequences, whose sampling error the spread over seeds does not see). The held-out losses
and the probe read blocks that start with the BOS when the models were trained so. The figures draw the first seed.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from poslens.errors import UsageError
from poslens.report.claims import Claim, Reading, Test, estimate_test, interval_text, num
from poslens.report.section import Figure, Panel, Section, section
from poslens.report.sections.figures import heatmaps, lines, profiles
from poslens.report.sweep import SWEEP_FULL, SWEEP_QUICK, combine_seeds, resolve_by_seeds, sweep_models
from poslens.train.config import TrainConfig

PE_NAMES = {"none": "NoPE", "rope": "RoPE"}
VARIANTS = {"none": "nope", "rope": "rope"}  # the sweep's variant of each encoding
PERPLEXITY_TOLERANCE = 1.05  # "comparable" = NoPE's held-out perplexity within 5% of RoPE's
NEAR_ORTHOGONAL = 0.1  # (a) is "the alpha = 0 case": its alpha closer to 0 than to 0.2, the paper's next alpha
SAME_TREND = 0.9  # "(e) almost identical to (d)": their off-diagonal entries correlate above 0.9
MUCH_STRONGER = 2.0  # "a much stronger pattern than the stack": at least twice its strength
I_INDEPENDENT = 0.9  # "an i-independent pattern" in (i): the key j alone explains more than 90% of its variance
VIVID = 2.0  # "a vivid line at the 0th column" of (b): the column above the other entries j < i by 2 of their SDs
PANELS = "abcdefghi"


def seed_models(sw, seed: int) -> dict:
    """The NoPE and RoPE models of one seed of the sweep `sw` (a `SweepModels`) and its token directory."""
    missing = [v for v in VARIANTS.values() if v not in sw.variants]
    if missing:
        raise UsageError(f"Section 4.2 needs the sweep's variants nope and rope; this sweep has "
                         f"{', '.join(sw.variants)}: add {' and '.join(missing)} to its matrix")
    return {**{pe: sw.path(v, seed) for pe, v in VARIANTS.items()}, "tokens": sw.tokens}


def intermediates_config(models: dict, size: dict):
    from poslens.analyses.intermediates import IntermediatesConfig

    num_seq, seq = size["fig3"]
    return IntermediatesConfig(model=str(models["none"]), data=str(models["tokens"]), mode="pack", seq_len=seq,
                               num_sequences=num_seq, batch_size=max(1, num_seq // 20), groups=20)


def measure(models: dict, size: dict, parts: Path, progress: bool, bos_first: bool) -> dict:
    """Every Section 4.2 number of the trained pair at `size`; the intermediates run (whose run.json holds every
    statistic of Figure 3's rows) is kept in `parts` under a fingerprint of its settings. `bos_first`: the pair was
    trained with every sequence starting with the BOS, so the held-out losses and the probe read blocks that start
    with it."""
    from poslens.analyses.intermediates import run_intermediates
    from poslens.engine.models import load_model
    from poslens.io.checkpoint import fingerprint
    from poslens.io.results import load
    from poslens.train.probe import heldout_losses, loss_comparison, position_probe, sequences_of
    from poslens.train.tokens import open_tokens

    icfg = intermediates_config(models, size)
    key = fingerprint(icfg.fingerprint_fields())[:8]
    run = parts / f"intermediates-trained-{key}"
    if not (run / "run.json").is_file() or "key_share" not in load(run, tensors=False).metrics["panels"]["i"]:
        run_intermediates(icfg, str(run), force=True, progress=progress)  # absent, or kept by an earlier poslens
    nets = {pe: load_model(str(models[pe]), dtype="float32")[0] for pe in PE_NAMES}
    context = nets["none"].config.max_position_embeddings
    tf = open_tokens(models["tokens"])
    val, bos = tf.val, tf.bos_id("the trained models' BOS") if bos_first else None  # as in training
    fit_n, test_n = size["probe"]
    loss_n = min(size["loss"], len(val) // (context - (bos is not None)))
    losses = loss_comparison(heldout_losses(nets, sequences_of(val, context, loss_n, bos=bos)))
    fit, test = (sequences_of(val, context, fit_n, bos=bos), sequences_of(val, context, test_n, offset=fit_n,
                                                                           bos=bos))
    probes = {pe: position_probe(nets[pe], fit, test) for pe in PE_NAMES}
    nope = probes["none"]
    last = len(nope.mae) - 1
    return {"intermediates": run, "config": icfg, "losses": losses, "loss_blocks": loss_n,
            "params": sum(p.numel() for p in nets["none"].parameters()),
            "context": context, "probe": {pe: {"mae": [e.item() for e in p.mae], "chance": p.chance.item()}
                                          for pe, p in probes.items()},
            "probe_blocks": (fit_n, test_n), "probe_depth": nope.difference(1, last).item(),
            "probe_first": nope.difference(0, 1).item()}


def _printed_slope(e: dict) -> str:
    return f"row slope {num(e['value'])} [{num(e['lo'])}, {num(e['hi'])}]" if _defined(e) else _fmt(e)


def _printed_ratio(e: dict) -> str:
    return f"off-diagonal/diagonal {e['value']:.3g} [{e['lo']:.3g}, {e['hi']:.3g}]" if _defined(e) else _fmt(e)


def _defined(e: dict) -> bool:
    return all(e.get(k) is not None and np.isfinite(e[k]) for k in ("value", "lo", "hi"))


_fmt = interval_text  # 'value [lo, hi]' of an estimate ('undefined', '(no interval)' where it has none)


def _seeds(e: dict, digits: int = 3) -> str:
    """'per seed 0.0851, 1.00, 0.255' of an estimate over seeds: each value to `digits` significant digits, trailing
    zeros kept so that the seeds read alike (undefined seeds read 'undefined')."""
    def one(v) -> str:
        text = num(v, digits)
        return text if text == "undefined" or "e" in text else f"{v:#.{digits}g}".rstrip(".")

    return "per seed " + ", ".join(one(v) for v in e["per_seed"])


@section("trained", "Section 4.2 on trained NoPE and RoPE models, over seeds (Figures 3 and 8)", models=True,
         quick={**SWEEP_QUICK, "fig3": (200, 50), "loss": 128, "probe": (48, 48)},
         full={**SWEEP_FULL, "fig3": (1000, 50), "loss": 512, "probe": (128, 128)})
def build(ctx, size: dict) -> Section:
    from poslens.io.results import load

    sw = sweep_models(ctx, size)
    cfg = next(mm.config for mm in sw.matrix.members if mm.variant == "nope")
    per_seed = [measure(seed_models(sw, seed), size, Path(ctx.parts), ctx.progress, cfg.bos) for seed in sw.seeds]
    runs = [load(m["intermediates"], tensors=False) for m in per_seed]
    im, m = combine_seeds([r.metrics for r in runs]), combine_seeds(per_seed)
    run_dir = Path(ctx.root) / "models" / "intermediates-trained-nope"
    shutil.copytree(per_seed[0]["intermediates"], run_dir)
    run = load(run_dir)
    data, icfg = run.meta["data"], m["config"]
    params = m["params"]
    first = seed_models(sw, sw.seeds[0])
    int_cmd = (f"poslens intermediates {first['none']} --data {sw.tokens} --mode pack --seq-len "
               f"{icfg.seq_len} --num-sequences {icfg.num_sequences} --batch-size {icfg.batch_size} --groups "
               f"{icfg.groups} --out runs/remeasure-intermediates-trained-nope")
    n = len(sw.seeds)
    s = Section(
        "No positional encoding in a trained model: Figure 3, Figure 8 and what training does (Kim et al., "
        "Section 4.2)",
        f"The NoPE and RoPE models of the sweep this report trains, or reads from the model cache when an earlier run "
        f"trained them ({sw.describe()}; vocabulary "
        f"{cfg.tokenizer.split(':')[-1]}; `{sw.command}`): for each of the {n} seeds, the same data, batches and "
        f"architecture with and without RoPE. {sw.MACHINE} Figures 3 and 8 use {data['sequences']} held-out "
        f"sequences of "
        f"{icfg.seq_len} tokens per seed: consecutive windows of the packed validation stream ("
        f"{data.get('documents_read', '?')} documents), each starting with the BOS as in training, so the text after "
        "the BOS mostly starts inside a document, where the paper took the first 50 tokens of each of 1,000 "
        "documents (one seed's run: "
        f"`{int_cmd}`). Each "
        f"claim is judged on the mean over the {n} seeds. Its 95% interval has two parts, added in quadrature: the "
        "t-interval over seeds (what training makes of a model varies from seed to seed) and the seeds' own "
        "intervals over the held-out sequences (95% delete-one-group jackknife over 20 groups, in each seed's run; "
        "root mean square over seeds): every seed reads the same sequences, so the spread over seeds does not show "
        "their sampling error, and more seeds would not shrink it. The figures draw seed "
        f"{sw.seeds[0]}.",
        scale=f"Section 4.2 is measured on {n} seeds of a {params / 1e6:.2g}M-parameter NoPE/RoPE pair ({cfg.layers} "
              f"layers, d = {cfg.hidden}, {cfg.heads} heads of size {cfg.hidden // cfg.heads} sharing {cfg.kv_heads} "
              f"key/value heads, RMSNorm) that poslens trains on {cfg.steps * cfg.batch_size * cfg.seq_len / 1e6:.2g}M "
              f"tokens of embedded text ({_trained_here(sum(v in VARIANTS.values() for v, _ in sw.trained), 2 * n)}); "
              "the paper's NoPE model has 1.5B parameters (heads of size 64) trained on 20B FineWeb-Edu tokens.")
    s.claims += figure3_claims(ctx, im, _scale(cfg))
    s.claims += haviv_claims(ctx, m, cfg)
    resolve_by_seeds(sw, s.claims)  # every interval is over the sweep's seeds
    c = max((r.metrics["block_output_check"] for r in runs), key=lambda c: c["max_rel"])
    s.claims.append(Claim(
        "poslens-block-output-check", "poslens", "anchor procedure of Figure 3 (g)",
        "panel (g), recomputed in float64 from (e) and the layer's own MLP, equals the model's next hidden state",
        (Test("largest |recomputed - the block's output| / largest |entry|, the worst seed", c["max_rel"], "<",
              c["tolerance"]),),
        measured=f"largest absolute deviation {c['max_abs']:.3g} ({c['dtype']}; tolerance {CHECK_NOTE}).",
        figure="Figure 3 (g)", command=ctx.remeasure("poslens-block-output-check")))
    nope, rope = m["probe"]["none"], m["probe"]["rope"]
    s.context += [("embeddings of the NoPE model carry no position but the BOS's (true by construction: a probe "
                   "check; position 1 always holds the BOS, so a probe of the embeddings can tell position 1 from the "
                   "rest and lands a little under chance)",
                   f"probe error at the embeddings {_fmt(nope['mae'][0])} tokens; chance (always the mean position) "
                   f"{num(nope['chance']['value'])}"),
                  ("the RoPE model for comparison (RoPE rotates queries and keys; it adds no position to the hidden "
                   "states)", "probe error by hidden state: " + ", ".join(
                      f"{'embeddings' if k == 0 else f'after layer {k}'} {_fmt(e)}" for k, e in enumerate(rope["mae"]))
                   + " tokens")]
    if ctx.draw:
        note = (f" The panels are seed {sw.seeds[0]}'s; the mean row slopes over keys 2 <= j < i, "
                f"(f) {_seeds(im['panels']['f']['row_slope'], 2)} and (i) {_seeds(im['panels']['i']['row_slope'], 2)}, "
                "differ between seeds, and the rows test their mean, so one seed's picture need not show it.")
        s.figures += figures(ctx, run, first, m, sw, note)
    return s


CHECK_NOTE = "64 machine epsilons of the model's dtype"


def _scale(cfg: TrainConfig) -> str:
    """The scale of the trained pair, for a claim's scope."""
    return f"{cfg.steps * cfg.batch_size * cfg.seq_len / 1e6:.2g}M training tokens"


def figure3_claims(ctx, im: dict, scale: str) -> list[Claim]:
    """The rows of Figure 3. Each is a claim about the paper's 1.5B-parameter NoPE model trained on 20B tokens, so
    a model of this scale cannot contradict it (the verdict rule's scope: a failure reads fails at this scale); the W_O
    row is ambiguous in its wording whatever the scale, and keeps both readings without a scope."""
    p, ch, amp = im["panels"], im["changes"], im["amplification"]
    out = []
    scope = f"the paper's 1.5B-parameter NoPE model trained on 20B tokens (this model: {scale})"

    def claim(cid, where, text, tests, key="", figure="", **kw):
        out.append(Claim(cid, "kim2025", where, text, tests, key=key,
                         figure=figure or "Figure 3 " + where.split("Figure 3 ")[-1], command=ctx.remeasure(cid),
                         scope=scope,
                         resolve="a model near the paper's scale (preset paper-1.5b on a GPU cluster)",
                         **kw))

    claim("kim-42-a-near-orthogonal", "Section 4.2, Figure 3 (a)",
          "most embeddings are nearly orthogonal: after LayerNorm their inner products are close to zero except on "
          "the diagonal (the alpha = 0 case)",
          (estimate_test("off-diagonal/diagonal ratio of (a) (the stack's alpha)", p["a"]["offdiag_ratio"], "<",
                 NEAR_ORTHOGONAL),),
          key=_printed_ratio(p["a"]["offdiag_ratio"]),
          measured=f"'close to zero' read as: alpha closer to 0 than to 0.2, the paper's next simulated alpha "
                   f"(threshold {NEAR_ORTHOGONAL:g}); {_seeds(p['a']['offdiag_ratio'])}.")
    claim("kim-42-a-to-b", "Section 4.2, Figure 3 (a), (b)",
          "from (a) to (b) the ratio of off-diagonal to diagonal values increases substantially (W_Q, W_K act like a "
          "larger alpha)", (estimate_test("change of the off-diagonal/diagonal ratio, (b) - (a)",
                                  ch["offdiag_ratio_b_minus_a"], ">"),),
          measured=f"(a) {_fmt(p['a']['offdiag_ratio'])}, (b) {_fmt(p['b']['offdiag_ratio'])}; the change "
                   f"{_seeds(ch['offdiag_ratio_b_minus_a'])}"
                   + (" (the ratio is undefined in a seed whose panel has a mean diagonal at or below 0: a token "
                      "unlike itself)" if any(v is None or not math.isfinite(v)
                                              for v in ch["offdiag_ratio_b_minus_a"]["per_seed"]) else "")
                   + ". Only the direction is tested: 'substantially' gives no size.")
    claim("kim-42-b-first-column", "Section 4.2, Figure 3 (b)",
          "a vivid line appears at the first column of (b) (key 1: the paper's 0th column), an attention sink",
          (estimate_test("|mean of (b)'s first column (queries 2..n) minus the mean of its other entries j < i|, in "
                         "standard deviations of those entries", p["b"]["first_column"], ">", VIVID),),
          measured=f"'vivid' read as: the column stands out, brighter or darker, from the other off-diagonal entries "
                   f"by more than {VIVID:g} of their standard deviations; {_seeds(p['b']['first_column'])}. Signed "
                   f"(above 0: brighter than the rest, a column of high scores; below 0: darker) "
                   f"{_seeds(p['b']['first_column_signed'])}" + _dark_line(p["b"]["first_column_signed"])
                   + ". The paper "
                   "leaves the sink's analysis out of scope, and so does this row: it tests only that the line is "
                   "there, whichever way it stands out.")
    claim("kim-42-c", "Section 4.2, Figure 3 (c)",
          "in (c) the diagonal values decrease with i, while the off-diagonal values remain nearly uniform",
          (estimate_test("slope of the diagonal of (c) in i, over its mean (per position)", p["c"]["diagonal_slope"],
                         "<"),
           estimate_test("coefficient of variation of the off-diagonal entries of (c) over that of its diagonal",
                 p["c"]["uniformity"], "<", 1.0)),
          measured="key 1 (the sink column) and position 1 left out; 'nearly uniform' read as: more uniform than the "
                   f"diagonal, the contrast the paper draws. Slope {_seeds(p['c']['diagonal_slope'])}; variation ratio "
                   f"{_seeds(p['c']['uniformity'])}.")
    cd = ch["offdiag_ratio_d_minus_c"]
    out.append(Claim(
        "kim-42-c-to-d", "kim2025", "Section 4.2, Figure 3 (c), (d)",
        "in (d) the ratio between the diagonal and the off-diagonal elements is significantly increased compared "
        "to (c): the effect of W_O, 'analogous to the relationship between (a) and (b)'",
        readings=(Reading("the diagonal/off-diagonal ratio rises (the sentence's own words): off-diagonal/diagonal "
                          "falls", (estimate_test("change of the off-diagonal/diagonal ratio, (d) - (c)", cd, "<"),)),
                  Reading("analogous to (a) -> (b), where, by the paper, off-diagonal/diagonal rose",
                          (estimate_test("change of the off-diagonal/diagonal ratio, (d) - (c)", cd, ">"),))),
        measured=f"off-diagonal/diagonal: (c) {_fmt(p['c']['offdiag_ratio'])}, (d) {_fmt(p['d']['offdiag_ratio'])}; "
                 f"the change {_seeds(cd)}. The two readings predict opposite signs of the same change, so on a model "
                 "of any scale where the change is resolved one reading holds and the other is contradicted: the "
                 "contradicted reading is one of the paper's wordings, not a failure of this model's scale (rule 5: "
                 "readings of opposite sides; which one holds is a statement at this scale).",
        scope=scope, opposite=True, figure="Figure 3 (c), (d)", command=ctx.remeasure("kim-42-c-to-d")))
    de = p["e"]["correlation_with_d"]
    claim("kim-42-e-like-d", "Section 4.2, Figure 3 (d), (e)",
          "after adding the residual (e), the trend is almost identical to (d)",
          (replace(estimate_test("correlation of the off-diagonal entries of (d) and (e)", de, ">", SAME_TREND),
                   digits=_near_one(de)),),
          key=interval_text(de, _near_one(de)),
          measured=f"'almost identical trend' read as: correlation above {SAME_TREND} (key 1, the sink, left out), "
                   "bias-corrected by the jackknife for the noise of the mean maps, which pulls a correlation toward "
                   f"0; {_seeds(de, _near_one(de) + 1)}.")
    for letter, where, text in (
            ("f", "Section 4.2, Figure 3 (f)", "after the post-attention LayerNorm (f), the Gram matrix increases "
                                               "with j for fixed i, as the theory and the simulation say"),
            ("i", "Section 4.2, Figure 3 (i)", "in the second layer's Q K^T (i) the scores clearly increase with j "
                                               "for fixed i")):
        claim(f"kim-42-{letter}-increasing", where, text,
              (estimate_test(f"mean row slope of ({letter}) over keys 2 <= j < i", p[letter]["row_slope"], ">"),
               estimate_test(f"share of rows of ({letter}) increasing in j", p[letter]["rows_increasing"], ">", 0.5)),
              key=_printed_slope(p[letter]["row_slope"]), figure=f"Figure 3 ({letter}), row profiles",
              measured="rows with at least two keys 2 <= j < i (key 1, the sink, left out); the row profiles with "
                       f"their error bands are drawn below (the first seed). Slope {_seeds(p[letter]['row_slope'])}; "
                       f"share {_seeds(p[letter]['rows_increasing'])}."
                       + (" The paper prints 'strict increase with i'; its theory (and panel (f)) predict an increase "
                          "with j for fixed i, which is what is tested; 'strict' is read as on average and in most "
                          "rows (every single step is tested on the parameter-free stack in Section 4.1, where it "
                          "is exact)." if letter == "i" else ""))
    claim("kim-42-g-inverts", "Section 4.2, Figure 3 (g)",
          "the feed-forward network and residual (g) laterally invert the pattern",
          (estimate_test("mean row slope of (g) over keys 2 <= j < i", p["g"]["row_slope"], "<"),),
          key=_printed_slope(p["g"]["row_slope"]), measured=f"Slope {_seeds(p['g']['row_slope'], 4)}.")
    claim("kim-42-h-restores", "Section 4.2, Figure 3 (g), (h)",
          "after (g)'s inversion, the next LayerNorm (h) restores the pattern",
          (estimate_test("(g) inverted: mean row slope of (g) over keys 2 <= j < i", p["g"]["row_slope"], "<"),
           estimate_test("mean row slope of (h) over keys 2 <= j < i", p["h"]["row_slope"], ">")),
          key=f"(g) {_printed_slope(p['g']['row_slope'])}; (h) {_printed_slope(p['h']['row_slope'])}",
          measured=f"'restores' read as: (g) is inverted (its rows decrease in j) and (h)'s rows increase in j "
                   f"again; (h)'s slope {_seeds(p['h']['row_slope'])}.")
    if "ratio" in amp:
        r = amp["ratio"]
        claim("kim-42-amplified", "Section 4.2, Figure 3 (i)",
              "training amplifies the pattern: (i) shows a much stronger, i-independent pattern than the "
              "parameter-free stack at the model's alpha",
              (estimate_test("strength of (i) over the stack's at the alpha of (a)", r, ">", MUCH_STRONGER),
               estimate_test("share of the off-diagonal variance of (i) explained by the key j alone",
                             p["i"]["key_share"], ">", I_INDEPENDENT)),
              key=("" if _defined(r) else  # defined: the rule's key, the deciding (failing, else open) test
                   f"undefined in {sum(not np.isfinite(v) for v in r['per_seed'])} of {len(r['per_seed'])} seeds"),
              measured=f"'much stronger' read as: at least {MUCH_STRONGER:g} times the stack's strength; strength = "
                       f"mean row slope of the scores in cosine units, E[q_i . k_j] / sqrt(E|q_i|^2 E|k_j|^2) (the "
                       f"stack's scores are cosines already); alpha from (a) {_fmt(amp['alpha'])}; model "
                       f"{_fmt(amp['model_strength'])}, stack {_fmt(amp['stack_strength'])}; the stack's strength is "
                       f"largest at alpha = {amp['strongest_stack']['alpha']:.2f}, and the model's strength over that "
                       f"largest value is {_fmt(amp['ratio_to_strongest_stack'])}. 'i-independent' read as for the "
                       f"stack at alpha = 0.2 (Section 4.1): the key alone explains more than {I_INDEPENDENT:.0%} "
                       "(bias-corrected by the jackknife for the maps' noise; key 1, the sink, left out). "
                       f"Ratio {_seeds(r)}; key share {_seeds(p['i']['key_share'])}.")
    return out


def _near_one(e: dict) -> int:
    """Significant digits for a correlation: 5 when its interval reaches above 0.999 (3 would print '1 [1, 1]')."""
    return 5 if max((x for x in (e.get("value"), e.get("hi")) if x is not None), default=0.0) > 0.999 else 3


def _dark_line(signed: dict) -> str:
    """'; darker than the rest in every seed here: ...' when every seed's column is below the rest (not a sink's
    high scores); '' otherwise."""
    seeds = [v for v in signed.get("per_seed", [signed["value"]]) if v is not None]
    if seeds and all(v < 0 for v in seeds):
        return ("; darker than the rest in every seed here: low scores on key 1, the opposite of a sink's high ones, "
                "so a pass of this row would not show a sink")
    return ""


def _trained_here(trained: int, models: int) -> str:
    """'all 6 models trained in this run' / 'this run read its 6 models from the model cache, ...' / '2 of its 6
    models trained in this run, the rest read from the model cache'."""
    if trained == models:
        return f"all {models} models trained in this run"
    if trained == 0:
        return f"this run read its {models} models from the model cache, trained by an earlier run"
    return f"{trained} of its {models} models trained in this run, the rest read from the model cache"


def _versus_chance(error: float, chance: float, layer: int) -> str:
    """'the probe after layer 4 is 17.9% better than chance' (or worse)."""
    gain = 100 * (1 - error / chance)
    return f"the probe after layer {layer} is {abs(gain):.1f}% {'better' if gain >= 0 else 'worse'} than chance"


def haviv_claims(ctx, m: dict, cfg: TrainConfig) -> list[Claim]:
    loss, pr = m["losses"], m["losses"]["perplexity_ratio"]
    nope = m["probe"]["none"]
    last = len(nope["mae"]) - 1
    tokens = _scale(cfg)
    return [
        Claim("haviv-comparable-perplexity", "haviv2022", "as cited by Kim et al., Sections 1-2",
              "a decoder without positional encoding models language about as well as one with it",
              (estimate_test("held-out perplexity ratio NoPE / RoPE", pr, "<", PERPLEXITY_TOLERANCE),),
              measured=f"held-out loss NoPE {_fmt(loss['loss_none'], 4)}, RoPE {_fmt(loss['loss_rope'], 4)} nats; "
                       f"{m['loss_blocks']} paired held-out sequences of {m['context']} tokens"
                       f"{', each starting with the BOS as in training' if cfg.bos else ''}; 'about as well' read "
                       f"as within {PERPLEXITY_TOLERANCE - 1:.0%}; ratio {_seeds(pr)}.",
              paper_number="perplexity 13.10 (NoPE) vs 13.05 (with positions) at 1.3B parameters",
              scope=f"1.3B-parameter models (this pair: {tokens})",
              resolve="a model near the claim's scale (preset paper-1.5b on a GPU cluster)",
              figure="training: NoPE and RoPE", command=ctx.remeasure("haviv-comparable-perplexity")),
        Claim("kazemnejad-position-after-layer-1", "kazemnejad2023", "as cited by Kim et al., Section 2",
              "without positional encoding, the first layer can already recover absolute position",
              (estimate_test("probe error after layer 1 - at the embeddings (tokens)", m["probe_first"], "<"),),
              measured=f"Kazemnejad et al. prove it for a constructed set of weights; tested here as what a trained "
                       f"NoPE model does: a ridge probe of the absolute position, error after layer 1 "
                       f"{_fmt(nope['mae'][1])} tokens vs {_fmt(nope['mae'][0])} at the embeddings (chance "
                       f"{num(nope['chance']['value'])}); the change {_seeds(m['probe_first'])}.",
              scope=f"an existence proof (constructed weights), which a trained model that does not use the "
                    f"construction cannot contradict (this pair: {tokens})", figure="linear probe of absolute position",
              command=ctx.remeasure("kazemnejad-position-after-layer-1")),
        Claim("haviv-probe-improves-with-depth", "haviv2022", "probing experiments",
              "absolute position becomes more predictable with depth in a model without positional encoding",
              (estimate_test(f"probe error after layer {last} - after layer 1 (tokens)", m["probe_depth"], "<"),),
              measured=f"after layer 1 {_fmt(nope['mae'][1])}, after layer {last} {_fmt(nope['mae'][last])} tokens; "
                       f"{_versus_chance(nope['mae'][last]['value'], nope['chance']['value'], last)}, far from the "
                       "15-20-token errors (2% of the context) a probe reaches at layer 12 of a 1.3B model; the change "
                       f"{_seeds(m['probe_depth'])}.",
              paper_number="error ~340 tokens at the embeddings, under 100 by layer 4, 15-20 by layer 12 of 24 "
                           "(context 1,024)",
              scope=f"1.3B-parameter models (this pair: {tokens})", figure="linear probe of absolute position",
              command=ctx.remeasure("haviv-probe-improves-with-depth"))]


def figures(ctx, run, models: dict, m: dict, sw, note: str = "") -> list[Figure]:
    """Figures 3 and 8 and the training curves of the first seed (`models`: its pair); the probe over seeds.
    `note`: a sentence for Figure 3's captions (how the drawn seed compares with the others)."""
    from poslens import plotting
    from poslens.analyses.intermediates import PANELS as WHAT

    seed = sw.seeds[0]
    label = f"trained NoPE model (sweep {sw.config.preset}, seed {seed})"
    titles = {c: f"({c}) {w}, layer {1 + (c in 'hi')}" for c, _, w in WHAT}
    panels = []
    for c in PANELS:
        v = run[f"panel_{c}"].double().numpy()
        se = run[f"panel_{c}_se"].double().numpy()
        panels.append(Panel(titles[c], v, se, plotting.offdiag_limits(v, (0.01, 0.99))))
    out = [heatmaps(ctx, "figure3", panels, "Figure 3 style: the trained NoPE model, layers 1 and 2, held-out text; "
                    "each panel's colour limits at the 1% and 99% quantiles of its off-diagonal entries (where the "
                    "diagonal lies outside them, it is drawn at the nearer end of the scale)." + note, ncols=3,
                    suptitle=f"Figure 3: {label}, Gram matrices of the intermediates of layers 1 and 2",
                    panel_size=3.0)]
    out.append(profiles(ctx, "figure3_profiles", [panels[5].values, panels[8].values], [panels[5].se, panels[8].se],
                        [titles["f"], titles["i"]], "Rows of panels (f) and (i) against the key 2 <= j < i for "
                        "three queries (the diagonal and key 1, the sink, left out, as in the rows' tests), with "
                        "bands of +/- 2 standard errors: the 'increasing in j' claims." + note,
                        suptitle="Figure 3 (f) and (i): scores against the key", first_key=2))
    scores, se = run["scores"].double().numpy(), run["scores_se"].double().numpy()
    layers = run["score_layers"].tolist()
    f8 = [Panel(f"layer {k + 1}", scores[i], se[i], plotting.offdiag_limits(scores[i], (0.01, 0.99)))
          for i, k in enumerate(layers)]
    out.append(heatmaps(ctx, "figure8", f8, "Figure 8 style: every layer's Q K^T * scaling of the trained NoPE model, "
                        "averaged over sequences and heads, drawn like Figure 3 (colour limits at the 1% and 99% "
                        "quantiles of the off-diagonal entries); the diagonal-normalised maps are in the run's "
                        "tensors.", ncols=min(6, len(f8)), suptitle=f"Figure 8: {label}, Q K^T * scaling per layer"))
    curves = {}
    for pe in PE_NAMES:
        rows = [json.loads(line) for line in (models[pe] / "metrics.jsonl").read_text().splitlines() if line]
        curves[f"{PE_NAMES[pe]} train"] = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        curves[f"{PE_NAMES[pe]} held-out"] = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    title = f"training: NoPE and RoPE, same data, seed {seed}"
    fig = plotting.curves(curves, "step", "next-token loss (nats)", title,
                          markers=[k for k in curves if k.endswith("held-out")])
    out.append(Figure(ctx.save(fig, "training_curves"), "Training loss (per step) and held-out loss (dots: one "
                      "evaluation each on the same held-out blocks, no interval) of the "
                      f"first seed's two models (the other seeds' held-out losses: `{sw.command}`).", title=title))
    series, errors = {}, {}
    for pe in PE_NAMES:
        maes = m["probe"][pe]["mae"]
        series[PE_NAMES[pe]] = [e["value"] for e in maes]
        errors[PE_NAMES[pe]] = [e["value"] - e["lo"] for e in maes]
    n = len(series["NoPE"])
    bos = next(mm.config for mm in sw.matrix.members if mm.variant == "nope").bos
    out.append(lines(ctx, "position_probe", range(n), series,
                     "Mean absolute error of a ridge probe of the absolute position, fitted per hidden state on "
                     f"{m['probe_blocks'][0]} held-out sequences of {m['context']} tokens"
                     f"{' (each starting with the BOS, as in training)' if bos else ''} and scored on "
                     f"{m['probe_blocks'][1]} others, per seed; mean over the {len(sw.seeds)} seeds, bars: 95% "
                     "t-intervals over seeds with each seed's interval over the held-out sequences added; dashed "
                     f"line: chance, always guessing the mean position ({num(m['probe']['none']['chance']['value'])}, "
                     "exact).",
                     "hidden state (embeddings, then after layer l)", "position probe error (tokens)",
                     "linear probe of absolute position, held out", errors=errors,
                     xticklabels=["emb."] + [str(k) for k in range(1, n)], hline=m["probe"]["none"]["chance"]["value"]))
    return out
