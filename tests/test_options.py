"""Options generated from config dataclasses: every field has a flag, empty command lines give the dataclass
defaults, values parse to the field's type, and the CLI's own option classes agree with the library's defaults."""

import argparse
import dataclasses
import inspect
import subprocess
import sys

import pytest
import torch

from poslens.cli import (
    COMMANDS,
    CompareOptions,
    MonteCarloOptions,
    Parser,
    ReproduceOptions,
    build_parser,
    flag_message,
)
from poslens.options import (
    add_options,
    configs_of,
    default_of,
    field_kind,
    flag_of,
    flags,
    from_args,
    option,
    option_fields,
    option_of,
)
from poslens.stack.config import StackConfig


def command_parsers():
    """(name, parser) of every command of the full `poslens` parser, teammates' modules included."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices.items())


def required_args(cls, skip):
    """A value for each required positional field (the rest of the command line stays empty)."""
    out = []
    for f, opt, _ in option_fields(cls):
        if f.name not in skip and opt.positional and default_of(f) is dataclasses.MISSING:
            out.append("x")
    return out


def required_kwargs(cls, skip):
    return {f.name: (["x"] if "list" in str(tp) else "x") for f, opt, tp in option_fields(cls)
            if f.name not in skip and opt.positional and default_of(f) is dataclasses.MISSING}


CONFIGS = [(name, p, cls, skip) for name, p in command_parsers() for cls, skip in configs_of(p)]


def test_every_command_with_options_is_covered():
    covered = {name for name, *_ in CONFIGS}
    assert {"simulate", "gramflow", "scores", "reproduce", "compare"} <= covered


@pytest.mark.parametrize("name, parser, cls, skip", CONFIGS, ids=[f"{n}-{c.__name__}" for n, _, c, _ in CONFIGS])
def test_empty_command_line_gives_the_dataclass_defaults(name, parser, cls, skip):
    args = parser.parse_args(required_args(cls, skip) + sum((required_args(c, s) for c, s in configs_of(parser)
                                                              if c is not cls), []))
    assert from_args(cls, args) == cls(**required_kwargs(cls, skip))


def non_default(f, opt, tp):
    """A command-line spelling (list of tokens) and the value it must give, different from the field's default."""
    default = default_of(f)
    scalar, container = field_kind(tp)
    flag = flag_of(f, opt)
    if scalar is bool:
        return [flag], not default
    if container is not None:
        items = list(opt.choices[:2]) if opt.choices else ([3, 1] if scalar is int else [0.5, 2.0] if scalar is float
                                                           else ["a", "b"])
        return [flag, ",".join(map(str, items))], container(items)
    if opt.choices is not None:
        choice = next(c for c in opt.choices if c != default)
        return [flag, str(choice)], choice
    if scalar is int:
        value = 3 if default in (None, dataclasses.MISSING) else default + 3
        return [f"{flag}={value}"], value
    if scalar is float:
        value = 0.25 if default is None else default + 0.25
        return [f"{flag}={value!r}"], value
    return [flag, "some-value"], "some-value"


@pytest.mark.parametrize("name, parser, cls, skip", CONFIGS, ids=[f"{n}-{c.__name__}" for n, _, c, _ in CONFIGS])
def test_every_field_is_reachable_by_its_flag(name, parser, cls, skip):
    # every field is declared with option() (a field left out on purpose is option() + skip), so none is unreachable
    assert [f.name for f in dataclasses.fields(cls)] == [f.name for f, _, _ in option_fields(cls)]
    positional = sum((required_args(c, s) for c, s in configs_of(parser)), [])
    base = vars(parser.parse_args(positional))
    for f, opt, tp in option_fields(cls):
        if f.name in skip or opt.positional:
            continue
        tokens, expected = non_default(f, opt, tp)
        parsed = vars(parser.parse_args([*tokens, *positional]))
        assert parsed[f.name] == expected, (f.name, tokens)
        assert {k: v for k, v in parsed.items() if k != f.name} == {k: v for k, v in base.items() if k != f.name}
    for f in dataclasses.fields(cls):  # skipped fields: not options of this command
        if f.name in skip:
            assert f.name not in base


def test_help_shows_each_default_once_from_the_dataclass():
    p = Parser(prog="t")
    add_options(p, StackConfig)
    text = " ".join(p.format_help().split())
    for f, _, _ in option_fields(StackConfig):
        d = default_of(f)
        if d is not None and not isinstance(d, bool):
            assert f"(default {d})" in text, f.name
    assert "--seq-len N, --n N" in text and "--d N, --hidden-size N" in text and "--no-residual" in text


@pytest.mark.parametrize(("name", "parser", "cls", "skip"), CONFIGS, ids=[f"{c[0]}-{c[2].__name__}" for c in CONFIGS])
def test_help_states_no_default_other_than_the_dataclass_number(name, parser, cls, skip):
    """A help text that names a default in words ("(default: as many as ...)") is the base field's; a command that
    composes the field with a number of its own must show that number, not the words (`option_of(..., help=)`):
    every option whose default is an int or float shows "(default N)" or no parenthesised default at all."""
    text = " ".join(parser.format_help().split())
    for f, opt, _ in option_fields(cls):
        d = default_of(f)
        if f.name in skip or opt.positional or isinstance(d, bool) or not isinstance(d, (int, float)):
            continue
        flag = opt.flag or "--" + f.name.replace("_", "-")
        help_of = text.split(flag, 2)[-1].split(" --", 1)[0]  # the option's own help, after its usage mention
        assert "(default:" not in help_of or f"(default {d})" in help_of, f"{name} {flag}: {help_of}"


def test_stack_round_trip_with_every_knob_changed():
    p = Parser(prog="t")
    add_options(p, StackConfig)
    args = p.parse_args(["--n", "12", "--hidden-size", "32", "--alpha", "0.3", "--layers", "6", "--norm",
                         "layernorm-d", "--no-residual", "--pe", "rope", "--rope-theta", "500", "--rope-scaling", "2",
                         "--mask", "sliding", "--window", "5"])
    assert from_args(StackConfig, args) == StackConfig(
        n=12, d=32, alpha=0.3, layers=6, norm="layernorm-d", residual=False, positional="rope", rope_theta=500.0,
        rope_scaling=2.0, mask="sliding", window=5)
    assert vars(p.parse_args(["--seq-len", "12"])) == vars(p.parse_args(["--n", "12"]))


@dataclasses.dataclass
class Toy:
    name: str = option(help="a name", positional=True)
    layers: list[int] | None = option(None, help="layer indices (default all)")
    shape: tuple[int, ...] = option((2, 3), help="a shape")
    ids: list[int] = option([0], help="a mutable default")
    scale: float = option(1.0, help="a scale, 100% = 1")
    kind: str = option("a", help="kind", choices=("a", "b"))
    keep: bool = option(True, help="drop it")


def toy_parser():
    p = Parser(prog="toy")
    add_options(p, Toy)
    return p


def parse_error(parser, argv, capsys):
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def test_types_parse_to_the_field_type():
    cfg = from_args(Toy, toy_parser().parse_args(["n", "--layers", "0, 2,-1", "--shape", "4", "--scale", "2.5",
                                                  "--kind", "b", "--no-keep"]))
    assert cfg == Toy(name="n", layers=[0, 2, -1], shape=(4,), ids=[0], scale=2.5, kind="b", keep=False)
    assert isinstance(cfg.shape, tuple)
    a, b = Toy(name="x"), Toy(name="y")
    a.ids.append(1)
    assert b.ids == [0]  # mutable defaults are per instance
    assert "100% = 1" in toy_parser().format_help()  # a % in help text survives argparse's formatting


@pytest.mark.parametrize("argv, words", [
    (["n", "--layers", "0,,1"], "argument --layers: takes comma-separated values"),
    (["n", "--layers", "a,b"], "argument --layers"),
    (["n", "--shape", ""], "argument --shape"),
    (["n", "--scale", "nan"], "argument --scale: must be a finite number"),
    (["n", "--scale=-inf"], "must be a finite number"),
    (["n", "--scale", "abc"], "invalid float value"),
    (["n", "--kind", "c"], "argument --kind: invalid choice"),
    ([], "required: name"),
])
def test_bad_values_are_one_line_errors(capsys, argv, words):
    assert words in parse_error(toy_parser(), argv, capsys)


def test_comma_list_choices_are_checked_per_item(capsys):
    p = Parser(prog="t")
    add_options(p, MonteCarloOptions)
    assert from_args(MonteCarloOptions, p.parse_args(["--maps", "probs,scores"])).maps == ("probs", "scores")
    assert "subset of scores,probs,cosine" in parse_error(p, ["--maps", "scores,logits"], capsys)


def test_unsupported_types_are_refused_when_the_parser_is_built():
    @dataclasses.dataclass
    class Bad:
        table: dict = option(None, help="not an option type")

    with pytest.raises(TypeError, match="not supported"):
        add_options(Parser(prog="t"), Bad)


def test_cli_option_classes_agree_with_the_library_defaults():
    from poslens.analyses.compare import compare
    from poslens.report.reproduce import reproduce
    from poslens.stack.simulate import MAPS, simulate

    sim = inspect.signature(simulate).parameters
    mc = MonteCarloOptions()
    assert (mc.seed, mc.chunk, mc.device, mc.maps) == (sim["seed"].default, sim["chunk"].default,
                                                       sim["device"].default, tuple(sim["maps"].default))
    assert mc.maps == MAPS and getattr(torch, mc.dtype) == sim["dtype"].default
    rep = inspect.signature(reproduce).parameters
    r = ReproduceOptions()
    assert (r.quick, r.samples, r.seed, r.models) == tuple(rep[k].default for k in ("quick", "samples", "seed",
                                                                                     "models"))
    assert CompareOptions(runs=["a"]).first == inspect.signature(compare).parameters["layers"].default


def test_flag_message_names_the_flag():
    names = {"seq_len": "--seq-len", "n": "--seq-len", "d": "--d"}
    assert flag_message("seq_len must be >= 2, got 1", "seq_len", names) == "--seq-len must be >= 2, got 1"
    assert flag_message("n must be >= 2, got 1", None, names) == "--seq-len must be >= 2, got 1"
    assert flag_message("d must be even with RoPE", None, names) == "--d must be even with RoPE"
    assert flag_message("dtype 'x' is unknown", None, names) == "dtype 'x' is unknown"  # a whole word only
    assert flag_message("--d is fine", "d", names) == "--d is fine"
    p = Parser(prog="t")
    add_options(p, StackConfig)
    assert flags(p)["n"] == "--seq-len" and flags(p)["residual"] == "--no-residual"


def test_library_errors_show_flags_end_to_end(capsys):
    from poslens.cli import main

    assert main(["scores", "some-model", "--seq-len", "1"]) == 2  # ScoresConfig.validate: seq_len, before loading
    err = capsys.readouterr().err
    assert err.strip() == "poslens scores: error: --seq-len must be >= 2, got 1"


def test_help_without_a_command_loads_no_analysis_or_plotting_library():
    """`poslens --help` (and every command module's `add_command`) stays light: no model, analysis or plot code."""
    code = ("import sys\nfrom poslens.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('matplotlib', 'transformers', 'poslens.analyses.scores', "
            "'poslens.plotting', 'poslens.engine.capture', 'poslens.engine.hooks') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]"
    assert set(COMMANDS) <= set(res.stdout.split("{")[1].split("}")[0].split(","))


@dataclasses.dataclass
class Bounded:
    n: int = option(2, lo=1, help="at least 1")
    p: float = option(0.5, lo=0, hi=1, open=True, help="in (0, 1)")
    k: int | None = option(None, lo=0, hi=4, help="optional, in [0, 4]")
    kind: str = option("a", choices=("a", "b"), help="a choice")


@dataclasses.dataclass
class Composed(Bounded):
    n: int = option_of(Bounded, "n", 7)


@pytest.mark.parametrize("kw, words", [
    (dict(n=0), "n must be >= 1, got 0"),
    (dict(n=1.5), "n must be an integer, got 1.5"),
    (dict(p=1.0), "p must be in (0, 1), got 1"),
    (dict(p=0.0), "p must be in (0, 1), got 0"),
    (dict(k=5), "k must be in [0, 4], got 5"),
    (dict(kind="c"), "kind must be one of a, b; got 'c'"),
])
def test_check_options_reads_each_bound_from_its_field(kw, words):
    from poslens.errors import UsageError
    from poslens.options import check_options

    check_options(Bounded())  # the defaults are in bounds; None passes for an optional field
    with pytest.raises(UsageError) as e:
        check_options(Bounded(**kw))
    assert str(e.value) == words and e.value.param == next(iter(kw))


def test_option_of_changes_the_default_and_keeps_help_bounds_and_place():
    from poslens.errors import UsageError
    from poslens.options import check_options

    assert Composed().n == 7 and [f.name for f in dataclasses.fields(Composed)] == ["n", "p", "k", "kind"]
    p = Parser(prog="t")
    add_options(p, Composed)
    assert "at least 1 (default 7)" in " ".join(p.format_help().split())
    with pytest.raises(UsageError, match="n must be >= 1"):
        check_options(Composed(n=0))
    with pytest.raises(TypeError, match="no option field 'm'"):
        option_of(Bounded, "m", 1)


def test_flag_message_maps_every_underscored_parameter():
    names = {"batch_size": "--batch-size", "num_sequences": "--num-sequences", "groups": "--groups"}
    message = "batch_size 20 puts all 16 sequences in one batch; lower batch_size to 8 or raise num_sequences"
    assert flag_message(message, "batch_size", names) == ("--batch-size 20 puts all 16 sequences in one batch; "
                                                          "lower --batch-size to 8 or raise --num-sequences")
    # prose words are not touched (no underscore), nor names that are no parameter of the command
    assert flag_message("two groups at blocks.0.hook_resid_pre", None, names) == \
        "two groups at blocks.0.hook_resid_pre"
