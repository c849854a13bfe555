"""`poslens leakage MODEL`: every leakage metric of a real model with intervals, the BOS interventions, the
predecessor's per-head test, position 0 and sinks; one run directory (docs/leakage.md).

An analysis on the pipeline (`poslens.engine.pipeline`), in passes over the same sequences: "orig" (as they are),
one per intervention (`interventions.prepare`: the batch changed, or a value written, before the forward), and
"null" (the predecessor's circular token shift) when `predecessor` is on. `LeakageMaps` reads the dense scores of
every layer through `attn.hook_attn_scores` and adds, per group of sequences (batch b -> group b mod G), the
head-mean scores, log-partitions and probabilities; the metrics are functions of those means, with
delete-one-group jackknife intervals (poslens.engine.stats). Per-sequence values (the predecessor's Delta R^2 of
every head, position 0's states) are rows, gathered over torchrun ranks rather than summed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from poslens.analyses.leakage import interventions as iv
from poslens.analyses.leakage import position0 as p0
from poslens.analyses.leakage import predecessor as pr
from poslens.analyses.leakage.metrics import Domain, leakage_metrics, split
from poslens.engine.config import ModelData
from poslens.engine.pipeline import Analysis, Job, Output, Pass, dense_score_bytes, run_analysis
from poslens.engine.statistics.spec import NoOptions, Spec
from poslens.engine.stats import Estimate, GroupedSums, Statistic, t_quantile
from poslens.errors import UsageError, check_int
from poslens.options import option, option_of


@dataclass
class LeakageConfig(ModelData):
    """Everything that determines a `leakage` run."""

    seq_len: int = option_of(ModelData, "seq_len", 128)
    num_sequences: int | None = option_of(ModelData, "num_sequences", 64)
    batch_size: int = option_of(ModelData, "batch_size", 8)
    groups: int = option_of(ModelData, "groups", 8)
    bos: str = option_of(ModelData, "bos", "always")  # Ruscio et al.'s fixed first token
    max_offset: int | None = option(None, lo=0, help="largest offset i - j in the domain (default seq_len // 2)")
    early_queries: int = option(32, lo=2, help="'early queries': i <= this (the interventions' domain)")
    first_key: bool = option(True, help="leave key 0 (the sink column) out of the domain", flag="--no-first-key")
    interventions: list[str] = option(["mean"], help="position-0 interventions: mean, random, token:ID, nobos, "
                                                     "freeze, shift:K (comma-separated; none: no intervention)")
    predecessor: bool = option(True, help="skip the predecessor's per-head linear Delta R^2 test (and its "
                                          "shifted-token pass)", flag="--no-predecessor")
    sink_threshold: float = option(0.3, lo=0, hi=1, open=True, help="alpha_0 above which a head counts as "
                                   "sink-reading (Gu et al.)")

    def validate(self) -> None:
        super().validate()
        check_int("early_queries", self.early_queries, 2, self.seq_len - 1)
        for spec in self.specs:
            iv.parse(spec)

    @property
    def specs(self) -> list[str]:
        """The interventions to run ("none" and empty entries dropped)."""
        return [s for s in self.interventions if s not in ("", "none")]


def domain(cfg: LeakageConfig, n: int, early: bool = False, window: int | None = None) -> Domain:
    """The metrics' domain for maps of size n (early: queries i <= early_queries)."""
    top = None if cfg.max_offset is None else min(cfg.max_offset, n - 1)
    dom = Domain(max_offset=top, first_key=cfg.first_key, max_query=cfg.early_queries if early else None,
                 window=window or None)
    dom.index(n)
    return dom


# ---------------------------------------------------------------- statistics


class LeakageMaps(Statistic):
    """One pass's attention, read as dense scores [B, H, T, T] at every layer: head-mean scores, log-partitions and
    probabilities per layer into the grouped sums (`maps`), the per-head probabilities summed over all sequences
    (`per_head`, in `self.heads`), and every sequence's linear Delta R^2 of every head (`dr2`, rows "dr2")."""

    name = "leakage_maps"
    KEYS = ("scores", "log_partition", "probs")

    def __init__(self, n_layers: int, groups: int, *, maps: bool = True, per_head: bool = False, dr2: bool = False,
                 seed: int = 0) -> None:
        super().__init__(groups)
        self.n_layers, self.maps, self.per_head, self.dr2, self.seed = n_layers, maps, per_head, dr2, seed
        self.heads = GroupedSums(1)  # per-head probabilities: one total over every sequence
        self._rows: list[torch.Tensor] = []
        self._batch = 0

    def hooks(self, hm) -> dict:
        return {f"blocks.{l}.attn.hook_attn_scores": self._hook(l) for l in range(self.n_layers)}

    def _hook(self, l: int):
        def hook(s, ctx):
            b, h, t, _ = s.shape
            self._batch = b
            s = s.float()
            lse = torch.logsumexp(s, -1)  # [B, H, T]: -inf keys drop out
            probs = torch.exp(s - lse[..., None])
            scores = torch.where(torch.isfinite(s), s, 0.0)
            L, g, f32 = self.n_layers, self.group, torch.float32
            if self.maps:  # maps: float32 sums of float32 values (as the capture engine); log-partitions in float64
                self.sums.buffer("scores", g, (L, t, t), dtype=f32)[l] += scores.sum((0, 1)).cpu() / h
                self.sums.buffer("log_partition", g, (L, t))[l] += lse.sum((0, 1)).double().cpu() / h
                self.sums.buffer("probs", g, (L, t, t), dtype=f32)[l] += probs.sum((0, 1)).cpu() / h
            if self.per_head:
                self.heads.buffer("probs", 0, (L, h, t, t), dtype=f32)[l] += probs.sum(0).cpu()
            if self.dr2:
                if ctx.window and ctx.window < t:  # the predecessor's design assumes every causal pair is seen
                    self._rows.append(torch.full((b, h), float("nan"), dtype=torch.float64))
                else:
                    self._rows.append(pr.linear_delta_r2(scores.double().cpu(), seed=self.seed))  # [B, H]
                if l == L - 1:
                    self.rows.add("dr2", torch.stack(self._rows, 1))  # [B, L, H]
                    self._rows = []
            return None

        return hook

    def end_batch(self) -> None:
        if self.maps:
            for key in self.KEYS:
                self.sums.count_buffer(key, self.group).add_(self._batch)
        if self.per_head:
            self.heads.count_buffer("probs", 0).add_(self._batch)

    def mean_heads(self) -> torch.Tensor:
        """Mean attention probabilities per layer and head [L, H, T, T] (float32, over every sequence)."""
        return self.heads.sums["probs"][0] / self.heads.counts["probs"][0]

    def result(self, level: float = 0.95) -> dict[str, torch.Tensor]:
        """Mean `scores`, `log_partition`, `probs` per layer with `_lo`, `_hi`, `_se` (delete-a-group jackknife);
        NaN above the diagonal (keys the softmax never sees)."""
        out: dict[str, torch.Tensor] = {}
        for key in self.KEYS:
            def seen(m, k=key):
                x = m[k]
                return x if k == "log_partition" else x.masked_fill(~torch.ones(x.shape[-2:], dtype=torch.bool)
                                                                    .tril(), float("nan"))

            out.update(self.sums.estimate(seen, level=level).as_dict(key))
        return {**{k: v.float() for k, v in out.items()}, "layers": torch.arange(self.n_layers)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **{f"heads/{k}": v for k, v in self.heads.state_dict().items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.heads.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("heads/")})

    def merge(self, other: LeakageMaps) -> None:
        super().merge(other)
        self.heads.merge(other.heads)

    def all_reduce(self, group=None) -> None:
        super().all_reduce(group)
        self.heads.all_reduce(group)


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
MAPS_SPEC = Spec("leakage_maps", "mean head-averaged scores, log-partitions and attention probabilities of every "
                 "layer (what `poslens leakage` measures its metrics on)", NoOptions,
                 lambda hm, o, groups: LeakageMaps(hm.n_layers, groups))


# ---------------------------------------------------------------- the analysis


class Leakage(Analysis):
    """Passes orig, one per intervention, and the predecessor's null; metrics with intervals on rank 0."""

    kind = "leakage"

    def check(self, job: Job) -> None:
        cfg, tok = job.config, job.tokenizer
        if cfg.bos == "always" and getattr(tok, "bos_token_id", None) is None:
            raise UsageError("bos: this tokenizer has no BOS token; use bos never (position 0 is then a content "
                             "token and the interventions replace it)", param="bos")
        iv.check(cfg.specs, job.model, cfg.seq_len, cfg.batch_size)  # every intervention's range, before any forward
        domain(cfg, cfg.seq_len)  # too few entries for a fit: refused before any sequence is cut

    def memory(self, job: Job) -> dict[str, tuple[float, str]]:
        cfg, c = job.config, job.model.config
        L, H, T = job.hm.n_layers, c.num_attention_heads, cfg.seq_len
        n = cfg.num_sequences or 0
        passes = 1 + len(cfg.specs)
        return {"dense scores of a batch": (dense_score_bytes(cfg, job.model), "seq_len"),
                "grouped sums of the maps": (passes * cfg.groups * L * (8 * T * T + 8 * T), "seq_len"),
                "per-head attention": (L * H * T * T * 4, "seq_len"),
                "per-sequence rows": (n * L * (2 * 8 * H + 4 * c.hidden_size), "num_sequences")}

    def passes(self, job: Job) -> list[Pass]:
        cfg, model, hm = job.config, job.model, job.hm
        L, G = hm.n_layers, job.groups
        out = [Pass("orig", [LeakageMaps(L, G, per_head=True, dr2=cfg.predecessor, seed=cfg.seed), Position0(G)])]
        reference = job.sequences[0]
        for spec in cfg.specs:
            out.append(Pass(spec, [LeakageMaps(L, G)],
                            prepare=lambda ids, index, spec=spec: iv.prepare(spec, model, hm, ids, reference,
                                                                              cfg.seed)))
        if cfg.predecessor:
            keep = 1 if job.data.get("bos_prepended") else 0
            out.append(Pass("null", [LeakageMaps(L, G, maps=False, dr2=True, seed=cfg.seed)],
                            prepare=lambda ids, index: (null_ids(ids, index, cfg.seed, keep), {}, None)))
        return out

    def finish(self, job: Job, passes: list[Pass]) -> Output:
        cfg = job.config
        orig, position = passes[0].statistics
        joint = GroupedSums(job.groups)  # every pass's sums under one roof: joint jackknife replicates
        for p in passes:
            maps = p.statistics[0]
            if maps.maps:
                prefix = "orig" if p.name == "orig" else f"iv/{p.name}"
                joint.sums.update({f"{prefix}/{k}": v for k, v in maps.sums.sums.items()})
                joint.counts.update({f"{prefix}/{k}": v for k, v in maps.sums.counts.items()})
        dr2 = {p.name: p.statistics[0].rows.get("dr2") for p in passes if p.name in ("orig", "null")}
        windows = [int(w or 0) for w in _windows(job.model)]
        metrics, tensors = summarise(cfg, joint, orig.mean_heads(), dr2, position.spread(cfg.level), windows,
                                     [p.name for p in passes])
        return Output(tensors, metrics)

    def figures(self, job: Job, output: Output, directory: Path) -> list[Path]:
        from poslens.analyses.leakage.figures import leakage_figures

        return leakage_figures(output.metrics, output.tensors, directory, job.label)


LEAKAGE = Leakage()


def run_leakage(cfg: LeakageConfig, out: str | Path, force: bool = False, progress: bool = True) -> Path | None:
    """Compute everything and write the run directory on rank 0 (returns its path there, None elsewhere)."""
    return run_analysis(LEAKAGE, cfg, out, force=force, progress=progress)


def null_ids(ids: torch.Tensor, index: int, seed: int, keep: int) -> torch.Tensor:
    """The predecessor's null input for batch `index` of the run: each sequence circularly shifted by a random
    offset (seeded by the run's seed and the batch index), the first `keep` positions (a BOS) in place."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    shifts = torch.randint(1, ids.shape[1] - keep, (ids.shape[0],), generator=g)
    return pr.circular_shift(ids.cpu(), shifts, keep).to(ids.device)


def _windows(model) -> list[int]:
    from poslens.engine.families import sliding_windows

    return sliding_windows(model.config)


def _early_logit(means: dict, name: str, cfg: LeakageConfig, windows: list[int]) -> torch.Tensor:
    """E_logit over the early-query domain per layer (each with its window), then their sum (last entry)."""
    s, lp = means[f"{name}/scores"], means[f"{name}/log_partition"]
    n = s.shape[-1]
    e = torch.stack([split(s[l], lp[l], domain(cfg, n, True, w or None))["e_logit"] for l, w in enumerate(windows)])
    return torch.cat([e, e.sum()[None]])


def _per_layer_metrics(means: dict, prefix: str, cfg: LeakageConfig, windows: list[int], early: bool) -> torch.Tensor:
    """leakage_metrics per layer (each layer with its own window), stacked [M, L] in METRIC_NAMES order."""
    cols = []
    n = means[f"{prefix}/scores"].shape[-1]
    for l, w in enumerate(windows):
        dom = domain(cfg, n, early=early, window=w or None)
        m = {k: means[f"{prefix}/{k}"][l] for k in ("scores", "log_partition", "probs")}
        m["log_probs"] = m["scores"] - m["log_partition"][:, None]
        vals = leakage_metrics(m, dom)
        cols.append(torch.stack([vals[k].reshape(()) for k in METRIC_NAMES]))
    return torch.stack(cols, 1)


METRIC_NAMES = ("scores/trf", "scores/drift", "scores/dr2_q", "scores/dr2_k", "scores/dr2_abs",
                "scores/sink_excess", "scores/early_key_slope", "log_probs/trf", "log_probs/drift", "probs/trf",
                "probs/drift", "split/e_total", "split/e_logit", "split/e_partition", "split/cross",
                "split/share_logit", "split/share_partition", "split/share_cross", "split/fraction")


def summarise(cfg: LeakageConfig, sums: GroupedSums, per_head_probs: torch.Tensor, dr2: dict,
              spread: Estimate, windows: list[int], passes: list[str]) -> tuple[dict, dict]:
    """Estimates with intervals for run.json and the tensors to save."""
    metrics: dict = {"level": cfg.level, "groups": sums.groups, "domain": asdict(domain(cfg, cfg.seq_len)),
                     "metric_names": list(METRIC_NAMES)}
    tensors: dict[str, torch.Tensor] = {}
    for name in ("scores", "log_partition", "probs"):
        tensors[f"orig/{name}"] = sums.mean(f"orig/{name}").float()
    for scope in ("all", "early"):
        est = sums.estimate(lambda m, e=scope == "early": _per_layer_metrics(m, "orig", cfg, windows, e),
                            level=cfg.level)
        for k, v in est.as_dict(f"metrics_{scope}").items():
            tensors[k] = v
        metrics[f"per_layer_{scope}"] = {
            k: {"value": est.value[i].tolist(), "lo": est.lo[i].tolist(), "hi": est.hi[i].tolist()}
            for i, k in enumerate(METRIC_NAMES)}
    metrics["interventions"] = {}
    for spec in passes:
        if spec in ("orig", "null"):
            continue

        def removed(m, spec=spec):
            orig = _early_logit(m, "orig", cfg, windows)
            repl = _early_logit(m, f"iv/{spec}", cfg, windows)
            return 1.0 - repl / orig  # removal fraction RF (notes C7), per layer and over all layers (last)

        est = sums.estimate(removed, level=cfg.level)
        tensors.update(est.as_dict(f"intervention/{spec}/removed"))
        metrics["interventions"][spec] = {
            "removed_all_layers": {"value": float(est.value[-1]), "lo": float(est.lo[-1]), "hi": float(est.hi[-1])},
            "removed_per_layer": {"value": est.value[:-1].tolist(), "lo": est.lo[:-1].tolist(),
                                  "hi": est.hi[:-1].tolist()}}
    sinks = p0.sink_rates(per_head_probs, cfg.sink_threshold)
    tensors["alpha0"] = sinks["alpha0"].float()
    tensors["probs_per_head"] = per_head_probs.float()
    metrics["sinks"] = {"rate": sinks["rate"], "tokens": sinks["tokens"], "epsilon": sinks["epsilon"],
                        "rate_64": sinks.get("rate_short"),
                        "sink_heads": p0.sink_heads(sinks["alpha0"], cfg.sink_threshold)}
    tensors["position0_spread"] = spread.value.float()
    tensors.update({f"position0_spread_{k}": getattr(spread, k).float() for k in ("lo", "hi", "se")})
    metrics["position0_spread"] = spread.value.tolist()
    metrics["position0_spread_interval"] = {"lo": spread.lo.tolist(), "hi": spread.hi.tolist(), "level": spread.level,
                                            "groups": spread.groups}
    if dr2.get("orig") is not None and dr2.get("null") is not None:
        test = pr.paired_test(dr2["orig"], dr2["null"], seed=cfg.seed, level=cfg.level)
        for k, v in test.as_dict().items():
            if isinstance(v, torch.Tensor):
                tensors[f"predecessor/{k}"] = v.float()
        per_layer = test.significant.sum(-1).tolist()
        metrics["predecessor"] = {"significant_heads_per_layer": per_layer,
                                  "heads": int(test.significant.numel()), "fdr": test.fdr,
                                  "top": _top_heads(test)}
    return metrics, tensors


def _top_heads(test: pr.PairedTest, k: int = 10) -> list[dict]:
    order = torch.argsort(test.gap.reshape(-1), descending=True)[:k]
    h = test.gap.shape[-1]
    return [{"layer": int(i) // h, "head": int(i) % h, "gap": float(test.gap.reshape(-1)[i]),
             "lo": float(test.lo.reshape(-1)[i]), "hi": float(test.hi.reshape(-1)[i]),
             "p": float(test.p.reshape(-1)[i]), "significant": bool(test.significant.reshape(-1)[i])}
            for i in order]

