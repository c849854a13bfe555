"""StableLM (stablelm-2-1.6b, stablelm-3b-4e1t, stablelm-zephyr): Llama's block with LayerNorms (weight and bias) and
RoPE on a quarter of each head. TransformerLens 3.9 has no StableLM; every point is checked against the float64
recomputation of tests/test_hooks.py and the bit-identical forwards of the family-parametrised tests. Here: the
partial rotation, the records, and the forms refused."""

from __future__ import annotations

import pytest
import torch
from test_alibi import assert_config_refused
from tiny_models import build, config, token_batch

from poslens.engine.families import family_of
from poslens.engine.hooks import HookedModel
from poslens.engine.pe import PositionalEncoding
from poslens.errors import UsageError


@torch.no_grad()
def test_rope_turns_the_first_quarter_of_each_head_and_leaves_the_rest():
    """attn.hook_rot_q and hook_rot_k equal hook_q and hook_k (after the bias) in each head's last 12 of 16 dimensions,
    bit for bit, and differ in the first 4 (past position 0, where the rotation is the identity); run.json's record
    says partial-rope with the factor, hm.cfg.rotary_dim 4."""
    model = build("stablelm")
    hm = HookedModel(model)
    _, cache = hm.run_with_cache(token_batch(2, 9, seed=4))
    for l in range(hm.n_layers):
        for part in ("q", "k"):
            plain, rot = cache[f"blocks.{l}.attn.hook_{part}"], cache[f"blocks.{l}.attn.hook_rot_{part}"]
            assert torch.equal(rot[..., 4:], plain[..., 4:])
            assert torch.equal(rot[:, 0], plain[:, 0]) and not torch.allclose(rot[:, 1:, :, :4], plain[:, 1:, :, :4])
    record = PositionalEncoding.of(model).record()
    assert record["layers"] == ["partial-rope"] * 3 and hm.cfg.rotary_dim == 4
    assert hm.cfg.normalization_type == "LN"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"use_parallel_residual": True}, "StableLM with use_parallel_residual=True is not supported yet"),
    ({"qk_layernorm": True}, "StableLM with qk_layernorm=True (a LayerNorm of each head's q and k, stablelm-2-12b)"),
])
def test_the_forms_not_built_are_refused_in_one_line(overrides, message, tmp_path, capsys):
    """The parallel residual and the per-head q/k LayerNorms: refused by the registry and by the command line (exit 2,
    one line, nothing written); the serial form without them is supported."""
    with pytest.raises(UsageError) as info:
        family_of(config("stablelm", **overrides))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert family_of(config("stablelm")).name == "StableLM"
    assert_config_refused("stablelm", overrides, message, tmp_path, capsys)
