"""Cohere (Command-R, Aya-23) and Cohere2 (Command-R7B): one LayerNorm without a bias (computed in float32) before a
parallel attention and gated SiLU MLP, summed (x + attn) + mlp; RoPE on interleaved pairs of dimensions; the LM head's
logits times logit_scale; Cohere2 applies RoPE in its sliding-window layers only (none in the full-attention ones).
TransformerLens 3.9 has neither; checked here against a float64 recomputation of every point of every layer from the
model's weights (Command-R+'s per-head q/k LayerNorms too), the positional encoding recorded, and the held-out
loss's logits. The
family-parametrised tests (bit-identical forwards, maps against a float64 reference, padded batches, cached
generation, in-place edits, the analyses end to end) run on both."""

from __future__ import annotations

import pytest
import torch
from test_hooks import _assert_matches, _linear
from tiny_models import build, heads_summed_twin, token_batch

from poslens.analyses.length.loss import lm_logits
from poslens.engine.families import positional_encoding_record, sliding_windows
from poslens.engine.hooks import HookedModel


def _norm(prefix: str, module, x, ref: dict, flat: bool = False):
    """Cohere's LayerNorm in float64 with TransformerLens's points: centred, scale sqrt(var + eps), the gain, no
    bias (q/k norms: over each head's D entries with the head's gain [H, D], TransformerLens's [B*T*heads, .])."""
    c = x - x.mean(-1, keepdim=True)
    scale = (c.pow(2).mean(-1, keepdim=True) + module.variance_epsilon).sqrt()
    out = c / scale * module.weight.double()
    for point, t in (("hook_scale", scale), ("hook_normalized", c / scale), ("hook_out", out)):
        ref[f"{prefix}.{point}"] = t.reshape(-1, t.shape[-1]) if flat else t
    return out


@torch.no_grad()
def _model(family: str, **overrides):
    """The tiny model with every Cohere LayerNorm's gain random around 1 (a fresh model's are 1)."""
    model = build(family, **overrides)
    g = torch.Generator().manual_seed(1)
    for module in model.modules():
        if type(module).__name__.endswith("LayerNorm"):
            module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=g))
    return model


def _rotate_pairs(x, theta: float, pos):
    """RoPE on interleaved pairs (2i, 2i + 1) of x [B, T, heads, D], frequencies theta^(-2i / D), written out here."""
    d = x.shape[-1]
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)[None]  # [T, D/2]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)


def _reference(model, l: int, x, rope: bool, window: int) -> dict:
    """Every point of layer l from its input x [B, T, d] (float64), TransformerLens's names and layouts."""
    cfg, blk = model.config, model.model.layers[l]
    attn, mlp = blk.self_attn, blk.mlp
    b, t, _ = x.shape
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    ref = {"hook_resid_pre": x}
    y = _norm("ln1", blk.input_layernorm, x, ref)
    q, k, v = (_linear(y, p).view(b, t, -1, d) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    ref["attn.hook_q"], ref["attn.hook_k"], ref["attn.hook_v"] = q, k, v
    if getattr(attn, "use_qk_norm", False):  # Command-R+'s form: a LayerNorm of each head's q and k
        q = _norm("attn.q_norm", attn.q_norm, q, ref, flat=True)
        k = _norm("attn.k_norm", attn.k_norm, k, ref, flat=True)
    if rope:
        theta = cfg.rope_parameters["rope_theta"]
        q, k = _rotate_pairs(q, theta, torch.arange(t)), _rotate_pairs(k, theta, torch.arange(t))
    ref["attn.hook_rot_q"], ref["attn.hook_rot_k"] = q, k
    k, v = k.repeat_interleave(h // kv, 2), v.repeat_interleave(h // kv, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * d**-0.5
    i, j = torch.arange(t)[:, None], torch.arange(t)[None]
    ok = (j <= i) & ((i - j < window) if window else True)
    s = ref["attn.hook_attn_scores"] = s.masked_fill(~ok, float("-inf"))
    p = ref["attn.hook_pattern"] = torch.softmax(s, -1)
    z = ref["attn.hook_z"] = torch.einsum("bhij,bjhd->bihd", p, v)
    a = ref["attn.hook_out"] = ref["hook_attn_out"] = _linear(z.flatten(-2), attn.o_proj)
    ref["hook_mlp_in"] = x
    y2 = _norm("ln2", blk.input_layernorm, x, ref)  # (TransformerLens's ln2 of a shared norm: ln1 again)
    gate, up = ref["mlp.hook_pre"], ref["mlp.hook_pre_linear"] = _linear(y2, mlp.gate_proj), _linear(y2, mlp.up_proj)
    post = ref["mlp.hook_post"] = torch.nn.functional.silu(gate) * up
    m = ref["mlp.hook_out"] = ref["hook_mlp_out"] = _linear(post, mlp.down_proj)
    ref["hook_resid_post"] = (x + a) + m
    return {f"blocks.{l}.{name}": value for name, value in ref.items()}


@pytest.mark.parametrize(("family", "overrides"), [("cohere", {}), ("cohere2", {}), ("cohere", {"use_qk_norm": True})])
@torch.no_grad()
def test_every_point_equals_a_float64_recomputation_and_reading_keeps_the_logits(family, overrides):
    """Every point of every layer within 2e-5 of its largest value (test_hooks's tolerance) of the recomputation from
    the layer's input; Cohere2's full-attention layer without RoPE (its rot points equal q and k) and its windows;
    Command-R+'s per-head q/k LayerNorms (use_qk_norm); the logits, every point read, those of the eager model with
    W_O's heads summed, bit for bit."""
    model = _model(family, **overrides)
    hm = HookedModel(model)
    ids = token_batch(2, 20, seed=3)
    logits, cache = hm.run_with_cache(ids, hm.points)
    assert torch.equal(logits, heads_summed_twin(model)(input_ids=ids).logits)
    rope = [r == "rope" for r in positional_encoding_record(model)["layers"]]
    windows = sliding_windows(model.config)
    assert (rope, windows) == (([True, False, True], [12, 0, 12]) if family == "cohere2" else ([True] * 3, [0] * 3))
    for l in range(hm.n_layers):
        ref = _reference(model, l, cache[f"blocks.{l}.hook_resid_pre"].double(), rope[l], windows[l])
        _assert_matches({name: cache[name] for name in ref}, ref)
        if not rope[l]:
            assert torch.equal(cache[f"blocks.{l}.attn.hook_rot_q"], cache[f"blocks.{l}.attn.hook_q"])


@pytest.mark.parametrize("family", ["cohere", "cohere2"])
@torch.no_grad()
def test_the_loss_reads_the_logits_times_logit_scale(family):
    """The length analysis's logits from the final norm's output equal the model's (logit_scale 0.25 applied), bit
    for bit; without the scale they would differ by a factor of 4."""
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(2, 10, seed=4)
    logits, cache = hm.run_with_cache(ids, ["unembed.hook_in"])
    assert torch.equal(lm_logits(model, cache["unembed.hook_in"]), logits)
    assert model.logit_scale == 0.25 and not torch.allclose(model.lm_head(cache["unembed.hook_in"]), logits)
