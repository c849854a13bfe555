"""Position 0 on tiny random models through the hook engine; the interventions' write hooks."""

import math

import pytest
import torch
from tiny_models import build, token_batch

from poslens.analyses.leakage import interventions as iv
from poslens.analyses.leakage import position0 as p0
from poslens.engine.families import embedding_scale
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError


def states(hm, ids, hooks=None):
    sink = []
    all_hooks = {k: [v] for k, v in p0.position0_hooks(hm.n_layers, sink).items()}
    for k, v in (hooks or {}).items():
        all_hooks.setdefault(k, []).insert(0, v)
    hm.run(ids, hooks=all_hooks)
    return sink[0]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_position0_state_is_fixed_by_token0(family):
    """Position 0 attends only to itself: with the same first token its state at every layer is the same for
    every input (the spread is 0 up to float32 rounding, < 1e-6), and differs when token 0 differs."""
    hm = HookedModel(build(family))
    ids = token_batch(6, 16, seed=1)
    ids[:, 0] = 1  # a fixed BOS
    fixed = p0.spread(states(hm, ids))
    assert fixed.shape == (hm.n_layers + 1,)
    assert float(fixed.abs().max()) < 1e-6
    varied = ids.clone()
    varied[:, 0] = torch.arange(10, 16)
    assert float(p0.spread(states(hm, varied)).min()) > 1e-3


def test_freeze_imposes_the_reference_trajectory_and_mean_replaces_the_embedding():
    model = build("llama")
    hm = HookedModel(model)
    ids = token_batch(4, 12, seed=2)
    ids[:, 0] = torch.arange(20, 24)
    _, hooks, _ = iv.prepare("freeze", model, hm, ids, reference=ids[1])
    frozen = states(hm, ids, hooks)
    assert float(p0.spread(frozen).abs().max()) < 1e-6
    torch.testing.assert_close(frozen[0], states(hm, ids[1:2])[0], rtol=0, atol=0)
    _, hooks, _ = iv.prepare("mean", model, hm, ids)
    got = states(hm, ids, hooks)[:, 0]
    mean = model.get_input_embeddings().weight.float().mean(0)
    torch.testing.assert_close(got, mean.expand_as(got), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_embedding_replacements_are_written_at_the_models_scale(family):
    """Gemma-2 and Gemma-3 multiply every looked-up embedding row by sqrt(hidden_size) (8 at d = 64) before the
    first layer; Llama by 1. `mean` writes the mean embedding at that scale (its norm is the scaled mean
    embedding's, to float32 rounding, 1e-6 relative) and `token:ID` writes exactly what the model writes for
    token ID (the same value as an unmodified forward of that token at position 0)."""
    model = build(family)
    hm = HookedModel(model)
    expected = math.sqrt(model.config.hidden_size) if family.startswith("gemma") else 1.0
    assert embedding_scale(model) == pytest.approx(expected, rel=1e-7)
    ids = token_batch(3, 10, seed=4)
    weight = model.get_input_embeddings().weight.detach().float()
    torch.testing.assert_close(model.get_input_embeddings()(ids).float(), weight[ids] * embedding_scale(model),
                               rtol=1e-6, atol=0)
    _, hooks, _ = iv.prepare("mean", model, hm, ids)
    got = states(hm, ids, hooks)[:, 0]  # [B, d] position 0 entering the first layer
    scaled_mean = weight.mean(0) * expected
    assert float(got.norm(dim=-1).min()) == pytest.approx(float(scaled_mean.norm()), rel=1e-6)
    torch.testing.assert_close(got, scaled_mean.expand_as(got), rtol=1e-6, atol=1e-7)
    _, hooks, _ = iv.prepare("token:7", model, hm, ids)
    own = ids.clone()
    own[:, 0] = 7
    torch.testing.assert_close(states(hm, ids, hooks)[:, 0], states(hm, own)[:, 0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_patch_from_another_documents_start_writes_its_first_token(family):
    """`patch:start:1@L`: position 0 (a fixed BOS) entering layer L takes the state that the previous sequence's
    first content token has at position 0 when it starts a sequence itself (a real token at the model's scale,
    unlike `mean`): entering layer 0 it is the model's own embedding of that token, entering layer 1 the first
    layer's output for that token alone; every other position is untouched there, and later layers' scores move
    (with a fixed BOS, `patch:other:1@L` would change nothing)."""
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(4, 12, seed=7)
    ids[:, 0] = 1
    firsts = ids.roll(1, 0)[:, 1:2]  # the previous sequence's first content token, alone at position 0
    def read(ids: torch.Tensor, point: str, write=None) -> torch.Tensor:
        got = []
        hm.run(ids, hooks={point: [*([write] if write else []), lambda x, ctx: got.append(x.clone())]})
        return got[0]

    for layer in (0, 1):
        point = f"blocks.{layer}.hook_resid_pre"
        _, hooks, _ = iv.prepare(f"patch:start:1@{layer}", model, hm, ids)
        got, want, plain = read(ids, point, hooks[point]), read(firsts, point), read(ids, point)
        torch.testing.assert_close(got[:, 0], want[:, 0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[:, 1:], plain[:, 1:], rtol=0, atol=0)
        assert not torch.allclose(got[:, 0], plain[:, 0])
    torch.testing.assert_close(states(hm, firsts)[:, 0],  # entering layer 0: the model's own embedding
                               model.get_input_embeddings()(firsts)[:, 0].detach().float(), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(layer2_scores(hm, ids, "patch:start:1@0", model), layer2_scores(hm, ids), atol=1e-4)


def layer2_scores(hm, ids, spec=None, model=None) -> torch.Tensor:
    """Layer 2's scores [B, H, T, T] of a plain forward or under the intervention `spec`."""
    got = []
    run_ids, hooks, pos = (ids, {}, None) if spec is None else iv.prepare(spec, model, hm, ids)
    hm.run(run_ids, hooks={**hooks, "blocks.2.attn.hook_attn_scores": lambda s, ctx: got.append(s.clone())},
           position_ids=pos)
    return got[0]


@pytest.mark.parametrize("spec,tol", [("shift:100", 1e-4), ("freeze", 1e-6), ("patch:other:1@1", 1e-6)])
def test_interventions_true_by_construction_change_nothing(spec, tol):
    """Tests of the code, not findings: RoPE depends on i - j only (moving every position id by 100 changes the
    scores by float32 rounding of angles up to 116 rad, < 1e-4); with a fixed first token position 0's
    trajectory is the same for every input, so freezing it or patching it from another sequence is a no-op
    (float32 rounding, < 1e-6)."""
    model = build("llama")
    hm = HookedModel(model)
    ids = token_batch(4, 16, seed=3)
    ids[:, 0] = 1
    torch.testing.assert_close(layer2_scores(hm, ids, spec, model), layer2_scores(hm, ids), rtol=tol, atol=tol)


def test_sinks_and_bad_specs():
    probs = torch.zeros(2, 3, 8, 8)
    probs[..., 0] = 1.0  # every head all on key 0
    probs[1, 2, 1:, 0] = 0.0
    out = p0.sink_rates(probs, 0.3, tokens=4)
    assert out["rate"] == pytest.approx(5 / 6)
    assert [(h["layer"], h["head"]) for h in p0.sink_heads(out["alpha0"])] == [(0, 0), (0, 1), (0, 2), (1, 0),
                                                                                  (1, 1)]
    for bad in ("bos", "token", "token:x", "mean:3"):
        with pytest.raises(UsageError, match="interventions"):
            iv.parse(bad)


def test_sink_rate_bounds_come_from_the_heads_intervals():
    """The rate counts heads whose attention on key 0 exceeds the threshold; its bounds count the heads whose
    interval lies above it (certainly sinks) and whose interval reaches above it (possibly sinks)."""
    from poslens.analyses.leakage.summary import sink_bounds, sinks
    from poslens.engine.stats import Estimate

    t = lambda *x: torch.tensor([x], dtype=torch.float64)  # noqa: E731  one layer, three heads
    a0 = Estimate(t(0.5, 0.2, 0.31), t(0.4, 0.1, 0.25), t(0.6, 0.35, 0.4), t(0.05, 0.05, 0.03), 8, 0.95, "jackknife")
    s = sinks(a0, a0.value, 0.3, 32)
    assert (s["rate"], s["rate_lo"], s["rate_hi"]) == pytest.approx((2 / 3, 1 / 3, 1.0))
    assert s["rate_64"] is None and [h["head"] for h in s["sink_heads"]] == [1, 3]
    assert "0.333 to 1.000 by the heads' own 95% intervals" in sink_bounds(s)
    assert sink_bounds({"rate": 0.5}) == ""  # a run written before the bounds were recorded
    nan = t(math.nan, math.nan, math.nan)  # one group of sequences: no intervals, so no bounds (not "0 to 0")
    one = sinks(Estimate(a0.value, nan, nan, nan, 1, 0.95, "jackknife"), a0.value, 0.3, 32)
    assert one["rate"] == pytest.approx(2 / 3) and one["rate_lo"] is None and sink_bounds(one) == ""


def test_two_sequences_are_refused_with_the_count_an_interval_needs(tmp_path, capsys):
    """Two sequences in two groups leave one sequence when a group is left out, and the spread compares pairs: the
    leakage command says it needs 3 or more (one line, exit 2, nothing written) instead of "at least 2 sequences, got
    1" for the 2 it was given; 3 run."""
    from test_family_runs import _saved

    from poslens import cli

    spec = _saved("llama", tmp_path / "m")
    args = ["leakage", spec, "--seq-len", "16", "--early-queries", "8", "--batch-size", "1", "--quiet",
            "--no-figures"]
    out = tmp_path / "out"
    assert cli.main([*args, "--num-sequences", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1 left of 2 sequences; raise --num-sequences to 3 or more" in err, err
    assert not out.exists()
    assert cli.main([*args, "--num-sequences", "3", "--out", str(out)]) == 0
