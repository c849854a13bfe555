"""The length statistics on tiny random models: the loss against transformers' own, attention entropy and key-0
share against the eager attention weights, causality, and what the mathematics predicts for uniform and planted
attention with and without the log-n scale."""

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import FAMILIES, build, token_batch

from poslens.analyses.length import AttentionProfile, PositionLoss, doubling_edges, parse, run_pass
from poslens.analyses.length.attention import SUPPORT
from poslens.analyses.length.masks import model_mask
from poslens.analyses.length.points import key_point, query_point
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError


def _run(hm, stats, ids, hooks=None, **kwargs):
    """One batch through `hm` with the statistics' readers after `hooks` (group 0)."""
    merged = {k: list(v) for k, v in (hooks or {}).items()}
    for s in stats:
        s.group = 0
        s.begin_batch(ids, None)
        for k, fn in s.hooks(hm).items():
            merged.setdefault(k, []).append(fn)
    hm.run(ids, kwargs.pop("attention_mask", None), hooks=merged, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_is_transformers_loss(family):
    # float32 logits and float64 sums against transformers' float32 mean: agreement to float32 rounding (1e-5)
    model = build(family)
    ids = token_batch(4, 24, seed=1)
    stat = PositionLoss([1, 8, 16, 24], groups=2, chunk_bytes=4 * 2 * 256 * 5)  # blocks of 5 positions
    run_pass(HookedModel(model), [stat], list(ids.split(2)))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
        per_token = F.cross_entropy(out.logits[:, :-1].double().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    tokens = torch.tensor([7.0, 8.0, 8.0])
    pooled = float((stat.buckets().value * tokens).sum() / tokens.sum())
    assert pooled == pytest.approx(float(out.loss), rel=1e-5)
    curve = stat.curve()
    assert torch.isnan(curve.value[0])
    torch.testing.assert_close(curve.value[1:], per_token.view(4, 23).mean(0), rtol=0, atol=2e-5)
    assert bool((curve.lo[1:] <= curve.value[1:]).all() and (curve.value[1:] <= curve.hi[1:]).all())


def test_loss_curve_is_causal():
    # the loss at target t depends on tokens <= t only: the curve at T is the first T positions of the curve at 2T
    hm = HookedModel(build("llama"))
    ids = token_batch(2, 32, seed=2)
    short, long = PositionLoss([1, 16]), PositionLoss([1, 16, 32])
    _run(hm, [short], ids[:, :16])
    _run(hm, [long], ids)
    torch.testing.assert_close(short.curve().value[1:], long.curve().value[1:16], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family,n", [("llama", 20), ("phi3", 20), ("gemma3", 20), ("gemma2", 20), ("llama", 150),
                                      ("gemma3", 150)])
def test_attention_profile_matches_eager_weights(family, n):
    # windows (gemma3, gemma2), softcap (gemma2), partial RoPE (phi3): float32 agreement with the eager softmax;
    # at 150 tokens the queries are read in CPU blocks of 64 (poslens.engine.capture.chunk_rows), each to its last key
    model = build(family)  # 1,024 positions
    ids = token_batch(2, n, seed=3)
    stat, strided = AttentionProfile(groups=2), AttentionProfile(groups=2, every=3)
    run_pass(HookedModel(model), [stat, strided], list(ids.split(1)))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True).attentions
    p = torch.stack(att).double()  # [L, B, H, T, T]
    ent = -(p * torch.where(p > 0, p.log(), 0.0)).sum(-1).mean((1, 2))
    res = stat.result()
    torch.testing.assert_close(res["entropy"], ent, rtol=0, atol=2e-5)
    torch.testing.assert_close(res["key0"], p[..., 0].mean((1, 2)), rtol=0, atol=2e-6)
    visible = torch.log((p > 0).sum(-1).double().clamp(min=1)).mean((1, 2))  # keys seen (window included)
    torch.testing.assert_close(res["log_keys"], visible, rtol=0, atol=1e-12)
    for q in ("entropy", "key0", "gap"):  # each interval within its range: H and the gap >= 0, a share in [0, 1]
        low, high = SUPPORT[q]
        lo, hi = res[f"{q}_lo"], res[f"{q}_hi"]
        assert stat.estimate(q).support == (low, high) and bool((lo[~lo.isnan()] >= low).all()), q
        assert bool((hi[~hi.isnan()] <= high).all()), q
    every = strided.result()["entropy"]
    torch.testing.assert_close(every[:, ::3], res["entropy"][:, ::3], rtol=0, atol=1e-12)
    assert bool(torch.isnan(every[:, 1::3]).all())


def _uniform_llama(seq):
    model = build("llama", num_hidden_layers=2, max_position_embeddings=seq)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()  # every score 0: attention uniform over the keys seen
    return HookedModel(model)


@pytest.mark.parametrize("spec", ["none", "logn", "logn-all"])
def test_log_scaling_keeps_uniform_attention_at_log_keys(spec):
    # a row of equal scores stays equal when multiplied by lambda_i (even lambda_0 = 0): H_i = log(i + 1) exactly,
    # so the gap to log(i + 1) is 0 at every evaluation length n = L, 2L, 4L, 8L
    train = 8
    hm = _uniform_llama(train)
    iv = parse(spec, train)
    for n in (train, 2 * train, 4 * train, 8 * train):
        stat = AttentionProfile()
        run_pass(hm, [stat], [token_batch(1, n, seed=n)], iv)
        res = stat.result()
        logn = torch.log1p(torch.arange(n, dtype=torch.float64))
        torch.testing.assert_close(res["log_keys"], logn.expand(2, n), rtol=0, atol=1e-12)
        assert float(res["gap"].abs().max()) < 2e-6


@pytest.mark.parametrize("clamp", [True, False])
def test_log_scaling_on_a_planted_sink_follows_the_closed_form(clamp):
    # plant q_i = c e_1 at every query and k_0 = c e_1, k_j = 0 (j > 0): row i has key 0 at margin Delta above i
    # equal keys. With the scale a_i = lambda_i Delta: p_i0 = e^a / (e^a + i), H_i = log(e^a + i) - a p_i0.
    # At Delta = log L, lambda_i = log(i + 1) / log L gives e^a = i + 1: p_i0 = (i + 1) / (2i + 1) -> 1/2 at any n,
    # where the unscaled share L / (L + i) fades.
    train, n = 16, 128
    hm = HookedModel(build("llama", num_hidden_layers=1, max_position_embeddings=train))
    layer = hm.model.model.layers[0].self_attn
    delta = math.log(train)
    c = math.sqrt(delta / layer.scaling)
    qname, _ = query_point(hm, 0)
    kname, kaxis = key_point(hm, 0)

    def plant_q(q, ctx):
        out = torch.zeros_like(q)
        out[..., 0] = c
        return out

    def plant_k(k, ctx):
        out = torch.zeros_like(k)
        out.select(kaxis, 0)[..., 0] = c
        return out

    ids = token_batch(1, n, seed=4)
    with parse("logn" if clamp else "logn-all", train).applied(hm, ids) as p:
        stat = AttentionProfile()
        _run(hm, [stat], ids, hooks={qname: [plant_q] + p.hooks[qname], kname: [plant_k]})
    i = torch.arange(n, dtype=torch.float64)
    lam = torch.log1p(i) / math.log(train)
    a = (lam.clamp(min=1.0) if clamp else lam) * delta
    p0 = torch.exp(a) / (torch.exp(a) + i)
    res = stat.result()
    torch.testing.assert_close(res["key0"][0], p0, rtol=0, atol=2e-6)
    torch.testing.assert_close(res["entropy"][0], torch.log(torch.exp(a) + i) - a * p0, rtol=0, atol=1e-5)
    if not clamp:
        torch.testing.assert_close(p0, (i + 1) / (2 * i + 1), rtol=1e-12, atol=0)


def test_ntk_factor_one_is_the_identity():
    hm = HookedModel(build("llama"))
    ids = token_batch(2, 40, seed=5)
    before = [b.clone() for b in hm.model.model.rotary_emb.buffers()]
    with torch.no_grad():
        ref = hm.model(input_ids=ids).logits
    with parse("ntk:1", 8).applied(hm, ids):
        with torch.no_grad():
            out = hm.model(input_ids=ids).logits
    assert torch.equal(out, ref)
    with parse("ntk:4", 8).applied(hm, ids):
        with torch.no_grad():
            assert not torch.equal(hm.model(input_ids=ids).logits, ref)
    assert all(torch.equal(a, b) for a, b in zip(before, hm.model.model.rotary_emb.buffers()))


def test_ntk_frequencies_equal_transformers_dynamic_ntk():
    # static NTK at factor F is transformers' dynamic NTK (factor 1) at F times the length: an independent formula
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = build("llama", max_position_embeddings=32)
    rotary = model.model.rotary_emb
    inv, att = parse("ntk:8", 32).frequencies(rotary, 8.0)
    cfg = model.config.__class__(**{**model.config.to_dict(),
                                    "rope_parameters": {"rope_type": "dynamic", "factor": 1.0, "rope_theta": 10000.0}})
    ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, None, seq_len=8 * 32)
    torch.testing.assert_close(inv, ref, rtol=1e-6, atol=0)
    d = 2 * inv.numel()
    closed = (10000.0 * 8 ** (d / (d - 2))) ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    torch.testing.assert_close(inv.double(), closed, rtol=1e-6, atol=0)
    assert att == 1.0


def test_yarn_uses_transformers_yarn():
    model = build("gemma3")  # per-layer-type rotary parameters
    hm = HookedModel(model)
    ids = token_batch(1, 48, seed=6)
    rot = model.model.rotary_emb
    saved = {k: v.clone() for k, v in rot.named_buffers()}
    with parse("yarn:4", 12).applied(hm, ids):
        assert rot.full_attention_attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
        assert not torch.equal(rot.full_attention_inv_freq, saved["full_attention_inv_freq"])
    assert rot.full_attention_attention_scaling == 1.0
    assert all(torch.equal(v, saved[k]) for k, v in rot.named_buffers())


def test_nope_loss_does_not_depend_on_position_offsets():
    # a NoPE model reads no position: shifting every position id by K (past max_position_embeddings) changes
    # nothing when the causal mask is passed explicitly (exactly: the same operations on the same numbers). With
    # a jump in the position ids and no mask, transformers would cut the sequence into packed pieces.
    model = build("smollm3", no_rope_layers=[0, 0, 0], max_position_embeddings=16)
    hm = HookedModel(model)
    ids = token_batch(2, 48, seed=7)
    mask = model_mask(model, 48)
    curves = []
    for offset in (0, 5000):
        stat = PositionLoss([1, 48])
        pos = (torch.arange(48) + offset)[None].expand(2, -1)
        _run(hm, [stat], ids, attention_mask=mask, position_ids=pos)
        curves.append(stat.curve().value)
    assert torch.equal(curves[0][1:], curves[1][1:])
    jump = torch.cat([torch.arange(24), torch.arange(24) + 1000])[None].expand(2, -1)
    masked, packed = PositionLoss([1, 48]), PositionLoss([1, 48])
    _run(hm, [masked], ids, attention_mask=mask, position_ids=jump)
    _run(hm, [packed], ids, position_ids=jump)
    assert torch.equal(masked.curve().value[1:], curves[0][1:])
    assert not torch.allclose(packed.curve().value[25:], curves[0][25:])


def test_window_masks_keys_past_w_on_top_of_the_models_own():
    # gemma3: layers 0 and 2 slide with window 12; a window of 20 binds the full layer only
    model = build("gemma3")
    stat = AttentionProfile()
    run_pass(HookedModel(model), [stat], [token_batch(1, 40, seed=8)], parse("window:20", 10))
    seen = stat.result()["log_keys"]
    i = torch.arange(40, dtype=torch.float64)
    torch.testing.assert_close(seen[0], torch.log(torch.clamp(i + 1, max=12)), rtol=0, atol=1e-12)
    torch.testing.assert_close(seen[1], torch.log(torch.clamp(i + 1, max=20)), rtol=0, atol=1e-12)
    assert float(stat.result()["key0"][1, 20:].abs().max()) == 0.0


def test_the_sink_window_keeps_key0_and_the_last_keys_on_top_of_the_models_own():
    """sink-window:W keeps key 0 and the last W - 1 keys: a query sees at most W keys, as under window:W, and the
    one key that differs is key 0 (shown by the keys counted and the share on key 0 past W). On gemma3 (layers 1 and
    3 slide with a window of 12, layer 2 global) the sliding layers keep their own window, key 0 hidden past it."""
    model = build("gemma3")
    ids = [token_batch(1, 40, seed=8)]
    sink, plain = AttentionProfile(), AttentionProfile()
    run_pass(HookedModel(model), [sink], ids, parse("sink-window:20", 10))
    run_pass(HookedModel(model), [plain], ids, parse("window:20", 10))
    i = torch.arange(40, dtype=torch.float64)
    seen = sink.result()["log_keys"]
    torch.testing.assert_close(seen[0], torch.log(torch.clamp(i + 1, max=12)), rtol=0, atol=1e-12)
    torch.testing.assert_close(seen[1], torch.log(torch.clamp(i + 1, max=20)), rtol=0, atol=1e-12)
    assert float(sink.result()["key0"][1, 20:].min()) > 0.0 == float(plain.result()["key0"][1, 20:].abs().max())
    assert float(sink.result()["key0"][0, 12:].abs().max()) == 0.0  # a sliding layer's own window still hides it


def test_the_sink_window_loss_is_transformers_loss_under_the_same_mask():
    """The loss under sink-window:W equals transformers' own loss of the model run with the mask built by hand
    (key 0 and keys i - j < W - 1), to float32 rounding (2e-5); with W past the sequence it is the model's own."""
    model = build("llama")
    ids = token_batch(2, 24, seed=3)
    i, j = torch.arange(24)[:, None], torch.arange(24)[None, :]
    allowed = (j <= i) & ((i - j < 8 - 1) | (j == 0))
    stat, whole, base = PositionLoss([1, 8, 24]), PositionLoss([1, 8, 24]), PositionLoss([1, 8, 24])
    run_pass(HookedModel(model), [stat], [ids], parse("sink-window:8", 8))
    run_pass(HookedModel(model), [whole], [ids], parse("sink-window:30", 8))
    run_pass(HookedModel(model), [base], [ids])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=allowed[None, None].expand(2, 1, 24, 24)).logits
        per_token = F.cross_entropy(logits[:, :-1].double().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    torch.testing.assert_close(stat.curve().value[1:], per_token.view(2, 23).mean(0), rtol=0, atol=2e-5)
    torch.testing.assert_close(whole.curve().value[1:], base.curve().value[1:], rtol=0, atol=2e-5)
    assert not torch.allclose(stat.curve().value[8:], base.curve().value[8:], rtol=0, atol=1e-3)
    with pytest.raises(UsageError):
        parse("sink-window:1", 8)  # key 0 alone: no recent key left


def test_freeze_makes_the_model_blind_to_the_first_token():
    # freeze writes position 0's embedding and every layer's output from a one-token run of the reference: all later
    # positions then compute exactly what they compute after the reference token (a no-op when it is already there)
    from poslens.analyses.length.interventions import Freeze

    hm = HookedModel(build("qwen2"))
    ids = token_batch(4, 24, seed=9)
    ids[:, 0] = 1  # a BOS
    other = ids.clone()
    other[:, 0] = token_batch(4, 1, seed=10)[:, 0]
    edges = doubling_edges(8, 24)
    base, same, moved, free = (PositionLoss(edges, groups=2) for _ in range(4))
    run_pass(hm, [base], list(ids.split(2)))
    run_pass(hm, [same], list(ids.split(2)), Freeze(1))
    run_pass(hm, [moved], list(other.split(2)), Freeze(1))
    run_pass(hm, [free], list(other.split(2)))
    for stat in (same, moved):
        torch.testing.assert_close(stat.curve().value[1:], base.curve().value[1:], rtol=0, atol=1e-5)
    assert not torch.allclose(free.curve().value[1:], base.curve().value[1:], rtol=0, atol=1e-3)


def test_bad_specs_and_inapplicable_interventions_are_one_line_errors():
    for spec in ("ntk:x", "logn:3", "shift", "yarn:0.5"):
        with pytest.raises(UsageError) as e:
            parse(spec, 8)
        assert "\n" not in str(e.value)
    nope = HookedModel(build("smollm3", no_rope_layers=[0, 0, 0]))
    with pytest.raises(UsageError, match="no RoPE layer"):
        run_pass(nope, [], [token_batch(1, 8)], parse("ntk", 8))
    with pytest.raises(UsageError, match="right padding"):
        PositionLoss([1, 4]).begin_batch(token_batch(1, 4), torch.tensor([[0, 1, 1, 1]]))
