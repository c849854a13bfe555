"""`poslens length MODEL --train-len L --eval-lens L,2L,4L,8L`: a model trained at length L evaluated past it, with
interventions at evaluation time; one run directory (docs/length.md).

An analysis on the pipeline (`poslens.engine.pipeline`): the sequences are cut at the longest evaluation length T
(held-out text, packed by default), then passes over the same batches, each a record (`plan.LengthPass`: model,
intervention, length, factor) with the statistics it feeds by name (`plan.LengthStatistics`: loss, profile, maps):

* `none` at T: the loss at every target position (`PositionLoss`), attention entropy and key-0 share by query
  (`AttentionProfile`), the averaged maps (`LengthMaps`: Capture, past max_position_embeddings where the model
  computes positions on the fly). By causality position t computes the same thing in a sequence cut at t' > t, so
  this one pass gives every evaluation length <= T (the maps at T' are the top-left T' x T' block);
* `logn`, `logn-all`, `window[:W]`, `sink-window[:W]`, `freeze` at T (they do not depend on the length), loss and
  attention profile;
* `ntk` and `yarn` once per evaluation length T' > L, on the first T' tokens, with factor T' / L (their frequencies
  depend on T'), or once at T with a factor given as `ntk:F`.

A pass's forwards run inside its model's weights (`seeds.SeedWeights`) and the intervention's change of the model
(`Intervention.changed`: ntk, yarn); each batch is the intervention's `prepare` (write hooks, a mask, ids). Every
pass puts batch b in group b mod G, so an intervention's effect on the loss over [L, T') is the paired difference
against `none` over the same sequences, with a delete-one-group jackknife interval (`compare.paired_difference`;
the numbers: `summary.summarise_model`). With `--seed-models` (other seeds of the same variant: same architecture
and tokenizer) every pass runs once per model, on the same sequences (the weights are swapped in place, model-major,
so each is loaded once per run and a resumed run swaps the right ones back), and every number is also given as the
mean over the models with a t-interval over seeds (`compare.over_seeds`): the error bar of a training effect.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from poslens.analyses.length.checks import (
    check_eval_length,
    check_maps_length,
    length_notes,
    memory_estimate,
)
from poslens.analyses.length.interventions import Intervention, Window, parse
from poslens.analyses.length.passes import prepared
from poslens.analyses.length.plan import LengthPass, LengthStatistics, edges_of, plan_passes, statistics_for
from poslens.analyses.length.seeds import SeedWeights, check_same_variant, distinct_models, weights_digest
from poslens.analyses.length.summary import over_models, summarise_model
from poslens.engine.config import SEQUENCES_HELP, ModelData
from poslens.engine.pipeline import Analysis, Job, Output, Pass, run_analysis
from poslens.errors import UsageError, check_int
from poslens.options import option, option_of

ALL = ("logn", "ntk", "yarn", "window", "sink-window", "alibi-scale", "freeze")  # what "all" runs (logn-all on
# request; each on the models it applies to)


@dataclass
class LengthConfig(ModelData):
    """Everything that determines a `length` run. `seq_len` is not an option of the command: it is settled to the
    longest evaluation length."""

    num_sequences: int | None = option_of(ModelData, "num_sequences", 32, help=SEQUENCES_HELP)
    batch_size: int = option_of(ModelData, "batch_size", 4)
    groups: int = option_of(ModelData, "groups", 8)
    mode: str = option_of(ModelData, "mode", "pack")  # sequences of 8L tokens: packed, few documents are that long
    train_len: int | None = option(None, lo=2, help="the length L the model was trained at (default: its "
                                   "max_position_embeddings)")
    eval_lens: list[int] | None = option(None, lo=2, help="evaluation lengths, comma-separated, the longest above "
                                         "L (default L,2L,4L,8L)")
    interventions: list[str] = option(["all"], help="interventions at evaluation time, each against none on the "
                                      "same sequences: logn, logn-all, ntk[:F], yarn[:F], window[:W], "
                                      "sink-window[:W], alibi-scale[:F] (ALiBi models), freeze, all (every one "
                                      "that applies to the model), none (comma-separated)")
    seed_models: list[str] = option([], help="other seeds of the same variant (same architecture and tokenizer), "
                                    "comma-separated: each is evaluated on the same sequences and every number is "
                                    "also a mean over the models with a t-interval over seeds")
    maps: bool = option(True, help="skip the averaged maps and their leakage metrics", flag="--no-maps")
    map_layers: list[int] | None = option(None, help="layers whose maps are captured, from 0 (default all)")
    profile_every: int = option(1, lo=1, help="attention entropy and key-0 share at every k-th query (k-fold "
                                "cheaper on long sequences)")
    scaled_at: str = option("each", choices=("each", "longest"), help="ntk and yarn (factor T/L), alibi-scale "
                            "(L/T) at each evaluation length T past L, or at the longest only (one pass each instead "
                            "of one per length; the effects at the shorter lengths are then not measured)")
    intervention_profiles: bool = option(True, help="skip the attention profile under the interventions (their "
                                         "loss is still measured; the profile of none stays)",
                                         flag="--no-intervention-profiles")

    def validate(self) -> None:
        super().validate()
        self.specs(explicit_only=True)
        distinct_models(self.model, self.seed_models)
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
            if model is not None:  # no position past L on a model whose table ends there: say what runs instead
                check_eval_length(model, L + 1, L)
            raise UsageError(f"eval_lens {_csv(lens)}: the longest must be above train_len {L} (the loss past L is "
                             f"what is measured), e.g. {L},{2 * L},{4 * L},{8 * L}", param="eval_lens")
        self.eval_lens, self.seq_len = lens, lens[-1]


def _csv(values) -> str:
    return ",".join(map(str, values))


# ---------------------------------------------------------------- the analysis


class Length(Analysis):
    """Passes none, each intervention (and each length for ntk and yarn), per model (`plan.plan_passes`); contrasts
    on rank 0."""

    kind = "length"

    def __init__(self) -> None:
        self.skipped: dict[str, str] = {}
        self.explicit: set[str] = set()
        self.weights: SeedWeights | None = None  # which model's weights the loaded model holds

    def configure(self, job: Job) -> None:
        cfg, model = job.config, job.model
        cfg.settle(model)
        check_eval_length(model, cfg.seq_len, cfg.train_len)  # a position table: refused past its size, in one line
        if cfg.maps:
            check_maps_length(model, cfg.seq_len)  # a rope type that reads the limit: refused here
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
        seen = {job.config.model: weights_digest(job.model)}
        self.weights = SeedWeights(job, [check_same_variant(job, spec, seen) for spec in job.config.seed_models])

    def memory(self, job: Job) -> dict[str, tuple[float, str]]:
        cfg = job.config
        n_layers = len(cfg.map_layers) if cfg.map_layers else job.hm.n_layers
        window = any(isinstance(parse(s, cfg.train_len), Window) for s in cfg.interventions)
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
        cfg = job.config
        first_token = int(job.sequences[0, 0])
        if "freeze" in cfg.interventions and bool((job.sequences[:, 0] == first_token).all()):
            why = (f"every sequence starts with the same first token (token id {first_token}, e.g. a BOS the model "
                   "was trained with): freezing position 1 to it is the identity by causality (its effect is 0 up "
                   "to float rounding)")
            if "freeze" in self.explicit:
                job.data["freeze_note"] = why
            else:
                self.skipped["freeze"] = why
                cfg.interventions = [s for s in cfg.interventions if s != "freeze"]
        models = 1 + len(cfg.seed_models)
        out: list[Pass] = []
        for p in plan_passes(cfg):
            iv = p.built(cfg.train_len, first_token)
            stats = statistics_for(p, cfg, job.model, job.groups)
            out.append(Pass(p.name(models), stats.listed(), prepare=prepared(job.hm, iv, p.length),
                            context=functools.partial(self._forwards, job, p, iv),
                            meta={"pass": p, "statistics": stats}))
        return out

    @contextlib.contextmanager
    def _forwards(self, job: Job, p: LengthPass, iv: Intervention) -> Iterator[None]:
        """Around a pass's forwards: its model's weights in the loaded model, the model changed by `iv` (ntk, yarn)."""
        with self.weights.use(p.model), iv.changed(job.hm, p.length):
            yield

    # ---- finishing

    def finish(self, job: Job, passes: list[Pass]) -> Output:
        cfg = job.config
        level, L, lens = cfg.level, cfg.train_len, cfg.eval_lens
        models = 1 + len(cfg.seed_models)
        names = [cfg.model, *cfg.seed_models]
        planned: list[tuple[LengthPass, LengthStatistics]] = [(p.meta["pass"], p.meta["statistics"]) for p in passes]
        tensors = {}
        per_model = []
        for k in range(models):
            tag = f"m{k}/" if models > 1 else ""
            entry, t = summarise_model(cfg, [(p, s) for p, s in planned if p.model == k], level)
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
        self.weights.restore()
        return Output(tensors, metrics, {"models": names})

    def figures(self, job: Job, output: Output, directory: Path) -> list[Path]:
        from poslens.analyses.length.figures import length_figures

        return length_figures(output.metrics, output.tensors, directory, job.label)


# ---------------------------------------------------------------- the command


def run_length(cfg: LengthConfig, out: str | Path, force: bool = False, progress: bool = True) -> Path | None:
    """Evaluate past the training length and write the run directory on rank 0 (returns its path there). An `out`
    inside a model directory or the data it reads is refused by the run directory's own check of its inputs
    (`poslens.io.protect.check_not_input`)."""
    return run_analysis(Length(), cfg, out, force=force, progress=progress)
