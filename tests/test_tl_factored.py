"""TransformerLens's FactoredMatrix, model.OV / model.QK and model.blocks[l] on poslens's HookedModel.

The Main Demo's weight idioms (tests/tl_demo.py's weights_demo: the toy FactoredMatrix, the eigenvalue copying score of
every head, the full OV circuit of the most copying head, the blocks' weights and a hook added through
`model.blocks[l].attn.hook_pattern`) give TransformerLens 3.9's results on the same unprocessed weights
(tests/reference/tl39_weights.json, made once by tests/reference/make_tl_demo_reference.py --weights), within
test_tl_demo's TOLERANCE (1e-4 of the largest |value|, or of 1): the weights are the same tensors, the eigenvalues come
from the same mdim x mdim products; the singular values here come from QR factorizations and TransformerLens's from
SVDs of the factors (both float32: they differ by about 1e-6 of the largest), and the forwards round differently
through 30 layers (about 1e-5). Beside that, each FactoredMatrix operation against the formed product in float64
(tolerance 1e-9 relative: float64 rounding of products of 64-wide factors is about 1e-14)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import tl_demo
import torch
from test_tl_demo import TOLERANCE, _agree, _json

from poslens.engine.activation_cache import NoEquivalent
from poslens.engine.factored import FactoredMatrix
from poslens.errors import UsageError

REFERENCE = json.loads((Path(__file__).parent / "reference" / "tl39_weights.json").read_text())


@pytest.fixture(scope="module")
def hooked(smollm2):
    from poslens.engine.hooks import HookedModel

    model, tokenizer, _ = smollm2
    return HookedModel(model, tokenizer)


@pytest.mark.slow
def test_weights_demo_gives_transformer_lens_results(hooked):
    worst: list = []
    got = _json(tl_demo.weights_demo(hooked, FactoredMatrix))
    _agree(got, REFERENCE["weights_demo"], "weights_demo", worst)
    assert worst and max(worst)[0] <= TOLERANCE and not math.isnan(max(worst)[0])


def test_weights_demo_meanings():
    """What the reference itself shows: grouped-query K repeated over each key head's 3 query heads, the copying
    score in [-1, 1] with the most copying head near 1 and its full OV circuit mapping most sampled tokens to
    themselves, the per-head outputs summing to attn_out (float32 rounding)."""
    ref = REFERENCE["weights_demo"]
    assert all(ref["gqa_repeat"]) and ref["block_shapes"]["_W_K"] == [3, 576, 64] and ref["block_shapes"]["W_K"] == [
        9, 576, 64]
    scores = ref["ov_copying_score"]
    assert len(scores) == 270 and all(-1 <= s <= 1 for s in scores) and max(scores) > 0.95
    assert ref["full_ov_top1"] > 0.5
    assert ref["head_outputs_sum_to_attn_out"] < 1e-4


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-9) -> None:
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
    assert err <= tol, f"{what}: relative difference {err:.3g}"


def test_factored_matrix_against_its_product():
    g = torch.Generator().manual_seed(1)
    A, B = torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, 6, generator=g,
                                                                                dtype=torch.float64)
    f, M = FactoredMatrix(A, B), A @ B
    assert f.shape == M.shape and (f.ldim, f.mdim, f.rdim, f.ndim) == (7, 4, 6, 4)
    _close(f.AB, M, "AB")
    _close(f.T.AB, M.transpose(-2, -1), "T")
    U, S, V = f.svd()
    _close(S, torch.linalg.svdvals(M)[..., :4], "singular values")
    _close(U @ torch.diag_embed(S) @ V.transpose(-2, -1), M, "U S V^T")
    _close(f.norm(), M.norm(dim=(-2, -1)), "norm")
    _close(f.make_even().AB, M, "make_even")
    _close(f.collapse_r() @ V.transpose(-2, -1), M, "collapse_r")
    _close(U @ f.collapse_l(), M, "collapse_l")
    _close(f[1, 2].AB, M[1, 2], "leading index")
    _close(f[1, 2, 3:5].AB, M[1, 2, 3:5], "rows")
    _close(f[1, 2, 3, -1].AB, M[1, 2, 3:4, -1:], "an integer row and column keep their dimensions")
    _close(f.unsqueeze(0).AB, M.unsqueeze(0), "unsqueeze")
    _close((f * 2.5).AB, 2.5 * M, "scalar")
    C, v, w = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((6, 9), (6,), (7,)))
    _close((f @ C).AB, M @ C, "@ matrix")
    _close(f @ v, M @ v, "@ vector")
    _close(w @ f, w @ M, "vector @")
    _close((C.T[:, :6] @ FactoredMatrix(A, B)[0, 0, :6]).AB, C.T[:, :6] @ M[0, 0, :6], "matrix @")
    square = FactoredMatrix(A[0], torch.randn(3, 4, 7, generator=g, dtype=torch.float64))
    _close((square @ square).AB, square.AB @ square.AB, "@ FactoredMatrix")
    ev = square.eigenvalues  # [3, 4]: the nonzero eigenvalues of the rank-4 7 x 7 product
    full = torch.linalg.eigvals(square.AB)
    for i in range(3):
        big = full[i][full[i].abs().argsort(descending=True)[:4]]
        assert torch.allclose(ev[i][ev[i].abs().argsort(descending=True)].abs(), big.abs(), rtol=1e-9)
        assert abs(complex(ev[i].sum() - full[i].sum())) < 1e-9 * float(full[i].abs().sum())
    _close(square.get_corner(2), square.AB[..., :2, :2][:2], "get_corner")


@pytest.mark.parametrize("bad,match", [
    (lambda: FactoredMatrix(torch.ones(3, 4), torch.ones(5, 2)), "must equal"),
    (lambda: FactoredMatrix(torch.ones(2, 3, 4), torch.ones(3, 4, 2)), "do not broadcast"),
    (lambda: FactoredMatrix(torch.ones(3, 4), torch.ones(4, 5)).BA, "square"),
    (lambda: FactoredMatrix(torch.ones(3, 4), torch.ones(4, 5))[0, 0, 0], "at most 2"),
    (lambda: FactoredMatrix(torch.ones(3, 4), torch.ones(4, 5)) @ torch.ones(4, 2), "rdim"),
    (lambda: FactoredMatrix(torch.ones(3, 4), torch.ones(4, 5)) * torch.ones(2), "scalar"),
])
def test_factored_matrix_bad_input_in_one_line(bad, match):
    with pytest.raises(UsageError, match=match) as err:
        bad()
    assert "\n" not in str(err.value)


def test_ov_qk_and_blocks_are_the_models_weights(hooked):
    """model.OV[l, h] is W_V[l, h] @ W_O[l, h] and QK W_Q @ W_K^T; blocks[l]'s weights are views of the parameters
    (TransformerLens's are the parameters: an in-place edit reaches the model); its hook points add hooks."""
    l, h = 5, 7
    assert torch.equal(hooked.OV[l, h].AB, hooked.W_V[l, h] @ hooked.W_O[l, h])
    assert torch.equal(hooked.QK[l, h].AB, hooked.W_Q[l, h] @ hooked.W_K[l, h].T)
    blk, layer = hooked.blocks[l], hooked.layers[l]
    assert torch.equal(blk.attn.OV[h].AB, hooked.OV[l, h].AB) and len(hooked.blocks) == hooked.n_layers
    attn = layer.self_attn
    for view, param in ((blk.attn.W_Q, attn.q_proj.weight), (blk.attn._W_K, attn.k_proj.weight),
                        (blk.attn.W_O, attn.o_proj.weight), (blk.mlp.W_in, layer.mlp.up_proj.weight),
                        (blk.mlp.W_gate, layer.mlp.gate_proj.weight), (blk.mlp.W_out, layer.mlp.down_proj.weight),
                        (blk.ln1.w, layer.input_layernorm.weight), (blk.ln2.w, layer.post_attention_layernorm.weight)):
        assert view.data_ptr() == param.data_ptr() and view.numel() == param.numel()
    assert torch.equal(blk.attn.W_Q[2], attn.q_proj.weight[128:192].T)  # head 2's rows of q_proj, [d_model, d_head]
    assert torch.equal(hooked.blocks[-1].attn.W_V, hooked.W_V[-1])
    x = torch.randn(2, 3, hooked.cfg.d_model)
    assert torch.equal(blk.ln1(x), layer.input_layernorm(x))

    tokens = hooked.to_tokens("The causal mask encodes position.")
    with torch.no_grad():
        plain = hooked(tokens)
        point = blk.attn.hook_z
        assert point.name == f"blocks.{l}.attn.hook_z"
        point.add_hook(lambda z, hook: z.mul_(0))
        ablated = hooked(tokens)
        point.remove_hooks()
        again = hooked(tokens)
    assert not torch.equal(ablated, plain) and torch.equal(again, plain)


@pytest.mark.parametrize("code", ["model.blocks[0].attn.rotary_sin", "model.blocks[0].ln1.b",
                                  "model.blocks[0].attn.hook_foo", "model.blocks[0](None)", "model.blocks[0].ln3",
                                  "model.blocks[0].mlp.W_foo"])
def test_blocks_without_equivalent_fail_in_one_line(hooked, code):
    with pytest.raises(NoEquivalent) as err:
        eval(code, {"model": hooked})
    assert "\n" not in str(err.value) and "no" in str(err.value), str(err.value)


def test_blocks_index_out_of_range(hooked):
    with pytest.raises(UsageError, match="30 layers"):
        hooked.blocks[30]
