"""`poslens sweep`: a matrix of model variants x seeds, trained on identical tokens, batches and steps, and their
held-out losses with between-seed intervals.

A matrix (a JSON file, a shipped preset, or flags) has

    "train":    the fields every model shares (a `TrainConfig` preset and fields on top: data, optimisation, size)
    "variants": name -> the model fields that differ (pe, pe_layers, rope_theta, rope_scaling, sliding_window,
                layer_types, and the shape fields), or the data convention (bos, blocks: a BOS first or not,
                packed cuts or document starts); every other data and optimisation field may not differ, so that
                every variant reads the same tokens in the same batches for the same number of steps (variants
                that differ in the data convention read the same tokens cut another way: that is their factor)
    "extends":  optional, another matrix (a shipped preset's name or a .json file) whose train fields and seeds
                this one takes (its own train fields on top): a one-factor matrix beside it shares its models
                where a variant's configuration is the same (the model cache trains it once)
    "seeds":    the seeds; seed s sets the initial weights and the data order, the same for every variant, so
                the variants of one seed start from the same weights (when their shapes agree) and see the same
                batches: differences between variants are paired by seed

Every model is trained once into the cache (`poslens.train.cache`, keyed by its full configuration and token
directory) and reused by any later sweep, `reproduce` or `train` of the same configuration; an interrupted sweep
resumes (finished models are read from the cache, the interrupted one resumes from its checkpoint).

The sweep's run directory: run.json with each model's directory, variant, seed, label and configuration
(``models``), the held-out loss of every variant (mean over seeds with a t-interval over seeds) and the paired
difference of every two variants (mean over seeds of the per-seed difference, t-interval) with a verdict;
tensors ``final_loss`` [variants, seeds], ``eval_loss`` [variants, seeds, evaluations], ``eval_step``; and
``figures/heldout_loss.{png,pdf}``. The error bar of a training effect is the spread over seeds: each model's own
held-out loss is one number per seed here, not an average with its own interval.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from poslens.errors import UsageError, check_choice, check_float, check_int, require
from poslens.options import option
from poslens.train.config import FIELDS, TrainConfig, load_preset, preset_path, resolve_config

PRESETS = ("pe", "pe-quick", "pe-sinks", "bos-quick", "bos-sinks")
VARIANT_FIELDS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "pe", "pe_layers", "rope_theta",
                  "rope_scaling", "sliding_window", "layer_types", "bos", "blocks")
COMPILE = ("auto", "on", "off")
DATA_CONVENTION = ("bos", "blocks")  # variant fields that change what a block holds (the factor is the data itself)


@dataclass
class SweepConfig:
    """What `poslens sweep` trains: a preset matrix, or its parts replaced by flags."""

    preset: str = option("pe", help="matrix: pe (NoPE, RoPE, NTK-scaled RoPE, sliding-window RoPE, all with BOS, "
                                    "3 seeds), pe-quick (the same, smaller), pe-sinks (8 heads of 8, 2,000 steps of "
                                    "8 x 64 at lr 0.04, 8 seeds: the 12 models of seeds 0-2 formed sinks), or a .json "
                                    "file")
    variants: str | None = option(None, help="variants instead of the preset's: NAME:FIELD=VALUE+FIELD=VALUE,... "
                                             "(e.g. nope:pe=none,ntk:pe=rope+rope_scaling=ntk:8)")
    seeds: list[int] | None = option(None, help="seeds instead of the preset's (each sets the initial weights and "
                                                "the data order of every variant)")
    train: str | None = option(None, help="shared training fields on top of the preset's: FIELD=VALUE+... "
                                          "(e.g. steps=300+tokens=runs/tok)")
    level: float = option(0.95, help="confidence level of the between-seed t-intervals")
    jobs: int = option(0, help="processes training at once, torch's threads shared out among them; 0: one per torch "
                               "thread on the CPU, 1 on a GPU (another thread count sums in another order: weights "
                               "differ at float32 rounding)")
    batched: bool = option(True, help="models that differ only in seed and positional encoding train as one "
                                      "computation (stacked weights, batched matrix products), in --jobs parts; "
                                      "--no-batched: each model alone, --jobs of them at once")
    compile: str = option("auto", help="batched: each decoder layer's training step through torch.compile's code "
                                       "(inductor, cached on disk under the poslens cache: compiled once per "
                                       "machine; eager where no compiler works, saying so); auto: on the CPU in a "
                                       "part of at least 10,000 model-steps, which repays the compiling; on; off",
                          choices=COMPILE)


@dataclass(frozen=True)
class Member:
    """One model of the matrix."""

    variant: str
    seed: int
    config: TrainConfig

    @property
    def label(self) -> str:
        """The positional encoding in words, and the data convention where it is not packed cuts: 'RoPE',
        'RoPE; document starts, BOS first'."""
        pe = self.config.positional_encoding().label()
        if self.config.blocks == "packed":
            return pe
        return f"{pe}; document starts, {'BOS first' if self.config.bos else 'no BOS'}"


@dataclass
class Matrix:
    """A resolved matrix: the shared fields, each variant's fields, the seeds, and one member per (variant, seed)."""

    train: dict[str, Any]
    variants: dict[str, dict[str, Any]]
    seeds: list[int]
    files: tuple[str, ...] = ()  # the matrix files read: the preset's and every one it extends

    @property
    def members(self) -> list[Member]:
        return [Member(v, s, _config(self.train, fields, s)) for v, fields in self.variants.items() for s in self.seeds]


# ---------------------------------------------------------------- the matrix


def _value(field: str, text: str) -> Any:
    """A flag's text as the type of TrainConfig field `field`."""
    default = TrainConfig.__dataclass_fields__[field].default
    if isinstance(default, bool):
        require(text.lower() in ("true", "false", "1", "0"), f"{field} takes true or false; got {text!r}")
        return text.lower() in ("true", "1")
    for kind in (int, float):
        if isinstance(default, kind):
            try:
                return kind(text)
            except ValueError:
                raise UsageError(f"{field} takes a number; got {text!r}") from None
    return None if text.lower() in ("", "none") and default is None else text


def parse_fields(spec: str, what: str) -> dict[str, Any]:
    """``FIELD=VALUE+FIELD=VALUE`` -> {field: typed value} (dashes or underscores in names)."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in spec.split("+"))):
        name, eq, text = item.partition("=")
        name = name.strip().replace("-", "_")
        require(bool(eq) and name in FIELDS, f"{what}: {item!r} is not FIELD=VALUE with a train field (known: "
                                             f"{', '.join(FIELDS)})")
        try:
            out[name] = _value(name, text.strip())
        except UsageError as e:
            raise UsageError(f"{what}: {e}") from None
    return out


def parse_variants(spec: str) -> dict[str, dict[str, Any]]:
    """``nope:pe=none,ntk:pe=rope+rope_scaling=ntk:8`` -> {"nope": {"pe": "none"}, "ntk": {...}}."""
    out: dict[str, dict[str, Any]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, colon, fields = item.partition(":")
        require(bool(colon) and name.strip() != "", f"variants: {item!r} is not NAME:FIELD=VALUE+...; e.g. "
                                                     "nope:pe=none,rope:pe=rope")
        require(name.strip() not in out, f"variants: {name.strip()!r} is named twice")
        out[name.strip()] = parse_fields(fields, f"variant {name.strip()}")
    return out


def _read(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The matrix in file `path` with the train fields and seeds of every matrix it extends; under "_files" the
    files read (this one first)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise UsageError(f"sweep preset {path}: cannot read it ({type(e).__name__})") from None
    require(isinstance(data, dict), f"sweep preset {path}: must hold a JSON object with train, variants, seeds")
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    unknown = sorted(set(data) - {"train", "variants", "seeds", "extends"})
    if unknown:  # the file's keys, not flags
        raise UsageError(f"sweep preset {path}: unknown key(s) {', '.join(unknown)}; use train, variants, seeds "
                         "(and extends)", in_file=True)
    if "extends" in data:
        base = data.pop("extends")
        require(isinstance(base, str) and base, f"sweep preset {path}: extends names another matrix")
        try:
            parent_path = preset_path(base, PRESETS, "sweep-")
        except UsageError as e:
            raise UsageError(f"sweep preset {path}: extends {base}: {e}") from None
        require(parent_path.resolve() not in seen, f"sweep preset {path}: extends {base}, which extends it back")
        parent = _read(parent_path, (*seen, path.resolve()))
        require(all(isinstance(x.get("train") or {}, dict) for x in (parent, data)),
                f"sweep preset {path}: train must be an object of fields")
        data = {"train": {**(parent.get("train") or {}), **(data.get("train") or {})},
                "seeds": data.get("seeds", parent.get("seeds")), "variants": data.get("variants"),
                "_files": parent["_files"]}
    return {**data, "_files": [str(path), *data.get("_files", [])]}


def _config(train: dict[str, Any], variant: dict[str, Any], seed: int) -> TrainConfig:
    fields = {**train, **variant, "seed": seed}
    return resolve_config(fields.pop("preset", "tiny"), **fields)


def _source(cfg: SweepConfig, train: dict[str, Any], seed: int, variant: str) -> str:
    """Where a member's refused field comes from: the shared train fields when they are refused alone (the flag
    --train, or the preset file's train), else the variant (the flag --variants, or the file's variant)."""
    try:
        _config(train, {}, seed).check()
    except UsageError:
        return "train" if cfg.train else f"sweep preset {cfg.preset}: train"
    return f"variants: {variant}" if cfg.variants else f"sweep preset {cfg.preset}: variant {variant}"


def resolve_matrix(cfg: SweepConfig) -> Matrix:
    """The matrix of `cfg` (preset, then flags), every member's configuration checked before anything runs."""
    data = _read(preset_path(cfg.preset, PRESETS, "sweep-"))
    for key, kind in (("train", dict), ("variants", dict), ("seeds", list)):
        require(isinstance(data.get(key, kind()), kind), f"sweep preset {cfg.preset}: {key} must be a JSON "
                                                         f"{'object' if kind is dict else 'list'}, got "
                                                         f"{type(data[key]).__name__}")
    train = dict(data.get("train") or {})
    if cfg.train:
        train.update(parse_fields(cfg.train, "train"))
    variants = parse_variants(cfg.variants) if cfg.variants else data.get("variants")
    seeds = list(cfg.seeds) if cfg.seeds is not None else data.get("seeds")
    require(isinstance(train, dict) and isinstance(variants, dict) and len(variants) >= 1,
            f"sweep preset {cfg.preset}: needs a train object and at least one variant")
    where = "seeds" if cfg.seeds is not None else f"sweep preset {cfg.preset}: seeds"  # a flag's, or the file's
    if not (isinstance(seeds, list) and len(seeds) >= 1
            and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        raise UsageError(f"{where} must be a list of one or more integers, got {seeds!r}", in_file=cfg.seeds is None)
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"{where} must differ from each other, got {seeds}", in_file=cfg.seeds is None)
    unknown = sorted(set(train) - set(FIELDS))
    require(not unknown, f"sweep train fields: unknown {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    require("seed" not in train, "the seed is the sweep's: give seeds, not a train seed")
    if "preset" in train:
        load_preset(train["preset"])
    for name, fields in variants.items():
        require(isinstance(fields, dict), f"variant {name}: must be an object of fields")
        shared = sorted(set(fields) - set(VARIANT_FIELDS))
        require(not shared, f"variant {name}: {', '.join(shared)} must be the same for every variant (the variants "
                            f"share tokens, batches and steps); set it under train. A variant may set: "
                            f"{', '.join(VARIANT_FIELDS)}")
    check_float("level", cfg.level, 0.0, 1.0, lo_open=True, hi_open=True)
    check_int("jobs", cfg.jobs, 0, 64)
    check_choice("compile", cfg.compile, COMPILE)
    for seed in seeds:
        check_int("seeds" if cfg.seeds is not None else f"sweep preset {cfg.preset}: seeds", seed, 0, 2**32 - 1)
    for name, fields in variants.items():  # every configuration checked up front, the error laid at its source
        for seed in seeds:
            try:
                config = _config(train, fields, seed)
                config.check()
            except UsageError as e:
                where = _source(cfg, train, seed, name)  # a flag's (spelled as the flag), or a file's
                raise UsageError(f"{where}: {e}", in_file=not where.startswith(("train", "variants"))) from None
            if "rope_theta" in fields and not any(config.positional_encoding().flags):  # as train refuses it
                raise UsageError(f"variant {name}: rope_theta has no effect, no layer of it has RoPE (pe none); set "
                                 "pe rope or a pe_layers pattern with a 1, or leave rope_theta out of it")
    matrix = Matrix(train=train, variants={k: dict(v) for k, v in variants.items()}, seeds=seeds,
                    files=tuple(data["_files"]))
    if train.get("tokens") is not None:  # the token directory too: one line for a file, a missing or corrupt one
        from poslens.io.tokenfile import open_tokens

        open_tokens(train["tokens"], check=())
    return matrix


def matrix_inputs(cfg: SweepConfig, matrix: Matrix) -> list[str | None]:
    """What a sweep reads besides the cache: its token directory, its matrix files (the preset's and every one it
    extends) and its training preset file (an --out may be none)."""
    preset = matrix.train.get("preset")
    files = [*matrix.files, *([preset] if isinstance(preset, str) and preset.endswith(".json") else [])]
    return [matrix.train.get("tokens"), *files]


# ---------------------------------------------------------------- statistics over seeds


def seed_interval(values: list[float | None], level: float = 0.95,
                  support: tuple[float, float] | None = None, shared: list[float] | None = None) -> dict[str, Any]:
    """`poslens.engine.stats.over_seeds` as run.json numbers: the mean of per-seed values with its t-interval over
    seeds (None with one seed), cut to `support` where given; `shared`: each seed's half-width over a text sample
    every seed read, added in quadrature (`over_seeds`; recorded as "shared", the root-mean-square, which more seeds
    cannot shrink; "sd" is then the spread over seeds alone). An undefined value (None) reads NaN: then so are the
    mean and its interval, and a test on them stays open."""
    from poslens.engine.stats import over_seeds

    values = [math.nan if v is None else float(v) for v in values]
    e = over_seeds(values, level, support, shared)
    n = len(values)
    bound = (lambda x: float(x)) if n >= 2 else (lambda x: None)
    sd = (math.nan if any(math.isnan(v) for v in values) else statistics.stdev(values)) if n >= 2 else None
    rms = None if shared is None else math.sqrt(sum(h * h for h in shared) / len(shared))
    return {"value": float(e.value), "lo": bound(e.lo), "hi": bound(e.hi), "sd": sd, "n": n,
            "level": level, "method": "t over seeds", "per_seed": values} | (
        {"support": list(support)} if support is not None else {}) | ({"shared": rms} if shared is not None else {})


def verdict(diff: dict[str, Any], a: str, b: str) -> str:
    """The rule for a paired difference a - b: resolved when its interval excludes 0."""
    lo, hi = diff["lo"], diff["hi"]
    if lo is None or hi is None:
        return "not resolved (one seed: no interval)"
    if hi < 0:
        return f"{a} lower than {b}"
    if lo > 0:
        return f"{a} higher than {b}"
    return f"not resolved at {diff['n']} seeds"


def summarise(losses: dict[str, list[float]], level: float = 0.95) -> dict[str, Any]:
    """Held-out loss per variant (list over the same seeds) and every paired difference, with t-intervals."""
    names = list(losses)
    table = {v: seed_interval(losses[v], level) for v in names}
    diffs = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            d = seed_interval([x - y for x, y in zip(losses[a], losses[b])], level)
            diffs[f"{a} - {b}"] = {**d, "a": a, "b": b, "verdict": verdict(d, a, b)}
    return {"heldout_loss": table, "differences": diffs}


# ---------------------------------------------------------------- running


def train_matrix(matrix: Matrix, progress: bool = True, jobs: int = 0, batched: bool = True,
                 compile: str = "auto") -> dict[tuple[str, int], Path]:
    """Every member's model directory: from the cache, or trained now (`train_models`). Progress lines name each
    model, k of N, and the time left, estimated from the models trained so far."""
    members = matrix.members
    heads = [f"[{k}/{len(members)}] {m.variant} ({m.label}), seed {m.seed}" for k, m in enumerate(members, 1)]
    paths = train_models([(m.config, h) for m, h in zip(members, heads)], progress, jobs, batched, compile)
    return {(m.variant, m.seed): t for m, t in zip(members, paths)}


MIN_SIDE_BY_SIDE_TOKENS = 100_000  # a worker process takes seconds to start: a model below this trains faster inline


def auto_jobs(cfgs: list[TrainConfig]) -> int:
    """How many of these models to train at once: on the CPU one per torch thread (small models use two cores
    better side by side than split over threads: 1.3x on two cores, BENCHMARKS.md "Sweep"), at most one per
    model; one where any trains on a GPU, or where every model trains on fewer than MIN_SIDE_BY_SIDE_TOKENS tokens
    (a test's few steps: starting the workers would cost more than it saves)."""
    import torch

    gpu = any(c.device.startswith("cuda") or (c.device == "auto" and torch.cuda.is_available()) for c in cfgs)
    small = all(c.steps * c.batch_size * c.seq_len < MIN_SIDE_BY_SIDE_TOKENS for c in cfgs)
    return 1 if gpu or small else max(1, min(len(cfgs), torch.get_num_threads()))


def train_models(work: list[tuple[TrainConfig, str]], progress: bool = True, jobs: int = 0,
                 batched: bool = True, compile: str = "auto") -> list[Path]:
    """The model directory of each (configuration, progress label): from the cache, or trained now into it. The
    configurations share one token directory (the first's).

    `batched` (the default): the models that can (`poslens.train.batched.batch_key`: all but seed, positional
    encoding and data convention equal: packed or document-start blocks, a BOS first or not) train as one
    computation, in `jobs` parts side by side (one process each, torch's threads shared out; 0 picks `auto_jobs`),
    each part at most `poslens.train.batched.max_models` models. Otherwise `jobs` > 1 trains that many models at
    once, each alone in its own process; their own progress bars are off then. `compile` (batched only): the
    layers' training step through compiled code (`poslens.train.batched.train_batched`'s `compile`): "auto" in
    the parts that repay it (`poslens.train.batched.worth_compiling`), "on" in every part, "off" in none."""
    from poslens.train.cache import finished, tokens_of, trained_model_dir

    jobs = check_int("jobs", jobs, 0, 64)
    check_choice("compile", compile, COMPILE)
    cfgs = [c for c, _ in work]
    tokens = tokens_of(cfgs[0], progress)  # shared by every model (a variant cannot change the data)
    targets = [trained_model_dir(c, tokens) for c in cfgs]
    heads = [h for _, h in work]
    todo: dict[Path, int] = {}  # target -> its first entry (two entries of one configuration: one model)
    for i, t in enumerate(targets):
        if not finished(t):  # not there, or corrupt (retrained, saying so)
            todo.setdefault(t, i)
    for i, t in enumerate(targets):
        if progress and todo.get(t) != i:
            print(f"{heads[i]}: {'cached' if t not in todo else 'the same model as ' + heads[todo[t]]}", flush=True)
    jobs = min(jobs or auto_jobs([cfgs[i] for i in todo.values()] or cfgs), max(1, len(todo)))
    if batched:
        units = _units([cfgs[i] for i in todo.values()], list(todo.values()), jobs, tokens)
        parts = [[(cfgs[i], heads[i]) for i in unit] for unit in units]
    else:
        parts = [[(cfgs[i], heads[i])] for i in todo.values()]
    clock = _Clock([(len(p), p[0][0].steps) for p in parts], progress, 1 if len(parts) == 1 else jobs)
    if jobs == 1 or len(parts) == 1:
        for part in parts:
            head = _unit_head(part)
            clock.start(head, part[0][0].steps, len(part))
            if batched:
                _train_unit(part, tokens, None, progress, compile)
            else:
                _train_member(part[0][0], tokens, None, head if progress else None)
            clock.done(head, len(part))
    else:
        _train_parallel(parts, tokens, jobs, clock, compile if batched else None)
    return targets


def _units(cfgs: list[TrainConfig], index: list[int], jobs: int, tokens: Path) -> list[list[int]]:
    """The models (`index`, configurations `cfgs`) cut into the parts that train as one computation: each group of
    one `batch_key` into `jobs` parts of nearly equal size (a part at most `max_models` models)."""
    from poslens.engine.distributed import setup
    from poslens.train.batched import groups, max_models
    from poslens.train.tokens import open_tokens

    units: list[list[int]] = []
    vocab = open_tokens(tokens).vocab_size
    for group in groups(cfgs):
        cap = max_models(cfgs[group[0]], vocab, setup(cfgs[group[0]].device).device)
        parts = max(min(jobs, len(group)), math.ceil(len(group) / cap))
        size = math.ceil(len(group) / parts)
        units += [[index[g] for g in group[k:k + size]] for k in range(0, len(group), size)]
    return units


def _unit_head(part: list[tuple[TrainConfig, str]]) -> str:
    """The progress line's name of a part: its first and last model, how many train as one computation, and their
    blocks where any is not packed cuts (e.g. "(document starts, BOS first; document starts, no BOS)")."""
    if len(part) == 1:
        return part[0][1]
    kinds = {(c.blocks, c.bos) for c, _ in part}
    blocks = "" if all(b == "packed" for b, _ in kinds) else " (" + "; ".join(
        f"{'document starts' if b == 'doc-start' else 'packed cuts'}, {'BOS first' if bos else 'no BOS'}"
        for b, bos in sorted(kinds, key=lambda k: (k[0] == "packed", not k[1]))) + ")"
    return f"{part[0][1]} .. {part[-1][1]}: {len(part)} models as one{blocks}"


def time_left(running: list[tuple[float, float]], queued: list[float], rate: float, slots: int) -> float:
    """Seconds until every part is trained, when each part trains at `rate` units of work per second (model-steps:
    the observed rate of one part, the finished parts' work over their wall time) and `slots` parts train at once.
    `running`: each running part's (work, seconds since it started); `queued`: the work of each part not started,
    in the order they start, each in the first slot that frees. A running part past its expected time counts 0."""
    require(rate > 0 and slots >= 1, f"time_left needs rate > 0 and slots >= 1, got rate {rate}, slots {slots}")
    free = [max(0.0, w / rate - e) for w, e in running] + [0.0] * max(0, slots - len(running))
    for w in queued:
        k = free.index(min(free))
        free[k] += w / rate
    return max(free, default=0.0)


class _Clock:
    """Progress lines of the parts being trained (a part: one model, or models trained as one computation), with the
    time left: the work left (model-steps) at the rate the finished parts trained, `slots` parts at once
    (`time_left`)."""

    def __init__(self, parts: list[tuple[int, int]], on: bool, slots: int = 1):
        """`parts`: (models, steps) of each part, in the order they start."""
        self.on, self.slots = on, max(1, slots)
        self.queued = [m * s for m, s in parts]
        self.total, self.finished = sum(m for m, _ in parts), 0
        self.running: dict[str, tuple[float, float]] = {}  # head -> (work, start time)
        self.work_done = self.seconds = 0.0

    def left(self) -> str:
        if not self.work_done:
            return "time left known after one model"
        now = time.perf_counter()
        running = [(w, now - t) for w, t in self.running.values()]
        rest = time_left(running, self.queued, self.work_done / self.seconds, self.slots)
        return f"about {_duration(rest)} left"

    def start(self, head: str, steps: int, models: int = 1) -> None:
        if self.queued:  # parts start in the order given
            self.queued.pop(0)
        self.running[head] = (float(models * steps), time.perf_counter())
        if self.on:
            self.say(f"{head}: training {steps} steps; {self.total - self.finished} model(s) to train, {self.left()}")

    def done(self, head: str, models: int = 1) -> None:
        work, began = self.running.pop(head)
        self.finished += models
        self.work_done += work
        self.seconds += max(time.perf_counter() - began, 1e-9)
        if self.on and self.finished < self.total:
            self.say(f"{head}: trained; {self.total - self.finished} model(s) to train, {self.left()}")

    @staticmethod
    def say(line: str) -> None:
        """One progress line on stdout, now (above a progress bar being drawn, as tqdm.write puts it)."""
        from tqdm.auto import tqdm

        tqdm.write(line)
        sys.stdout.flush()


def _train_member(cfg: TrainConfig, tokens: Path, threads: int | None, label: str | None) -> str:
    """Train one model into the cache (in this process, or in a worker with `threads` torch threads)."""
    from poslens.train.cache import trained_model

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return str(trained_model(cfg, progress=label is not None, label=label, tokens=tokens))


def _train_unit(part: list[tuple[TrainConfig, str]], tokens: Path, threads: int | None, progress: bool,
                compile: str, slot: int | None = None) -> None:
    """Train the models of `part` into the cache as one computation (in this process, or in a worker with `threads`
    torch threads): each model's cache lock is held while it trains; a model another process finished meanwhile is
    left out. `compile`: compiled layers "on", "off", or "auto": where the part repays them
    (`poslens.train.batched.worth_compiling`). `slot`: in a worker of `_train_parallel`, the part's entry in the
    shared counters, where each step writes the model-steps done."""
    import contextlib
    import dataclasses

    from poslens.engine.distributed import setup
    from poslens.io.lock import entry_lock
    from poslens.train.batched import train_batched, worth_compiling
    from poslens.train.cache import clear_corrupt, trained_model_dir

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    with contextlib.ExitStack() as stack:
        left = []
        for cfg, _ in part:
            target = trained_model_dir(cfg, tokens)
            stack.enter_context(entry_lock(target, f"the model {target.name}"))
            clear_corrupt(target)
            if not (target / "run.json").is_file():
                left.append((dataclasses.replace(cfg, tokens=str(tokens)), target))
        if left:
            on = compile == "on" or (compile == "auto" and worth_compiling(left[0][0], len(left),
                                                                         setup(left[0][0].device).device))
            counters, models = _COUNTERS, len(left)
            on_step = None if slot is None or counters is None else \
                (lambda step: counters.__setitem__(slot, step * models))
            train_batched([c for c, _ in left], [t for _, t in left], progress=progress,
                          label=_unit_head(part) if progress else None, compile=on, on_step=on_step)


_COUNTERS: Any = None  # in a worker of `_train_parallel`: model-steps done per part, shared with the parent


def _worker_init(counters: Any) -> None:
    """A `_train_parallel` worker: Ctrl-C ignored (the parent stops the workers; each keeps its last checkpoint), the
    parent's SIGTERM an exit that unwinds the job (its run directories' builds removed, its locks released: a plain
    SIGTERM ends the process with no cleanup, which left each model's empty ``build/`` in the cache), and the shared
    counters kept for `_train_unit`."""
    import signal

    global _COUNTERS
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    _COUNTERS = counters


def _quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (a process of its own, started once) with its warning about leaked
    semaphores ignored: a Ctrl-C ends the workers while the pool's queues hold semaphores, which the tracker then
    unlinks itself, but says so in two lines on stderr after the command's one line."""
    from multiprocessing import resource_tracker

    old = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [old, "ignore::UserWarning:multiprocessing.resource_tracker"]))
    try:
        resource_tracker.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = old


def _train_parallel(parts: list[list[tuple[TrainConfig, str]]], tokens: Path, jobs: int, clock: _Clock,
                    compile: str | None) -> None:
    """Train `parts` in `jobs` worker processes, each part as one computation (`_train_unit`, compiled as `compile`
    says, as the parts trained in this process are: a part of one model too), or with `compile` None each model
    alone (`_train_member`: parts of one model)."""
    from concurrent.futures import FIRST_COMPLETED, wait

    import torch
    from tqdm.auto import tqdm

    from poslens.engine import workers

    threads = max(1, torch.get_num_threads() // jobs)
    _quiet_resource_tracker()
    counters = workers.context().Array("q", len(parts), lock=False)  # model-steps done per part, written by its worker
    work = [len(p) * p[0][0].steps for p in parts]
    pool = workers.Pool(jobs, initializer=_worker_init, initargs=(counters,))
    # one bar for every part (the workers draw none): model-steps done; a model trained alone (compile None) counts
    # when it is finished
    bar = tqdm(total=sum(work), desc=f"training {clock.total} models, {jobs} parts at a time", unit="model-step",
               disable=not clock.on, dynamic_ncols=True)
    pending: dict[Any, tuple[str, int, int]] = {}
    done = 0  # model-steps of the finished parts
    try:
        queue = list(enumerate(parts))
        while queue or pending:
            while queue and len(pending) < jobs:
                slot, part = queue.pop(0)
                head = _unit_head(part)
                clock.start(head, part[0][0].steps, len(part))
                if compile is None:
                    future = pool.submit(_train_member, part[0][0], tokens, threads, None)
                else:
                    future = pool.submit(_train_unit, part, tokens, threads, False, compile, slot)
                pending[future] = (head, len(part), slot)
            finished, _ = wait(pending, timeout=2.0, return_when=FIRST_COMPLETED)
            for f in finished:
                f.result()  # a worker's error is raised here, as one line
                head, models, slot = pending.pop(f)
                done += work[slot]
                clock.done(head, models)
            bar.n = done + sum(counters[slot] for _, _, slot in pending.values())
            bar.refresh()
        pool.shutdown()
    except BaseException:
        for p in list(getattr(pool, "_processes", {}).values()):  # stop the workers now: what they checkpointed stays
            p.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        bar.close()


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def run_sweep(cfg: SweepConfig, out: str | os.PathLike, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train (or read from the cache) every model of the matrix and write the sweep's run directory to `out`;
    returns its run.json contents."""
    import torch

    from poslens import plotting
    from poslens.io.results import load, open_run, write_run

    matrix = resolve_matrix(cfg)
    started = time.perf_counter()
    with open_run(out, force, inputs=matrix_inputs(cfg, matrix)) as run:
        paths = train_matrix(matrix, progress, cfg.jobs, cfg.batched, cfg.compile)
        runs = {key: load(path) for key, path in paths.items()}
        names, seeds = list(matrix.variants), matrix.seeds
        final = torch.tensor([[float(runs[(v, s)]["eval_loss"][-1]) for s in seeds] for v in names],
                             dtype=torch.float64)
        curves = torch.stack([torch.stack([runs[(v, s)]["eval_loss"] for s in seeds]) for v in names])
        steps = runs[(names[0], seeds[0])]["eval_step"]
        metrics = summarise({v: final[i].tolist() for i, v in enumerate(names)}, cfg.level)
        labels = {m.variant: m.label for m in matrix.members}
        series, errors = {}, {}
        for i, v in enumerate(names):
            per_step = [seed_interval(curves[i, :, e].tolist(), cfg.level) for e in range(len(steps))]
            series[f"{v}: {labels[v]}"] = [p["value"] for p in per_step]
            errors[f"{v}: {labels[v]}"] = [0.0 if p["hi"] is None else p["hi"] - p["value"] for p in per_step]
        fig = plotting.line_plot(steps.tolist(), series, "step", "held-out loss (nats)",
                                 f"mean over {len(seeds)} seed(s), {100 * cfg.level:g}% t-interval over seeds",
                                 errors=errors)
        plotting.save(fig, run.build / "figures", "heldout_loss")
        models = [{"variant": m.variant, "seed": m.seed, "label": m.label, "path": str(paths[(m.variant, m.seed)]),
                   "config": asdict(m.config)} for m in matrix.members]
        meta = {"kind": "sweep", "command": "sweep",
                "config": {**asdict(cfg), "train": matrix.train, "variants": matrix.variants, "seeds": seeds},
                "models": models, "labels": labels, "metrics": metrics,
                "timings": {"seconds": time.perf_counter() - started}}
        write_run(run.build, {"final_loss": final, "eval_loss": curves, "eval_step": steps}, meta)
    return meta
