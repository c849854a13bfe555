"""`poslens length MODEL --train-len L --eval-lens L,2L,4L,8L`: a model trained at length L evaluated past it, with
interventions at evaluation time; one run directory (docs/length.md).

An analysis on the pipeline (`poslens.engine.pipeline`): the sequences are cut at the longest evaluation length T
(held-out text, packed by default), then passes over the same batches:

* `none` at T: the loss at every target position (`PositionLoss`), attention entropy and key-0 share by query
  (`AttentionProfile`), the averaged maps (`LengthMaps`: Capture, past max_position_embeddings where the model
  computes positions on the fly). By causality position t computes the same thing in a sequence cut at t' > t, so
  this one pass gives every evaluation length <= T (the maps at T' are the top-left T' x T' block);
* `logn`, `logn-all`, `window[:W]`, `freeze` at T (they do not depend on the length), loss and attention profile;
* `ntk` and `yarn` once per evaluation length T' > L, on the first T' tokens, with factor T' / L (their frequencies
  depend on T'), or once at T with a factor given as `ntk:F`.

Every pass puts batch b in group b mod G, so an intervention's effect on the loss over [L, T') is the paired
difference against `none` over the same sequences, with a delete-one-group jackknife interval
(`compare.paired_difference`). With `--seed-models` (other seeds of the same variant: same architecture and
tokenizer) every pass runs once per model, on the same sequences (the weights are swapped in place, model-major, so
each is loaded once per run and a resumed run swaps the right ones back), and every number is also given as the mean
over the models with a t-interval over seeds (`compare.over_seeds`): the error bar of a training effect.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from poslens.analyses.length.attention import AttentionProfile
from poslens.analyses.length.checks import (
    check_eval_length,
    context_limit_lifted,
    length_notes,
    memory_estimate,
    reset_rotary,
    rope_types,
)
from poslens.analyses.length.compare import over_seeds, paired_difference
from poslens.analyses.length.interventions import Freeze, RopeScaling, Window, parse
from poslens.analyses.length.loss import PositionLoss, span_means
from poslens.analyses.length.maps import LengthMaps
from poslens.engine.config import ModelData
from poslens.engine.pipeline import Analysis, Job, Output, Pass, run_analysis
from poslens.engine.stats import Estimate
from poslens.errors import UsageError, check_int
from poslens.options import option, option_of

ALL = ("logn", "ntk", "yarn", "window", "sink-window", "freeze")  # what "all" runs (logn-all on request)
MAP_METRICS = ("scores/trf", "log_probs/trf", "split/fraction", "split/share_partition", "split/share_logit",
               "split/share_cross", "split/e_partition", "split/e_logit")  # the lean set (maps.LEAN): no fits
PROFILED = ("logn", "window", "sink-window")  # passes that also read the attention profile (besides none): they
# change the softmax's denominator or the keys it sums over; the others are measured by their loss
BINS_PER_L = 4  # the loss curve's figure and tensors: bins of L / 4 target positions


@dataclass
class LengthConfig(ModelData):
    """Everything that determines a `length` run. `seq_len` is not an option of the command: it is settled to the
    longest evaluation length."""

    num_sequences: int | None = option_of(ModelData, "num_sequences", 32)
    batch_size: int = option_of(ModelData, "batch_size", 4)
    groups: int = option_of(ModelData, "groups", 8)
    mode: str = option_of(ModelData, "mode", "pack")  # sequences of 8L tokens: packed, few documents are that long
    train_len: int | None = option(None, lo=2, help="the length L the model was trained at (default: its "
                                   "max_position_embeddings)")
    eval_lens: list[int] | None = option(None, lo=2, help="evaluation lengths, comma-separated, the longest above "
                                         "L (default L,2L,4L,8L)")
    interventions: list[str] = option(["all"], help="interventions at evaluation time, each against none on the "
                                      "same sequences: logn, logn-all, ntk[:F], yarn[:F], window[:W], freeze, all "
                                      "(every one that applies to the model), none (comma-separated)")
    seed_models: list[str] = option([], help="other seeds of the same variant (same architecture and tokenizer), "
                                    "comma-separated: each is evaluated on the same sequences and every number is "
                                    "also a mean over the models with a t-interval over seeds")
    maps: bool = option(True, help="skip the averaged maps and their leakage metrics", flag="--no-maps")
    map_layers: list[int] | None = option(None, help="layers whose maps are captured, from 0 (default all)")
    profile_every: int = option(1, lo=1, help="attention entropy and key-0 share at every k-th query (k-fold "
                                "cheaper on long sequences)")
    scaled_at: str = option("each", choices=("each", "longest"), help="ntk and yarn (factor T/L) at each "
                            "evaluation length T past L, or at the longest only (one pass each instead of one per "
                            "length; the effects at the shorter lengths are then not measured)")
    intervention_profiles: bool = option(True, help="skip the attention profile under the interventions (their "
                                         "loss is still measured; the profile of none stays)",
                                         flag="--no-intervention-profiles")

    def validate(self) -> None:
        super().validate()
        self.specs(explicit_only=True)
        _distinct_models(self.model, self.seed_models)
        if self.eval_lens is not None:
            if self.train_len is not None:
                self.settle(None)
            elif len(set(self.eval_lens)) != len(self.eval_lens):
                raise UsageError(f"eval_lens {_csv(self.eval_lens)} names a length twice", param="eval_lens")

    def more_models(self) -> list[str]:
        return list(self.seed_models)

    def specs(self, explicit_only: bool = False) -> list[str]:
        """The interventions to run, "all" expanded (by the caller: `Length.configure`), "none" dropped; each spec
        parsed (a one-line error for a bad one)."""
        out = []
        for s in self.interventions:
            s = str(s).strip()
            if s in ("", "none") or (s == "all" and explicit_only):
                continue
            if s == "all":
                out.extend(x for x in ALL if x not in out)
                continue
            parse(s, self.train_len or 2)
            if s not in out:
                out.append(s)
        return out

    def settle(self, model) -> None:
        """train_len (default: the model's max_position_embeddings), eval_lens (default L, 2L, 4L, 8L, sorted) and
        seq_len (the longest); one-line errors for lengths that say nothing past L."""
        from poslens.engine.models import max_positions

        if self.train_len is None:
            self.train_len = max_positions(model)
        L = check_int("train_len", self.train_len, 2)
        lens = [L, 2 * L, 4 * L, 8 * L] if self.eval_lens is None else list(self.eval_lens)
        if len(set(lens)) != len(lens):
            raise UsageError(f"eval_lens {_csv(lens)} names a length twice", param="eval_lens")
        lens = sorted(check_int("eval_lens", t, 2) for t in lens)
        if lens[-1] <= L:
            raise UsageError(f"eval_lens {_csv(lens)}: the longest must be above train_len {L} (the loss past L is "
                             f"what is measured), e.g. {L},{2 * L},{4 * L},{8 * L}", param="eval_lens")
        self.eval_lens, self.seq_len = lens, lens[-1]


def _csv(values) -> str:
    return ",".join(map(str, values))


# ---------------------------------------------------------------- the analysis


class Length(Analysis):
    """Passes none, each intervention (and each length for ntk and yarn), per model; contrasts on rank 0."""

    kind = "length"

    def __init__(self) -> None:
        self.skipped: dict[str, str] = {}
        self.explicit: set[str] = set()
        self.current: list[int] = [0]  # which model's weights the loaded model holds
        self.weights: dict[int, dict] = {}

    def configure(self, job: Job) -> None:
        cfg, model = job.config, job.model
        cfg.settle(model)
        check_eval_length(model, cfg.seq_len)  # a position table: refused past its size, in one line
        if cfg.maps:
            with context_limit_lifted(model, cfg.seq_len):  # a rope type that reads the limit: refused here
                pass
        from poslens.engine.families import sliding_windows

        self.explicit = {s for s in cfg.interventions if s != "all"}
        self.skipped = {}
        chosen = []
        for spec in cfg.specs():
            iv = parse(spec, cfg.train_len)
            if isinstance(iv, Window) and (iv.window or cfg.train_len) >= cfg.seq_len:  # masks no key: an identity
                raise UsageError(f"interventions: {spec} masks nothing: its window {iv.window or cfg.train_len} is not "
                                 f"below the longest evaluation length {cfg.seq_len}; use a window below it",
                                 param="interventions")
            try:
                iv.check(model)
            except UsageError as e:
                if spec in self.explicit:
                    raise UsageError(f"interventions: {e}", param="interventions") from None
                self.skipped[spec] = str(e).split(": ", 1)[-1]
                continue
            native = sliding_windows(model.config)
            width = iv.window or cfg.train_len if isinstance(iv, Window) else 0
            if width and spec not in self.explicit and all(0 < w <= width for w in native):
                self.skipped[spec] = (f"every layer already attends to at most {max(native)} keys, so " + (
                    f"its own window hides key 1 from every query past {max(native)}: a window that keeps key 1 "
                    "cannot keep it" if iv.sinks else f"a window of {width} is the identity"))
                continue
            chosen.append(spec)
        cfg.interventions = chosen
        for layer in cfg.map_layers or []:
            check_int("map_layers", layer, 0, job.hm.n_layers - 1)

    def window(self, job: Job) -> int:
        return job.config.seq_len  # positions are computed on the fly; `configure` refused a position table

    def check(self, job: Job) -> None:
        self.weights = {}
        self.current = [0]
        seen = {job.config.model: _weights_digest(job.model)}
        for k, spec in enumerate(job.config.seed_models, 1):
            self.weights[k] = _same_variant(job, spec, seen)

    def memory(self, job: Job) -> dict[str, tuple[float, str]]:
        cfg = job.config
        n_layers = len(cfg.map_layers) if cfg.map_layers else job.hm.n_layers
        window = any(s.startswith(("window", "sink-window")) for s in cfg.interventions)
        est = memory_estimate(job.model, cfg.seq_len, cfg.batch_size, groups=cfg.groups, map_layers=n_layers,
                              map_keys=2 if cfg.maps else 0, window_mask=window)
        models = 1 + len(cfg.seed_models)
        weights = sum(p.numel() * p.element_size() for p in job.model.parameters())
        return {"averaged maps at the longest length": (models * est["maps"], "eval_lens"),
                "explicit window mask": (est["mask"], "batch_size"),
                "chunked readers": (est["readers"], "batch_size"),
                "weights of the other seeds": (2 * len(cfg.seed_models) * weights, "seed_models")}

    # ---- passes

    def passes(self, job: Job) -> list[Pass]:
        cfg, hm = job.config, job.hm
        L, lens, T, G = cfg.train_len, cfg.eval_lens, cfg.seq_len, job.groups
        reference = int(job.sequences[0, 0])
        if "freeze" in cfg.interventions and bool((job.sequences[:, 0] == reference).all()):
            why = (f"every sequence starts with the same first token (token id {reference}, e.g. a BOS the model "
                   "was trained with): freezing position 1 to it is the identity by causality (its effect is 0 up "
                   "to float rounding)")
            if "freeze" in self.explicit:
                job.data["freeze_note"] = why
            else:
                self.skipped["freeze"] = why
                cfg.interventions = [s for s in cfg.interventions if s != "freeze"]
        out: list[Pass] = []
        models = 1 + len(cfg.seed_models)
        for k in range(models):
            tag = f"m{k}/" if models > 1 else ""

            def stats(n: int, maps: bool = False, profile: bool = True, k=k) -> list:
                s = [PositionLoss(edges_of(L, [t for t in lens if t <= n] or [n]), G)]
                if profile:
                    s.append(AttentionProfile(groups=G, every=cfg.profile_every))
                if maps:
                    s.append(LengthMaps(job.model, cfg.map_layers, groups=G, probs=False))
                return s

            use = self._use(job, k)
            out.append(Pass(f"{tag}none", stats(T, cfg.maps), prepare=self._plain(job), context=use,
                            meta={"model": k, "spec": "none", "length": T}))
            for spec in cfg.interventions:
                iv = parse(spec, L)
                if isinstance(iv, RopeScaling):
                    each = [t for t in lens if t > L] if cfg.scaled_at == "each" else [T]
                    pairs = [(T, iv.factor)] if iv.factor is not None else [(t, t / L) for t in each]
                    for t, factor in pairs:
                        name = f"{tag}{spec}" if iv.factor is not None else f"{tag}{spec}@{t}"
                        out.append(Pass(name, stats(t, profile=False), prepare=self._plain(job, t),
                                        context=_both(use, iv, hm, factor),
                                        meta={"model": k, "spec": spec, "length": t, "factor": factor}))
                    continue
                if isinstance(iv, Freeze):
                    iv.token = reference
                profile = cfg.intervention_profiles and spec.startswith(PROFILED)
                out.append(Pass(f"{tag}{spec}", stats(T, profile=profile), prepare=self._applied(job, iv), context=use,
                                meta={"model": k, "spec": spec, "length": T}))
        return out

    def _use(self, job: Job, k: int):
        """A pass context that puts model k's weights into the loaded model (nothing when they are there)."""

        @contextlib.contextmanager
        def use():
            if self.current[0] != k:
                if 0 not in self.weights:  # the first model's own weights, kept once before the first swap
                    self.weights[0] = {n: t.detach().clone() for n, t in job.model.state_dict().items()}
                weights = self.weights[k]
                if isinstance(weights, str):
                    weights = _load_weights(job, weights)
                job.model.load_state_dict(weights)
                self.current[0] = k
            yield

        return use

    @staticmethod
    def _plain(job: Job, length: int | None = None):
        def prepare(ids, index):
            reset_rotary(job.model)  # dynamic RoPE: each batch as if it were the first
            return (ids if length is None else ids[:, :length]), {}, None

        return prepare

    @staticmethod
    def _applied(job: Job, iv):
        def prepare(ids, index):
            reset_rotary(job.model)
            with iv.applied(job.hm, ids) as p:  # logn, window, freeze: nothing to restore afterwards
                pass
            return p.ids, p.hooks, p.position_ids, p.attention_mask

        return prepare

    # ---- finishing

    def finish(self, job: Job, passes: list[Pass]) -> Output:
        cfg = job.config
        level, L, lens = cfg.level, cfg.train_len, cfg.eval_lens
        models = 1 + len(cfg.seed_models)
        names = [cfg.model, *cfg.seed_models]
        tensors: dict[str, torch.Tensor] = {}
        per_model = []
        for k in range(models):
            mine = [p for p in passes if p.meta["model"] == k]
            base = next(p for p in mine if p.meta["spec"] == "none")
            tag = f"m{k}/" if models > 1 else ""
            entry, t = summarise_model(cfg, base, mine, level)
            entry["model"] = names[k]
            per_model.append(entry)
            tensors.update({f"{tag}{name}": v for name, v in t.items()})
        metrics = {"train_len": L, "eval_lens": lens, "edges": edges_of(L, lens), "level": level,
                   "groups": job.groups, "interventions": list(cfg.interventions), "skipped": dict(self.skipped),
                   "notes": length_notes(job.model, cfg.seq_len) + ([job.data["freeze_note"]]
                                                                    if "freeze_note" in job.data else []),
                   "models": per_model}
        if models > 1:
            metrics["seeds"] = over_models(per_model, level)
        if self.weights.get(0) is not None and not isinstance(self.weights[0], str):
            job.model.load_state_dict(self.weights[0])  # the first model's weights back, as loaded
            self.current[0] = 0
        return Output(tensors, metrics, {"models": names})

    def figures(self, job: Job, output: Output, directory: Path) -> list[Path]:
        from poslens.analyses.length.figures import length_figures

        return length_figures(output.metrics, output.tensors, directory, job.label)


def _both(use, iv: RopeScaling, hm, factor: float):
    @contextlib.contextmanager
    def both():
        with use(), iv.scaled(hm, factor):
            yield

    return both


def edges_of(train_len: int, lens: list[int]) -> list[int]:
    """Bucket edges: [1, L), then [previous, T) for each evaluation length T above L."""
    return [1, train_len] + [t for t in lens if t > train_len]


# ---------------------------------------------------------------- other seeds


def _distinct_models(model: str, seeds: list[str]) -> None:
    """Refuse a seed model that names the evaluated model or another seed model again (the same directory: a
    t-interval over copies of one model has zero width and says nothing), before anything is loaded."""
    from poslens.engine.models import resolve

    def where(spec: str) -> str:
        ms = resolve(spec)
        return os.path.realpath(ms.path) if ms.kind in ("local", "gguf") and ms.path else ms.spec

    first: dict[str, str] = {where(model): model}
    for spec in seeds:
        key = where(spec)
        if key in first:
            what = "the evaluated model" if first[key] == model else f"seed model {first[key]}"
            raise UsageError(f"seed_models: {spec} is {what} again; give each seed's model once (a model twice gives "
                             "an interval of zero width over copies of one model)", param="seed_models")
        first[key] = spec


def _weights_digest(model) -> str:
    """A digest of every parameter and buffer of `model` (names, shapes, dtypes and bytes): equal for copies."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trained_length(spec: str, model) -> int:
    """The length a model was trained at: the `seq_len` its poslens training run recorded (run.json beside the
    weights), else its max_position_embeddings."""
    from poslens.engine.models import max_positions, resolve

    ms = resolve(spec)
    record = Path(ms.path) / "run.json" if ms.kind == "local" and ms.path else None
    if record is not None and record.is_file():
        try:
            meta = json.loads(record.read_text())
            if meta.get("kind") == "train" and isinstance(meta.get("config", {}).get("seq_len"), int):
                return int(meta["config"]["seq_len"])
        except (OSError, ValueError):
            pass
    return max_positions(model)


def _vocabulary(tokenizer) -> tuple | None:
    """What decides how a tokenizer cuts text into ids: its vocabulary (token -> id) and its special ids."""
    if tokenizer is None:
        return None
    return (tuple(sorted(tokenizer.get_vocab().items())), tokenizer.bos_token_id, tokenizer.eos_token_id)


def _same_variant(job: Job, spec: str, seen: dict[str, str] | None = None) -> str:
    """Check, up front, that `spec` is another seed of the loaded model's variant (same class, parameter shapes,
    positional encoding, windows, rotary settings, vocabulary, tokenizer and training length, and other weights
    than every model before it: `seen`, model spec -> weights digest); returns it (its weights are loaded when its
    passes start)."""
    from poslens.engine.families import positional_encoding, sliding_windows
    from poslens.engine.models import load_model, load_tokenizer

    cfg = job.config
    other, other_tok = load_model(spec, dtype=cfg.dtype, device="cpu", pe=cfg.pe)
    a, b = job.model, other
    shapes = {n: tuple(t.shape) for n, t in a.state_dict().items()}
    facts = {"architecture": (type(a).__name__, type(b).__name__),
             "parameter shapes": (shapes, {n: tuple(t.shape) for n, t in b.state_dict().items()}),
             "positional encoding": (positional_encoding(a), positional_encoding(b)),
             "sliding windows": (sliding_windows(a.config), sliding_windows(b.config)),
             "rope type": (rope_types(a), rope_types(b)),
             "rope base": (_rope_base(a), _rope_base(b))}
    for what, (x, y) in facts.items():
        if x != y:
            raise UsageError(f"seed_models: {spec} is not another seed of {cfg.model}'s variant: its {what} "
                             "differs; give models trained alike but for the seed", param="seed_models")
    own, theirs = trained_length(cfg.model, a), trained_length(spec, b)
    if own != theirs:
        raise UsageError(f"seed_models: {spec} was trained at length {theirs} and {cfg.model} at {own}; give seeds "
                         "trained at the same length", param="seed_models")
    mine = _vocabulary(load_tokenizer(cfg.model) if cfg.tokenizer is not None else job.tokenizer)
    if mine is not None and _vocabulary(other_tok) is not None and _vocabulary(other_tok) != mine:
        raise UsageError(f"seed_models: {spec} has another tokenizer than {cfg.model} (its vocabulary or special "
                         "ids differ), so the same text would be other ids to it; give seeds trained with the same "
                         "tokenizer", param="seed_models")
    if seen is not None:
        digest = _weights_digest(b)
        same = next((name for name, d in seen.items() if d == digest), None)
        if same is not None:
            raise UsageError(f"seed_models: {spec} has the same weights as {same} (a copy of one model gives an "
                             "interval of zero width); give models trained with other seeds", param="seed_models")
        seen[spec] = digest
    del other
    return spec


def _rope_base(model) -> float | None:
    from poslens.engine.families import rotary_modules

    for m in rotary_modules(model):
        inv = getattr(m, "inv_freq", None)
        if inv is not None:
            return float(inv[1]) if inv.numel() > 1 else float(inv[0])
    return None


def _load_weights(job: Job, spec: str) -> dict:
    from poslens.engine.models import load_model

    other, _ = load_model(spec, dtype=job.config.dtype, device=str(job.dist.device), pe=job.config.pe)
    return other.state_dict()


# ---------------------------------------------------------------- estimates


def _item(est: Estimate, i=None) -> dict:
    pick = (lambda t: float(t)) if i is None else (lambda t: float(t[i]))
    return {"value": pick(est.value), "lo": pick(est.lo), "hi": pick(est.hi)}


def summarise_model(cfg: LengthConfig, base: Pass, passes: list[Pass], level: float) -> tuple[dict, dict]:
    """One model's numbers (run.json) and tensors: loss by bucket and its rise past L, each intervention's paired
    effect on the loss over [L, T) for every evaluation length T, the attention profile by bucket, and the map
    metrics at every evaluation length."""
    L, lens, T = cfg.train_len, cfg.eval_lens, cfg.seq_len
    loss, profile = base.statistics[0], base.statistics[1]
    past = [t for t in lens if t > L]
    edges = edges_of(L, lens)
    tensors = {**loss.curve(level).as_dict("loss"), **binned(loss, L, T, level).as_dict("loss_binned")}
    entry: dict = {"buckets": [_item(loss.buckets(level), i) for i in range(len(edges) - 1)],
                   "loss_past_L": {str(t): _item(loss.spans([(L, t)], level), 0) for t in past},
                   "rise": {str(t): _item(rise(loss, L, t, level)) for t in past}}
    effects: dict = {}
    for p in passes:
        spec = p.meta["spec"]
        if spec == "none":
            continue
        other, t_pass = p.statistics[0], p.meta["length"]
        for t in past:
            if t > t_pass or (p.meta.get("factor") is not None and "@" in p.name and t != t_pass):
                continue
            d = paired_difference(loss, other, level, spans=[(L, t)])
            effects.setdefault(spec, {})[str(t)] = {**_item(d, 0),
                                                    "loss": _item(other.spans([(L, t)], level), 0)}
        if t_pass == T and "@" not in p.name or p.name.endswith(f"@{T}"):
            tensors.update(binned(other, L, t_pass, level).as_dict(f"loss_binned/{spec}"))
            if len(p.statistics) > 1:
                prof = p.statistics[1].result(level)
                tensors.update({f"profile/{spec}/{k}": v for k, v in prof.items()})
    entry["effects"] = effects
    prof = profile.result(level)
    tensors.update({f"profile/none/{k}": v for k, v in prof.items()})
    entry["profile"] = profile_buckets(profile, edges, level)
    if len(base.statistics) > 2:
        maps: LengthMaps = base.statistics[2]
        entry["maps"] = {str(t): {k: {"value": e.value.tolist(), "lo": e.lo.tolist(), "hi": e.hi.tolist()}
                                  for k, e in met.items()}
                         for t, met in maps.metrics_at(lens, level, MAP_METRICS).items()}
        res = maps.result(level=level, metrics=False)
        tensors.update({"maps/scores": res["scores"].float(), "maps/scores_se": res["scores_se"].float(),
                        "maps/layers": torch.as_tensor(maps.layers)})
    return entry, tensors


def rise(loss: PositionLoss, L: int, t: int, level: float) -> Estimate:
    """Loss over [t/2, t) minus loss over [L/2, L) on the same sequences (how much worse the last doubling is than
    the end of the training range), with its jackknife interval."""
    spans = [(max(1, L // 2), L), (t // 2, t)]
    return loss.sums.estimate(lambda m: (lambda s: s[1] - s[0])(span_means(m["nll"], spans)), level)


def binned(loss: PositionLoss, L: int, n: int, level: float) -> Estimate:
    """Mean loss in bins of L / 4 target positions (from 1) up to n, with jackknife intervals: the curve's figure."""
    width = max(1, L // BINS_PER_L)
    spans = [(max(1, s), min(n, s + width)) for s in range(0, n, width) if min(n, s + width) > max(1, s)]
    return loss.sums.estimate(lambda m: span_means(m["nll"], spans), level)


def profile_buckets(profile: AttentionProfile, edges: list[int], level: float) -> dict:
    """Entropy gap log(keys seen) - H and key-0 share, averaged over the queries of each bucket (queries read),
    per layer, with jackknife intervals."""
    layers = profile._layers()
    out = {}
    for q in ("gap", "key0", "entropy"):
        def f(m, q=q):
            rows = []
            for l in layers:
                x = m[f"log_keys/{l}"] - m[f"entropy/{l}"] if q == "gap" else m[f"{q}/{l}"]
                rows.append(torch.stack([x[a:b].nanmean() for a, b in zip(edges, edges[1:])]))
            return torch.stack(rows)

        e = profile.sums.estimate(f, level)
        out[q] = {"value": e.value.tolist(), "lo": e.lo.tolist(), "hi": e.hi.tolist()}
    return out


def over_models(per_model: list[dict], level: float) -> dict:
    """Each number of the models (loss per bucket and past L, rise, effects, profile) as a mean over the models with a
    t-interval over seeds; the per-model values beside it."""

    def seeds(values: list[float], support: tuple[float, float] | None = None) -> dict:
        e = over_seeds(values, level, support)
        return {"value": float(e.value), "lo": float(e.lo), "hi": float(e.hi), "n": len(values),
                "per_model": list(values)}

    first = per_model[0]
    out: dict = {"buckets": [seeds([m["buckets"][i]["value"] for m in per_model])
                             for i in range(len(first["buckets"]))],
                 "loss_past_L": {t: seeds([m["loss_past_L"][t]["value"] for m in per_model])
                                 for t in first["loss_past_L"]},
                 "rise": {t: seeds([m["rise"][t]["value"] for m in per_model]) for t in first["rise"]},
                 "effects": {spec: {t: seeds([m["effects"][spec][t]["value"] for m in per_model]) for t in by_t}
                             for spec, by_t in first["effects"].items()}}
    support = {"gap": (0.0, math.inf), "key0": (0.0, 1.0)}  # entropy <= log(keys seen); a share
    out["profile"] = {q: [[seeds([m["profile"][q]["value"][l][b] for m in per_model], support[q])
                           for b in range(len(first["profile"][q]["value"][l]))]
                          for l in range(len(first["profile"][q]["value"]))] for q in ("gap", "key0")}
    return out


# ---------------------------------------------------------------- the command


def run_length(cfg: LengthConfig, out: str | Path, force: bool = False, progress: bool = True) -> Path | None:
    """Evaluate past the training length and write the run directory on rank 0 (returns its path there). An `out`
    inside a model directory or the data it reads is refused by the run directory's own check of its inputs
    (`poslens.io.protect.check_not_input`)."""
    return run_analysis(Length(), cfg, out, force=force, progress=progress)


def _ci(e: dict, signed: bool = False) -> str:
    f = "+.3f" if signed else ".3f"
    if e.get("lo") is None or not math.isfinite(e["lo"]):
        return f"{e['value']:{f}}"
    return f"{e['value']:{f}} [{e['lo']:{f}}, {e['hi']:{f}}]"


def summary_lines(meta: dict) -> list[str]:
    """What `poslens length` prints: the loss per bucket, its rise past L, and each intervention's paired effect on the
    loss past L at the longest length (per model, and over seeds when several)."""
    m = meta["metrics"]
    L, edges, level = m["train_len"], m["edges"], m["level"]
    T = str(m["eval_lens"][-1])
    spans = ", ".join(f"{a + 1}-{b}" for a, b in zip(edges, edges[1:]))  # 0-based [a, b): positions a+1..b
    lines = [f"L = {L}; loss (nats) by target position {spans} (positions from 1), {100 * level:g}% jackknife "
             f"intervals over {m['groups']} groups of sequences"]
    for entry in m["models"]:
        lines.append(f"{entry['model']}: " + ", ".join(_ci(b) for b in entry["buckets"])
                     + f"; rise (positions {int(T) // 2 + 1}-{T}) - (positions {L // 2 + 1}-{L}): "
                       f"{_ci(entry['rise'][T], True)}")
        for spec, by_t in entry["effects"].items():
            if T in by_t:
                lines.append(f"  {spec}: loss over positions {L + 1}-{T} {_ci(by_t[T]['loss'])}, effect "
                             f"{_ci(by_t[T], True)} (paired, against none)")
    if "seeds" in m:
        s = m["seeds"]
        lines.append(f"over {len(m['models'])} seeds (mean, {100 * level:g}% t-interval): rise "
                     f"{_ci(s['rise'][T], True)}; effects "
                     + "; ".join(f"{spec} {_ci(by_t[T], True)}" for spec, by_t in s["effects"].items() if T in by_t))
    lines += [f"skipped {spec}: {why}" for spec, why in m.get("skipped", {}).items()]
    lines += [f"note: {n}" for n in m.get("notes", [])]
    return lines
