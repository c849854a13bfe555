"""`poslens leakage MODEL`: every leakage metric of a real model with intervals, the BOS interventions, the
predecessor's per-head test, position 0 and sinks; one run directory (docs/leakage.md).

Passes over the same sequences: "orig" (as they are), one per intervention, and "null" (the predecessor's
circular token shift) when `predecessor` is on. Every pass reads the dense scores of every layer through
`attn.hook_attn_scores` and adds, per group of sequences (batch b -> group b mod G), the head-mean scores,
log-partitions and probabilities; the metrics are functions of those means, with delete-one-group jackknife
intervals (poslens.engine.stats). Partial sums are checkpointed and a rerun resumes; under torchrun each rank
takes its shard and the sums are all-reduced.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from poslens.analyses.leakage import interventions as iv
from poslens.analyses.leakage import position0 as p0
from poslens.analyses.leakage import predecessor as pr
from poslens.analyses.leakage.metrics import Domain, leakage_metrics, split
from poslens.engine.stats import GroupedSums
from poslens.errors import UsageError, check_choice, check_int
from poslens.io.checkpoint import load_partial, save_partial
from poslens.io.results import check_output, sharded_run_directory, write_run
from poslens.options import option


@dataclass
class LeakageConfig:
    """Everything that determines a `leakage` run."""

    model: str = option(help="hub id, directory, .gguf, smollm2-135m or random:CONFIG", positional=True)
    data: str | None = option(None, help="text: .txt/.md file, directory, .jsonl, .parquet or a saved dataset "
                                         "(default: the embedded Python documentation)")
    text_field: str = option("text", help="column or JSON field holding the text")
    seq_len: int = option(128, help="tokens per sequence, BOS included")
    num_sequences: int = option(64, help="sequences (each a group member; at least 2 per group)")
    batch_size: int = option(8, help="sequences per forward")
    groups: int = option(8, help="groups of sequences for the jackknife intervals (batch b goes to group b mod G)")
    bos: str = option("always", help="BOS at position 0: always (Ruscio et al.'s fixed first token), auto, never",
                      choices=("always", "auto", "never"))
    max_offset: int | None = option(None, help="largest offset i - j in the domain (default seq_len // 2)")
    early_queries: int = option(32, help="'early queries': i <= this (the interventions' domain)")
    first_key: bool = option(True, help="leave key 0 (the sink column) out of the domain", flag="--no-first-key")
    interventions: list[str] = option(["mean"], help="position-0 interventions: mean, random, token:ID, nobos, "
                                                     "freeze, shift:K (comma-separated; empty: none)")
    predecessor: bool = option(True, help="skip the predecessor's per-head linear Delta R^2 test (and its "
                                          "shifted-token pass)", flag="--no-predecessor")
    sink_threshold: float = option(0.3, help="alpha_0 above which a head counts as sink-reading (Gu et al.)")
    level: float = option(0.95, help="confidence level of the intervals")
    dtype: str = option("auto", help="model dtype (auto: float32 on the CPU)")
    device: str = option("cpu", help="cpu or cuda")
    tokenizer: str | None = option(None, help="tokenizer spec for a random:CONFIG model")
    seed: int = option(0, help="seed of the random interventions, the null shifts and the tests")
    checkpoint_every: int = option(4, help="batches between saved partial sums")

    def validate(self) -> None:
        check_int("seq_len", self.seq_len, 8)
        check_int("num_sequences", self.num_sequences, 2)
        check_int("batch_size", self.batch_size, 1)
        check_int("groups", self.groups, 2)
        check_int("early_queries", self.early_queries, 2, self.seq_len - 1)
        check_choice("bos", self.bos, ("always", "auto", "never"))
        check_int("checkpoint_every", self.checkpoint_every, 1)
        for spec in self.interventions:
            iv.parse(spec)
        batches = -(-self.num_sequences // self.batch_size)
        if batches < self.groups:
            raise UsageError(f"groups: {self.groups} groups need at least {self.groups} batches, got {batches} "
                             f"({self.num_sequences} sequences of batch_size {self.batch_size}); lower --groups or "
                             "--batch-size, or raise --num-sequences")
        domain(self, self.seq_len)  # too few entries for a fit: fail before loading anything


def domain(cfg: LeakageConfig, n: int, early: bool = False, window: int | None = None) -> Domain:
    """The metrics' domain for maps of size n (early: queries i <= early_queries)."""
    top = None if cfg.max_offset is None else min(cfg.max_offset, n - 1)
    dom = Domain(max_offset=top, first_key=cfg.first_key, max_query=cfg.early_queries if early else None,
                 window=window or None)
    dom.index(n)
    return dom


class _Accumulator:
    """Hooks of one pass: head-mean scores, log-partitions and probabilities per layer into GroupedSums, plus
    (orig) per-head probabilities and (orig, null) per-sequence linear Delta R^2 of every head."""

    def __init__(self, sums: GroupedSums, n_layers: int, prefix: str, per_head: torch.Tensor | None,
                 dr2: list | None, seed: int) -> None:
        self.sums, self.n_layers, self.prefix = sums, n_layers, prefix
        self.per_head, self.dr2, self.seed = per_head, dr2, seed
        self.group, self._rows = 0, []

    def hooks(self) -> dict:
        return {f"blocks.{l}.attn.hook_attn_scores": self._hook(l) for l in range(self.n_layers)}

    def _hook(self, l: int):
        def hook(s, ctx):
            b, h, t, _ = s.shape
            s = s.float()
            lse = torch.logsumexp(s, -1)  # [B, H, T]: -inf keys drop out
            probs = torch.exp(s - lse[..., None])
            finite = torch.isfinite(s)
            scores = torch.where(finite, s, 0.0)
            L = self.n_layers
            g = self.group
            # maps: float32 sums of float32 values (as the capture engine); the log-partition vector in float64
            f32 = torch.float32
            self.sums.buffer(f"{self.prefix}/scores", g, (L, t, t), dtype=f32)[l] += scores.sum((0, 1)).cpu() / h
            self.sums.buffer(f"{self.prefix}/log_partition", g, (L, t))[l] += lse.sum((0, 1)).double().cpu() / h
            self.sums.buffer(f"{self.prefix}/probs", g, (L, t, t), dtype=f32)[l] += probs.sum((0, 1)).cpu() / h
            if self.per_head is not None:
                self.per_head[l] += probs.sum(0).cpu()
            if self.dr2 is not None:
                if ctx.window and ctx.window < t:  # the predecessor's design assumes every causal pair is seen
                    self._rows.append(torch.full((b, h), float("nan"), dtype=torch.float64))
                else:
                    self._rows.append(pr.linear_delta_r2(scores.double().cpu(), seed=self.seed))  # [B, H]
                if l == L - 1:
                    self.dr2.append(torch.stack(self._rows, 1))  # [B, L, H]
                    self._rows = []
            return None

        return hook

    def count(self, batch: int) -> None:
        for key in ("scores", "log_partition", "probs"):
            self.sums.count_buffer(f"{self.prefix}/{key}", self.group).add_(batch)


def _early_logit(means: dict, name: str, cfg: LeakageConfig, windows: list[int]) -> torch.Tensor:
    """E_logit over the early-query domain per layer (each with its window), then their sum (last entry)."""
    s, lp = means[f"{name}/scores"], means[f"{name}/log_partition"]
    n = s.shape[-1]
    e = torch.stack([split(s[l], lp[l], domain(cfg, n, True, w or None))["e_logit"] for l, w in enumerate(windows)])
    return torch.cat([e, e.sum()[None]])


def run_leakage(cfg: LeakageConfig, out: str, force: bool = False, progress: bool = True) -> Path | None:
    """Compute everything and write the run directory on rank 0 (returns its path there, None elsewhere)."""
    from poslens.analyses.scores import distributed, partial_path
    from poslens.engine.data import iter_documents, make_sequences, shard, source_label
    from poslens.engine.families import sliding_windows
    from poslens.engine.hooks import HookedModel
    from poslens.engine.models import load_model, max_positions, model_record

    cfg.validate()
    started = time.perf_counter()
    rank, world = distributed(cfg.device)
    target = check_output(out, force) if rank == 0 else Path(out).expanduser().absolute()
    documents = iter_documents(cfg.data, cfg.text_field)
    first = next(documents, None)
    if first is None:
        raise UsageError(f"data {cfg.data}: no documents found")
    model, tok = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, tokenizer=cfg.tokenizer)
    if cfg.seq_len > max_positions(model):
        raise UsageError(f"seq_len {cfg.seq_len} is beyond the model's {max_positions(model)} positions")
    bos_id = getattr(tok, "bos_token_id", None) if tok is not None else None
    if cfg.bos == "always" and bos_id is None:
        raise UsageError("bos: this tokenizer has no BOS token; use --bos never (position 0 is then a content "
                         "token and the interventions replace it)")
    ids, data_stats = make_sequences(tok, itertools.chain([first], documents), cfg.seq_len, cfg.num_sequences,
                                     bos=cfg.bos)
    data_stats["source"] = source_label(cfg.data)
    hm = HookedModel(model)
    L = hm.n_layers
    windows = [int(w or 0) for w in sliding_windows(model.config)]
    mine = shard(ids, rank, world)
    batches = list(torch.split(mine, cfg.batch_size))
    offset = sum(-(-len(shard(ids, r, world)) // cfg.batch_size) for r in range(rank))  # global batch index
    passes = ["orig"] + list(cfg.interventions) + (["null"] if cfg.predecessor else [])
    sums = GroupedSums(cfg.groups)
    heads = model.config.num_attention_heads
    per_head = torch.zeros(L, heads, cfg.seq_len, cfg.seq_len)  # float32 sums, as the head-mean maps
    dr2: dict[str, list] = {"orig": [], "null": []}
    pos0: list = []
    fp = {**asdict(cfg), "world": world, "rank": rank}
    fp.pop("checkpoint_every")
    fp.pop("device")
    ckpt = partial_path(target, rank, world)
    done = 0
    resumed = load_partial(ckpt, fp)
    if resumed is not None:
        state, done = resumed
        sums.load_state_dict({k: v for k, v in state.items() if k.startswith(("sum/", "count/"))})
        per_head = state["per_head"].clone()
        for k in ("orig", "null", "pos0"):
            if f"list/{k}" in state:
                (pos0 if k == "pos0" else dr2[k]).append(state[f"list/{k}"])
    units = [(p, b) for p in passes for b in range(len(batches))]
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(units), initial=done, desc="leakage", unit="batch")
    reference = ids[0]
    for u in range(done, len(units)):
        name, b = units[u]
        batch = batches[b].to(cfg.device)
        prefix = name
        if name == "null":
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + offset + b)
            keep = 1 if data_stats.get("bos_prepended") else 0
            shifts = torch.randint(1, batch.shape[1] - keep, (batch.shape[0],), generator=g)
            run_ids, hooks, pos = pr.circular_shift(batch.cpu(), shifts, keep).to(cfg.device), {}, None
        elif name == "orig":
            run_ids, hooks, pos = batch, {}, None
        else:
            prefix = f"iv/{name}"
            run_ids, hooks, pos = iv.prepare(name, model, hm, batch, reference, cfg.seed)
        acc = _Accumulator(sums, L, prefix, per_head if name == "orig" else None,
                           dr2[name] if (cfg.predecessor and name in dr2) else None, cfg.seed)
        acc.group = (offset + b) % cfg.groups
        all_hooks: dict[str, list] = {}
        extra = [hooks, p0.position0_hooks(L, pos0) if name == "orig" else {}, acc.hooks()]
        for group in extra:  # interventions write first, readers see the result
            for k, fn in group.items():
                all_hooks.setdefault(k, []).append(fn)
        hm.run(run_ids, hooks=all_hooks, position_ids=pos)
        acc.count(batch.shape[0])
        if bar is not None:
            bar.update(1)
        if (u + 1) % cfg.checkpoint_every == 0 and u + 1 < len(units):
            state = {**sums.state_dict(), "per_head": per_head}
            for k, rows in (("orig", dr2["orig"]), ("null", dr2["null"]), ("pos0", pos0)):
                if rows:
                    state[f"list/{k}"] = torch.cat(rows)
            save_partial(ckpt, state, u + 1, fp)
    if bar is not None:
        bar.close()
    cat = {k: torch.cat(v) if v else None for k, v in dr2.items()}
    pos0_states = torch.cat(pos0)
    if world > 1:
        import torch.distributed as dist

        sums.all_reduce()
        dist.all_reduce(per_head)
        gathered = [None] * world
        dist.all_gather_object(gathered, (cat, pos0_states))
        cat = {k: None if gathered[0][0][k] is None else torch.cat([g[0][k] for g in gathered]) for k in cat}
        pos0_states = torch.cat([g[1] for g in gathered])
    with sharded_run_directory(target, force, rank, world, ckpt) as tmp:
        if tmp is not None:
            from poslens.analyses.leakage.figures import leakage_figures

            metrics, tensors = summarise(cfg, sums, per_head / len(ids), cat, pos0_states, windows, passes)
            leakage_figures(metrics, tensors, tmp / "figures", cfg.model)
            write_run(tmp, tensors, {"kind": "leakage", "config": asdict(cfg), "data": data_stats,
                                     "world_size": world, "resumed_from_batch": done, "metrics": metrics,
                                     "model": model_record(model),
                                     "timings": {"seconds": time.perf_counter() - started}})
    return target if rank == 0 else None


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
                "probs/drift", "split/e_total", "split/e_logit", "split/e_mask", "split/cross", "split/share_logit",
                "split/share_mask", "split/share_cross", "split/fraction")


def summarise(cfg: LeakageConfig, sums: GroupedSums, per_head_probs: torch.Tensor, dr2: dict,
              pos0_states: torch.Tensor, windows: list[int], passes: list[str]) -> tuple[dict, dict]:
    """Estimates with intervals for run.json and the tensors to save."""
    metrics: dict = {"level": cfg.level, "groups": cfg.groups, "domain": asdict(domain(cfg, cfg.seq_len)),
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
    spread = p0.spread(pos0_states)
    tensors["position0_spread"] = spread.float()
    metrics["position0_spread"] = spread.tolist()
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

