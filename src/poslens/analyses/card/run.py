"""`poslens card MODEL [MODEL ...]`: run every analysis of the card into sub-run directories, then write the page.

Layout of --out (docs/card.md):

    OUT/MODEL_LABEL/scores/    `poslens scores`              Kim et al.'s non-relative pattern (Section 5.2)
    OUT/MODEL_LABEL/leakage/   `poslens leakage`             attention terms, key 0 in and out, sinks
    OUT/MODEL_LABEL/probe/     `poslens stat position_probe` held-out R^2 of absolute position per layer
    OUT/MODEL_LABEL/length/    `poslens length`              loss by position past a length L, interventions
    OUT/card/                  card.md, card.html, figures/, run.json (every sub-run's command)

Each sub-run is an ordinary run directory of its analysis, written by the analysis's own run function; the exact
command that re-measures it is recorded and printed on the card. Rerunning the same card reuses every finished
sub-run whose recorded config equals the one asked (an interrupted sub-run resumes from its checkpoints); a
sub-run made with other settings is refused without --force. The page is rewritten every time.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poslens.engine.config import DTYPES
from poslens.engine.data import BOS_POLICIES, MODES
from poslens.errors import UsageError
from poslens.options import check_options, default_of, field_kind, flag_of, option, option_fields, parse_sizes

ANALYSES = ("scores", "leakage", "probe", "length")

# Each analysis's sizes (`--sizes ANALYSIS.KEY=VALUE`): chosen so that SmolLM2-135M's card takes at most 10
# minutes on 2 CPU cores (BENCHMARKS.md, "Card"). `multiple`: the length panel evaluates at L and multiple x L.
SIZES: dict[str, dict[str, Any]] = {
    "scores": {"seq_len": 128, "num_sequences": 32, "batch_size": 4, "groups": 8},
    "leakage": {"seq_len": 128, "num_sequences": 32, "batch_size": 4, "groups": 8, "early_queries": 32},
    "probe": {"seq_len": 128, "num_sequences": 32, "batch_size": 4, "groups": 4, "ridge": 1e-2, "skip_first": 1},
    "length": {"train_len": 128, "multiple": 2, "num_sequences": 8, "batch_size": 2, "groups": 4},
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
        return [_safe(Path(m.removeprefix("random:")).name.removesuffix(".json").removesuffix(".gguf") or m)
                for m in self.models]


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


def plan(cfg: CardConfig, out: Path) -> list[SubRun]:
    """Every sub-run of the card, model-major, in ANALYSES order (nothing loaded or run)."""
    from poslens.analyses.card.probe import ProbeOptions
    from poslens.analyses.leakage.run import LeakageConfig, run_leakage
    from poslens.analyses.length.run import LengthConfig, run_length
    from poslens.analyses.scores import ScoresConfig, run_scores
    from poslens.analyses.stat import StatConfig, run_stat

    sizes = cfg.size_table()
    shared = {"data": cfg.data, "text_field": cfg.text_field, "dtype": cfg.dtype, "device": cfg.device,
              "tokenizer": cfg.tokenizer, "seed": cfg.seed, "level": cfg.level}
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
        probe = StatConfig(model=model, **text, **s)
        s = dict(sizes["length"])
        L, k = s.pop("train_len"), s.pop("multiple")
        length = LengthConfig(model=model, **shared, **s, train_len=L, eval_lens=[L, k * L])
        runs += [
            SubRun(model, label, "scores", base / "scores", scores, command_line("scores", scores, base / "scores"),
                   run_scores),
            SubRun(model, label, "leakage", base / "leakage", leakage,
                   command_line("leakage", leakage, base / "leakage"), run_leakage),
            SubRun(model, label, "probe", base / "probe", probe,
                   command_line("stat position_probe", probe, base / "probe", options),
                   lambda c, p, force, progress, o=options: run_stat("position_probe", c, o, p, force, progress),
                   extra={"statistic": {"name": "position_probe", "options": dataclasses.asdict(options)}}),
            SubRun(model, label, "length", base / "length", length,
                   command_line("length", length, base / "length", skip=("seq_len",)), run_length,
                   settled=("interventions",)),
        ]
    for r in runs:
        r.config.validate() if r.analysis != "length" else _validate_length(r.config)
    return runs


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
            if opt.positional:
                argv.insert(1 + len(name.split()), str(value))
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
    """Whether the finished run at sub.path measured what `sub` asks (None: no finished run there). Fields that
    change how a run goes, not what it reads (device, checkpoints, figures) are not compared."""
    meta = recorded(sub.path)
    if meta is None:
        return None
    have = meta.get("config") or {}
    want = json.loads(json.dumps(dataclasses.asdict(sub.config), default=str))
    extra = json.loads(json.dumps(sub.extra, default=str))
    ignored = ("device", "checkpoint_every", "figures", *sub.settled)
    return (all(have.get(k) == v for k, v in want.items() if k not in ignored)
            and all(meta.get(k) == v for k, v in extra.items()))


def check_out(out: Path, force: bool, labels: list[str]) -> None:
    """Refuse an --out that is something other than a card directory (a file, or a folder with other things than
    a card's page and sub-runs: those of `labels`, when the page was never written because a sub-run stopped)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UsageError(f"out: {out} is a file; choose another --out", param="out")
    entries = [p for p in out.iterdir() if not p.name.startswith(".") and p.name not in (*labels, "card")]
    if entries and recorded(out / "card") is None and not force:
        raise UsageError(f"out: {out} exists and is not a card directory (no card/run.json); choose another --out, "
                         "or --force to write the card into it", param="out")


def run_card(cfg: CardConfig, out: str | Path, force: bool = False, progress: bool = True,
             command: str | None = None) -> Path:
    """Run (or reuse) every sub-run, then write the card into out/card; returns that directory."""
    from poslens.analyses.card.page import write_card

    cfg.validate()
    out = Path(out).expanduser().absolute()
    check_out(out, force, cfg.model_labels())
    runs = plan(cfg, out)
    for sub in runs:
        same = same_config(sub)
        if same and not force:
            sub.reused = True
            continue
        if same is False and not force:
            raise UsageError(f"out: {sub.path} was measured with other settings than this card asks; use --force to "
                             "measure it again, or another --out", param="out")
        if progress:
            print(f"card: {sub.label}: {sub.analysis} ({sub.command})", flush=True)
        sub.run(sub.config, sub.path, force=force, progress=progress)
        sub.reused = False
    return write_card(cfg, out, runs, command=command)


def cmd_card(args) -> None:
    """The `poslens card` handler."""
    from poslens.options import from_args

    cfg = from_args(CardConfig, args)
    path = run_card(cfg, args.out, force=args.force, progress=not args.quiet,
                    command=shlex.join(["poslens", *getattr(args, "argv", [])]))
    for name in ("card.md", "card.html"):
        print(f"wrote {path / name}")
