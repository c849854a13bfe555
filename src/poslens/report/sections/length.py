"""Past the training length, on the sweep's models: does the causal mask's position signal decide length
generalisation here?

The sweep (`poslens sweep`: NoPE, RoPE, NTK-scaled RoPE and RoPE with a sliding window of 32, trained at a length L
on the embedded corpus with a BOS first, the preset's seeds, the same tokens, batches and initial weights for every
variant of a seed) is evaluated by `poslens length` at L, 2L, 4L, 8L on the held-out split of the training tokens,
each variant's seeds in one run on the same sequences. Every number is a mean over the seeds with a Student t
interval over them (the error bar of a training effect); a difference between variants is taken seed by seed (seed s
of every variant shares its initial weights and data order) before the interval.

The question is operational, and each row says which test decides it: NoPE's only position signal is the causal
mask (Kim et al.), which reaches the query at position p (positions count from 1) through its softmax denominator,
a sum over the p keys it sees, which keeps growing past L. If that signal decides length generalisation, NoPE
degrades past L, a correction for the denominator's growth restores it (log-n scaling: the attention logits of the
query at position p multiplied by max(1, log p / log L), the log of the number of keys it sees over the log of L,
1 up to position L and larger past it, so that its attention does not spread thinner as the keys past L add terms
to the denominator), and for RoPE the same correction helps more than rescaling its frequencies (NTK at T/L: the
rotary base scaled by NTK's rule for the length factor T/L, T the evaluation length and L the training length;
YaRN at T/L: the YaRN rescaling of the rotary frequencies, as transformers implements it, for the same factor).
"""

from __future__ import annotations

import math
import shutil
import textwrap
from dataclasses import asdict
from pathlib import Path

import numpy as np

from poslens.report.claims import Claim, Test, estimate_test, interval_text
from poslens.report.section import Panel, Section, section
from poslens.report.sections.figures import heatmaps, lines, share_limits
from poslens.report.sweep import SWEEP_FULL, SWEEP_QUICK, resolve_by_seeds, sweep_models

# variants: the sweep's variants to evaluate (None: all; the tests take nope and rope). effects_of: the variants whose
# interventions run (None: all); the others are evaluated without any (their loss, profile and maps), since no row's
# verdict reads their interventions. jobs: variants evaluated at once, each in its own process with torch's threads
# shared out (1: one after the other in this process).
SIZES_QUICK = {**SWEEP_QUICK, "sequences": 4, "groups": 2, "profile_every": 8, "maps": True, "variants": None,
               "effects_of": ["nope", "rope"], "jobs": 2}
SIZES_FULL = {**SWEEP_FULL, "sequences": 32, "groups": 8, "profile_every": 2, "maps": True, "variants": None,
              "effects_of": ["nope", "rope"], "jobs": 2}
EFFECTS = "which intervention helps which variant"  # the figure the rows point to (its title)
NAMES = {"logn": "log-n scaling", "logn-all": "log-n scaling at every position", "ntk": "NTK at T/L",
         "yarn": "YaRN at T/L", "window": "window of L", "sink-window": "window of L keeping key 1",
         "freeze": "position 1 frozen"}
KEEPS = ("the window of L keeping key 1: the first key (the sink) and the last L - 1 keys, as StreamingLLM's and "
         "LM-Infinite's masks keep it, so that a query still sees L keys and the one key that differs from the "
         "window of L is the sink")
TL = "T the evaluation length, L the training length"  # said where a row first names T/L


def positions(a: int, b: int) -> str:
    """0-based target or query indices [a, b) as the 1-based positions they are: 'positions a+1-b'."""
    return f"positions {a + 1}-{b}"


def _t(values: list[float], level: float = 0.95, support: tuple[float, float] | None = None) -> dict:
    from poslens.train.sweep import seed_interval

    return seed_interval(values, level, support)


def _test(statistic: str, e: dict, side: str, threshold: float = 0.0) -> Test:
    """A test on a mean over seeds; with one seed there is no interval, and the test stays open (not exact)."""
    return estimate_test(statistic, e, side, threshold,
                         f"95% t-interval over {e.get('n', len(e.get('per_seed', e.get('per_model', []))))} seeds")


_ci = interval_text  # 'value [lo, hi]' of an estimate


def length_runs(ctx, size: dict) -> tuple[object, dict[str, Path], int]:
    """One `poslens length` run per variant of the sweep (its seeds together), from the report's parts when done;
    returns the sweep, run directory per variant (in the parts) and L.

    What the verdicts do not read is not run: NTK and YaRN only at the longest length (factor 8, the effects the
    rows read), the attention profile only without an intervention (the entropy figure's), and no intervention on
    the variants outside `effects_of` (no row reads their effects). `jobs` runs run at once in processes of their
    own (torch's threads shared out)."""
    from poslens.analyses.length.run import LengthConfig
    from poslens.io.checkpoint import fingerprint

    sw = sweep_models(ctx, size)
    L = sw.matrix.members[0].config.seq_len
    groups = size["groups"]
    runs, todo = {}, []
    effects_of = size.get("effects_of")
    for v in [v for v in sw.variants if size.get("variants") is None or v in size["variants"]]:
        paths = [str(sw.path(v, s)) for s in sw.seeds]
        cfg = LengthConfig(model=paths[0], seed_models=paths[1:], data=str(sw.tokens), bos="always", train_len=L,
                           eval_lens=[L, 2 * L, 4 * L, 8 * L], num_sequences=size["sequences"],
                           batch_size=max(1, size["sequences"] // groups), groups=groups,
                           interventions=["all"] if effects_of is None or v in effects_of else ["none"],
                           maps=size["maps"], profile_every=size["profile_every"], figures=False,
                           scaled_at="longest", intervention_profiles=False)
        key = fingerprint(asdict(cfg))[:10]
        runs[v] = Path(ctx.parts) / f"length-{v}-{key}"
        if not (runs[v] / "run.json").exists():
            todo.append((v, cfg, runs[v]))
    jobs = max(1, min(int(size.get("jobs") or 1), len(todo)))
    if ctx.progress and todo:
        print(f"  poslens length: {', '.join(v for v, _, _ in todo)} ({len(sw.seeds)} seeds each) to {8 * L} tokens"
              + (f", {jobs} at a time" if jobs > 1 else ""), flush=True)
    if jobs == 1:
        for _, cfg, out in todo:
            _run_one(cfg, out, ctx.progress)
    else:
        _run_side_by_side(todo, jobs, ctx.progress)
    return sw, runs, L


def _run_one(cfg, out: Path, progress: bool, threads: int | None = None) -> None:
    """One `poslens length` run into `out` (over what an interrupted attempt left there); `threads`: torch's."""
    from poslens.analyses.length.run import run_length

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    run_length(cfg, out, force=out.exists(), progress=progress)


def _run_side_by_side(todo: list, jobs: int, progress: bool) -> None:
    """The runs of `todo` (variant, config, out), `jobs` at a time, each in a worker process (`poslens.engine.workers`)
    with torch's threads shared out; a run's error is raised here."""
    from concurrent.futures import as_completed

    import torch

    from poslens.engine import workers

    threads = max(1, torch.get_num_threads() // jobs)
    with workers.Pool(jobs) as pool:
        pending = {pool.submit(_run_one, cfg, out, False, threads): v for v, cfg, out in todo}
        for f in as_completed(pending):
            f.result()
            if progress:
                print(f"  poslens length: {pending[f]} done", flush=True)


@section("length", "past the training length (the sweep's models)", models=True, quick=SIZES_QUICK,
         full=SIZES_FULL)
def build(ctx, size: dict) -> Section:
    from poslens.io.results import load

    sw, dirs, L = length_runs(ctx, size)
    T = 8 * L
    runs = {v: load(d, tensors=False) for v, d in dirs.items()}
    for v, d in dirs.items():  # run.json only: the maps' tensors stay in the parts (tens of MB per variant)
        dest = Path(ctx.root) / "models" / f"length-{v}"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(d / "run.json", dest / "run.json")
    seeds = {v: r.metrics["seeds"] for v, r in runs.items()}
    per = {v: r.metrics["models"] for v, r in runs.items()}
    t = str(T)

    def rise(v):
        return seeds[v]["rise"][t]

    def effect(v, spec):
        return seeds[v]["effects"].get(spec, {}).get(t)

    def paired(a, b, what):  # seed by seed: a - b
        xs = [x["rise"][t]["value"] if what == "rise" else x["effects"][what][t]["value"] for x in per[a]]
        ys = [y["rise"][t]["value"] if what == "rise" else y["effects"][what][t]["value"] for y in per[b]]
        return _t([x - y for x, y in zip(xs, ys)])

    claims: list[Claim] = []
    scale = (f"{sw.describe()}; evaluated on {size['sequences']} held-out sequences of {T} tokens per model")
    here = f"at this scale only ({sw.short()})"
    past = positions(L, T)  # the target positions past L: L + 1 .. T
    rise_range = (f"the loss over {positions(T // 2, T)} minus over {positions(max(1, L // 2), L)}, on the same "
                  "sequences")
    variants = list(runs)
    windows = ("window", "sink-window")
    if "nope" in variants and "rope" in variants and all(effect(v, w) for v in ("rope", "nope") for w in windows):
        claims.append(Claim(
            "kazemnejad-nope-extrapolates", "kazemnejad2023", "abstract",
            "a decoder without positional encoding generalises past its training length better than one with RoPE",
            (_test(f"how much more the loss rises past L for RoPE than for NoPE: rise ({rise_range}), RoPE minus "
                   "NoPE, per seed (nats)", paired("rope", "nope", "rise"), ">"),
             _test(f"how much more RoPE gains than NoPE from cutting each query's context to its last {L} keys: "
                   f"window-of-L effect, RoPE minus NoPE, per seed (loss over {past}, nats)",
                   paired_effects(per["rope"], "window", "nope", t, other=per["nope"]), "<"),
             _test(f"the same with the window of L keeping key 1 (the sink and the last {L - 1} keys): its effect, "
                   f"RoPE minus NoPE, per seed (loss over {past}, nats)",
                   paired_effects(per["rope"], "sink-window", "nope", t, other=per["nope"]), "<")),
            measured=f"'generalises better' read two ways, all three tests required: the loss rises less past L (the "
                     f"rise alone mixes position with the text at those positions; the difference of two models' "
                     f"rises on the same sequences does not), and context past L hurts less, by both windows (the "
                     f"window-of-L effect: the loss with the context cut to the last L keys minus with the full "
                     f"context, same tokens, below 0 when context past L hurts; the window of L also hides key 1, so "
                     f"on models with sink heads it removes the sink too, and {KEEPS}). Rise: NoPE "
                     f"{_ci(rise('nope'))}, RoPE {_ci(rise('rope'))}; window effect: NoPE "
                     f"{_ci(effect('nope', 'window'))}, RoPE {_ci(effect('rope', 'window'))}; keeping key 1: NoPE "
                     f"{_ci(effect('nope', 'sink-window'))}, RoPE {_ci(effect('rope', 'sink-window'))} (mean over "
                     f"seeds, 95% t-interval). The paper's models were ~100M-parameter decoders on synthetic tasks; "
                     f"these are language models {here}.",
            scope="~100M-parameter decoders on synthetic reasoning and arithmetic tasks",
            figure=EFFECTS, command=ctx.remeasure("kazemnejad-nope-extrapolates")))
    if "nope" in variants and effect("nope", "logn") is not None and all(effect("nope", w) for w in windows):
        claims.append(Claim(
            "length-mask-decides-nope", "poslens", "this report (length question)",
            "the mask's position signal decides NoPE's length generalisation here: the model whose only position "
            "signal is the causal mask is hurt by context past L, and correcting for the growth of the mask's "
            "denominator term lowers its loss past L (log-n scaling: the query at position p, which sees p keys, "
            "has its attention logits multiplied by max(1, log p / log L), so that past L its attention does not "
            "spread thinner as the number of keys grows)",
            (_test(f"NoPE: the window of L's paired effect on the loss over {past} (nats; below 0: context past "
                   "L hurts)", effect("nope", "window"), "<"),
             _test(f"NoPE: the window of L keeping key 1's paired effect on the loss over {past} (nats; below 0: "
                   "context past L hurts with the sink kept)", effect("nope", "sink-window"), "<"),
             _test(f"NoPE: log-n scaling's paired effect on the loss over {past} (nats)", effect("nope", "logn"),
                   "<")),
            measured=f"{here}. The effects are paired on the same tokens (intervention minus none), so the text's "
                     "variation cancels; both windows keep every query's denominator to as many keys as in training, "
                     f"and 'hurt by context past L' is judged on both: the window of L also hides key 1 (the sink), "
                     f"and {KEEPS}.",
            finding=True, figure=EFFECTS, command=ctx.remeasure("length-mask-decides-nope")))
    if "rope" in variants and effect("rope", "logn") is not None and effect("rope", "ntk") is not None:
        claims.append(Claim(
            "length-mask-or-frequencies-rope", "poslens", "this report (length question)",
            "RoPE's loss past L is lowered more by correcting the mask's denominator term (log-n scaling) than by "
            f"rescaling the rotary frequencies (NTK at T/L, {TL})",
            (_test(f"RoPE: log-n scaling's effect minus NTK's on the loss over {past}, per seed (nats)",
                   paired_effects(per["rope"], "logn", "ntk", t), "<"),),
            measured=f"{here}; effects against no intervention, paired on the same sequences, then differenced seed "
                     f"by seed: log-n {_ci(effect('rope', 'logn'))}, NTK {_ci(effect('rope', 'ntk'))}. Contradicted "
                     "means the frequencies' rescaling helps more.",
            finding=True, figure=EFFECTS, command=ctx.remeasure("length-mask-or-frequencies-rope")))
    for v in variants:
        for spec in ("ntk", "yarn", "window", "sink-window"):
            e = effect(v, spec)
            if v == "rope" and e is not None:
                claims.append(Claim(
                    f"length-{spec}-helps-rope", "poslens", "this report (interventions)",
                    f"{NAMES[spec]} at evaluation time lowers RoPE's loss past L"
                    + (f" ({TL})" if "T/L" in NAMES[spec] else ""),
                    (_test(f"RoPE: {NAMES[spec]}'s paired effect on the loss over {past} (nats)", e, "<"),),
                    measured=here, finding=True, figure=EFFECTS,
                    command=ctx.remeasure(f"length-{spec}-helps-rope")))
    resolve_by_seeds(sw, claims, lambda c: f"a measurement at the paper's scale ({c.scope})")
    defined = any(c.id == "kazemnejad-nope-extrapolates" for c in claims)  # that row states the rise's range
    context = [(f"{v} ({sw.labels[v]}): rise of the loss past L{'' if defined else f' ({rise_range})'} and each "
                f"intervention's effect on the loss over {past} (nats, mean over seeds, 95% t-interval)",
                f"rise {_ci(rise(v))}; " + "; ".join(f"{NAMES.get(s.split(':')[0], s)} {_ci(e[t])}"
                                                     for s, e in seeds[v]["effects"].items() if t in e))
               for v in variants]
    for v, r in runs.items():
        if not r.metrics["interventions"] and not r.metrics.get("skipped"):
            context.append((f"{v}: no intervention run", "no row's verdict reads this variant's intervention "
                            "effects (the section's size effects_of), so only its loss, attention profile and maps "
                            "are measured"))
        for spec, why in r.metrics.get("skipped", {}).items():
            context.append((f"{v}: {NAMES.get(spec, spec)} not run", why))
        for note in r.metrics.get("notes", []):
            context.append((f"{v}: note", note))
    s = Section(
        "Past the training length: does the causal mask's position signal decide length generalisation here?",
        __doc__.split("\n\n", 1)[1].replace("\n", " ") + f" This run: the sweep's preset {sw.config.preset} "
        f"({sw.describe()}), trained at L = {L}. {sw.MACHINE} The runs: "
        + "; ".join(
            f"`poslens length {sw.path(v, sw.seeds[0])} --seed-models "
            f"{','.join(str(sw.path(v, x)) for x in sw.seeds[1:])} --data {sw.tokens} --bos always --train-len {L} "
            f"--num-sequences {size['sequences']} --batch-size {max(1, size['sequences'] // size['groups'])} "
            f"--groups {size['groups']} --profile-every {size['profile_every']}`" for v in variants)
        + "; the sweep: `" + sw.command + "`.",
        claims=claims, context=context,
        scale=f"The length section measures {scale}; its verdicts are for that scale only.")
    s.figures += figures(ctx, sw, runs, dirs, L, size['profile_every'])
    return s


def paired_effects(models: list[dict], a: str, b: str, t: str, other: list[dict] | None = None) -> dict:
    """Effect of intervention a minus that of b, seed by seed, with the t-interval over seeds; with `other` (another
    variant's models, seed for seed), intervention a's effect in `models` minus its effect in `other` (b unused)."""
    if other is not None:
        return _t([m["effects"][a][t]["value"] - o["effects"][a][t]["value"] for m, o in zip(models, other)])
    return _t([m["effects"][a][t]["value"] - m["effects"][b][t]["value"] for m in models])


def figures(ctx, sw, runs: dict, dirs: dict, L: int, every: int) -> list:
    from poslens.analyses.length.figures import bin_centres
    from poslens.io.results import load

    T = 8 * L
    out = []
    xs = bin_centres(L, T)
    series, errors = {}, {}
    for v, r in runs.items():  # the mean over seeds of each bin, with the t-interval over seeds
        tensors = load(dirs[v]).tensors
        k = len(r.metrics["models"])
        curves = np.stack([tensors[f"m{i}/loss_binned"].double().numpy() for i in range(k)])
        mean = curves.mean(0)
        half = np.array([(lambda e: (e["hi"] - e["value"]) if e["hi"] is not None else 0.0)(_t(list(c)))
                         for c in curves.T])
        series[f"{v}: {sw.labels[v]}"], errors[f"{v}: {sw.labels[v]}"] = mean, half
    out.append(lines(ctx, "length_loss", xs, series,
                     f"Held-out loss against target position, up to 8L = {T}, in bins of {L // 4} positions "
                     "(positions count from 1; the first token, position 1, has no loss, so the first bin starts at "
                     "position 2); each variant's mean over "
                     f"its seeds with 95% t-intervals over seeds; trained at L = {L}. Every variant reads the same "
                     "sequences, so the curves share the text's ups and downs; the paired effects below remove them. "
                     f"Dashed line: the training length L = {L}.",
                     "target position", "next-token loss (nats)", "Loss past the training length, by variant",
                     errors=errors, vline=L))
    specs = sorted({s for r in runs.values() for s in r.metrics["seeds"]["effects"]})
    t = str(T)
    series, errors = {}, {}
    for spec in specs:
        vals, errs = [], []
        for r in runs.values():
            e = r.metrics["seeds"]["effects"].get(spec, {}).get(t)
            vals.append(np.nan if e is None else e["value"])
            errs.append((0.0, 0.0) if e is None or e["lo"] is None else (e["value"] - e["lo"], e["hi"] - e["value"]))
        series[NAMES.get(spec, spec)] = vals
        errors[NAMES.get(spec, spec)] = np.array(errs).T
    out.append(lines(ctx, "length_effects", list(range(1, len(runs) + 1)), series,
                     f"Each intervention's paired effect on the loss over positions L + 1 to 8L ({positions(L, T)}; "
                     "intervention minus none on the same sequences), by variant, mean over seeds with 95% "
                     "t-intervals; below 0 the intervention helps; "
                     "an intervention that does not apply to a variant, or is not run on it (no row reads the "
                     "effects of the variants outside the section's size effects_of, NoPE and RoPE by default), has "
                     "no point there.",
                     "variant", "effect on the loss past L (nats)", "Which intervention helps which variant",
                     errors=errors, zero=True, xticklabels=[f"{v}\n{textwrap.fill(sw.labels[v], 16)}" for v in runs],
                     joined=False))
    series, errors = {}, {}
    for v, r in runs.items():
        prof = r.metrics["seeds"]["profile"]["gap"]
        last = prof[-1]
        name = f"{sw.labels[v]}, last layer"
        series[name] = [b["value"] for b in last]
        errors[name] = np.array([(b["value"] - b["lo"], b["hi"] - b["value"]) if b["lo"] is not None else (0.0, 0.0)
                                 for b in last]).T
    edges = runs[next(iter(runs))].metrics["edges"]
    first = (f" (from position {edges[0] + 1}: the query at position 1 sees one key, and its gap is 0)"
             if edges[0] > 0 else "")
    out.append(lines(ctx, "length_entropy_gap", list(range(1, len(edges))), series,
                     "log(keys seen) - attention entropy of the last layer, averaged over the queries read ("
                     f"{'every query' if every == 1 else f'one query in {every}'}, --profile-every {every}) in each "
                     f"range of positions{first}, mean over seeds with 95% t-intervals (cut at 0, below which a gap "
                     "cannot go): how far attention is from uniform over the keys seen. Positions count from 1: the "
                     "query at position p sees p keys under the causal mask and min(p, W) under a window W, so "
                     "log(keys seen) is log p or log min(p, W). The values with their intervals, every layer and "
                     "range of positions: models/length-{nope,rope,ntk,window}/run.json, metrics.seeds.profile.gap "
                     "(the last layer is drawn).",
                     "query positions", "entropy gap (nats)", "Entropy gap of the last layer by query position",
                     errors=errors, xticklabels=[f"{a + 1}-{b}" for a, b in zip(edges, edges[1:])]))
    panels = []
    for v in [x for x in ("nope", "rope") if x in runs]:
        maps = load(dirs[v]).tensors
        if "m0/maps/scores" in maps:
            m, se = maps["m0/maps/scores"].double().numpy(), maps["m0/maps/scores_se"].double().numpy()
            panels += [Panel(f"{sw.labels[v]}, layer {i + 1}", m[i], se[i]) for i in range(m.shape[0])]
    if panels:  # NoPE and RoPE are compared panel by panel: one colour scale for the whole figure
        out.append(heatmaps(ctx, "length_maps", share_limits(panels), f"Mean attention scores at 8L = {T} tokens of "
                            f"seed {sw.seeds[0]} of NoPE and RoPE (trained at L = {L}), every layer (rows: query i, "
                            "columns: key j, from 1); one colour scale for every panel, so that NoPE and RoPE "
                            "compare: its limits at the 1% and 99% quantiles of all panels' off-diagonal entries (an "
                            "entry outside them at the nearer end).",
                            ncols=len(panels) // 2 or 1, big=True, interactive=False,
                            suptitle=f"Maps past the training length (L = {L}, shown to {T})"))
    series, errors, values = {}, {}, {}
    lens = runs[next(iter(runs))].metrics["eval_lens"]
    for v, r in runs.items():
        if "maps" not in r.metrics["models"][0]:
            continue
        per_t = [_t([m["maps"][str(n)]["attn/share_mask_only"]["value"][-1] for m in r.metrics["models"]],
                    support=(0.0, math.inf)) for n in lens]  # a share of energies: >= 0; the cross term is signed
        series[sw.labels[v]] = [e["value"] for e in per_t]
        errors[sw.labels[v]] = np.array([(e["value"] - e["lo"], e["hi"] - e["value"]) if e["lo"] is not None
                                         else (0.0, 0.0) for e in per_t]).T
        values[sw.labels[v]] = per_t
    if series:
        out.append(lines(ctx, "length_leakage", lens, series,
                         "Share of the last layer's mask-only term (attn/share_mask_only: the causal softmax of "
                         "the lag profile of its scores' two-way fit, per sequence and head) in the non-relative "
                         "energy of that layer's mean log-probabilities, on the maps at each evaluation length "
                         "(offsets up to T/2; the decomposition of poslens leakage, unchanged by any constant per "
                         "query added to the scores; docs/leakage.md), mean over seeds with 95% t-intervals cut at 0 "
                         "(a share of energies; it can exceed 1, since the interaction term is signed). Values: "
                         + "; ".join(
                             f"{name}: " + ", ".join(f"T = {n} {interval_text(e)}" for n, e in zip(lens, ests))
                             for name, ests in values.items()) + ".",
                         "evaluation length T (tokens)", "mask-only share",
                         "The mask's term past the training length", errors=errors, logx=True))
    return out
