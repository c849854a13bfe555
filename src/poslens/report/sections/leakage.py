"""Ruscio, Nanni & Silvestri (2026), "Where does Absolute Position come from in decoder-only Transformers?":
absolute-position leakage in a RoPE model (SmolLM2-135M) and in the parameter-free stack.

Only the paper's abstract and opening could be read (docs/leakage.md): the split of the non-relative part of the
mean log-probabilities into a logit (residual-stream) part, a log-partition (mask) part and their cross term is
poslens's reconstruction. Rows measured on another model or in the parameter-free stack carry the scope of the
paper's own measurement, so they can hold or stay not resolved but cannot contradict it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from poslens.io.results import load
from poslens.report.claims import Claim, Test, num
from poslens.report.section import Section, section
from poslens.report.sections.figures import interval_errors, lines

HEADLINE = 0.40  # the paper's printed share of the residual-stream component a BOS replacement removes


def _interval(e: dict, digits: int = 3) -> str:
    return f"{num(e['value'], digits)} [{num(e['lo'], digits)}, {num(e['hi'], digits)}]"


def leakage_claims(run: str | Path, stack: str | Path | None = None) -> tuple[list[Claim], list]:
    """Claims and context rows from a `poslens leakage` run directory and, optionally, a `poslens leakage-stack`
    run (the API behind this section; docs/leakage.md)."""
    r = load(run, tensors=False)
    m, model = r.metrics, r.config.get("model")
    level = m.get("level", 0.95)
    interval = f"{100 * level:g}% jackknife over {m.get('groups')} groups"
    early = m["per_layer_early"]
    logit, mask = early["split/e_logit"], early["split/e_partition"]
    layers = len(logit["value"])
    both = [k for k in range(layers) if logit["lo"][k] > 0 and mask["lo"][k] > 0]
    claims, context = [], []
    claims.append(Claim(
        "ruscio-both-sources", "ruscio2026", "abstract",
        "both sources leak absolute position: the causal mask (each query's softmax denominator) and the residual "
        "stream", (Test("layers whose mask part and logit part both have a lower bound above 0 (early queries)",
                        len(both), ">", 0.5),),
        measured=f"{model}, {r.meta.get('data', {}).get('sequences')} sequences of {r.config.get('seq_len')} tokens: "
                 f"both parts above 0 in {len(both)} of {layers} layers ({interval}); the split is poslens's "
                 "reconstruction (docs/leakage.md: e_partition and e_logit).",
        figure="leakage_sources", key=f"{len(both)} of {layers} layers"))
    for spec, e in m.get("interventions", {}).items():
        if spec not in ("mean", "random") and not spec.startswith("token"):
            continue
        rf = e["removed_all_layers"]
        claims.append(Claim(
            f"ruscio-bos-replacement-{spec.replace(':', '-')}", "ruscio2026", "abstract",
            "replacing the BOS embedding before the forward pass removes part of the residual-stream component at "
            "early queries", (Test(f"share of the early-query logit part removed ({spec} replacement)", rf["value"],
                                   ">", 0.0, rf["lo"], rf["hi"], interval),),
            measured=f"{model}; the paper's replacement vector and model are not public (a summary names "
                     "Llama-3.2-3B).", paper_number=f"{HEADLINE:.0%} removed at early queries",
            scope="the paper's model and replacement (not public)"))
    spread = max(abs(x) for x in m["position0_spread"])
    context.append(("position 0 is the same state for every input with a fixed first token (true by construction "
                    "under the causal mask; a test of poslens)", f"largest spread over layers {spread:.1e}"))
    s = m["sinks"]
    context.append(("attention sinks (Gu et al.'s per-head test; the paper's criterion is not public)",
                    f"sink rate {s['rate']:.3f} at {s['tokens']} tokens, {len(s['sink_heads'])} heads with attention "
                    f"on key 1 above {s['epsilon']}"))
    if stack is not None:
        a = load(stack, tensors=False).metrics["architectures"]
        last = {k: v["exact"]["share_logit"][-1] for k, v in a.items()}
        claims.append(Claim(
            "ruscio-architectures", "ruscio2026", "abstract",
            "NTK scaling suppresses the residual-stream component, sliding-window attention lets it accumulate with "
            "depth, standard RoPE sits between",
            (Test("last-layer logit share, standard - NTK (parameter-free stack, exact)",
                  last["standard"] - last["ntk"], ">", 0.0),
             Test("last-layer logit share, sliding window - standard (parameter-free stack, exact)",
                  last["sliding"] - last["standard"], ">", 0.0)),
            measured="last-layer logit share: " + ", ".join(f"{k} {v:.4f}" for k, v in last.items())
                     + "; the stack has no trained weights, while the claim is about trained models.",
            scope="trained models (Qwen, Mistral, Llama)", figure="leakage_architectures"))
    return claims, context


@section("leakage", "absolute-position leakage (Ruscio, Nanni & Silvestri)", models=True,
         quick={"sequences": 16, "seq_len": 64, "groups": 4, "stack_samples": 0, "predecessor": True},
         full={"sequences": 32, "seq_len": 128, "groups": 8, "stack_samples": 512, "predecessor": True})
def build(ctx, size: dict) -> Section:
    from poslens.analyses.leakage.command import StackLeakageOptions
    from poslens.analyses.leakage.run import LeakageConfig, run_leakage
    from poslens.analyses.leakage.stackrun import run_stack_leakage
    from poslens.io.checkpoint import fingerprint

    seqs, seq_len, groups = size["sequences"], size["seq_len"], size["groups"]
    cfg = LeakageConfig(model="smollm2-135m", seq_len=seq_len, num_sequences=seqs, batch_size=seqs // groups,
                        groups=groups, early_queries=min(32, seq_len // 2), predecessor=size["predecessor"])
    stack = StackLeakageOptions(samples=size["stack_samples"], groups=4)
    runs = {}
    for name, conf, make in (("leakage", cfg, lambda o, out: run_leakage(o, out, progress=ctx.progress)),
                             ("leakage-stack", stack, run_stack_leakage)):
        key = fingerprint({k: getattr(conf, k) for k in conf.__dataclass_fields__})[:8]
        cached = Path(ctx.parts) / f"{name}-{key}"
        if not cached.exists():
            make(conf, str(cached))
        runs[name] = Path(ctx.root) / "models" / name
        shutil.copytree(cached, runs[name])
    maps = (f"poslens leakage smollm2-135m --seq-len {seq_len} --num-sequences {seqs} --batch-size "
               f"{seqs // groups} --groups {groups} --early-queries {cfg.early_queries} --out runs/leakage; "
               f"poslens leakage-stack --samples {stack.samples} --out runs/leakage-stack")
    claims, context = leakage_claims(runs["leakage"], runs["leakage-stack"])
    for c in claims:
        c.command = ctx.remeasure(c.id)
    s = Section(
        "Absolute position in a RoPE model: the causal mask and the residual stream (Ruscio, Nanni & Silvestri, "
        "2026)",
        "Ruscio, Nanni & Silvestri (2026), 'Where does Absolute Position come from in decoder-only Transformers?', "
        "say that absolute position leaks into RoPE models through the softmax denominator of the causal mask and "
        "through the residual stream, whose position-0 trajectory is a closed system driven by the first token. Only "
        "their abstract could be read, so poslens's split of the non-relative part of the mean log-probabilities into "
        "a logit (residual-stream) part, a log-partition (mask) part and their cross term is a reconstruction "
        f"(docs/leakage.md), measured on SmolLM2-135M ({seqs} sequences of {seq_len} tokens of the embedded text, BOS "
        f"at position 1, 95% jackknife intervals) and in the parameter-free stack. The runs: `{maps}`.",
        claims=claims, context=context,
        scale=f"The leakage section measures SmolLM2-135M over {seqs} sequences of {seq_len} tokens; the paper "
              "studied 3B-7B models (Llama, Qwen, Mistral, per its abstract and a summary).")
    m = load(runs["leakage"], tensors=False).metrics["per_layer_early"]
    xs = np.arange(1, len(m["split/e_logit"]["value"]) + 1)
    names = {"log-partition term (e_partition)": "split/e_partition", "upstream logit term (e_logit)": "split/e_logit"}
    s.figures.append(lines(
        ctx, "leakage_sources", xs, {label: m[key]["value"] for label, key in names.items()},
        "Energy of the non-relative part of the mean log-probabilities at early queries, in the exact split's two "
        "terms (docs/leakage.md: a descriptive identity, not a split into causes), per layer from 1, with 95% "
        "jackknife intervals.", "layer", "non-relative energy (early queries)",
        "SmolLM2-135M: the exact split of the non-relative energy",
        errors={label: interval_errors(*(m[key][k] for k in ("value", "lo", "hi"))) for label, key in names.items()},
        logy=True))
    a = load(runs["leakage-stack"], tensors=False).metrics["architectures"]
    xs = np.arange(1, len(a["standard"]["exact"]["share_logit"]) + 1)
    s.figures.append(lines(ctx, "leakage_architectures", xs, {k: v["exact"]["share_logit"] for k, v in a.items()},
                           "Parameter-free stack (d -> infinity, exact): share of the logit part in the non-relative "
                           "energy per layer (from 1), standard RoPE, NTK-scaled RoPE and a sliding window.", "layer",
                           "logit share", "Parameter-free stack: logit share by architecture"))
    return s
