"""`poslens leakage` end to end on a tiny local-directory Llama: run directory, nulls, resume, bad input."""

import os
import subprocess
import sys

import pytest
import torch
from test_pipeline import saved_tiny_llama

import poslens
from poslens.analyses.leakage.run import LeakageConfig, run_leakage
from poslens.cli import main
from poslens.engine.pipeline import checkpoint_path
from poslens.errors import UsageError
from poslens.report.sections.leakage import leakage_claims


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama saved with a byte-level tokenizer that has a BOS token."""
    return saved_tiny_llama(tmp_path_factory.mktemp("tiny-llama-leak") / "model")


def cfg(model_dir, **kw):
    base = dict(model=str(model_dir), seq_len=24, num_sequences=8, batch_size=2, groups=4, early_queries=10,
                interventions=["mean", "shift:50", "freeze", "nobos"])
    return LeakageConfig(**{**base, **kw})


def test_run_directory_with_intervals_and_nulls(model_dir, tmp_path):
    run = poslens.load(run_leakage(cfg(model_dir), tmp_path / "run", progress=False))
    m = run.metrics
    assert run.meta["kind"] == "leakage"
    early = m["per_layer_early"]
    for key in ("split/share_logit", "scores/trf", "log_probs/drift"):
        e = early[key]
        assert all(lo <= v <= hi for v, lo, hi in zip(e["value"], e["lo"], e["hi"]))
    # the parts of the split add up exactly, layer by layer
    tot = [a + b + c for a, b, c in zip(early["split/e_logit"]["value"], early["split/e_partition"]["value"],
                                       early["split/cross"]["value"])]
    assert tot == pytest.approx(early["split/e_total"]["value"], rel=1e-9)
    iv = m["interventions"]
    # shifting every position id leaves a RoPE model's scores unchanged up to float32 rounding: nothing removed
    assert abs(iv["shift:50"]["removed_all_layers"]["value"]) < 1e-4
    # with a fixed BOS the position-0 trajectory is already the same for every input: freezing it is a no-op
    assert abs(iv["freeze"]["removed_all_layers"]["value"]) < 1e-4
    assert max(abs(x) for x in m["position0_spread"]) < 1e-6
    assert m["position0_spread_interval"]["groups"] == 4 and len(m["position0_spread_interval"]["hi"]) == 4
    # replacing the BOS embedding does change the early logit part (in either direction for random weights)
    assert abs(iv["mean"]["removed_all_layers"]["value"]) > 1e-3
    assert run["probs_per_head"].shape == (3, 4, 24, 24)
    assert len(m["predecessor"]["significant_heads_per_layer"]) == 3
    for f in ("shares_by_layer_early.png", "removed_by_layer.png", "alpha0.png"):
        assert (tmp_path / "run" / "figures" / f).exists()
    claims, context = leakage_claims(tmp_path / "run")
    assert any(c.id == "ruscio-bos-replacement-mean" for c in claims)
    assert any(what.startswith("position 0") for what, _ in context)


def test_resume_after_interrupt_equals_uninterrupted(model_dir, tmp_path, monkeypatch):
    kw = dict(interventions=["mean"], checkpoint_every=1)
    full = poslens.load(run_leakage(cfg(model_dir, **kw), tmp_path / "full", progress=False))
    from poslens.engine import hooks as hooks_mod

    original = hooks_mod.HookedModel.run
    calls = {"n": 0}

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return original(self, *a, **k)

    monkeypatch.setattr(hooks_mod.HookedModel, "run", flaky)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        run_leakage(cfg(model_dir, **kw), out, progress=False)
    assert checkpoint_path(out).exists()
    monkeypatch.setattr(hooks_mod.HookedModel, "run", original)
    resumed = poslens.load(run_leakage(cfg(model_dir, **kw), out, progress=False))
    assert resumed.meta["resumed_from_unit"] == 5
    for key in ("orig/scores", "metrics_early", "metrics_early_lo", "intervention/mean/removed", "predecessor/gap"):
        torch.testing.assert_close(resumed[key], full[key], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kw,words", [
    (dict(early_queries=1), "early_queries"),
    (dict(max_offset=0), "max_offset"),
    (dict(interventions=["bos"]), "interventions"),
    (dict(num_sequences=1), "num_sequences"),
    (dict(groups=1), "groups"),
])
def test_bad_input_is_a_one_line_usage_error(model_dir, tmp_path, kw, words):
    with pytest.raises(UsageError, match=words) as e:
        run_leakage(cfg(model_dir, **kw), tmp_path / "bad", progress=False)
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, line", [
    (["--level", "1"], "--level must be in (0, 1), got 1"),
    (["--sink-threshold", "2"], "--sink-threshold must be in (0, 1), got 2"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--pe", "sinusoidal"], "argument --pe: invalid choice"),
    # sizes refused with the estimate before a sequence is cut (dense [8, 4, T, T] scores alone: 7.7 TB)
    (["--seq-len", "100000"], "--seq-len 100000: the run would need about "),
])
def test_command_line_refusals_name_the_flag_and_leave_nothing(model_dir, tmp_path, capsys, argv, line):
    """Refused before anything is loaded (no lock file, no .out.partial-* checkpoint left), the flag named."""
    try:
        code = main(["leakage", str(model_dir), *argv, "--quiet", "--out", str(tmp_path / "out")])
    except SystemExit as e:  # argparse's own choices
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and line in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_groups_lowered_to_the_batches_and_said(model_dir, tmp_path, capsys):
    """The groups rule: 8 sequences in batches of 2 keep 4 groups, not 8; run.json and stdout say so."""
    assert main(["leakage", str(model_dir), "--seq-len", "24", "--num-sequences", "8", "--batch-size", "2",
                 "--early-queries", "10", "--interventions", "none", "--no-predecessor", "--no-figures", "--quiet",
                 "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    run = poslens.load(tmp_path / "run", tensors=False)
    assert run.meta["groups"] == {"asked": 8, "used": 4, "batches": 4, "note": run.meta["groups"]["note"]}
    assert run.metrics["groups"] == 4 and "groups lowered from 8 to 4" in out
    assert out.splitlines()[-1] == f"wrote {tmp_path / 'run'}"


@pytest.mark.slow
def test_torchrun_two_ranks_equal_single_process(model_dir, tmp_path):
    """Two gloo ranks, 4 sequences each in batches of 2: the same batches land in the same groups as in one
    process, so every mean and every interval is the same (float32 sums of the same numbers in another order:
    1e-6)."""
    kw = dict(interventions=["mean"])
    single = poslens.load(run_leakage(cfg(model_dir, **kw), tmp_path / "single", progress=False))
    script = tmp_path / "rank.py"
    script.write_text("import sys\nfrom poslens.analyses.leakage.run import LeakageConfig, run_leakage\n"
                      f"run_leakage(LeakageConfig(**{cfg(model_dir, **kw).__dict__!r}), sys.argv[1], progress=False)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
           str(script), str(tmp_path / "sharded")]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    sharded = poslens.load(tmp_path / "sharded")
    assert sharded.meta["world_size"] == 2
    for key in ("orig/scores", "metrics_all", "metrics_all_lo", "intervention/mean/removed", "predecessor/gap"):
        torch.testing.assert_close(sharded[key], single[key], rtol=1e-6, atol=1e-6, equal_nan=True)
