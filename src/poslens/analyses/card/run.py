"""`poslens card MODEL [MODEL ...]`: run every analysis of the card into sub-run directories, then write the page.

Layout of --out (docs/card.md):

    OUT/MODEL_LABEL/scores/    `poslens scores`              Kim et al.'s non-relative pattern (Section 5.2)
    OUT/MODEL_LABEL/leakage/   `poslens leakage`             attention terms, key 0 in and out, sinks
    OUT/MODEL_LABEL/probe/     `poslens stat position_probe` held-out R^2 of absolute position per layer
    OUT/MODEL_LABEL/length/    `poslens length`              loss by position past a length L, interventions
    OUT/card/                  card.md, card.html, figures/, run.json (every sub-run's command)

Each sub-run is an ordinary run directory of its analysis, written by the analysis's own run function (scores,
leakage and probe, which read the same batches, in one pass: `shared.py`); the exact command that re-measures it is
recorded and printed on the card, and its wall and CPU time are printed and kept in the card's run.json. Rerunning
the same card reuses every finished sub-run whose recorded config equals the one asked (an interrupted sub-run
resumes from its checkpoints); a sub-run made with other settings is refused without --force. The page is rewritten
every time. --out must be new, empty or a card directory, with or without --force (`out.py`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import resource
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poslens.analyses.card.out import PAGE
from poslens.engine.config import DTYPES
from poslens.engine.data import BOS_POLICIES, MODES
from poslens.errors import UsageError
from poslens.options import check_options, default_of, field_kind, flag_of, option, option_fields, parse_sizes

ANALYSES = ("scores", "leakage", "probe", "length")

# Each analysis's sizes (`--sizes ANALYSIS.KEY=VALUE`): chosen so that SmolLM2-135M's card takes well under 10
# minutes on 2 CPU cores (BENCHMARKS.md, "Card"; why each size suffices: docs/card.md, "Sizes"). scores, leakage
# and probe cut the same batches, so they share one forward per batch (`shared.py`); keep their seq_len,
# num_sequences and batch_size equal. `multiple`: the length panel evaluates at L and multiple x L.
SIZES: dict[str, dict[str, Any]] = {
    "scores": {"seq_len": 128, "num_sequences": 32, "batch_size": 4, "groups": 8},
    "leakage": {"seq_len": 128, "num_sequences": 32, "batch_size": 4, "groups": 8, "early_queries": 32},
    "probe": {"seq_len": 128, "num_sequences": 32, "batch_size": 4, "groups": 4, "ridge": 1e-2, "skip_first": 1},
    "length": {"train_len": 64, "multiple": 2, "num_sequences": 12, "batch_size": 2, "groups": 6},
}


@dataclass
class CardConfig:
    """What a card runs on: the models, the one text they all read, and each analysis's sizes."""

    models: list[str] = option(help="models, each as `poslens scores` takes it (hub id, directory, .gguf, "
                               "smollm2-135m, random:<config.json>)", positional=True, metavar="MODEL")
    data: str | None = option(None, help="text every model reads (as `poslens scores --data`); default: the "
                              "embedded corpus")
    text_field: str = option("text", help="field or column holding the text (.jsonl, .parquet, saved datasets)")
    mode: str = option("first", choices=MODES, help="how the scores, leakage and probe sequences are cut: first "
                       "(the first seq-len tokens of each long-enough document) or pack; the length panel packs")
    bos: str = option("always", choices=BOS_POLICIES, help="BOS token at position 0 of the scores, leakage and "
                      "probe sequences (always: Ruscio et al.'s fixed first token)")
    dtype: str = option("auto", choices=DTYPES, help="as `poslens scores --dtype`")
    device: str = option("cpu", help="cpu, cuda or cuda:N")
    tokenizer: str | None = option(None, help="tokenizer for random: configs without tokenizer files")
    seed: int = option(0, lo=0, help="seed of random: models and of every random choice")
    level: float = option(0.95, lo=0, hi=1, open=True, help="confidence level of every interval")
    labels: list[str] | None = option(None, help="a name per model for the page and the sub-run folders "
                                      "(comma-separated; default: from the model specs)")
    sizes: list[str] | None = option(None, metavar="ANALYSIS.KEY=VALUE,...",
                                     help="change an analysis's size, e.g. probe.num_sequences=64,length.multiple=4 "
                                     "(analyses and keys: docs/card.md, or the card's run.json config.sizes)")

    def validate(self) -> None:
        check_options(self)
        if not self.models:
            raise UsageError("models: give at least one model", param="models")
        if self.labels is not None and len(self.labels) != len(self.models):
            raise UsageError(f"labels: {len(self.labels)} labels for {len(self.models)} models; give one per model",
                             param="labels")
        self.size_table()
        names = self.model_labels()
        if len(set(names)) != len(names):
            raise UsageError(f"labels: two models have the label {_first_repeat(names)!r}; give --labels",
                             param="labels")
        if PAGE in names:  # OUT/card is the page's own folder
            raise UsageError(f"labels: a model's label is {PAGE!r}, the name of the page's folder in the output "
                             "directory; give it another label (--labels)", param="labels")

    def size_table(self) -> dict[str, dict[str, Any]]:
        """SIZES updated by `sizes` (unknown analyses, keys or values of another type refused in one line)."""
        out = {k: dict(v) for k, v in SIZES.items()}
        for analysis, given in parse_sizes(self.sizes, "probe.num_sequences=64").items():
            if analysis not in out:
                raise UsageError(f"sizes: no analysis {analysis!r}; analyses: {', '.join(out)}", param="sizes")
            for key, parsed in given.items():
                if key not in out[analysis]:
                    raise UsageError(f"sizes: {analysis} has no size {key!r} (it has {', '.join(out[analysis])})",
                                     param="sizes")
                value = json.dumps(parsed) if not isinstance(parsed, str) else parsed
                default = out[analysis][key]
                if isinstance(default, float) and isinstance(parsed, int) and not isinstance(parsed, bool):
                    parsed = float(parsed)
                if type(parsed) is not type(default):
                    raise UsageError(f"sizes: {analysis}.{key} takes a value like {default!r}, not {value!r}",
                                     param="sizes")
                out[analysis][key] = parsed
        if out["length"]["multiple"] < 2:
            raise UsageError("sizes: length.multiple must be >= 2 (the loss past L is what the panel shows)",
                             param="sizes")
        return out

    def model_labels(self) -> list[str]:
        """The page's name and the sub-run folder of each model."""
        if self.labels is not None:
            return [_safe(x) for x in self.labels]
        return [_safe(_default_label(m)) for m in self.models]


def _default_label(model: str) -> str:
    """A model spec's folder or file name without .json or .gguf; for a `random:` config named config.json, its
    folder's name (random:gpt2/config.json -> gpt2), so that configs in folders of their own get distinct labels."""
    path = Path(model.removeprefix("random:"))
    if model.startswith("random:") and path.name == "config.json" and path.parent.name:
        return path.parent.name
    return path.name.removesuffix(".json").removesuffix(".gguf") or model


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-.") or "model"


def _first_repeat(names: list[str]) -> str:
    return next(n for n in names if names.count(n) > 1)


@dataclass
class SubRun:
    """One analysis of one model: where it goes, its config, and the command that re-measures it."""

    model: str
    label: str
    analysis: str
    path: Path
    config: Any
    command: str
    run: Any = field(repr=False)  # run(config, path, force, progress) -> Path
    extra: dict = field(default_factory=dict)  # run.json entries besides config that must match (the probe's options)
    settled: tuple[str, ...] = ()  # config fields the analysis settles itself (length's "all" interventions)
    reused: bool = False  # a finished run of the same config was found and read as it is
    pipeline: Any = None  # its pipeline Analysis, when it is one plain pass that can share a forward (`shared.py`)
    shared_with: tuple[str, ...] = ()  # the analyses measured in the same pass as this one (this call)
    seconds: float | None = None  # wall time of this call's run (None: reused)
    cpu_seconds: float | None = None  # CPU time (user + system, every thread) of this call's run

    def timing(self) -> dict:
        """run.json's record of this sub-run's cost: this call's wall and CPU seconds, or, reused, the seconds its
        own run.json recorded when it was measured."""
        if self.reused:
            meta = recorded(self.path) or {}
            return {"reused": True, "measured_seconds": (meta.get("timings") or {}).get("seconds")}
        return {"reused": False, "seconds": self.seconds, "cpu_seconds": self.cpu_seconds,
                **({"one_pass_with": list(self.shared_with)} if self.shared_with else {})}


def plan(cfg: CardConfig, out: Path) -> list[SubRun]:
    """Every sub-run of the card, model-major, in ANALYSES order (nothing loaded or run)."""
    from poslens.analyses.card.probe import ProbeOptions
    from poslens.analyses.leakage.run import LEAKAGE, LeakageConfig, run_leakage
    from poslens.analyses.length.run import LengthConfig, run_length
    from poslens.analyses.scores import SCORES, ScoresConfig, run_scores
    from poslens.analyses.stat import StatAnalysis, StatConfig, run_stat
    from poslens.engine.statistics import spec

    sizes = cfg.size_table()
    # figures off: the card draws its own from the tensors (each sub-run's command re-draws them without the flag)
    shared = {"data": cfg.data, "text_field": cfg.text_field, "dtype": cfg.dtype, "device": cfg.device,
              "tokenizer": cfg.tokenizer, "seed": cfg.seed, "level": cfg.level, "figures": False}
    text = {**shared, "mode": cfg.mode, "bos": cfg.bos}
    runs = []
    for model, label in zip(cfg.models, cfg.model_labels()):
        base = out / label
        s = sizes["scores"]
        scores = ScoresConfig(model=model, **text, **s)
        s = sizes["leakage"]
        leakage = LeakageConfig(model=model, **text, **s, interventions=["none"], nulls=["none"], predecessor=False)
        s = dict(sizes["probe"])
        options = ProbeOptions(ridge=s.pop("ridge"), skip_first=s.pop("skip_first"))
        _sized("probe", lambda o=options: check_options(o), sizes)
        probe = StatConfig(model=model, **text, **s)
        s = dict(sizes["length"])
        L, k = s.pop("train_len"), s.pop("multiple")
        # the panel reads the loss by position and the interventions' effects on it: no maps, no profiles under
        # the interventions (the two costliest readers of a length run; `poslens length` keeps them by default)
        length = LengthConfig(model=model, **shared, **s, train_len=L, eval_lens=[L, k * L], maps=False,
                              intervention_profiles=False)
        runs += [
            SubRun(model, label, "scores", base / "scores", scores, command_line("scores", scores, base / "scores"),
                   run_scores, pipeline=SCORES),
            SubRun(model, label, "leakage", base / "leakage", leakage,
                   command_line("leakage", leakage, base / "leakage"), run_leakage, pipeline=LEAKAGE),
            SubRun(model, label, "probe", base / "probe", probe,
                   command_line("stat position_probe", probe, base / "probe", options),
                   lambda c, p, force, progress, o=options: run_stat("position_probe", c, o, p, force, progress),
                   extra={"statistic": {"name": "position_probe", "options": dataclasses.asdict(options)}},
                   pipeline=StatAnalysis(spec("position_probe"), options)),
            SubRun(model, label, "length", base / "length", length,
                   command_line("length", length, base / "length", skip=("seq_len",)), run_length,
                   settled=("interventions",)),
        ]
    for r in runs:
        _sized(r.analysis, r.config.validate if r.analysis != "length" else lambda c=r.config: _validate_length(c),
               sizes)
    return runs


def _sized(analysis: str, check: Any, sizes: dict[str, dict[str, Any]]) -> Any:
    """check(); a refusal of one of the analysis's sizes names the --sizes entry that set it."""
    try:
        return check()
    except UsageError as e:
        if e.param in sizes[analysis]:
            raise UsageError(f"sizes: {analysis}.{e}", param="sizes") from None
        raise


def _validate_length(cfg) -> None:
    cfg.validate()
    if cfg.eval_lens is not None and cfg.train_len is not None:
        cfg.settle(None)  # eval_lens sorted, seq_len = the longest (what the run records)


def command_line(name: str, cfg: Any, out: Path, *extra: Any, skip: tuple[str, ...] = ()) -> str:
    """The `poslens NAME ...` command that writes the same run: every option of `cfg` (and of the `extra` options
    dataclasses) that differs from its default, the positional model first."""
    argv = ["poslens", *name.split()]
    for obj in (cfg, *extra):
        for f, opt, tp in option_fields(type(obj)):
            value = getattr(obj, f.name)
            if opt.positional:  # a list of them (the card's models) one argument each
                at = 1 + len(name.split())
                argv[at:at] = list(map(str, value)) if isinstance(value, (list, tuple)) else [str(value)]
                continue
            if f.name in skip or value == default_of(f) or value is None:
                continue
            if field_kind(tp)[0] is bool and field_kind(tp)[1] is None:
                argv.append(flag_of(f, opt))
            elif isinstance(value, (list, tuple)):
                argv += [flag_of(f, opt), ",".join(map(str, value))]
            else:
                argv += [flag_of(f, opt), str(value)]
    return shlex.join([*argv, "--out", str(out)])


def recorded(path: Path) -> dict | None:
    """run.json of a finished run directory at `path` (None when there is none)."""
    meta = path / "run.json"
    if not meta.is_file():
        return None
    try:
        return json.loads(meta.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return None


def same_config(sub: SubRun) -> bool | None:
    """Whether the finished run at sub.path measured what `sub` asks (None: no finished run there): the same
    options, and the same files of its inputs (model, tokenizer, text: `input_stamps`) as they are now. Fields that
    change how a run goes, not what it reads (device, checkpoints, figures) are not compared."""
    from poslens.engine.pipeline import input_stamps

    meta = recorded(sub.path)
    if meta is None:
        return None
    have = meta.get("config") or {}
    want = json.loads(json.dumps(dataclasses.asdict(sub.config), default=str))
    extra = json.loads(json.dumps(sub.extra, default=str))
    ignored = ("device", "checkpoint_every", "figures", *sub.settled)
    inputs = meta.get("inputs")
    return (all(have.get(k) == v for k, v in want.items() if k not in ignored)
            and all(meta.get(k) == v for k, v in extra.items())
            and isinstance(inputs, dict) and all(inputs.get(k) == v for k, v in input_stamps(sub.config).items()))


def run_card(cfg: CardConfig, out: str | Path, force: bool = False, progress: bool = True,
             command: str | None = None) -> Path:
    """Run (or reuse) every sub-run, then write the card into out/card; returns that directory."""
    from poslens.analyses.card.out import check_card_out, replaced_by_another
    from poslens.analyses.card.page import write_card
    from poslens.analyses.card.shared import same_batches

    started = (time.perf_counter(), cpu_seconds())
    cfg.validate()
    out = Path(out).expanduser().absolute()
    check_card_out(out)
    runs = plan(cfg, out)
    pending = []
    for sub in runs:
        same = same_config(sub)
        if same and not force:
            sub.reused = True
            continue
        why = replaced_by_another(sub.path)  # checked for every sub-run before any is measured
        if why:
            raise UsageError(f"out: {sub.path} cannot be measured again: {why}; choose another --out (poslens "
                             "replaces only what it wrote)", param="out")
        if same is False and not force:
            raise UsageError(f"out: {sub.path} was measured with other settings than this card asks, or its model "
                             "or text files have changed since; use --force to measure it again, or another --out",
                             param="out")
        pending.append(sub)
    preflight(pending)
    while pending:  # a model's sub-runs on the same batches share one forward per batch (`shared.py`)
        group = [pending.pop(0)]
        if group[0].pipeline is not None:
            group += [s for s in pending if s.label == group[0].label and s.pipeline is not None
                      and same_batches(group[0].config, s.config)]
            pending = [s for s in pending if s not in group]
        measure(group, force, progress)
    return write_card(cfg, out, runs, command=command, started=started)


def preflight(pending: list[SubRun]) -> None:
    """Refuse, before any sub-run is measured, a size some model cannot take (a sequence past its window, a length
    evaluation past its position table), by the checks the sub-runs make, on each model's architecture without its
    weights (`skeleton`); a model whose config cannot be read so (a GGUF file) is checked when its sub-run loads it."""
    from poslens.analyses.length.checks import check_eval_length
    from poslens.engine.models import max_positions, skeleton
    from poslens.engine.pipeline import check_window

    for model_spec in dict.fromkeys(s.model for s in pending):
        model = skeleton(model_spec)
        for sub in (s for s in pending if s.model == model_spec and model is not None):
            try:
                if sub.analysis == "length":  # its seq_len: the longest evaluation (settled by `plan`)
                    check_eval_length(model, sub.config.seq_len)
                else:
                    check_window(sub.config.seq_len, max_positions(model))
            except UsageError as e:
                raise refusal([sub], e) from None


def refusal(group: list[SubRun], e: UsageError) -> UsageError:
    """A sub-run's one-line refusal named by model and analysis; a sub-run's own field (seq_len, eval_len) is no card
    flag, so the error says how the card sets it."""
    names = " + ".join(s.analysis for s in group)
    sizes = f" (a card sets the sizes of its analyses with --sizes {group[0].analysis}.KEY=VALUE; see --help)"
    return UsageError(f"{group[0].label} {names}: {e}{sizes if e.param else ''}")


def measure(group: list[SubRun], force: bool, progress: bool) -> None:
    """Run one sub-run, or several of one model on the same batches in one pass; record the time on each."""
    from poslens.analyses.card.shared import run_shared

    names = " + ".join(s.analysis for s in group)
    if progress:
        print(f"card: {group[0].label}: {names}" + (" in one pass" if len(group) > 1 else f" ({group[0].command})"),
              flush=True)
    wall, cpu = time.perf_counter(), cpu_seconds()
    try:
        if len(group) > 1:
            run_shared([(s.pipeline, s.config, s.path) for s in group], force=force, progress=progress)
        else:
            group[0].run(group[0].config, group[0].path, force=force, progress=progress)
    except UsageError as e:
        raise refusal(group, e) from None
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    for s in group:
        s.reused, s.seconds, s.cpu_seconds = False, wall, cpu
        s.shared_with = tuple(o.analysis for o in group if o is not s)
    if progress:
        print(f"card: {group[0].label}: {names} done in {wall:.0f} s ({cpu:.0f} s CPU)", flush=True)


def cpu_seconds() -> float:
    """CPU time of this process so far (user + system, every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timing_lines(meta: dict) -> list[str]:
    """What `poslens card` prints at the end: each sub-run's wall and CPU time (or that it was reused) and the
    whole call's, from the card's run.json (`meta`)."""
    lines, printed = [], set()
    for r in meta.get("runs", []):
        t = r.get("timing") or {}
        printed.add((r["label"], r["analysis"]))
        if t.get("reused"):
            took = t.get("measured_seconds")
            lines.append(f"  {r['label']}/{r['analysis']}: reused" + (f" (measured in {took:.0f} s)" if took else ""))
        elif t.get("seconds") is not None:
            together = "".join(f" + {a}" for a in t.get("one_pass_with", []))
            if any((r["label"], a) in printed for a in t.get("one_pass_with", [])):
                continue  # printed with the first of its pass
            lines.append(f"  {r['label']}/{r['analysis']}{together}: {t['seconds']:.0f} s ({t['cpu_seconds']:.0f} s "
                         "CPU)" + (" in one pass" if together else ""))
    total = meta.get("timings") or {}
    if "seconds" in total:
        lines.append(f"  card: {total['seconds']:.0f} s ({total['cpu_seconds']:.0f} s CPU), the page "
                     f"{total['page_seconds']:.0f} s of it")
    return ["time:", *lines] if lines else []


def cmd_card(args) -> None:
    """The `poslens card` handler."""
    from poslens.options import from_args

    cfg = from_args(CardConfig, args)
    path = run_card(cfg, args.out, force=args.force, progress=not args.quiet,
                    command=shlex.join(["poslens", *getattr(args, "argv", [])]))
    if not args.quiet:
        print("\n".join(timing_lines(recorded(path) or {})))
    for name in ("card.md", "card.html"):
        print(f"wrote {path / name}")
