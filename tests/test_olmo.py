"""OLMo (1) (allenai/OLMo-1B-hf, OLMo-7B-hf): Llama's block with LayerNorms that have no weight and no bias
(OlmoLayerNorm, eps 1e-5). TransformerLens 3.9's names and values are tests/test_family_tl.py's (the OLMo entry of
tests/reference/tl39_families.json), the float64 recomputation of every point tests/test_hooks.py's; here what the
parameter-free norm changes: the TransformerLens weights and config, the stack through the final norm, and the
clip_qkv form refused."""

from __future__ import annotations

import pytest
import torch
from test_alibi import assert_config_refused
from tiny_models import build, config, token_batch

from poslens.engine.families import family_of
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError


@torch.no_grad()
def test_the_norms_are_transformer_lens_layer_norms_with_unit_gain_and_zero_bias():
    """hm.cfg says LN with eps 1e-5 (TransformerLens's OLMo entries); every norm's w is ones and b zeros (what
    TransformerLens's conversion writes for the parameter-free norm), and the gain apply_ln_to_stack multiplies by."""
    hm = HookedModel(build("olmo"))
    assert hm.cfg.normalization_type == "LN" and hm.cfg.eps == 1e-5 and not hm.cfg.final_rms
    d = hm.cfg.d_model
    for norm in (hm.blocks[0].ln1, hm.blocks[2].ln2, hm.ln_final):
        assert torch.equal(norm.w, torch.ones(d)) and torch.equal(norm.b, torch.zeros(d))
    assert torch.equal(hm.norm_gain("ln_final"), torch.ones(d))


@torch.no_grad()
def test_the_residual_stack_through_the_final_norm_sums_to_its_output():
    """apply_ln_to_stack on decompose_resid's components (embedding, each attention and MLP output): centred, divided
    by the cached scale, they sum to the final norm's output, unembed.hook_in (1e-5 of its largest value: float32
    sums in another order). Not centring, as an RMSNorm's stack is not, misses by far more."""
    hm = HookedModel(build("olmo"))
    _, cache = hm.run_with_cache(token_batch(2, 10, seed=3), hm.points)
    stack = cache.decompose_resid(layer=hm.cfg.n_layers)
    out = cache["unembed.hook_in"]
    got = cache.apply_ln_to_stack(stack).sum(0)
    assert (got - out).abs().max() <= 1e-5 * out.abs().max()
    uncentred = (stack / cache["ln_final.hook_scale"]).sum(0)
    assert (uncentred - out).abs().max() > 1e-2 * out.abs().max()


def test_clip_qkv_is_refused_in_one_line(tmp_path, capsys):
    """OLMo with clip_qkv (q, k and v clamped in place after their projections) is refused by the registry and by
    the command line (exit 2, one line, nothing written)."""
    message = "OLMo with clip_qkv 8.0 (q, k and v clamped in place after their projections) is not supported yet"
    with pytest.raises(UsageError, match="clip_qkv 8.0"):
        family_of(config("olmo", clip_qkv=8.0))
    assert family_of(config("olmo")).name == "OLMo"
    assert_config_refused("olmo", {"clip_qkv": 8.0}, message, tmp_path, capsys)
