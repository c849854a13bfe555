"""poslens.utils.get_act_name and the ActivationCache methods of the logit lens and direct logit attribution, with
TransformerLens's semantics, checked by the identities they exist for: the accumulated stream's last component through
the final norm and W_U is the logits; the decomposition and the head results (with the remainder) add up to the
stream; the logit attributions of the decomposition add up to the logit difference. Every identity holds exactly in
real arithmetic; the tolerance 2e-5 of the largest |value| covers float32 rounding of the model's forward (a sum of
at most a dozen float32 components, a division by the cached scale)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build, randomize_norm_gains, token_batch

from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError
from poslens.utils import get_act_name


def _close(got, ref, what, tol=2e-5):
    got, ref = got.double(), ref.double()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < tol, f"{what}: relative deviation {err:.2e}"


@pytest.mark.parametrize(("args", "full"), [
    (("resid_pre", 10), "blocks.10.hook_resid_pre"), (("pattern", 0), "blocks.0.attn.hook_pattern"),
    (("attn", 0), "blocks.0.attn.hook_pattern"), (("attn_logits", 2), "blocks.2.attn.hook_attn_scores"),
    (("k6",), "blocks.6.attn.hook_k"), (("scale4ln1",), "blocks.4.ln1.hook_scale"),
    (("scale", 4, "ln1"), "blocks.4.ln1.hook_scale"), (("normalized",), "ln_final.hook_normalized"),
    (("scale",), "ln_final.hook_scale"), (("embed",), "hook_embed"), (("pos_embed",), "hook_pos_embed"),
    (("pre5",), "blocks.5.mlp.hook_pre"), (("mlp_post", 1), "blocks.1.mlp.hook_post"),
    (("attn_out", 3), "blocks.3.hook_attn_out"), (("result", 1), "blocks.1.attn.hook_result"),
    (("q_input", 2), "blocks.2.hook_q_input"), (("mlp_in", 0), "blocks.0.hook_mlp_in"),
    (("rot_q", 1), "blocks.1.attn.hook_rot_q"), (("query", 3), "blocks.3.attn.hook_q"),
    (("z", 0, "a"), "blocks.0.attn.hook_z"), (("resid_mid", 2, "block"), "blocks.2.hook_resid_mid"),
    (("blocks.0.hook_resid_post",), "blocks.0.hook_resid_post"),
])
def test_get_act_name_follows_transformer_lens(args, full):
    assert get_act_name(*args) == full


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@torch.no_grad()
def test_logit_lens_and_attribution_identities(family):
    model = randomize_norm_gains(build(family))
    hm = HookedModel(model)
    ids = token_batch(2, 9, seed=13)
    logits, cache = hm.run_with_cache(ids)
    n = hm.n_layers
    accumulated, labels = cache.accumulated_resid(layer=-1, incl_mid=True, apply_ln=True, return_labels=True)
    assert labels == [f"{l}_{k}" for l in range(n) for k in ("pre", "mid")] + ["final_post"]
    assert accumulated.shape == (2 * n + 1, 2, 9, hm.cfg.d_model)
    head = cache["unembed.hook_out"]  # the logits before Gemma-2's softcap (none here)
    _close(accumulated[-1] @ hm.W_U, head, "logit lens of the final stream = logits")
    _close(accumulated[-1], cache["ln_final.hook_out"] if "ln_final.hook_out" in cache else
           hm.ln_final(cache["resid_post", -1]), "final component through the norm")
    into_1 = cache.accumulated_resid(layer=1, pos_slice=-1)  # the input to layer 1, last position: 0_pre, 1_pre
    assert into_1.shape == (2, 2, hm.cfg.d_model)
    _, own = hm.run_with_cache(ids, ["blocks.1.ln1.hook_out"])
    _close(cache.apply_ln_to_stack(into_1, layer=1, pos_slice=-1)[-1], own["blocks.1.ln1.hook_out"][:, -1],
           "apply_ln_to_stack at layer 1 = ln1's output")
    parts, labels = cache.decompose_resid(return_labels=True)
    assert labels == ["embed"] + [f"{l}_{k}_out" for l in range(n) for k in ("attn", "mlp")]
    _close(parts.sum(0), cache["resid_post", -1], "decomposition adds up to the stream")
    heads, labels = cache.stack_head_results(layer=-1, incl_remainder=True, pos_slice=-1, return_labels=True)
    assert labels[:2] == ["L0H0", "L0H1"] and labels[-1] == "remainder" and heads.shape[0] == n * hm.cfg.n_heads + 1
    _close(heads.sum(0), cache["resid_post", -1][:, -1], "head results and remainder add up to the stream")
    right, wrong = ids[:, -1], ids[:, 0]  # any two tokens per row
    attrs = cache.logit_attrs(parts[:, :, -1], right, wrong, pos_slice=-1)
    diff = head[torch.arange(2), -1, right] - head[torch.arange(2), -1, wrong]
    assert attrs.shape == (len(parts), 2)
    _close(attrs.sum(0), diff, "attributions add up to the logit difference", 1e-4)
    whole = cache.apply_ln_to_stack(cache["resid_post", -1][None], recompute_ln=True)[0]
    _close(whole, hm.ln_final(cache["resid_post", -1]), "recompute_ln = the final norm")
    if family == "llama":  # without Gemma's sandwich norm, a head's result summed = attention's output
        _close(cache.stack_head_results(layer=1).sum(0), cache["attn_out", 0], "heads of layer 0 = attn_out")
    with pytest.raises(UsageError, match="layer must be in"):
        cache.accumulated_resid(layer=n + 1)
