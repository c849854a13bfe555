"""The sweep's trained models for report sections: one shared, cached way to get them.

`poslens sweep`'s matrix (variants x seeds trained on identical tokens, batches and steps; `poslens.train.sweep`)
is what the report's sections judge training effects on: each section that needs it calls `sweep_models`, which
trains what the model cache lacks (progress lines name each model, k of N, and the time left) and reads the
rest from the cache, so the first section pays and every later call (another section, a re-measure, another
reproduce) is free. How to call it from a section:

    from poslens.report.sweep import SWEEP_FULL, SWEEP_QUICK, sweep_models

    @section("length", "...", models=True, quick={**SWEEP_QUICK, "n": 8}, full={**SWEEP_FULL, "n": 50})
    def build(ctx, size):
        sw = sweep_models(ctx, size)            # size["sweep"]: pe-quick (--quick) or pe-sinks (the full run)
        for variant in sw.variants:             # nope, rope, ntk, window (the preset's order)
            for seed in sw.seeds:               # 0, 1, 2
                path = sw.path(variant, seed)   # a model directory: load_model(str(path)), data=str(sw.tokens)
        sw.heldout("rope")                      # held-out loss per seed (the sweep's last evaluation)
        sw.command                              # `poslens sweep ...` that trains (or lists) the same models

The size keys (`SWEEP_QUICK`, `SWEEP_FULL`; tests override them through `reproduce(sizes=...)`):

    sweep        the matrix: a preset of `poslens sweep` (pe, pe-quick) or a .json file
    sweep_train  shared training fields on top of the preset's, FIELD=VALUE+... (None: the preset's); a test
                 trains a tiny sweep with e.g. "steps=6+warmup=2+layers=2+eval_every=3+save_every=0+tokens=DIR"
    sweep_seeds  the seeds instead of the preset's (None: the preset's)

Every model is recorded in the report's provenance (`ctx.record`: its directory, 'trained now' or 'from the
cache', SHA-256). Two sections that ask for the same matrix get the same `SweepModels` (kept on the context).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from poslens.report.claims import Test
from poslens.report.context import with_cache
from poslens.train.sweep import Matrix, SweepConfig, resolve_matrix, seed_interval

SWEEP_QUICK = {"sweep": "pe-quick", "sweep_train": None, "sweep_seeds": None}
# the full run trains `pe-sinks` (8 heads of 8, 2,000 steps of 8 x 64 tokens at lr 0.04: 13.3 min on two cores, a
# size at which every model of the matrix formed sink heads; BENCHMARKS.md "Sweep"); the 1,000-step `pe` takes
# 24 min and forms none. Another matrix: reproduce(sizes={"leakage": {"sweep": "pe"}, "length": {"sweep": "pe"}})
SWEEP_FULL = {"sweep": "pe-sinks", "sweep_train": None, "sweep_seeds": None}


@dataclass
class SweepModels:
    """The trained models of one matrix: `paths[(variant, seed)]`, the token directory they were trained on (its
    held-out split is the text to analyse), the matrix, and what each model's run.json says."""

    config: SweepConfig
    matrix: Matrix
    paths: dict[tuple[str, int], Path]
    tokens: Path
    trained: list[tuple[str, int]] = field(default_factory=list)  # the members this call trained (not cached)

    @property
    def variants(self) -> list[str]:
        return list(self.matrix.variants)

    @property
    def seeds(self) -> list[int]:
        return list(self.matrix.seeds)

    @property
    def labels(self) -> dict[str, str]:
        """variant -> its positional encoding in words ('RoPE (NTK x8)', ...)."""
        return {m.variant: m.label for m in self.matrix.members}

    def path(self, variant: str, seed: int) -> Path:
        return self.paths[(variant, seed)]

    def run(self, variant: str, seed: int) -> dict:
        """The model's training run.json (config, metrics, tokens)."""
        import json

        return json.loads((self.path(variant, seed) / "run.json").read_text())

    def heldout(self, variant: str) -> list[float]:
        """Final held-out loss of `variant`, one per seed (in `seeds` order)."""
        return [float(self.run(variant, s)["metrics"]["final_eval_loss"]) for s in self.seeds]

    def heldout_interval(self, variant: str, level: float = 0.95) -> dict:
        """Mean held-out loss over seeds with its t-interval over seeds (`poslens.train.sweep.seed_interval`)."""
        return seed_interval(self.heldout(variant), level)

    @property
    def command(self) -> str:
        """The `poslens sweep` command that trains (or, when cached, lists) these models."""
        argv = ["poslens", "sweep", "--preset", self.config.preset]
        if self.config.train:
            argv += ["--train", self.config.train]
        if self.config.seeds is not None:
            argv += ["--seeds", ",".join(map(str, self.config.seeds))]
        return with_cache(shlex.join(argv + ["--out", "runs/sweep"]))

    MACHINE = ("Training is bit-identical when repeated on one machine, not across processors whose CPU kernels "
               "differ (torch's AVX2 against AVX-512: the provenance names both the processor of this run and the one "
               "that trained each cached model), and over the sweep's steps such models drift apart: on two machines "
               "four rows on them came out with different verdicts (README, 'What the paper says'). A row on them "
               "is a statement about these seeds of these tiny models.")

    def short(self) -> str:
        """'the pe-sinks sweep (4 variants x 3 seeds; described in the section's text)': a row's pointer to the
        description a section gives once."""
        return (f"the {self.config.preset} sweep ({len(self.variants)} variants x {len(self.seeds)} seeds; described "
                "in the section's text)")

    def describe(self) -> str:
        """'4 variants (nope: NoPE, ...) x 3 seeds, 4 layers, d = 64, 4 heads sharing 2 key/value heads, RMSNorm
        (SmolLM3 architecture), 300 steps of 16 x 128 tokens (AdamW, learning rate ...), BOS first (...)'."""
        c = self.matrix.members[0].config
        heads = f"{c.heads} heads" + (f" sharing {c.kv_heads} key/value heads" if c.kv_heads != c.heads else "")
        bos = ", BOS first" if c.bos else ""
        conventions = {m.variant: (m.config.bos, m.config.blocks) for m in self.matrix.members}
        if len(set(conventions.values())) > 1:  # the data convention is a factor of this matrix: say it per variant
            bos = ", blocks per variant: " + ", ".join(
                f"{v}: {'document starts' if blocks == 'doc-start' else 'packed cuts'}, "
                f"{'BOS first' if b else 'no BOS'}" for v, (b, blocks) in conventions.items())
        if any(m.config.bos for m in self.matrix.members) and self.tokens is not None:
            from poslens.io.tokenfile import open_tokens

            tf = open_tokens(self.tokens, check=())
            if tf.header.get("bos_token_id") == tf.separator_id:
                bos += (f" (id {tf.separator_id}, the tokenizer's document separator, which also marks document "
                        "boundaries inside the packed blocks)")
        return (f"{len(self.variants)} variants ({', '.join(f'{v}: {k}' for v, k in self.labels.items())}) x "
                f"{len(self.seeds)} seeds, {c.layers} layers, d = {c.hidden}, {heads}, RMSNorm (SmolLM3 "
                f"architecture), {c.steps} steps of {c.batch_size} x {c.seq_len} tokens (AdamW, learning rate {c.lr:g} "
                f"after {c.warmup} warm-up steps, cosine to {c.min_lr_ratio:g} of it, weight decay {c.weight_decay:g})"
                f"{bos}")


def combine_seeds(results: list):
    """Per-seed results of one shape (nested dicts and lists) -> that shape with every estimate (a dict with "value",
    "lo", "hi": an interval over one model's sequences) replaced by the t-interval over seeds of its per-seed values
    (`seed_interval`; the per-seed values under "per_seed"; an estimate's "support", the range it cannot leave,
    cuts the interval; each seed's half-width over the text is added in quadrature, `half_width`); other leaves
    are the first seed's."""
    first = results[0]
    if isinstance(first, dict):
        if {"value", "lo", "hi"} <= first.keys():
            return seed_interval([r["value"] for r in results], support=first.get("support"),
                                 shared=[half_width(r) for r in results])
        return {k: combine_seeds([r[k] for r in results]) for k in first}
    if isinstance(first, list):
        return [combine_seeds(list(col)) for col in zip(*results)]
    return first


def half_width(e: dict) -> float:
    """Half the width of one model's interval before it was cut to its support: t * se of a jackknife interval
    with a "support" (a cut interval is narrower than the sampling noise it stands for), else (hi - lo) / 2 (NaN
    without an interval)."""
    if e.get("support") is not None and e.get("method") == "jackknife" and e.get("se") is not None \
            and e.get("groups", 0) >= 2:
        from poslens.engine.stats import t_quantile

        return t_quantile((1 + e["level"]) / 2, e["groups"] - 1) * e["se"]
    return (e["hi"] - e["lo"]) / 2 if e["lo"] is not None and e["hi"] is not None else math.nan


MANY_SEEDS = 24  # beyond this a seed list is no command to hand a reader: the count alone is given


def seeds_needed(test: Test, n: int, level: float = 0.95, most: int = 10_000) -> int | None:
    """Seeds at which `test`'s t-interval over `n` seeds would just exclude its threshold if the mean and the spread
    over seeds stayed as they are: the smallest m with sqrt((t_{m-1} sd / sqrt(m))^2 + floor^2) < |mean - threshold|,
    `floor` the half-width of the text every seed read, which more seeds do not shrink (None: no interval, a mean on
    the threshold, a floor at least the gap, or more than `most`)."""
    from poslens.engine.stats import t_quantile

    p, gap = (1 + level) / 2, abs(test.value - test.threshold)
    if n < 2 or test.exact or not (math.isfinite(test.lo) and math.isfinite(test.hi) and gap > 0):
        return None
    floor = test.floor or 0.0
    if floor >= gap:
        return None
    seeds_half = math.sqrt(max(((test.hi - test.lo) / 2) ** 2 - floor ** 2, 0.0))
    sd = seeds_half * math.sqrt(n) / t_quantile(p, n - 1)

    def narrow(m: int) -> bool:  # the half-width at m seeds is below the gap (it falls as m grows)
        return math.hypot(t_quantile(p, m - 1) * sd / math.sqrt(m), floor) < gap

    if not narrow(most):
        return None
    lo, hi = n, most
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if narrow(mid) else (mid + 1, hi)
    return lo


def more_seeds(sw, tests: tuple[Test, ...], scoped: bool = False) -> str:
    """What would decide a row of t-intervals over the sweep's seeds: more seeds, as many as its slowest open test
    needs at the present means and spreads (`seeds_needed`), with the `poslens sweep` command that trains them.
    `scoped`: the row is about a larger scale, where a failure reads not resolved, so the line does not say that
    more seeds would decide it against the claim (`Claim.resolve_line` says what a failure would mean)."""
    n = len(sw.seeds)
    needs = {t: seeds_needed(t, n) for t in tests if t.outcome() == "open"}
    need = list(needs.values())
    if not need:
        return ""
    text = [t for t in tests if t.outcome() == "open" and t.floor is not None and math.isfinite(t.value)
            and t.floor >= abs(t.value - t.threshold)]
    if text:
        return (f"more held-out text as well as more seeds: every seed reads the same held-out sequences, and that "
                f"sample's own interval (half-width {text[0].floor:.3g}) is wider than the distance of the estimate "
                f"from the threshold ({abs(text[0].value - text[0].threshold):.3g}), which no number of seeds "
                f"would shrink")
    if None in need:
        return (f"more seeds of the sweep (each interval is over its {n} seeds; no count follows from a mean on the "
                f"threshold or from one seed): `{sw.command}` with more --seeds")
    against = [t for t in tests if t.outcome() == "open" and t.against()]
    first_fail = min((needs[t] for t in against if needs[t] is not None), default=None)
    head = (f"more seeds of the sweep (each interval is a t-interval over its seeds): about {max(need):,} to resolve "
            f"every open test at the present means and spreads over seeds, against {n} here"
            + (f"; {_count(against, len(need))} on the failing side, so at the present means about "
               f"{first_fail:,} would decide the row against the claim" if against and not scoped and first_fail
               else ""))
    if max(need) > MANY_SEEDS:
        return head + " (the effect is small next to its spread over seeds: a larger effect, e.g. a longer-trained "\
                      "model, would decide it sooner than that many seeds)"
    seeds = sw.seeds + [max(sw.seeds) + k for k in range(1, max(need) - n + 1)]
    return head + f": `{replace(sw, config=replace(sw.config, seeds=seeds)).command}`"


def _count(tests: list, open_tests: int) -> str:
    """'its open test estimates' / '2 of the 3 open tests estimate'."""
    if open_tests == 1:
        return "its open test estimates"
    return f"{len(tests)} of the {open_tests} open tests estimate{'s' if len(tests) == 1 else ''}"


def resolve_by_seeds(sw, claims, default=None) -> None:
    """Put the seeds that would decide each not-resolved row of intervals over the sweep's seeds (`more_seeds`)
    before its resolve line; `default(claim)`: the line for a row that has neither."""
    for c in claims:
        if c.verdict == "not resolved":
            c.resolve = "; or ".join(x for x in (more_seeds(sw, c.tests, bool(c.scope)), c.resolve) if x) or (
                default(c) if default else "")


def sweep_config(size: dict) -> SweepConfig:
    """The `SweepConfig` of a section's sizes (keys `sweep`, `sweep_train`, `sweep_seeds`; module docstring)."""
    seeds = size.get("sweep_seeds")
    return SweepConfig(preset=size.get("sweep", "pe"), train=size.get("sweep_train"),
                       seeds=None if seeds is None else [int(s) for s in seeds])


def planned_sweeps(steps) -> list[SweepConfig]:
    """Every matrix the sections of a run (`poslens.report.reproduce.plan`'s (spec, size) pairs) will read through
    `sweep_models`: each model section's ``sweep`` and every other size key ending in ``_sweep`` (the leakage
    section's ``bos_sweep``), with that section's ``sweep_train`` and ``sweep_seeds``; each matrix once."""
    out: dict[tuple, SweepConfig] = {}
    for spec, size in steps:
        if not spec.models:
            continue
        for key in sorted(k for k in size if k == "sweep" or k.endswith("_sweep")):
            cfg = sweep_config({**size, "sweep": size[key]})
            out.setdefault((cfg.preset, cfg.train, None if cfg.seeds is None else tuple(cfg.seeds)), cfg)
    return list(out.values())


def train_sweeps(ctx, configs: list[SweepConfig], progress: bool | None = None) -> list[Path]:
    """Train, as one set, every model of the matrices `configs` that the model cache lacks, before any section
    asks (`poslens.train.sweep.train_models` on the union: a model two matrices share, e.g. standard RoPE on
    packed cuts, once; models of one shape in one computation whatever their matrix, so the few models one matrix
    adds train beside the others' instead of in parts of their own, each part paying the per-step overhead and
    the compiling again). Returns the model directories trained now; `sweep_models` then finds every model in the
    cache and records these as trained now."""
    from poslens.train.cache import tokens_of
    from poslens.train.sweep import train_models

    progress = ctx.progress if progress is None else progress
    work: dict[Path, list[tuple]] = {}  # token directory -> (configuration, progress label) of each member
    for cfg in configs:
        matrix = resolve_matrix(cfg)
        tokens = tokens_of(matrix.members[0].config, progress)
        work.setdefault(tokens, []).extend(
            (m.config, f"{cfg.preset} {m.variant} ({m.label}), seed {m.seed}") for m in matrix.members
            if not _done(m.config, tokens))
    trained: list[Path] = []
    for todo in work.values():
        if not todo:
            continue
        if progress:
            print(f"  sweeps {', '.join(c.preset for c in configs)}: {len(todo)} models to train as one set",
                  flush=True)
        heads = [(c, f"[{k}/{len(todo)}] {h}") for k, (c, h) in enumerate(todo, 1)]
        trained += train_models(heads, progress, configs[0].jobs, configs[0].batched, configs[0].compile)
    ctx.__dict__.setdefault("_trained_now", set()).update(trained)
    return trained


def sweep_models(ctx, size: dict | SweepConfig, progress: bool | None = None) -> SweepModels:
    """The trained models of the sweep named by `size` (a section's sizes, or a `SweepConfig`): trained now into the
    model cache where it lacks them, else read from it; kept on `ctx`, so a second call is free. Progress lines
    (`ctx.progress` unless `progress` says otherwise) name the matrix, then each model trained."""
    from poslens.io.checkpoint import fingerprint
    from poslens.train.cache import tokens_of
    from poslens.train.sweep import train_matrix

    cfg = size if isinstance(size, SweepConfig) else sweep_config(size)
    progress = ctx.progress if progress is None else progress
    memo = ctx.__dict__.setdefault("_sweeps", {})
    matrix = resolve_matrix(cfg)
    key = fingerprint({"train": matrix.train, "variants": matrix.variants, "seeds": matrix.seeds})
    if key in memo:
        return memo[key]
    tokens = tokens_of(matrix.members[0].config, progress)
    cached = {(m.variant, m.seed) for m in matrix.members if _done(m.config, tokens)}
    if progress:
        n = len(matrix.members)
        print(f"  sweep {cfg.preset}: {len(matrix.variants)} variants x {len(matrix.seeds)} seeds = {n} models, "
              f"{len(cached)} in the model cache, {n - len(cached)} to train", flush=True)
    paths = train_matrix(matrix, progress=progress, jobs=cfg.jobs, compile=cfg.compile)
    now = ctx.__dict__.get("_trained_now", set())  # trained by this run's `train_sweeps`, before any section asked
    out = SweepModels(cfg, matrix, paths, tokens, [k for k, p in paths.items() if k not in cached or p in now])
    ctx.record(f"sweep {cfg.preset} tokens", tokens, "the embedded corpus tokenized once into the cache (train and "
               "held-out splits: every sweep model trained on it, and every measurement on them reads its held-out "
               "split)")
    for (variant, seed), path in paths.items():
        ctx.record(f"sweep {variant} seed {seed}", path,
                   "trained now" if (variant, seed) in out.trained else f"from the cache ({_trained_by(path)})")
    memo[key] = out
    return out


def _trained_by(path: Path) -> str:
    """'trained by git 3611901... on 2026-11-26 17:10 UTC', from the model's own run.json (an older poslens did not
    record them: then it says so)."""
    from poslens.errors import UsageError
    from poslens.io.results import load

    try:
        env = load(path, tensors=False).meta.get("environment", {})
    except (UsageError, OSError, ValueError):
        env = {}
    if "source" not in env:
        return "trained by a poslens that did not record its source revision or date"
    cpu = (f", {env['cpu']} with torch's {env['cpu_capability']} kernels" if env.get("cpu_capability") else
           ", on a processor it did not record (poslens records it since 2026-11-26)" if not env.get("gpu") else "")
    return f"trained by {env['source']} on {env.get('date', 'an unrecorded date')}{cpu}"


def _done(cfg, tokens: Path) -> bool:
    from poslens.train.cache import trained_model_dir

    return (trained_model_dir(cfg, tokens) / "run.json").is_file()
