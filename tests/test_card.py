"""`poslens card`: the residual-stream probe against an independent ridge fit, the panels on constructed models with
a known answer (a NoPE model: no rotary position anywhere, and absolute position that only the causal mask can have
put in the stream), the run directory's layout and commands, resume, two models side by side, bad input."""

from __future__ import annotations

import json
import shlex
import shutil

import numpy as np
import pytest
import torch
from test_pipeline import saved_tiny_llama, text_of

from poslens.analyses.card.probe import PositionProbe
from poslens.analyses.card.run import CardConfig, plan
from poslens.cli import build_parser, main
from poslens.options import from_args

SIZES = ",".join([
    *(f"{a}.{k}={v}" for a in ("scores", "leakage") for k, v in
      (("seq_len", 24), ("num_sequences", 24), ("batch_size", 2), ("groups", 4))),
    "leakage.early_queries=8",
    "probe.seq_len=24", "probe.num_sequences=24", "probe.batch_size=2", "probe.groups=4",
    "length.train_len=16", "length.num_sequences=4", "length.batch_size=2", "length.groups=2"])


# ---------------------------------------------------------------- the probe, without a model


def _feed(probe: PositionProbe, x: torch.Tensor, batch_size: int) -> None:
    """x [N, T, d] through the probe's hidden-state-0 reader, batch b in group b mod G (the runner's rule)."""
    read = probe._reader(0)
    for b, chunk in enumerate(x.split(batch_size)):
        probe.group = b % probe.sums.groups
        read(chunk, None)


def _direct_r2(x: np.ndarray, groups: int, batch_size: int, ridge: float, skip: int) -> list[float]:
    """Held-out R^2 per fold by an explicit ridge fit on the other folds' tokens (numpy, float64): the reference."""
    n, t_len, d = x.shape
    fold = (np.arange(n) // batch_size) % groups
    t = np.arange(skip, t_len, dtype=np.float64)
    out = []
    for k in range(groups):
        tr, te = x[fold != k][:, skip:].reshape(-1, d), x[fold == k][:, skip:].reshape(-1, d)
        ttr = np.tile(t, (fold != k).sum())
        tte = np.tile(t, (fold == k).sum())
        mean, scale = tr.mean(0), np.maximum(tr.std(0), 1e-12)
        z = (tr - mean) / scale
        w = np.linalg.solve(z.T @ z / len(z) + ridge * np.eye(d), z.T @ (ttr - ttr.mean()) / len(z))
        pred = (te - mean) / scale @ w + ttr.mean()
        out.append(1 - ((tte - pred) ** 2).sum() / ((tte - ttr.mean()) ** 2).sum())
    return out


@pytest.mark.parametrize("signal", ["none", "weak", "exact"])
def test_the_cross_fitted_r2_equals_an_explicit_ridge_fit_on_held_out_folds(signal):
    # features: noise; weak: plus 0.05 x the position in one coordinate; exact: that coordinate is the position.
    # 1e-9: the same ridge solved from float64 normal equations and from the tokens themselves
    gen = torch.Generator().manual_seed(0)
    n, t_len, d = 24, 16, 6
    x = torch.randn(n, t_len, d, generator=gen, dtype=torch.float64)
    t = torch.arange(t_len, dtype=torch.float64)
    if signal == "weak":
        x[..., 2] += 0.05 * t
    if signal == "exact":
        x[..., 2] = t
    probe = PositionProbe(groups=4, ridge=1e-2, skip_first=1)
    _feed(probe, x, batch_size=3)
    folds = [1 - sse / sst for sse, sst in probe.fold_errors(0)]
    ref = _direct_r2(x.numpy(), 4, 3, 1e-2, 1)
    assert np.allclose(folds, ref, rtol=0, atol=1e-9)
    r = probe.result()
    assert float(r["r2"][0]) == pytest.approx(np.mean(ref), abs=1e-9)
    assert float(r["r2_lo"][0]) <= float(r["r2"][0]) <= float(r["r2_hi"][0])
    if signal == "exact":  # R^2 is 1 up to the ridge's shrinkage (1e-2 relative: a 1% shrink, R^2 ~ 1 - 1e-4)
        assert float(r["r2_lo"][0]) > 0.999
    if signal == "none":  # nothing to find: held out, a fitted probe does no better than the mean position
        assert float(r["r2"][0]) < 0.0


def test_the_held_out_r2_interval_is_cut_at_1():
    # R^2 = 1 - SSE / SST <= 1; four folds near 1 and one far below give a raw t-interval reaching above 1
    from poslens.engine.stats import over_seeds

    probe = PositionProbe(groups=4)
    probe.sums.add("x/0", 0, torch.zeros(1, dtype=torch.float64), 1)  # one hidden-state index
    r2 = [0.99, 0.6, 0.97, 0.98]
    probe.fold_errors = lambda index: [(1.0 - r, 1.0) for r in r2]
    raw, got = over_seeds(r2), probe.result()
    assert float(raw.hi) > 1.0 and float(got["r2_hi"][0]) == 1.0
    assert float(got["r2_lo"][0]) == pytest.approx(float(raw.lo)) and float(got["r2"][0]) == pytest.approx(np.mean(r2))


# ---------------------------------------------------------------- one card of two models


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    """One card of a tiny RoPE Llama and a tiny NoPE SmolLM3 (RoPE off in every layer) on the same text."""
    root = tmp_path_factory.mktemp("card")
    rope = saved_tiny_llama(root / "rope")
    nope = saved_tiny_llama(root / "nope", family="smollm3", no_rope_layers=[0, 0, 0])
    out = root / "out"
    # one tokenizer for both (each saved tiny model numbers its byte alphabet in its own order)
    argv = ["card", str(rope), str(nope), "--data", text_of(rope), "--tokenizer", str(rope), "--mode", "pack",
            "--sizes", SIZES, "--out", str(out), "--quiet"]
    assert main(argv) == 0
    return {"argv": argv, "out": out, "meta": json.loads((out / "card" / "run.json").read_text())}


def _model(card, label):
    return next(m for m in card["meta"]["models"] if m["label"] == label)


def test_the_run_directory_holds_every_sub_run_and_the_page(card):
    out = card["out"]
    for label in ("rope", "nope"):
        for analysis in ("scores", "leakage", "probe", "length"):
            assert json.loads((out / label / analysis / "run.json").read_text())["kind"] in (analysis, "stat")
    page = (out / "card" / "card.html").read_text()
    assert "data:image/png;base64," in page and "src='figures" not in page  # self-contained
    md = (out / "card" / "card.md").read_text()
    assert card["meta"]["kind"] == "card" and len(card["meta"]["runs"]) == 8
    for run in card["meta"]["runs"]:
        assert run["command"] in md and run["command"] in page.replace("&#x27;", "'")


def test_every_printed_command_parses_to_the_config_the_card_ran(card):
    # the command under a panel re-measures exactly that sub-run: parsed, it gives the same config
    cfg = from_args(CardConfig, build_parser("card").parse_args(card["argv"]))
    for sub in plan(cfg, card["out"]):
        argv = shlex.split(sub.command)[1:]
        args = build_parser(argv[0]).parse_args(argv)
        if sub.analysis == "probe":
            from poslens.analyses.stat import StatConfig

            got = from_args(StatConfig, args)
        else:
            got = from_args(type(sub.config), args)
            if sub.analysis == "length":
                got.validate()
                got.settle(None)
        assert got == sub.config, sub.command
        assert args.out == str(sub.path)


def test_a_nope_model_has_no_rotary_position_and_the_rope_model_has_it(card):
    assert {r["scheme"] for r in _model(card, "nope")["scheme"]["layers"]} == {"none"}
    assert {r["scheme"] for r in _model(card, "rope")["scheme"]["layers"]} == {"rope"}
    md = (card["out"] / "card" / "card.md").read_text()
    assert "| 1 | rope | full | 10000 | none | full | - |" in md  # the scheme rows, side by side (no base without RoPE)
    # NoPE has nothing for NTK or YaRN to rescale: the length panel runs only the interventions that apply
    assert not {"ntk", "yarn"} & set(_model(card, "nope")["length"]["effects"])
    assert {"ntk", "yarn"} <= set(_model(card, "rope")["length"]["effects"])


def test_in_a_nope_model_only_the_mask_can_put_position_in_the_stream(card):
    # The embeddings of a NoPE model are a function of the token alone, and in packed text the token is independent
    # of its position: held out, no probe of the embeddings beats the mean position (R^2 <= 0 up to noise). After
    # the attention layers (causal mask, no RoPE) position is decodable: above the embeddings, beyond both intervals.
    r2 = _model(card, "nope")["probe"]  # (value, lo, hi) per hidden state
    assert r2[0][0] < 0.02
    assert max(r[1] for r in r2[1:]) > r2[0][2]


def test_a_rerun_reuses_every_sub_run_and_other_settings_are_refused(card, capsys):
    out = card["out"]
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/*/run.json")}
    assert main(card["argv"]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/*/run.json")} == stamps
    assert "reused: 8 of 8" in (out / "card" / "card.md").read_text()
    shutil.rmtree(out / "card")  # as a card stopped before its page: the sub-runs alone are a card to resume
    assert main(card["argv"]) == 0
    assert "reused: 8 of 8" in (out / "card" / "card.md").read_text()
    capsys.readouterr()
    argv = [a.replace("probe.groups=4", "probe.groups=3") for a in card["argv"]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "other settings" in err and "--force" in err
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/*/run.json")} == stamps
    notes = out / "nope" / "length" / "notes.txt"  # a file of the user's in a sub-run --force would measure again
    notes.write_text("mine")
    try:
        assert main([*card["argv"], "--force"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{notes} was not written by poslens" in err, err
        assert {p: p.stat().st_mtime_ns for p in out.glob("*/*/run.json")} == stamps  # nothing measured
    finally:
        notes.unlink()


@pytest.mark.parametrize("extra, words", [
    (["--sizes", "probe.folds=3"], "probe has no size 'folds'"),
    (["--sizes", "scores.seq_len=long"], "takes a value like 128"),
    (["--sizes", "fit.ridge=1"], "no analysis 'fit'"),
    (["--sizes", "length.multiple=1"], "length.multiple must be >= 2"),
    (["--sizes", "scores.seq_len=-3"], "--sizes: scores.seq_len must be >= 2, got -3"),  # named: no card flag
    (["--sizes", "probe.ridge=-1"], "--sizes: probe.ridge must be in [0, inf], got -1"),  # was accepted
    (["--labels", "a,b"], "2 labels for 1 models"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(extra, words, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["card", str(tmp_path / "no-model"), *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("what", ["notes", "notes in a model folder", "a run of another kind"])
def test_an_out_holding_other_things_is_refused_with_or_without_force(what, force, tmp_path, capsys):
    # --force has one meaning everywhere: it replaces only what poslens wrote, so a folder of the user's or a run
    # of another command is refused either way, in one line, and nothing is written
    from poslens.io.results import run_directory, write_run

    out = tmp_path / "mine"
    if what == "a run of another kind":
        with run_directory(out) as build:
            write_run(build, {"x": torch.zeros(2)}, {"kind": "scores"})
    else:
        (out / ("smollm2-135m" if "model" in what else "")).mkdir(parents=True)
        (out / ("smollm2-135m/notes.txt" if "model" in what else "notes.txt")).write_text("mine")
    before = sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    assert main(["card", "smollm2-135m", "--out", str(out), *force]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a card directory" in err and "choose another --out" in err, err
    assert "--force to" not in err  # no --force suggested: it would not replace this
    assert sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before


def test_random_configs_named_config_json_are_labelled_by_their_folder(tmp_path, capsys):
    cfg = CardConfig(models=["random:runs/a/config.json", "random:b/config.json", "random:c.json", "smollm2-135m"])
    cfg.validate()  # distinct labels: no refusal
    assert cfg.model_labels() == ["a", "b", "c", "smollm2-135m"]
    out = tmp_path / "out"  # labels that still collide are refused in one line, nothing written
    assert main(["card", "random:x/a/config.json", "random:y/a/config.json", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "two models have the label 'a'; give --labels" in err, err
    assert not out.exists()
    # the label of the page's own folder, refused before any work (it was measured, then refused by its own --out)
    assert main(["card", "smollm2-135m", "--labels", "card", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the page's folder" in err, err
    assert not out.exists()


def test_two_models_on_one_tokenizer_get_a_paired_probe_difference(card):
    # both tiny models read the same tokens (one tokenizer) of the same text in the same groups: the probe panel
    # pairs them fold by fold; the mean of the per-fold differences is the difference of the means (1e-12: float64)
    from poslens.analyses.card.page import paired_probe

    rope, nope = _model(card, "rope"), _model(card, "nope")
    assert rope["tokens_checksum"] == nope["tokens_checksum"]
    diff = paired_probe(rope, nope, 0.95)
    assert diff is not None and len(diff) == len(rope["probe"])
    for (v, lo, hi), a, b in zip(diff, rope["probe"], nope["probe"]):
        assert v == pytest.approx(a[0] - b[0], abs=1e-12) and lo <= v <= hi
    assert "rope - nope, paired" in (card["out"] / "card" / "card.md").read_text()
    other = dict(nope, tokens_checksum=[x + 1 for x in nope["tokens_checksum"]])  # other tokens: not paired
    assert paired_probe(rope, other, 0.95) is None


def test_the_shared_pass_gives_each_sub_run_what_its_own_command_gives(card, tmp_path):
    # scores, leakage and the probe of one model read the same batches, so the card measures them in one forward per
    # batch (analyses/card/shared.py); each sub-run must hold what its printed command writes when run alone. The
    # forward is the same but the pass with the leakage reader forms the dense scores, so the stream may differ by
    # float32 rounding: 1e-5 (relative to each tensor's largest entry) is far above that and far below any effect.
    from poslens.io.results import load

    cfg = from_args(CardConfig, build_parser("card").parse_args(card["argv"]))
    subs = [s for s in plan(cfg, card["out"]) if s.label == "rope" and s.analysis != "length"]
    timing = {r["analysis"]: r["timing"] for r in card["meta"]["runs"] if r["label"] == "rope"}
    assert set(timing["scores"]["one_pass_with"]) == {"leakage", "probe"}
    for sub in subs:
        kept = load(sub.path)
        assert {r["kind"] for r in kept.meta["shared_pass"]["runs"]} == {"scores", "leakage", "stat"}
        argv = shlex.split(sub.command)[1:]
        argv[argv.index("--out") + 1] = str(tmp_path / sub.analysis)
        assert main([*argv, "--quiet"]) == 0
        alone = load(tmp_path / sub.analysis)
        assert set(alone.tensors) == set(kept.tensors), sub.analysis
        for name, t in alone.tensors.items():
            a, b = t.double(), kept.tensors[name].double()
            scale = float(a[torch.isfinite(a)].abs().max()) if torch.isfinite(a).any() else 1.0
            assert torch.allclose(a, b, rtol=0, atol=1e-5 * max(scale, 1e-12), equal_nan=True), (sub.analysis, name)


def test_panels_pair_two_models_on_one_tokenizer_through_each_runs_own_replicates(card):
    # every sub-run keeps its estimates' leave-one-group-out values: the jackknife of one run's replicates gives back
    # that run's own interval (1e-6: replicates stored in float32, intervals of order 0.01-1), and the paired
    # difference of the two models is the difference of the estimates with the jackknife of the replicates'
    # differences; a model against itself differs by exactly 0 with a zero-width interval (the text cancels)
    from poslens.analyses.card.page import paired_columns
    from poslens.analyses.card.paired import difference, pairable
    from poslens.analyses.leakage.causal import SUPPORT
    from poslens.engine.stats import NONNEGATIVE, jackknife

    rope, nope = _model(card, "rope"), _model(card, "nope")
    for analysis in ("scores", "leakage", "length"):
        assert pairable(rope, nope, analysis), analysis
    for r, reps in zip(rope["scores"], rope["replicates"]["scores"]):  # an RMS: its interval cut at 0, as the run's
        own = jackknife(torch.tensor(r["rms"][0], dtype=torch.float64), torch.tensor(reps, dtype=torch.float64),
                        support=NONNEGATIVE)
        assert float(own.lo) == pytest.approx(r["rms"][1], abs=1e-6)
        assert float(own.hi) == pytest.approx(r["rms"][2], abs=1e-6)
    for b, reps in zip(rope["length"]["bins"], rope["replicates"]["length"]):  # a loss, cut at 0 likewise
        own = jackknife(torch.tensor(b["loss"][0], dtype=torch.float64), torch.tensor(reps, dtype=torch.float64),
                        support=NONNEGATIVE)
        assert (float(own.lo), float(own.hi)) == pytest.approx(b["loss"][1:], abs=1e-5)
    # a share of e_total cannot be negative: the run cuts its interval to [0, inf) (causal.SUPPORT), and so does the
    # recomputation (a lower end just below 0 is cut to 0 on one processor and not on another)
    share = rope["leakage"]["attn/share_residual"]["key0_out"]
    for (v, lo, hi), reps in zip(share, rope["replicates"]["leakage"]["attn/share_residual"]["key0_out"]):
        own = jackknife(torch.tensor(v, dtype=torch.float64), torch.tensor(reps, dtype=torch.float64),
                        support=SUPPORT["attn/share_residual"])
        assert (float(own.lo), float(own.hi)) == pytest.approx((lo, hi), abs=1e-5)
    cols = paired_columns([rope, nope], 0.95)
    for panel in ("scores", "leakage", "length"):
        (other, rows), = cols[panel]
        assert other is nope and rows
    d = cols["scores"][0][1][0]["pattern RMS"]
    assert d == pytest.approx(difference(rope["scores"][0]["rms"][0], rope["replicates"]["scores"][0],
                                         nope["scores"][0]["rms"][0], nope["replicates"]["scores"][0], 0.95))
    assert d[0] == pytest.approx(rope["scores"][0]["rms"][0] - nope["scores"][0]["rms"][0], abs=1e-12)
    same = paired_columns([rope, dict(rope, label="again")], 0.95)
    assert all(x == pytest.approx((0.0, 0.0, 0.0), abs=1e-12) for row in same["length"][0][1] for x in row.values())
    md = (card["out"] / "card" / "card.md").read_text()
    assert "pattern RMS, rope - nope, paired" in md and "loss, rope - nope, paired" in md
    assert "rope - nope: paired (the same token ids" in md
    other = dict(nope, batches={**nope["batches"], "length": {**nope["batches"]["length"], "tokens": "other"}})
    assert paired_columns([rope, other], 0.95)["length"] == []  # other token ids: side by side only


@pytest.mark.parametrize("call", [6, 20])  # the 6th hooked forward: inside the shared pass; the 20th: inside length
def test_a_card_interrupted_inside_a_sub_run_resumes_to_the_same_numbers(card, call, tmp_path, monkeypatch):
    # Ctrl-C in the middle of a sub-run, then the same command: the sub-run resumes from its checkpoint (saved after
    # every batch here) and every sub-run holds, bit for bit, what the uninterrupted card of the fixture holds
    from poslens.engine.hooks import HookedModel
    from poslens.io import checkpoint
    from poslens.io.results import load

    monkeypatch.setattr(checkpoint, "CHECKPOINT_SECONDS", 0)
    argv = [a for a in card["argv"] if not a.endswith("nope")]
    out = tmp_path / "out"
    argv[argv.index("--out") + 1] = str(out)
    original, calls = HookedModel.run, []

    def flaky(self, *a, **k):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt  # as Ctrl-C
        return original(self, *a, **k)

    monkeypatch.setattr(HookedModel, "run", flaky)
    assert main(argv) == 130 and not (out / "card").exists()
    monkeypatch.setattr(HookedModel, "run", original)
    assert main(argv) == 0
    analyses = ("scores", "leakage", "probe", "length")
    resumed = {a: load(out / "rope" / a) for a in analyses}
    interrupted = [a for a in analyses if resumed[a].meta["resumed_from_unit"] > 0]
    assert interrupted == (["scores", "leakage", "probe"] if call < 12 else ["length"])
    for a in analyses:
        full = load(card["out"] / "rope" / a)
        assert set(resumed[a].tensors) == set(full.tensors), a
        for name, t in full.tensors.items():
            torch.testing.assert_close(resumed[a].tensors[name], t, rtol=0, atol=0, equal_nan=True, msg=(a, name))


def test_each_sub_runs_time_is_kept_and_printed(card):
    # run.json keeps this call's wall and CPU seconds per sub-run (the three of one pass share theirs) and the
    # whole call's; `poslens card` prints them from there
    from poslens.analyses.card.run import timing_lines

    runs = {(r["label"], r["analysis"]): r["timing"] for r in card["meta"]["runs"]}
    for label in ("rope", "nope"):
        assert runs[label, "scores"]["seconds"] == runs[label, "probe"]["seconds"] > 0
        assert runs[label, "length"]["cpu_seconds"] > 0 and "one_pass_with" not in runs[label, "length"]
    total = card["meta"]["timings"]
    assert total["seconds"] >= sum(runs[k]["seconds"] for k in runs if k[1] in ("scores", "length"))
    lines = timing_lines(card["meta"])  # the first call's run.json (a later test reruns the card: all reused)
    assert any(line.startswith("  rope/scores + leakage + probe: ") and "in one pass" in line for line in lines)
    assert any(line.startswith("  nope/length: ") for line in lines) and lines[-1].startswith("  card: ")
    assert not any("rope/leakage" in line for line in lines)  # printed once, with the first of its pass


def test_the_card_command_line_names_every_model_and_parses_back():
    # the command the report prints for a card of two models: each model its own argument, the sizes as given
    from pathlib import Path

    from poslens.analyses.card.run import command_line

    cfg = CardConfig(models=["smollm2-135m", "gemma-3-270m"], sizes=["probe.num_sequences=8", "length.multiple=3"])
    argv = shlex.split(command_line("card", cfg, Path("runs/card")))
    assert argv[:4] == ["poslens", "card", "smollm2-135m", "gemma-3-270m"] and argv[-2:] == ["--out", "runs/card"]
    assert from_args(CardConfig, build_parser("card").parse_args(argv[1:])) == cfg


def test_a_size_past_a_models_table_names_the_cards_sizes(tmp_path, capsys):
    """A GPT-2 whose position table (64) is shorter than the card's default scores.seq_len (128): one line that
    names the card's --sizes (the sub-run's own field, seq_len, is not a card flag), exit 2, nothing written."""
    gpt2 = json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 49152,
                       "n_positions": 64, "eos_token_id": 0, "bos_token_id": 0})
    out = tmp_path / "out"
    assert main(["card", f"random:{gpt2}", "--labels", "g64", "--tokenizer", "smollm2-135m", "--out", str(out),
                 "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "g64 scores" in err and "seq_len 128 is beyond the model's window of 64" in err, err
    assert "--sizes scores.KEY=VALUE" in err and "--seq-len" not in err, err
    assert not out.exists()


def test_a_length_past_a_models_table_is_refused_before_anything_is_measured(tmp_path, capsys):
    """A GPT-2 with 128 table rows takes the scores, leakage and probe sub-runs (128 tokens) but not a length panel
    at 4 x 64 tokens: the card refuses in one line (exit 2) before its first sub-run, by the check the length sub-run
    makes (nothing measured, nothing written), where it used to refuse after measuring the others."""
    gpt2 = json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 49152,
                       "n_positions": 128, "eos_token_id": 0, "bos_token_id": 0})
    out = tmp_path / "out"
    assert main(["card", f"random:{gpt2}", "--labels", "g128", "--tokenizer", "smollm2-135m", "--sizes",
                 "length.multiple=4", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.endswith("--sizes length.KEY=VALUE; see --help)"), err
    assert "g128 length: eval_lens: 256 tokens reach past" in err, err
    assert "card: g128:" not in captured.out  # no sub-run started
    assert not out.exists()


def test_the_preflight_reads_the_architecture_without_weights():
    """`skeleton` builds a model on the meta device (nothing allocated) whose table and window are the config's."""
    from poslens.engine.models import max_positions, position_limit, skeleton

    gpt2 = json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 96})
    model = skeleton(f"random:{gpt2}")
    assert all(p.is_meta for p in model.parameters())
    assert position_limit(model)[1] == 96 and max_positions(model) == 96
    llama = json.dumps({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                        "intermediate_size": 64, "max_position_embeddings": 80})
    model = skeleton(f"random:{llama}")
    assert position_limit(model) is None and max_positions(model) == 80


def test_a_sink_head_is_listed_as_decided_only_when_its_interval_lies_above_the_threshold():
    # heads over Gu et al.'s threshold by the mean are recorded with their intervals; the page counts and lists first
    # those whose whole interval is above it (a head at 0.305 [0.117, 0.493] was listed like one at 0.9)
    from poslens.analyses.card.page import sink_line
    from poslens.analyses.leakage.summary import sinks
    from poslens.engine.stats import Estimate

    t = lambda *rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    a0 = Estimate(t([0.9, 0.305, 0.1]), t([0.8, 0.117, 0.0]), t([1.0, 0.493, 0.2]), t([0.05, 0.09, 0.05]), 8, 0.95,
                  "jackknife")
    s = sinks(a0, t([0.9, 0.3, 0.1]), 0.3, 32)
    assert [(h["head"], h["above"]) for h in s["sink_heads"]] == [(1, True), (2, False)]
    assert s["sink_heads"][1]["alpha0_lo"] == pytest.approx(0.117)
    line = sink_line({"sinks": s})
    assert "1 sink-reading heads (the interval of the attention on key 0 above the threshold; 2 by their means)" in line


def test_the_length_panel_names_positions_as_poslens_length_does(card):
    """Positions are 1-based and position 1 has no loss: the first bin starts at 2, each bin ends where the next
    starts, and an effect past L is over positions L + 1 to N, as `poslens length` prints it."""
    from poslens.analyses.card.page import length_effects

    m = _model(card, "rope")
    bins, L = m["length"]["bins"], m["length"]["train_len"]
    assert bins[0]["from"] == 2 and all(b["from"] == a["to"] + 1 for a, b in zip(bins, bins[1:]))
    lines = [x for x in length_effects(m) if "not run" not in x]
    assert lines and all(f"positions {L + 1}-" in x for x in lines), lines
