"""Seed 004's claims set beside what poslens measured: rows for `poslens reproduce`'s report (item 6)."""

from __future__ import annotations

from pathlib import Path

from poslens.io.results import load


def _interval(e: dict) -> str:
    return f"{e['value']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}]"


def leakage_section(run: str, stack: str | None = None, headline: float = 0.40) -> list[dict]:
    """Claim rows {"claim", "measured", "agrees", "note"} from a `poslens leakage` run directory and, optionally, a
    `poslens leakage-stack` run. `agrees` is True, False, or None where the comparison is not like for like."""
    r = load(run, tensors=False)
    m = r.metrics
    model = r.config.get("model")
    rows = []
    early = m["per_layer_early"]
    logit = early["split/e_logit"]
    mask = early["split/e_partition"]
    both = [l for l in range(len(logit["value"])) if logit["lo"][l] > 0 and mask["lo"][l] > 0]
    rows.append({"claim": "both sources, the causal mask and the residual stream, leak absolute position",
                 "measured": f"{model}: mask and logit parts both above zero (interval) at early queries in "
                             f"{len(both)} of {len(logit['value'])} layers",
                 "agrees": len(both) > 0, "note": "our split: e_partition and e_logit of docs/leakage.md"})
    for spec, e in m.get("interventions", {}).items():
        if spec not in ("mean", "random") and not spec.startswith("token"):
            continue
        rf = e["removed_all_layers"]
        rows.append({"claim": f"replacing the BOS embedding removes {headline:.0%} of the residual-stream component "
                              "at early queries",
                     "measured": f"{model}, {spec} replacement: removed {_interval(rf)}",
                     "agrees": bool(rf["lo"] <= headline <= rf["hi"]),
                     "note": "theirs: Llama-3.2-3B (per a summary), replacement vector unknown; ours: "
                             f"{r.meta.get('data', {}).get('sequences')} x {r.config.get('seq_len')} tokens"})
    spread = max(abs(x) for x in m["position0_spread"])
    fixed = r.meta.get("data", {}).get("bos_prepended")
    rows.append({"claim": "position 0 is a closed system: a deterministic fingerprint of the token at position 0",
                 "measured": f"max position-0 spread over layers {spread:.2e} ({'fixed BOS' if fixed else 'no BOS'})",
                 "agrees": (spread < 1e-5) if fixed else (spread > 1e-5), "note": "spread = 1 - mean pairwise cosine"})
    s = m["sinks"]
    rows.append({"claim": "attention sinks: heads that read position 0",
                 "measured": f"sink rate {s['rate']:.3f} at {s['tokens']} tokens"
                             + (f" ({s['rate_64']:.3f} at 64)" if s.get("rate_64") is not None else "") + ", "
                             f"{len(s['sink_heads'])} heads with alpha_0 > {s['epsilon']}",
                 "agrees": None, "note": "seed 004's own criterion is not public; Gu et al.'s per-head test"})
    if stack is not None:
        a = load(stack, tensors=False).metrics["architectures"]
        last = {k: v["exact"]["share_logit"][-1] for k, v in a.items()}
        rows.append({"claim": "NTK scaling suppresses the residual-stream component, sliding windows let it "
                              "accumulate with depth, standard RoPE sits between",
                     "measured": "parameter-free stack (d -> infinity), last-layer logit share: "
                                 + ", ".join(f"{k} {v:.4f}" for k, v in last.items()),
                     "agrees": bool(last["ntk"] < last["standard"] < last["sliding"]),
                     "note": "no trained weights in the stack: the NTK effect is a property of trained models"})
    return rows


# like-for-like comparisons: a mechanism claim measured on our model can hold or be contradicted; a number measured
# by seed 004 on another model (or a claim about trained models checked in the parameter-free stack) cannot.
_LIKE_FOR_LIKE = ("both sources", "position 0 is a closed system")


def reproduce_section(ctx, quick: bool = False):
    """Seed 004 in `poslens reproduce`: `poslens leakage smollm2-135m` and `poslens leakage-stack` (cached in the
    reproduce parts directory under a fingerprint of their settings), as a report Section with one verdict per
    claim. Verdicts: holds / contradicted for mechanism claims measured on our model; not resolved where seed 004's
    number comes from another model (Llama-3.2-3B) or the claim is about trained models; context otherwise."""
    import shutil

    from poslens.analyses.leakage.command import StackLeakageOptions
    from poslens.analyses.leakage.run import LeakageConfig, run_leakage
    from poslens.analyses.leakage.stackrun import run_stack_leakage
    from poslens.io.checkpoint import fingerprint
    from poslens.report.render import CONTEXT, Claim, Section

    seqs, seq_len, groups = (16, 64, 4) if quick else (32, 128, 8)
    cfg = LeakageConfig(model="smollm2-135m", seq_len=seq_len, num_sequences=seqs, batch_size=seqs // groups,
                        groups=groups, early_queries=min(32, seq_len // 2))
    stack = StackLeakageOptions(samples=0 if quick else 512, groups=4)  # 4 blocks of 128 samples: one per group
    runs = {}
    for name, conf, make in (("leakage", cfg, lambda o, out: run_leakage(o, out, progress=ctx.progress)),
                             ("leakage-stack", stack, run_stack_leakage)):
        key = fingerprint({k: getattr(conf, k) for k in conf.__dataclass_fields__})[:8]
        cached = Path(ctx.parts) / f"{name}-{key}"
        if not cached.exists():
            make(conf, str(cached))
        runs[name] = Path(ctx.root) / "models" / cached.name
        shutil.copytree(cached, runs[name])
    rows = leakage_section(str(runs["leakage"]), str(runs["leakage-stack"]))
    command = (f"poslens leakage smollm2-135m --seq-len {seq_len} --num-sequences {seqs} --batch-size "
               f"{seqs // groups} --groups {groups}; poslens leakage-stack")
    s = Section("Absolute position in a RoPE model: the causal mask and the residual stream (seed 004)",
                "Ruscio et al. (2026) say absolute position leaks into RoPE models through the softmax denominator "
                "of the causal mask and through the residual stream, whose position-0 trajectory is a closed "
                "system driven by the first token. poslens splits the non-relative part of the mean "
                "log-probabilities into a logit (residual-stream) part, a log-partition (mask) part and their cross "
                "term (docs/leakage.md; seed 004's own formulas are not public, so this split is our "
                f"reconstruction), on SmolLM2-135M ({seqs} sequences of {seq_len} tokens of the embedded text, BOS "
                "at position 0, 95% jackknife intervals) and in the parameter-free stack.")
    for fig in sorted((runs["leakage"] / "figures").glob("*.png"))[:2] + \
            sorted((runs["leakage-stack"] / "figures").glob("architectures_exact*.png")):
        s.figures.append((fig, fig.stem.replace("_", " ")))
    for row in rows:
        like = row["claim"].startswith(_LIKE_FOR_LIKE)
        if row["agrees"] is None:
            verdict = CONTEXT
        elif row["agrees"]:
            verdict = "holds"
        else:
            verdict = "contradicted" if like else "not resolved"
        note = row["note"] + ("" if like or row["agrees"] is not False else
                              "; resolving it needs seed 004's own model and settings")
        s.claims.append(Claim(row["claim"], "seed 004", f"{row['measured']} ({note})", verdict,
                              "leakage figures", command))
    return s
