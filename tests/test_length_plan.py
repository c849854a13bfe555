"""The passes of `poslens length` as records (model, intervention, length, factor) with their statistics by name,
read back by their fields, never by their names; and the up-front maps check as a plain function."""

from __future__ import annotations

import pytest
from tiny_models import build, token_batch

from poslens.analyses.length import LengthPass, PositionLoss, parse, plan_passes, run_pass
from poslens.analyses.length.checks import check_maps_length
from poslens.analyses.length.interventions import Freeze, LogScaling, RopeScaling, Window
from poslens.analyses.length.plan import statistics_for
from poslens.analyses.length.run import LengthConfig
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError


def settled(**fields) -> LengthConfig:
    """A config as `Length.configure` leaves it: L = 16, eval lengths 16, 32, 64, interventions chosen."""
    base = dict(model="m", train_len=16, eval_lens=[16, 32, 64], seq_len=64, maps=False,
                interventions=["logn", "ntk", "ntk:4", "window:8", "freeze"])
    return LengthConfig(**{**base, **fields})


def test_plan_is_model_major_with_one_rope_pass_per_length_past_L():
    plan = plan_passes(settled(seed_models=["s1"]))
    one = [LengthPass(0, "none", 64), LengthPass(0, "logn", 64), LengthPass(0, "ntk", 32, 2.0, per_length=True),
           LengthPass(0, "ntk", 64, 4.0, per_length=True), LengthPass(0, "ntk:4", 64, 4.0),
           LengthPass(0, "window:8", 64), LengthPass(0, "freeze", 64)]
    assert plan == one + [LengthPass(1, p.intervention, p.length, p.factor, p.per_length) for p in one]
    # the names the progress bar and the checkpoint's fingerprint carry (as before the records)
    assert [p.name(2) for p in plan[:5]] == ["m0/none", "m0/logn", "m0/ntk@32", "m0/ntk@64", "m0/ntk:4"]
    assert plan[2].name(1) == "ntk@32" and plan[4].name(1) == "ntk:4"
    # scaled at the longest length only: one pass, factor T / L, still read at its own length alone
    lean = [p for p in plan_passes(settled(scaled_at="longest")) if p.intervention == "ntk"]
    assert lean == [LengthPass(0, "ntk", 64, 4.0, per_length=True)]


def test_a_pass_measures_the_effects_its_record_covers():
    past = [32, 64]
    assert LengthPass(0, "logn", 64).effect_lengths(past) == [32, 64]  # causality: a prefix of the pass at T
    assert LengthPass(0, "ntk:4", 64, 4.0).effect_lengths(past) == [32, 64]  # a fixed factor: the same model
    assert LengthPass(0, "ntk", 32, 2.0, per_length=True).effect_lengths(past) == [32]
    assert LengthPass(0, "ntk", 64, 4.0, per_length=True).effect_lengths(past) == [64]  # not the factor 2 model
    assert LengthPass(0, "yarn", 32, 2.0, per_length=True).effect_lengths([64]) == []


def test_a_record_builds_its_intervention():
    ntk = LengthPass(0, "ntk", 32, 2.0, per_length=True).built(16, first_token=7)
    assert isinstance(ntk, RopeScaling) and ntk.kind == "ntk" and ntk.factor == 2.0 and ntk.train_len == 16
    freeze = LengthPass(0, "freeze", 64).built(16, first_token=7)
    assert isinstance(freeze, Freeze) and freeze.token == 7
    assert isinstance(LengthPass(0, "logn-all", 64).built(16, 7), LogScaling)
    sink = LengthPass(0, "sink-window:8", 64).built(16, 7)
    assert isinstance(sink, Window) and sink.window == 8 and sink.sinks == 1


@pytest.mark.parametrize("profiles", [True, False])
def test_statistics_by_name(profiles):
    cfg = settled(interventions=["logn-all", "sink-window:8", "freeze", "ntk:4"], intervention_profiles=profiles,
                  maps=True, map_layers=[0])
    model = build("llama", max_position_embeddings=16)
    stats = {p.intervention: statistics_for(p, cfg, model, groups=4) for p in plan_passes(cfg)}
    none = stats["none"]
    assert none.profile is not None and none.maps is not None and none.listed() == [none.loss, none.profile,
                                                                                    none.maps]
    assert none.loss.edges == [1, 16, 32, 64] and none.loss.sums.groups == 4
    for spec in ("logn-all", "sink-window:8"):  # they change the softmax's denominator or the keys it sums over
        assert (stats[spec].profile is not None) == profiles and stats[spec].maps is None
    for spec in ("freeze", "ntk:4"):  # measured by their loss alone
        assert stats[spec].listed() == [stats[spec].loss]
    short = statistics_for(LengthPass(0, "ntk", 32, 2.0, per_length=True), cfg, model, 4)
    assert short.loss.edges == [1, 16, 32]


def test_maps_length_is_checked_by_a_plain_function():
    dynamic = build("llama", max_position_embeddings=16,
                    rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    check_maps_length(dynamic, 16)  # up to max_position_embeddings: nothing to check
    with pytest.raises(UsageError, match="rope_type dynamic") as e:
        check_maps_length(dynamic, 48)
    assert "\n" not in str(e.value)
    check_maps_length(build("llama", max_position_embeddings=16), 48)  # default RoPE: computed on the fly


def test_run_pass_takes_batches_of_one_length():
    """An intervention may change the model for a length (ntk, yarn: factor T / L), so a pass is of one length."""
    hm = HookedModel(build("llama", max_position_embeddings=16))
    with pytest.raises(UsageError, match=r"one length .* got lengths \[8, 12\]"):
        run_pass(hm, [PositionLoss([1, 8])], [token_batch(1, 8), token_batch(1, 12)], parse("ntk", 8))
