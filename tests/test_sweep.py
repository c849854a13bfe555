"""`poslens sweep`: the matrix, the between-seed statistics, caching, pairing and resuming, on micro models."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from poslens.cli import main
from poslens.errors import UsageError
from poslens.train.sweep import SweepConfig, parse_variants, resolve_matrix, run_sweep, seed_interval, summarise

pytest_plugins = ("train_fixtures",)  # the session's token directory (fixture `tokens`)
MICRO = dict(preset="tiny", layers=1, hidden=32, intermediate=64, heads=2, kv_heads=1, seq_len=16, steps=3,
             batch_size=4, micro_batch=4, warmup=1, eval_every=3, eval_batches=1, save_every=0, bos=True)


def _matrix_file(tmp_path, tokens, variants, seeds=(0, 1)):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps({"train": {**MICRO, "tokens": str(tokens)}, "variants": variants,
                                "seeds": list(seeds)}))
    return str(path)


def test_shipped_presets_resolve_to_the_four_variants():
    for name in ("pe", "pe-quick", "pe-sinks"):
        m = resolve_matrix(SweepConfig(preset=name))
        # the full run's sweep at eight seeds (issue 34: every trained-model verdict over eight seeds)
        assert list(m.variants) == ["nope", "rope", "ntk", "window"] and m.seeds == (
            list(range(8)) if name == "pe-sinks" else [0, 1, 2])
        labels = {x.variant: x.label for x in m.members}
        assert labels["nope"] == "NoPE" and labels["ntk"] == "RoPE (ntk:8)"
        window = next(x.config for x in m.members if x.variant == "window")
        assert 0 < window.sliding_window < window.seq_len  # the window binds during training
        assert all(x.config.bos for x in m.members)


@pytest.mark.parametrize("name, base", [("bos-sinks", "pe-sinks"), ("bos-quick", "pe-quick")])
def test_bos_matrices_are_one_factor_variants_beside_their_sweep(name, base, tmp_path):
    """The BOS matrices extend the sweep the report trains (its training fields and seeds): their `rope` is the very
    configuration of the sweep's `rope` (so the cache trains it once: same model directory), `rope-doc` differs
    from it in the blocks alone (document starts, BOS first), `rope-doc-nobos` from `rope-doc` in the BOS alone;
    each has its own label. A matrix that extends itself is refused in one line."""
    from dataclasses import asdict

    from poslens.train.cache import trained_model_dir

    m, parent = resolve_matrix(SweepConfig(preset=name)), resolve_matrix(SweepConfig(preset=base))
    assert list(m.variants) == ["rope", "rope-doc", "rope-doc-nobos"] and m.seeds == parent.seeds
    for seed in m.seeds:
        cfg = {x.variant: asdict(x.config) for x in m.members if x.seed == seed}
        same = next(asdict(x.config) for x in parent.members if x.seed == seed and x.variant == "rope")
        assert cfg["rope"] == same

        def differ(a, b):
            return {k for k in a if a[k] != b[k]}

        assert differ(cfg["rope-doc"], cfg["rope"]) == {"blocks"} and cfg["rope-doc"]["blocks"] == "doc-start"
        assert differ(cfg["rope-doc-nobos"], cfg["rope-doc"]) == {"bos"} and not cfg["rope-doc-nobos"]["bos"]
    tokens = tmp_path / "tok"
    tokens.mkdir()
    (tokens / "header.json").write_text("{}")
    rope = next(x.config for x in m.members if x.variant == "rope")
    twin = next(x.config for x in parent.members if x.variant == "rope" and x.seed == rope.seed)
    assert trained_model_dir(rope, tokens) == trained_model_dir(twin, tokens)
    labels = {x.variant: x.label for x in m.members}
    assert labels == {"rope": "RoPE", "rope-doc": "RoPE; document starts, BOS first",
                      "rope-doc-nobos": "RoPE; document starts, no BOS"}
    from poslens.report.sweep import SweepModels

    text = SweepModels(SweepConfig(preset=name), m, {}, None).describe()  # the report says each model's blocks
    assert text.endswith("blocks per variant: rope: packed cuts, BOS first, rope-doc: document starts, BOS first, "
                         "rope-doc-nobos: document starts, no BOS")
    assert SweepModels(SweepConfig(preset=base), parent, {}, None).describe().endswith(", BOS first")
    loop = tmp_path / "loop.json"
    loop.write_text(json.dumps({"extends": str(loop), "variants": {"a": {"pe": "rope"}}}))
    with pytest.raises(UsageError, match="extends it back"):
        resolve_matrix(SweepConfig(preset=str(loop)))


def test_a_sweep_over_the_data_convention_trains_each_variant_as_configured(tmp_path, tokens, capsys):
    """Variants that differ in the blocks and the BOS train end to end in one sweep, as one computation (the
    progress line says so and names their blocks; each run.json counts 3 batched models): each model's run.json
    says its blocks and BOS, each has its own cached directory and a finite held-out loss (over document starts for
    the document-start variants)."""
    preset = _matrix_file(tmp_path, tokens, {"packed": {"pe": "rope"}, "doc": {"pe": "rope", "blocks": "doc-start"},
                                             "doc-nobos": {"pe": "rope", "blocks": "doc-start", "bos": False}},
                          seeds=(11,))  # a seed no other test trains: the session's model cache is shared
    meta = run_sweep(SweepConfig(preset=preset, jobs=1), tmp_path / "sweep", progress=True)
    assert "3 models as one (document starts, BOS first; document starts, no BOS; packed cuts, BOS first): " \
           "training 3 steps" in capsys.readouterr().out
    models = {m["variant"]: m for m in meta["models"]}
    assert len({m["path"] for m in models.values()}) == 3
    for variant, (blocks, bos) in {"packed": ("packed", True), "doc": ("doc-start", True),
                                   "doc-nobos": ("doc-start", False)}.items():
        run = json.loads(Path(models[variant]["path"], "run.json").read_text())
        assert (run["config"]["blocks"], run["config"]["bos"]) == (blocks, bos)
        assert run["metrics"]["batched_models"] == 3
        assert math.isfinite(meta["metrics"]["heldout_loss"][variant]["value"])


def test_flags_and_bad_matrices(tmp_path, tokens):
    m = resolve_matrix(SweepConfig(preset="pe-quick", variants="a:pe=none,b:pe=rope+rope_scaling=linear:2",
                                   seeds=[5], train="steps=20+warmup=2"))
    assert m.variants == {"a": {"pe": "none"}, "b": {"pe": "rope", "rope_scaling": "linear:2"}}
    assert [(x.variant, x.seed, x.config.steps) for x in m.members] == [("a", 5, 20), ("b", 5, 20)]
    bad = {"data field in a variant": ({"x": {"pe": "rope", "steps": 9}}, "must be the same for every variant"),
           "unknown field": ({"x": {"pe": "rope", "depth": 3}}, "must be the same for every variant"),
           "bad value": ({"x": {"pe": "rope", "rope_scaling": "ntk:0.5"}}, "rope_scaling factor"),
           # as `train --pe none --rope-theta` is refused: two identical NoPE models, a paired difference of 0
           "a base without RoPE": ({"x": {"pe": "none", "rope_theta": 5000}, "y": {"pe": "none"}},
                                   "variant x: rope_theta has no effect, no layer of it has RoPE")}
    for variants, message in bad.values():
        with pytest.raises(UsageError, match=message):
            resolve_matrix(SweepConfig(preset=_matrix_file(tmp_path, tokens, variants)))
    with pytest.raises(UsageError, match="differ from each other"):
        resolve_matrix(SweepConfig(preset="pe-quick", seeds=[1, 1]))
    for spec in ("nope", "a:pe", "a:pe=none,a:pe=rope"):
        with pytest.raises(UsageError, match="variant"):
            parse_variants(spec)
    # a refused value names the flag it came from: --variants and the variant, --train, --seeds
    for flags, message in ((["--variants", "nope:pe=foo"], "--variants: nope: pe must be one of none, rope"),
                           (["--train", "steps=-1"], "--train: steps must be >= 1, got -1"),
                           (["--train", "steps=abc"], "--train: steps takes a number; got 'abc'"),
                           (["--seeds", "-1"], "--seeds must be in [0, 4294967295], got -1")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(["sweep", *flags, "--quiet", "--out", str(tmp_path / "x")]) == 2
        assert err.getvalue().startswith(f"poslens sweep: error: {message}") and err.getvalue().count("\n") == 1, \
            err.getvalue()
    with pytest.raises(UsageError, match="sweep preset .*: variant x: rope_scaling factor"):  # a file's variant
        resolve_matrix(SweepConfig(preset=_matrix_file(tmp_path, tokens, {"x": {"pe": "rope",
                                                                                "rope_scaling": "ntk:0.5"}})))


def test_between_seed_interval_is_the_t_interval():
    """mean -/+ t_{n-1, 0.975} sd / sqrt(n); t_{2, 0.975} = 4.302652729911275 (a table value)."""
    e = seed_interval([1.0, 2.0, 3.0])
    assert e["value"] == 2.0 and e["sd"] == 1.0
    assert math.isclose(e["hi"] - 2.0, 4.302652729911275 / math.sqrt(3), rel_tol=1e-9)
    assert seed_interval([4.0])["lo"] is None  # one seed: no interval
    share = seed_interval([0.0, 1.0, 0.94], support=(0.0, 1.0))  # a share: t-interval -0.75..2.04 cut to [0, 1]
    assert (share["lo"], share["hi"]) == (0.0, 1.0) and share["value"] == pytest.approx(1.94 / 3)
    from poslens.report.sweep import combine_seeds

    per_seed = [{"x": {"value": v, "lo": v, "hi": v, "support": [0.0, 1.0]}} for v in (0.2, 0.9, 0.95)]
    assert combine_seeds(per_seed)["x"]["lo"] == 0.0  # an estimate's support travels through the combination
    s = summarise({"a": [1.0, 2.0, 3.0], "b": [1.5, 2.4, 3.6]})
    d = s["differences"]["a - b"]
    assert d["per_seed"] == pytest.approx([-0.5, -0.4, -0.6]) and d["verdict"] == "a lower than b"


def test_combine_seeds_adds_each_seeds_half_width_before_its_cut():
    """A seed's interval cut to its support is narrower than the text's noise it stands for: the half-width added
    over seeds is the jackknife's t * se, not half the cut interval; an uncut one's is (hi - lo) / 2, as before."""
    from poslens.engine.stats import t_quantile
    from poslens.report.sweep import combine_seeds

    t = t_quantile(0.975, 3)
    cut = [{"value": v, "lo": v - t * 0.05, "hi": 1.0, "se": 0.05, "level": 0.95, "groups": 4, "method": "jackknife",
            "support": [0.0, 1.0]} for v in (0.95, 0.9, 0.97)]
    assert combine_seeds(cut)["shared"] == pytest.approx(t * 0.05, rel=1e-12)
    plain = [{"value": v, "lo": v - 0.1, "hi": v + 0.1} for v in (0.5, 0.6, 0.7)]
    assert combine_seeds(plain)["shared"] == pytest.approx(0.1, rel=1e-12)


def test_combine_seeds_replaces_each_estimate_by_the_t_interval_of_its_per_seed_values():
    """`combine_seeds` (the report's Section 4.2): each estimate of one shape of per-seed results becomes mean -/+
    t_{n-1} sd / sqrt(n) of its values (t_{2, 0.975} = 4.302653 for three seeds); an undefined seed leaves the mean
    and its interval undefined; other leaves are the first seed's. Every seed read the same held-out text, so each
    seed's own half-width over it (here 1) is added in quadrature: sqrt(h_seeds^2 + 1)."""
    from poslens.report.sweep import combine_seeds

    def est(v):
        return {"value": v, "lo": None if v is None else v - 1, "hi": None if v is None else v + 1, "groups": 20}

    results = [{"a": est(1.0), "b": [est(2.0), {"c": est(None)}], "n": 7},
               {"a": est(2.0), "b": [est(4.0), {"c": est(1.0)}], "n": 8},
               {"a": est(6.0), "b": [est(9.0), {"c": est(2.0)}], "n": 9}]
    out = combine_seeds(results)
    sd = math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + (6 - 3) ** 2) / 2)
    assert out["a"]["value"] == 3.0 and out["a"]["per_seed"] == [1.0, 2.0, 6.0] and out["a"]["n"] == 3
    assert math.isclose(out["a"]["hi"] - 3.0, math.hypot(4.302653 * sd / math.sqrt(3), 1.0), rel_tol=1e-6)
    assert out["a"]["shared"] == 1.0 and out["a"]["sd"] == pytest.approx(sd)
    assert math.isclose(out["b"][0]["value"], 5.0) and out["n"] == 7
    assert math.isnan(out["b"][1]["c"]["value"]) and math.isnan(out["b"][1]["c"]["lo"])


def test_sweep_trains_pairs_caches_and_resumes(tmp_path, tokens, monkeypatch):
    """A 2 x 2 matrix whose two variants are the same model: the second variant is read from the cache (no
    training), so its paired differences are exactly 0; an interrupted sweep resumes, training only the models
    it had not finished; the held-out losses are the models' own final evaluations."""
    import poslens.train.loop as loop
    from poslens.io.results import load

    trained = []
    original = loop.train

    def counting(cfg, out, **kw):
        trained.append((cfg.pe, cfg.seed))
        if len(trained) == 2 and not getattr(counting, "resumed", False):
            raise KeyboardInterrupt  # interrupted while training the second model
        return original(cfg, out, **kw)

    monkeypatch.setattr(loop, "train", counting)
    preset = _matrix_file(tmp_path, tokens, {"nope": {"pe": "none"}, "rope": {"pe": "rope"},
                                             "nope2": {"pe": "none"}})
    cfg = SweepConfig(preset=preset, jobs=1, batched=False)  # each alone in this process, where `counting` sees it
    with pytest.raises(KeyboardInterrupt):
        run_sweep(cfg, tmp_path / "sweep", progress=False)
    assert not (tmp_path / "sweep").exists()
    counting.resumed = True
    meta = run_sweep(cfg, tmp_path / "sweep", progress=False)
    # nope s0 trained before the interrupt, nope s1 interrupted and trained again, then rope s0, rope s1; nope2 cached
    assert trained == [("none", 0), ("none", 1), ("none", 1), ("rope", 0), ("rope", 1)]
    # two worker processes train a new seed's models side by side (this process's train is not called)
    more = run_sweep(SweepConfig(preset=preset, seeds=[0, 1, 2], jobs=2, batched=False), tmp_path / "sweep3",
                     progress=False)
    assert len(trained) == 5 and all(Path(m["path"], "run.json").is_file() for m in more["models"])
    assert [m["path"] for m in more["models"] if m["seed"] < 2] == [m["path"] for m in meta["models"]]  # cached
    run = load(tmp_path / "sweep")
    assert run["final_loss"].shape == (3, 2) and run["eval_loss"].shape == (3, 2, 2)
    for i, m in enumerate(meta["models"]):
        own = load(m["path"]).metrics["final_eval_loss"]
        assert run["final_loss"].flatten()[i].item() == own
    diffs = meta["metrics"]["differences"]
    assert diffs["nope - nope2"]["per_seed"] == [0.0, 0.0] and diffs["nope - nope2"]["lo"] == 0.0
    assert meta["models"][0]["path"] == meta["models"][4]["path"]  # the same configuration: one cached model
    assert (tmp_path / "sweep" / "figures" / "heldout_loss.png").is_file()


def test_a_batched_sweep_killed_midway_resumes_to_the_uninterrupted_sweep(tmp_path, tokens, monkeypatch):
    """The default sweep trains its models as one computation (here its six in one part, in this process); killed
    after its first checkpoints and rerun, it gives bit-identical held-out losses and weights to a sweep that was
    never interrupted (each in its own cache)."""
    import torch
    from safetensors.torch import load_file

    import poslens.train.batched as batched

    preset = _matrix_file(tmp_path, tokens, {"nope": {"pe": "none"}, "rope": {"pe": "rope"},
                                             "window": {"pe": "rope", "sliding_window": 8}})
    monkeypatch.setenv("POSLENS_CACHE", str(tmp_path / "cache-whole"))
    train = "steps=4+save_every=2+eval_every=2"
    whole = run_sweep(SweepConfig(preset=preset, train=train, jobs=1), tmp_path / "whole", progress=False)
    monkeypatch.setenv("POSLENS_CACHE", str(tmp_path / "cache-killed"))
    original = batched._save

    def killed(*args, **kw):
        original(*args, **kw)
        raise KeyboardInterrupt  # killed right after the first checkpoints

    monkeypatch.setattr(batched, "_save", killed)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(SweepConfig(preset=preset, train=train, jobs=1), tmp_path / "resumed", progress=False)
    monkeypatch.setattr(batched, "_save", original)
    resumed = run_sweep(SweepConfig(preset=preset, train=train, jobs=1), tmp_path / "resumed", progress=False)
    assert whole["metrics"]["heldout_loss"] == resumed["metrics"]["heldout_loss"]
    for a, b in zip(whole["models"], resumed["models"]):
        wa = load_file(str(Path(a["path"], "model.safetensors")))
        wb = load_file(str(Path(b["path"], "model.safetensors")))
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
        assert json.loads(Path(b["path"], "run.json").read_text())["metrics"]["batched_models"] == 6


def test_auto_jobs_is_one_model_per_cpu_thread_and_one_on_a_gpu(monkeypatch):
    """0 jobs = one model per torch thread on the CPU, never more models than there are, one on a GPU, and one
    for models too small to pay for starting a worker."""
    import torch

    from poslens.train.config import resolve_config
    from poslens.train.sweep import auto_jobs

    cpu = resolve_config("tiny", device="cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert auto_jobs([cpu] * 12) == 4 and auto_jobs([cpu] * 3) == 3 and auto_jobs([cpu]) == 1
    assert auto_jobs([cpu, resolve_config("tiny", device="cuda")]) == 1
    assert auto_jobs([resolve_config("tiny", device="cpu", steps=6, warmup=2)] * 4) == 1  # a test's few steps: inline


def test_seeds_that_read_the_same_text_keep_that_texts_interval():
    """Seeds that agree exactly on one shared held-out sample still carry that sample's interval (the spread over
    seeds is 0, the interval is not); more seeds cannot shrink it, so when it alone exceeds the distance of the
    estimate from the threshold no seed count is given and the row asks for more held-out text."""
    from poslens.engine.stats import over_seeds
    from poslens.report.claims import estimate_test
    from poslens.report.sweep import SweepModels, more_seeds, seeds_needed

    same = over_seeds([0.3, 0.3, 0.3], shared=[0.2, 0.2, 0.2])
    assert float(same.lo) == pytest.approx(0.1) and float(same.hi) == pytest.approx(0.5)
    e = seed_interval([0.05, 0.1, 0.15], shared=[0.3, 0.3, 0.3])
    test = estimate_test("effect", e, ">")
    assert test.outcome() == "open" and test.floor == pytest.approx(0.3) and seeds_needed(test, 3) is None
    cfg = SweepConfig(preset="pe-quick")
    text = more_seeds(SweepModels(cfg, resolve_matrix(cfg), {}, None), (test,))
    assert text.startswith("more held-out text") and "--seeds" not in text
    narrow = estimate_test("effect", seed_interval([0.05, 0.1, 0.15], shared=[0.01] * 3), ">")
    m = seeds_needed(narrow, 3)  # a small floor: a count, larger than without the floor
    plain = estimate_test("effect", seed_interval([0.05, 0.1, 0.15]), ">")
    assert m is not None and m >= seeds_needed(plain, 3)


def test_a_corrupt_cached_model_is_trained_again_saying_so(tmp_path, tokens, monkeypatch, capfd):
    """A cached model whose weights changed on disk after poslens wrote them (one byte, same size) is not read as
    it is: the sweep says so on stderr and trains it again, batched (bit-identical to the first training: the same
    configuration in the same process) or alone; before the check it was used without a word."""
    from poslens.train.cache import corrupt

    monkeypatch.setenv("POSLENS_CACHE", str(tmp_path / "cache"))
    preset = _matrix_file(tmp_path, tokens, {"rope": {"pe": "rope"}}, seeds=(0,))
    first = run_sweep(SweepConfig(preset=preset, jobs=1), tmp_path / "a", progress=False)
    weights = Path(first["models"][0]["path"], "model.safetensors")
    good = weights.read_bytes()

    def flip() -> None:
        data = bytearray(good)
        data[-100] ^= 1  # inside the last tensor's values: the file still loads, with another weight
        weights.write_bytes(bytes(data))
        assert corrupt(weights.parent) is not None
        capfd.readouterr()

    flip()
    again = run_sweep(SweepConfig(preset=preset, jobs=1), tmp_path / "b", progress=False)
    assert "the cached model is corrupt" in capfd.readouterr().err
    assert again["models"][0]["path"] == first["models"][0]["path"] and weights.read_bytes() == good
    flip()
    run_sweep(SweepConfig(preset=preset, jobs=1, batched=False), tmp_path / "c", progress=False)
    assert "model.safetensors was changed after poslens wrote it" in capfd.readouterr().err
    assert corrupt(weights.parent) is None and Path(weights.parent, "run.json").is_file()


def test_time_left_counts_the_parts_running_side_by_side():
    """The time left is the work left at the observed rate of one part, `slots` parts at once: two equal parts
    started together, the first just finished after 100 s, leave about nothing (the old clock, one model after
    another, said 100 s: the full run's "about 32.8 min left" a minute before the end); queued parts go to the
    first free slot; one slot is the sequential sum."""
    from poslens.train.sweep import time_left

    rate = 16 * 2000 / 100.0  # model-steps per second of one part: 16 models x 2,000 steps in 100 s
    assert time_left([(32000, 100.0)], [], rate, 2) == 0.0
    assert time_left([(32000, 60.0)], [], rate, 2) == pytest.approx(40.0)
    # four equal parts on two slots, the first finished at 100 s, the second 100 s in: two start now, 100 s
    assert time_left([(32000, 100.0)], [32000, 32000], rate, 2) == pytest.approx(100.0)
    # three queued beside a part 30 s in, on two slots: slot 1 runs one now (ends at 100), slot 2 one from 70 s
    # (ends at 170), the third takes slot 1 at 100 s and ends at 200 s
    assert time_left([(32000, 30.0)], [32000, 32000, 32000], rate, 2) == pytest.approx(200.0)
    assert time_left([], [32000, 32000, 16000], rate, 1) == pytest.approx(250.0)  # sequential: the sum
    assert time_left([], [], rate, 3) == 0.0
    with pytest.raises(UsageError, match="rate > 0"):
        time_left([], [1.0], 0.0, 1)


def test_the_clock_of_two_parallel_parts_says_the_time_of_the_one_still_running(monkeypatch, capsys):
    """The progress lines of a sweep in two parallel parts of 16 models: after the first part ends (100 s), the
    second, started with it and as large, has about nothing left, not another 100 s."""
    import poslens.train.sweep as sweep

    now = [0.0]
    monkeypatch.setattr(sweep.time, "perf_counter", lambda: now[0])
    clock = sweep._Clock([(16, 2000), (16, 2000), (8, 2000)], on=True, slots=2)
    clock.start("a", 2000, 16)
    clock.start("b", 2000, 16)
    now[0] = 100.0
    clock.done("a", 16)
    clock.start("c", 2000, 8)
    now[0] = 105.0
    clock.done("b", 16)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("40 model(s) to train, time left known after one model")
    assert lines[2] == "a: trained; 24 model(s) to train, about 50 s left"  # c (8 models: 50 s) still queued
    assert lines[3] == "c: training 2000 steps; 24 model(s) to train, about 50 s left"
    # b took 105 s: rate 64,000 / 205 s; c 5 s in, 16,000 model-steps: 51 s left
    assert lines[4] == "b: trained; 8 model(s) to train, about 46 s left"


def test_parallel_parts_of_one_model_train_as_the_parts_in_this_process_do(tmp_path, tokens, monkeypatch, capsys):
    """Two models in two worker processes (--jobs 2): each part of one model trains through the batched trainer, as
    a part of one model trained in this process does, so --compile reaches it (before, such a part trained with
    `poslens train`'s loop, and `--compile on` compiled nothing)."""
    monkeypatch.setenv("POSLENS_CACHE", str(tmp_path / "cache"))  # the workers' too: not the models of other tests
    preset = _matrix_file(tmp_path, tokens, {"nope": {"pe": "none"}})
    meta = run_sweep(SweepConfig(preset=preset, jobs=2), tmp_path / "sweep", progress=True)
    for m in meta["models"]:
        assert json.loads(Path(m["path"], "run.json").read_text())["metrics"]["batched_models"] == 1
    # the workers draw no bar; the parent draws one for both parts, in model-steps, up to all of them
    err = capsys.readouterr().err
    work = 2 * MICRO["steps"]
    assert "training 2 models, 2 parts at a time" in err and f"{work}/{work}" in err


def test_a_worker_part_writes_its_model_steps_where_the_parent_reads_them(tmp_path, tokens, monkeypatch):
    """The parent's bar over parts trained in worker processes reads each part's model-steps from shared counters;
    `_train_unit` in a worker writes its part's entry after every step (here called in this process, as a worker
    calls it): two models of one computation, `steps` steps, so 2 * steps at the end, and every value it wrote on
    the way a multiple of 2 (one step of both models at a time)."""
    from poslens.train import sweep

    monkeypatch.setenv("POSLENS_CACHE", str(tmp_path / "cache"))
    preset = _matrix_file(tmp_path, tokens, {"nope": {"pe": "none"}}, seeds=(0, 1))
    members = resolve_matrix(SweepConfig(preset=preset)).members
    part = [(m.config, f"{m.variant} s{m.seed}") for m in members]
    seen = []

    class Counters(list):  # stands for the shared array; its item assignments recorded
        def __setitem__(self, i, v):
            seen.append((i, v))
            super().__setitem__(i, v)

    counters = Counters([0, 0, 0])
    monkeypatch.setattr(sweep, "_COUNTERS", counters)
    sweep._train_unit(part, Path(tokens), None, False, "off", slot=1)
    steps = part[0][0].steps
    assert counters[1] == 2 * steps and counters[0] == counters[2] == 0
    assert [v for _, v in seen] == [2 * (k + 1) for k in range(steps)] and {i for i, _ in seen} == {1}


def test_ctrl_c_on_a_sweep_in_worker_processes_is_one_line_and_leaves_no_process(tmp_path, tokens):
    """Ctrl-C in a terminal (SIGINT to the process group) while two worker processes train: exit 130, one line on
    stderr (before: two more lines from multiprocessing's resource tracker about the pool's semaphores), no --out,
    no worker left running; each model keeps its checkpoint, and nothing else of its run stays in the cache (before:
    its empty build directory and its lock files)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    preset = _matrix_file(tmp_path, tokens, {"nope": {"pe": "none"}})
    train = "steps=100000+save_every=2+eval_every=100000"  # runs until interrupted
    env = {**os.environ, "POSLENS_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "src"),
                                                       os.environ.get("PYTHONPATH")]))}
    sweep = subprocess.Popen([sys.executable, "-m", "poslens", "sweep", "--preset", preset, "--train", train,
                              "--jobs", "2", "--compile", "off",  # 100,000 steps would compile first (auto): ~35 s
                              "--quiet", "--out", str(tmp_path / "out")], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             preexec_fn=lambda: (os.setpgrp(), signal.signal(signal.SIGINT, signal.SIG_DFL)))
    try:
        deadline = time.monotonic() + 300
        while len(list((tmp_path / "cache" / "trained").glob(".*.partial/checkpoint/trainer.pt"))) < 2:
            assert sweep.poll() is None and time.monotonic() < deadline, sweep.stderr.read()
            time.sleep(0.5)
        os.killpg(sweep.pid, signal.SIGINT)
        _, err = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)  # never left running, whatever failed above
    assert sweep.returncode == 130 and err.splitlines() == [
        "poslens sweep: interrupted; nothing was written to --out (rerun the same command; runs with checkpoints "
        "resume where they stopped)"], err
    assert not (tmp_path / "out").exists()
    deadline = time.monotonic() + 60  # the group ends: no worker left (the resource tracker exits after the parent)
    while time.monotonic() < deadline:
        try:
            os.killpg(sweep.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(subprocess.run(["ps", "-o", "pid,args", "-g", str(sweep.pid)], capture_output=True,
                                            text=True).stdout)
    left = [p for p in (tmp_path / "cache" / "trained").rglob("*")
            if p.name == "build" or ".tmp-" in p.name or p.name.endswith(".lock")]
    assert not left, left


def _run_until_stopped(out: str) -> None:
    """A job of a sweep's worker: a run directory with a checkpoint, written until the worker is stopped."""
    import time

    from poslens.io.rundir import open_run

    with open_run(out) as run:
        run.checkpoint("state").write_bytes(b"")
        time.sleep(60)


def test_a_worker_the_sweep_stops_leaves_only_its_checkpoints(tmp_path):
    """On Ctrl-C a sweep's parent stops its workers with SIGTERM (`_train_parallel`); a worker unwinds its job then,
    as an exit would: its run directory's build and lock go, its checkpoints stay for the rerun (before: SIGTERM
    ended the worker where it was, and the empty ``.NAME.partial/build`` and the lock file stayed)."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor

    from poslens.train.sweep import _worker_init

    out = tmp_path / "model"
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"), initializer=_worker_init,
                               initargs=(None,))
    try:
        pool.submit(_run_until_stopped, str(out))
        deadline = time.monotonic() + 30
        while not (tmp_path / ".model.partial" / "state.safetensors").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for p in list(pool._processes.values()):  # as `_train_parallel` stops its workers
            p.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        ".model.partial", ".model.partial/state.safetensors"]


def test_the_matrices_a_run_reads_train_as_one_set_before_any_section_asks(tmp_path, tokens, monkeypatch):
    """`train_sweeps` trains the union of two matrices that share a model in one `train_models` call: the shared
    configuration once, every model in one computation (each run.json counts 3 batched models); `sweep_models` then
    trains nothing more and records each model as trained by this run. `planned_sweeps` finds both matrices the
    full report reads (the sweep and the leakage section's BOS sweep), each once."""
    import poslens.train.sweep as sweep_module
    from poslens.report.reproduce import plan
    from poslens.report.sweep import planned_sweeps, sweep_models, train_sweeps

    calls = []
    original = sweep_module.train_models
    monkeypatch.setattr(sweep_module, "train_models", lambda work, *a, **k: calls.append(len(work)) or original(
        work, *a, **k))
    a = SweepConfig(preset=_matrix_file(tmp_path / "a", tokens, {"rope": {"pe": "rope"}, "nope": {"pe": "none"}},
                                        seeds=(13,)))
    b = SweepConfig(preset=_matrix_file(tmp_path / "b", tokens, {"rope": {"pe": "rope"},
                                                                 "doc": {"pe": "rope", "blocks": "doc-start"}},
                                        seeds=(13,)))

    class Ctx:
        progress = False

        def record(self, *args):
            pass

    ctx = Ctx()
    trained = train_sweeps(ctx, [a, b])
    assert calls == [4] and len(set(trained)) == 3  # four members, three models, one call
    for path in set(trained):
        assert json.loads(Path(path, "run.json").read_text())["metrics"]["batched_models"] == 3
    for cfg in (a, b):
        sw = sweep_models(ctx, cfg)
        assert sorted(sw.trained) == sorted(sw.paths)  # trained by this run, not "from the cache"
    assert calls == [4, 2, 2]  # the sections' own calls find every model in the cache
    presets = [c.preset for c in planned_sweeps(plan(False, True, None))]
    assert sorted(presets) == ["bos-sinks", "pe-sinks"]
