"""Command-line options generated from config dataclasses, so each default and help text is written once.

A config field declared with `option(...)` carries its CLI facts in its metadata; `add_options` turns every
such field into one argparse argument and `from_args` builds the config back from the parsed namespace:

    @dataclass
    class FooConfig:
        seq_len: int = option(1024, help="tokens per sequence")      # --seq-len N
        layers: list[int] | None = option(None, help="layer indices (default all)")  # --layers 0,1,2
        quick: bool = option(False, help="fewer samples")            # --quick
        residual: bool = option(True, help="drop the residual")      # --no-residual

Names: `seq_len` -> `--seq-len` (or `flag=`, plus `aliases=`). Types: bool (False: a switch; True: `--no-NAME`,
whose help describes the switch), int, float (finite only), str, `X | None`, and `list[X]` / `tuple[X, ...]` written
comma-separated (`--layers 0,1,2`; a positional list takes space-separated values). The help shows the default
unless it is None (the help says what None means) or the text already mentions a default.

A field's bounds live on it too (`option(2, lo=1, help=...)`), and `check_options(config)` checks every bound and
choice of a config in one place (its `validate()` calls it). A config that composes another may change a default
without restating the rest: `seq_len: int = option_of(ModelData, "seq_len", 50)`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

_KEY = "poslens.option"


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error message (no usage block) and exit status 2."""

    def error(self, message: str):  # noqa: D102
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_output_args(parser: argparse.ArgumentParser, default: str | None, *, quiet: bool = True) -> None:
    """`--out`, `--force` and (unless quiet=False) `--quiet`, the same for every command that writes a run
    directory: command-line arguments, not config fields. `default` None: the command picks the directory."""
    shown = default if default is not None else "chosen by the command"
    parser.add_argument("--out", default=default, help=f"run directory to write (default {shown})")
    parser.add_argument("--force", action="store_true",
                        help="replace --out if everything in it was written by poslens (anything else is refused)")
    if quiet:
        parser.add_argument("--quiet", action="store_true", help="no progress bar")


@dataclasses.dataclass(frozen=True)
class Option:
    """The command-line facts of one config field (stored in the field's metadata)."""

    help: str
    choices: tuple | None = None
    positional: bool = False
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    lo: float | None = None  # bounds checked by `check_options` (inclusive; exclusive with `open`)
    hi: float | None = None
    open: bool = False


def option(default: Any = dataclasses.MISSING, *, help: str, choices: Iterable | None = None,
           positional: bool = False, flag: str | None = None, aliases: Iterable[str] = (),
           metavar: str | None = None, lo: float | None = None, hi: float | None = None, open: bool = False) -> Any:
    """A dataclass field whose default and help also define its command-line option (no default: required).

    `lo`, `hi`: the values allowed (inclusive; both exclusive with `open=True`), checked by `check_options`."""
    meta = {_KEY: Option(help, tuple(choices) if choices is not None else None, positional, flag, tuple(aliases),
                         metavar, lo, hi, open)}
    return _field(default, meta)


def _field(default: Any, meta: dict) -> Any:
    if isinstance(default, (list, dict, set)):  # mutable: each instance gets its own copy
        return dataclasses.field(default_factory=lambda: copy.copy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def option_of(cls: type, name: str, default: Any, help: str | None = None) -> Any:
    """Field `name` of the dataclass `cls` (help, bounds, choices, flag) with another default: how a config that
    composes `cls` changes a default without restating the rest; `help` replaces a help text that describes the
    original default (then `--help` appends the new one)."""
    f = next((f for f in dataclasses.fields(cls) if f.name == name and _KEY in f.metadata), None)
    if f is None:
        raise TypeError(f"{cls.__name__} has no option field {name!r}")
    metadata = dict(f.metadata)
    if help is not None:
        metadata[_KEY] = dataclasses.replace(metadata[_KEY], help=help)
    return _field(default, metadata)


def check_options(config: Any) -> None:
    """Check every bound and choice declared on the option fields of `config` (a one-line UsageError naming the
    first field out of range). None passes for an optional field; list items are checked one by one."""
    from poslens.errors import UsageError, check_choice, check_float, check_int

    for f, opt, tp in option_fields(type(config)):
        value = getattr(config, f.name)
        scalar, container = field_kind(tp)
        if value is None and _optional(tp):
            continue
        for item in (value if container is not None and isinstance(value, (list, tuple)) else [value]):
            if opt.choices is not None:
                check_choice(f.name, item, opt.choices)
            elif scalar is bool and not isinstance(item, bool):
                raise UsageError(f"{f.name} must be True or False, got {item!r}", param=f.name)
            elif scalar is int and (opt.lo is not None or opt.hi is not None):
                check_int(f.name, item, -(1 << 62) if opt.lo is None else int(opt.lo) + opt.open,
                          None if opt.hi is None else int(opt.hi) - opt.open)
            elif scalar is float and (opt.lo is not None or opt.hi is not None):
                check_float(f.name, item, -math.inf if opt.lo is None else opt.lo,
                            math.inf if opt.hi is None else opt.hi, lo_open=opt.open, hi_open=opt.open)
            elif scalar is str and not isinstance(item, str):
                raise UsageError(f"{f.name} must be a string, got {item!r}", param=f.name)


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def option_fields(cls: type) -> list[tuple[dataclasses.Field, Option, Any]]:
    """(field, its Option, its resolved type) for every field of `cls` declared with `option`."""
    hints = typing.get_type_hints(cls)
    return [(f, f.metadata[_KEY], hints[f.name]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def default_of(f: dataclasses.Field) -> Any:
    """The field's default value (MISSING when it has none)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def flag_of(f: dataclasses.Field, opt: Option) -> str:
    """The main spelling of a field's option: `--seq-len` for `seq_len`, `--no-residual` for a True bool."""
    if opt.flag:
        return opt.flag
    dashed = f.name.replace("_", "-")
    return f"--no-{dashed}" if default_of(f) is True else f"--{dashed}"


def field_kind(tp: Any) -> tuple[Any, Any | None]:
    """(scalar type, container or None) of a field type; `X | None` counts as X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"option type {tp} is not supported (one type, optionally | None)")
        tp = rest[0]
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"option type {tp} is not supported; use tuple[X, ...]")
        return args[0], origin
    return tp, None


def _finite_float(text: str) -> float:
    value = float(text)  # a ValueError reads "invalid float value: 'abc'"
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


_finite_float.__name__ = "float"
_SCALARS: dict[type, Callable[[str], Any]] = {int: int, float: _finite_float, str: str}
_METAVARS = {int: "N", float: "X"}  # str options keep argparse's NAME


def split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets, so a JSON list stays one item: "a=[0,1],b=2" -> ["a=[0,1]",
    "b=2"]."""
    items, depth, start = [], 0, 0
    for k, ch in enumerate(text):
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            items.append(text[start:k])
            start = k + 1
    return [*items, text[start:]]


def _comma_separated(scalar: Callable[[str], Any], container: type, choices: tuple | None) -> Callable[[str], Any]:
    """Parser of `a,b,c` into `container` of scalars, each checked against `choices`."""

    def parse(text: str) -> Any:
        items = [s.strip() for s in split_top_level(text)]
        try:
            values = [scalar(s) for s in items if s]
        except (ValueError, argparse.ArgumentTypeError):
            values = []
        if not values or len(values) != len(items):
            example = ",".join(map(str, choices)) if choices else "0,1,2"
            raise argparse.ArgumentTypeError(f"takes comma-separated values such as {example}; got {text!r}")
        if choices is not None and any(v not in choices for v in values):
            raise argparse.ArgumentTypeError(f"takes a comma-separated subset of {','.join(map(str, choices))}; "
                                             f"got {text!r}")
        return container(values)

    return parse


def _help(opt: Option, default: Any) -> str:
    """The help text plus the dataclass default (unless None, a switch's, or already stated), %-escaped."""
    text = opt.help
    if not (default is None or default is dataclasses.MISSING or isinstance(default, bool) or "default" in text):
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        text = f"{text} (default {shown})"
    return text.replace("%", "%%")


def add_options(parser: argparse.ArgumentParser, cls: type, *, skip: Iterable[str] = (),
                group: str | Any | None = None) -> None:
    """Add one argument per `option` field of the dataclass `cls` (fields in `skip` left out).

    `group`: a title (a new argument group), an existing argument group, or None (the parser itself).
    The parser remembers (cls, skip) in `configs_of(parser)`, so tests can check every command's options.
    """
    target = parser.add_argument_group(group) if isinstance(group, str) else (group or parser)
    skip = frozenset(skip)
    parser.__dict__.setdefault("poslens_configs", []).append((cls, skip))
    for f, opt, tp in option_fields(cls):
        if f.name in skip:
            continue
        default = default_of(f)
        scalar, container = field_kind(tp)
        kw: dict[str, Any] = {"help": _help(opt, default)}
        if opt.metavar or scalar in _METAVARS and opt.choices is None:
            kw["metavar"] = opt.metavar or _METAVARS[scalar] + (f",{_METAVARS[scalar]},..." if container else "")
        if scalar is bool and container is None:
            if default not in (True, False):
                raise TypeError(f"bool option {cls.__name__}.{f.name} needs a default of True or False")
            target.add_argument(flag_of(f, opt), *opt.aliases, dest=f.name, default=default,
                                action="store_false" if default else "store_true", help=kw["help"])
            continue
        if scalar not in _SCALARS:
            raise TypeError(f"option type {tp} of {cls.__name__}.{f.name} is not supported")
        if container is not None and not opt.positional:
            kw["type"] = _comma_separated(_SCALARS[scalar], container, opt.choices)
        else:
            kw["type"] = _SCALARS[scalar]
            if opt.choices is not None:
                kw["choices"] = opt.choices
        if opt.positional:  # a list is space-separated here: one or more values (zero or more with a default)
            if container is not None:
                kw["nargs"] = "+" if default is dataclasses.MISSING else "*"
            elif default is not dataclasses.MISSING:
                kw["nargs"] = "?"
            if default is not dataclasses.MISSING:
                kw["default"] = default
            target.add_argument(f.name, **kw)
        else:
            target.add_argument(flag_of(f, opt), *opt.aliases, dest=f.name, default=default, **kw)


def configs_of(parser: argparse.ArgumentParser) -> list[tuple[type, frozenset[str]]]:
    """The (config class, skipped fields) pairs `add_options` added to `parser`."""
    return list(parser.__dict__.get("poslens_configs", []))


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """Build `cls` from the parsed options present in `args` (skipped ones keep their defaults), then `overrides`."""
    values = {}
    for f, _, tp in option_fields(cls):
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            container = field_kind(tp)[1]
            values[f.name] = container(value) if container is not None and isinstance(value, list) else value
    return cls(**{**values, **overrides})


def flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> main flag of every optional argument of `parser` (for naming parameters in error messages)."""
    return {a.dest: a.option_strings[0] for a in parser._actions  # argparse keeps no public list
            if a.option_strings and a.dest not in ("help", "version")}


def parse_sizes(items: list[str] | None, example: str = "leakage.sequences=64") -> dict[str, dict[str, Any]]:
    """`sizes` entries PART.KEY=VALUE -> {part: {key: value}}, values read as JSON where they parse (64, 0.5, true,
    "pe"), else as text (`reproduce --sizes`, `card --sizes`); `example` is shown when an entry is malformed."""
    import json

    from poslens.errors import UsageError

    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        name, eq, value = item.partition("=")
        part, dot, key = name.partition(".")
        if not (eq and dot and part and key):
            raise UsageError(f"sizes: {item!r} is not SECTION.KEY=VALUE (e.g. {example})", param="sizes")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        out.setdefault(part, {})[key] = parsed
    return out
