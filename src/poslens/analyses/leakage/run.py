"""`poslens leakage MODEL`: every leakage metric of a real model with intervals, key 0 in and out side by side, the
mask-only counterfactual, the interventions and the nulls as paired contrasts, the predecessor's per-head test
with its power, position 0 and sinks; one run directory (docs/leakage.md, "Real models").

An analysis on the pipeline (`poslens.engine.pipeline`), in passes over the same sequences in the same groups:
"original" (as they are), one per intervention (`interventions.prepare`: the batch changed, or a value written,
before the forward), one per null (`nulls.prepare`: windows inside the same documents, or the circular token
shift, which is also the predecessor's null) and, with the offset null, every intervention again on its windows
(`nulls.prepare_intervention`, passes "offset/SPEC"). Every pass runs `causal.LeakageMaps` (the grouped sums
every metric is a smooth function of); the original and the circular null keep the predecessor's per-sequence Delta R^2
(`predecessor.DeltaR2Rows`), the original position 0's states. `summary.summarise` turns the sums into
estimates with delete-one-group jackknife intervals, paired between passes (`contrast.contrast`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from poslens.analyses.leakage import interventions as iv
from poslens.analyses.leakage import nulls as nl
from poslens.analyses.leakage import position0 as p0
from poslens.analyses.leakage.causal import MEAN_SCORES, VARIANTS, Domains, LayerMaps, LeakageMaps, head_mean
from poslens.analyses.leakage.predecessor import DeltaR2Rows
from poslens.engine.config import DEFAULT_SEQUENCES, SEQUENCES_HELP, ModelData
from poslens.engine.pipeline import Analysis, Job, Output, Pass, dense_score_bytes, run_analysis
from poslens.engine.statistics.spec import NoOptions, Spec
from poslens.engine.stats import Estimate, Statistic, t_quantile
from poslens.errors import UsageError, check_int, require
from poslens.options import option, option_of


@dataclass
class LeakageConfig(ModelData):
    """Everything that determines a `leakage` run. The defaults (64 x 128 tokens, two interventions, two nulls,
    the predecessor) keep SmolLM2-135M under 10 minutes on 2 CPU cores (docs/leakage.md, "Cost")."""

    seq_len: int = option_of(ModelData, "seq_len", 128)
    num_sequences: int | None = option_of(ModelData, "num_sequences", 64, help=SEQUENCES_HELP)
    batch_size: int = option_of(ModelData, "batch_size", 8)
    groups: int = option_of(ModelData, "groups", 8)
    bos: str = option_of(ModelData, "bos", "always")  # Ruscio et al.'s fixed first token
    max_offset: int | None = option(None, lo=0, help="largest offset i - j in the domain (default seq_len // 2)")
    early_queries: int = option(32, lo=2, help="'early queries': i <= this")
    interventions: list[str] = option(["mean", "patch:inside:1@0"],
                                      help="interventions, each a pass contrasted with the original: mean, random, "
                                           "token:ID, nobos, freeze, shift:K, patch:SOURCE:K@L (SOURCE other, "
                                           "inside, start or mean; comma-separated; none: no intervention)")
    nulls: list[str] = option(["offset", "circular"], help="null passes: offset (windows at random offsets "
                              "inside the same documents, as they are and under every intervention), circular "
                              "(tokens after the BOS rolled); none: no null "
                              "(the predecessor's test still runs the circular pass)")
    min_offset: int = option(128, lo=1, help="the offset null's and the inside patches' windows start at least "
                                             "this many tokens into their documents")
    predecessor: bool = option(True, help="skip the predecessor's per-head linear Delta R^2 test",
                               flag="--no-predecessor")
    sink_threshold: float = option(0.3, lo=0, hi=1, open=True, help="alpha_0 above which a head counts as "
                                   "sink-reading (Gu et al.)")

    def validate(self) -> None:
        super().validate()
        check_int("early_queries", self.early_queries, 2)
        if self.early_queries > self.seq_len - 1:  # the default, 32, meets a short --seq-len here
            raise UsageError(f"early_queries ({self.early_queries}) must be below seq_len ({self.seq_len}): the early "
                             f"queries are i <= early_queries; give early_queries {self.seq_len - 1} or less",
                             param="early_queries")
        for spec in self.specs:
            iv.parse(spec)
        for name in self.nulls:
            if name not in (*nl.NULLS, "", "none"):
                raise UsageError(f"nulls: unknown null {name!r}; use {', '.join(nl.NULLS)} or none", param="nulls")
        if self.windows and self.mode != "first":
            raise UsageError("mode pack: the offset null and the inside patches need windows inside documents; use "
                             "mode first, or drop them: give nulls circular, and give interventions without "
                             "patch:inside", param="mode")
        self.domains  # noqa: B018 (max_offset's bound; the domains' sizes are checked with the model, after the
        # memory estimate: a domain mask is seq_len^2)

    def check_domains(self) -> None:
        """Refuse domains with too few entries for a fit (one line naming max_offset or early_queries)."""
        domains = self.domains
        for _, early, first_key in VARIANTS:
            try:
                domains.of(self.seq_len, early, first_key).index(self.seq_len)
            except UsageError as e:
                raise UsageError(str(e), param="max_offset" if self.max_offset is not None else "early_queries") from e

    @property
    def specs(self) -> list[str]:
        """The interventions to run ("none" and empty entries dropped)."""
        return [s for s in self.interventions if s not in ("", "none")]

    @property
    def null_passes(self) -> list[str]:
        """The nulls to run, in `nulls.NULLS` order: the circular one also when only the predecessor needs it."""
        return [n for n in nl.NULLS if n in self.nulls or (n == "circular" and self.predecessor)]

    @property
    def offset_specs(self) -> list[str]:
        """The interventions the offset null runs again on its windows: every one, when the offset null runs."""
        return list(self.specs) if "offset" in self.nulls else []

    @property
    def windows(self) -> bool:
        """Whether the run needs windows inside the documents (the offset null, an inside patch)."""
        return "offset" in self.nulls or any(iv.parse(s).source == "inside" for s in self.specs)

    @property
    def domains(self) -> Domains:
        if self.max_offset is not None:
            check_int("max_offset", self.max_offset, 1)
            require(self.max_offset <= self.seq_len - 1, f"max_offset {self.max_offset} is past the longest offset "
                                                         f"i - j of seq_len {self.seq_len}; give max_offset "
                                                         f"{self.seq_len - 1} or less")
        return Domains(max_offset=self.max_offset, early_queries=self.early_queries)


# ---------------------------------------------------------------- statistics for `poslens stat`


class MeanMaps(LeakageMaps):
    """`poslens stat leakage_maps`: the head-mean scores, log-partitions (of the scores and of their lag
    profile, `causal.lag_log_partition`) and probabilities of every layer, with intervals."""

    def result(self, level: float = 0.95) -> dict[str, torch.Tensor]:
        self.check_masks()
        out: dict[str, torch.Tensor] = {}
        lower = None
        for key in ("scores", "log_partition", "lag_log_partition", "probs"):
            def fn(m, k=key):
                x = head_mean({MEAN_SCORES: m[MEAN_SCORES]} if k == "scores" else {k: m[k]})[k]
                if x.dim() == 3:  # maps: NaN above the diagonal (keys the softmax never sees)
                    return x.masked_fill(~torch.ones(x.shape[-2:], dtype=torch.bool).tril(), math.nan)
                return x

            out.update({k: v.float() for k, v in self.sums.estimate(fn, level=level).as_dict(key).items()})
            lower = out[key]
        return {**out, "layers": torch.arange(lower.shape[0])}


class Position0(Statistic):
    """Position 0's state after the embedding and after every layer, one row per sequence (rows "states",
    [N, L + 1, d] float32, and the group of each sequence, rows "group"): what `position0.spread` measures."""

    name = "position0"

    def hooks(self, hm) -> dict:
        self._sink: list[torch.Tensor] = []
        return p0.position0_hooks(hm.n_layers, self._sink)

    def end_batch(self) -> None:
        states = self._sink.pop()
        self.rows.add("states", states)
        self.rows.add("group", torch.full((states.shape[0],), self.group % self.sums.groups))

    def spread(self, level: float = 0.95) -> Estimate:
        """D0 per entry (embedding, then every layer) with a delete-a-group jackknife interval: `position0.spread`
        of all sequences, and of the sequences outside each group in turn."""
        states, group = self.rows.get("states"), self.rows.get("group")
        value = p0.spread(states)
        kept = group.unique().tolist()
        if len(kept) < 2:
            nan = torch.full_like(value, math.nan)
            return Estimate(value, nan, nan.clone(), nan.clone(), len(kept), level, "jackknife")
        left = min(int((group != g).sum()) for g in kept)
        if left < 2:  # a replicate compares pairs of the sequences outside one group
            raise UsageError(f"position-0 spread's interval leaves one group of sequences out at a time and compares "
                             f"pairs of the rest, {left} left of {len(group)} sequences; raise num_sequences to 3 or "
                             "more")
        reps = torch.stack([p0.spread(states[group != g]) for g in kept])
        k = len(kept)
        se = torch.sqrt((k - 1) / k * ((reps - reps.mean(0)) ** 2).sum(0))
        t = t_quantile((1 + level) / 2, k - 1)
        return Estimate(value, value - t * se, value + t * se, se, k, level, "jackknife")

    def result(self, level: float = 0.95) -> dict[str, torch.Tensor]:
        """`spread` [L + 1] (after the embedding, then after each layer) with `_lo`, `_hi`, `_se`."""
        return {k: v.float() for k, v in self.spread(level).as_dict("spread").items()}


POSITION0_SPEC = Spec("position0", "how much position 0's state varies across inputs, after the embedding and each "
                      "layer (1 - mean pairwise cosine; 0: the same for every input)", NoOptions,
                      lambda hm, o, groups: Position0(groups))
MAPS_SPEC = Spec("leakage_maps", "mean head-averaged scores, log-partitions (of the scores and of their Toeplitz "
                 "projection) and attention probabilities of every layer (what `poslens leakage` measures its "
                 "metrics on)", NoOptions, lambda hm, o, groups: MeanMaps(groups))


# ---------------------------------------------------------------- the analysis


# the estimates' memory above the sums, in per-head float64 mean maps [L, H, T, T]: measured 9.3 at 256 and at 384
# tokens on SmolLM2-135M with the report's Gemma-3 passes (benchmarks/leakage_memory.py; docs/leakage.md, "Where the
# time and the memory go"), with a margin for sliding-window layers' per-window copies
ESTIMATE_MAPS = 12


class Leakage(Analysis):
    """Passes original, one per intervention, one per null; estimates and contrasts on rank 0."""

    kind = "leakage"

    def check(self, job: Job) -> None:
        cfg, tok = job.config, job.tokenizer
        if cfg.bos == "always" and getattr(tok, "bos_token_id", None) is None:
            raise UsageError("bos: this tokenizer has no BOS token; use bos never (position 0 is then a content "
                             "token and the interventions replace it)", param="bos")
        iv.check(cfg.specs, job.model, cfg.seq_len, cfg.batch_size)  # every intervention's range, before any forward
        cfg.check_domains()

    def memory(self, job: Job) -> dict[str, tuple[float, str]]:
        cfg, c = job.config, job.model.config
        L, H, T, d = job.hm.n_layers, c.num_attention_heads, cfg.seq_len, c.hidden_size
        n = cfg.num_sequences or DEFAULT_SEQUENCES
        heads, layers = 1 + len(cfg.specs), len(cfg.null_passes) + len(cfg.offset_specs)  # LeakageMaps, LayerMaps
        sums = cfg.groups * (heads * LeakageMaps.group_bytes(L, H, T) + layers * LayerMaps.group_bytes(L, H, T))
        return {"dense scores of a batch": (dense_score_bytes(cfg, job.model), "seq_len"),
                # every pass's sums, and the estimates after the passes: ESTIMATE_MAPS per-head float64 mean maps
                "grouped sums of the maps": (sums + ESTIMATE_MAPS * L * H * T * T * 8, "seq_len"),
                "per-sequence rows": (n * L * (2 * 8 * H) + n * (L + 1) * d * 4, "num_sequences")}

    def sequences(self, job: Job, documents) -> tuple[torch.Tensor, dict]:
        cfg = job.config
        if not cfg.windows:
            return super().sequences(job, documents)
        from poslens.engine.data import document_windows

        start, inside, data = document_windows(job.tokenizer, documents, cfg.seq_len,
                                               cfg.num_sequences or DEFAULT_SEQUENCES, min_offset=cfg.min_offset,
                                               seed=cfg.seed, bos=cfg.bos)
        job.inputs["inside"] = inside
        return start, data

    def passes(self, job: Job) -> list[Pass]:
        cfg, model, hm, G = job.config, job.model, job.hm, job.groups
        domains = cfg.domains
        bos_prepended = bool(job.data.get("bos_prepended"))
        reference = job.sequences[0]

        def inside(index: int, ids: torch.Tensor) -> torch.Tensor | None:
            rows = job.inputs.get("inside")
            return None if rows is None else rows[job.batch_rows(index)].to(ids.device)

        def maps(per_head: bool = True) -> LeakageMaps:  # per-head maps where per-head metrics are read
            return LeakageMaps(G, domains) if per_head else LayerMaps(G, domains)

        rows = [DeltaR2Rows(seed=cfg.seed)] if cfg.predecessor else []
        out = [Pass("original", [maps(), *rows, Position0(G)])]
        for spec in cfg.specs:
            out.append(Pass(spec, [maps()], prepare=lambda ids, index, spec=spec: iv.prepare(
                spec, model, hm, ids, reference, cfg.seed, inside=inside(index, ids), bos_prepended=bos_prepended)))
        for name in cfg.null_passes:
            out.append(Pass(name, [maps(False), *([DeltaR2Rows(seed=cfg.seed)] if name == "circular" else [])],
                            prepare=lambda ids, index, name=name: nl.prepare(
                                name, ids, inside=inside(index, ids), batch_index=index, seed=cfg.seed,
                                bos_prepended=bos_prepended)))
        for spec in cfg.offset_specs:  # every intervention again on the offset null's windows, paired by group
            out.append(Pass(nl.OFFSET_PASS + spec, [maps(False)], meta={"offset_intervention": spec},
                            prepare=lambda ids, index, spec=spec: nl.prepare_intervention(
                                spec, model, hm, ids, inside=inside(index, ids), reference=reference, seed=cfg.seed,
                                bos_prepended=bos_prepended)))
        return out

    def finish(self, job: Job, passes: list[Pass]) -> Output:
        from poslens.analyses.leakage.summary import summarise

        # many small tensor operations: one intra-op thread (a second only synchronises; on a shared machine it
        # made them 10-25 times slower in CPU time: docs/leakage.md, "Defaults and cost")
        for p in passes:  # sums kept on the device while the passes ran: to the CPU once, for the estimates
            for stat in p.statistics:
                stat.sums.to("cpu")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return summarise(job, passes)
        finally:
            torch.set_num_threads(threads)

    def figures(self, job: Job, output: Output, directory: Path) -> list[Path]:
        from poslens.analyses.leakage.figures import leakage_figures

        return leakage_figures(output.metrics, output.tensors, directory, job.label)


LEAKAGE = Leakage()


def run_leakage(cfg: LeakageConfig, out: str | Path, force: bool = False, progress: bool = True) -> Path | None:
    """Compute everything and write the run directory on rank 0 (returns its path there, None elsewhere)."""
    return run_analysis(LEAKAGE, cfg, out, force=force, progress=progress)
