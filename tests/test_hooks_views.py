"""The reading paths that avoid copies: TransformerLens's per-head attention inputs (hook_attn_in, hook_q_input,
hook_k_input, hook_v_input) and hook_mlp_in handed to hooks as a view of the residual stream
(`lazy_copies.LazyCopies`, materialised in place before a hook writes it or takes a view of it), GPT-J's and Phi's ln2
points handed ln1's values, and attn.hook_result (its values and writes, on every family here).

What must hold, exactly (torch.equal, no tolerance: the values are the same floats as before, only where they live
changed): a reader sees resid_pre repeated per head, as `x.unsqueeze(2).repeat(...)` made it, and the logits of a
read-only run are the plain forward's; TransformerLens's in-place idioms (`x[:, :, h] = 0`, `x[:, :, h] += v`,
`x[:, :, h].zero_()` through a view, `add_`, `out=`) take effect on head h's copy only, giving the logits of the same
edit on a returned clone, and never reach the residual stream; attn.hook_result equals the einsum of hook_z with
W_O's rows by head, attention's output (attn.hook_out) is those values summed over the heads plus b_O, bit for bit (as
TransformerLens computes it with use_attn_result; the logits are the model's with W_O so computed, within float32
rounding of the plain forward's), and a write there (in place or returned) moves the logits as the returned clone
does. On Llama
(grouped-query), GPT-NeoX and BLOOM (per-head fused q/k/v), Falcon (multi-query) and GPT-2 (no per-head inputs in
TransformerLens's GPT-2 through poslens: hook_result only)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build, heads_summed_twin, token_batch

from poslens.engine.hooks import HookedModel

INPUT_FAMILIES = ("llama", "gpt_neox", "bloom", "falcon", "gpt_neo", "mpt", "gpt_bigcode")
RESULT_FAMILIES = ("llama", "gpt_neox", "bloom", "falcon", "gpt2", "gpt_neo", "mpt", "gpt_bigcode")


def _keep(into: dict, key: str, copy: bool = True):
    """A reader keeping its value (a copy, or the tensor itself) in into[key]; it returns None."""
    def read(x, ctx):
        into[key] = x.clone() if copy else x

    return read


def _heads(hm: HookedModel, point: str) -> int:
    return hm._heads[1] if point in ("hook_k_input", "hook_v_input") else hm._heads[0]


def _points(hm: HookedModel) -> list[str]:
    return ["hook_q_input", "hook_k_input", "hook_v_input"] + (["hook_attn_in"] if hm._heads[0] == hm._heads[1]
                                                                else [])


@pytest.mark.parametrize("family", INPUT_FAMILIES)
@torch.no_grad()
def test_readers_see_the_repeated_stream_without_a_copy_and_change_nothing(family):
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(2, 9, seed=3)
    plain = model(input_ids=ids, use_cache=False).logits
    seen, strides, resid = {}, {}, {}

    def keep(x, ctx):
        strides[ctx.name] = x.stride()
        seen[ctx.name] = (x.clone(), x[:, :, -1].clone(), x.sum(2))  # a copy, a view's copy, a reduction

    hooks = {f"blocks.{l}.{p}": keep for l in range(hm.n_layers) for p in _points(hm)}
    hooks.update({f"blocks.{l}.hook_resid_pre": (lambda x, ctx: resid.__setitem__(ctx.layer, x.clone()))
                  for l in range(hm.n_layers)})
    logits = hm.run(ids, hooks=hooks, logits=True).logits
    assert torch.equal(logits, plain)  # read only: the model's own projections ran on the stream
    for name, (copy, last, total) in seen.items():
        x = resid[int(name.split(".")[1])]
        heads = _heads(hm, name.split(".")[-1])
        if heads > 1:  # the hook got a broadcast: no per-head copy was made to read it
            assert strides[name][2] == 0, name
        assert torch.equal(copy, x.unsqueeze(2).repeat(1, 1, heads, 1)), name
        assert torch.equal(last, x) and torch.equal(total, x.unsqueeze(2).repeat(1, 1, heads, 1).sum(2)), name


def _edits(hm: HookedModel, width: int):
    """(name, in-place edit, the same edit on a returned clone) of head h's copy; h = 1 where the point has 2 heads."""
    vector = torch.randn(width, generator=torch.Generator().manual_seed(11))

    def head(x):
        return min(1, x.shape[2] - 1)

    def add_clone(x, ctx):
        y = x.clone()
        y[:, :, head(x)] += vector
        return y

    def zero_clone(x, ctx):
        y = x.clone()
        y[:, :, head(x)] = 0
        return y

    def shift_clone(x, ctx):
        return x + vector

    def set_zero(x, ctx):
        x[:, :, head(x)] = 0  # TransformerLens's ablation idiom

    def add(x, ctx):
        x[:, :, head(x)] += vector

    def zero_view(x, ctx):
        x[:, :, head(x)].zero_()  # through a view taken first

    def shift(x, ctx):  # every head (a scale would pass through the norm)
        x.add_(vector)

    def shift_out(x, ctx):
        torch.add(x, vector, out=x)

    return [("x[:, :, h] = 0", set_zero, zero_clone), ("x[:, :, h] += v", add, add_clone),
            ("x[:, :, h].zero_()", zero_view, zero_clone), ("x.add_(v)", shift, shift_clone),
            ("torch.add(x, v, out=x)", shift_out, shift_clone)]


@pytest.mark.parametrize("family", INPUT_FAMILIES)
@torch.no_grad()
def test_in_place_writes_take_effect_on_one_heads_copy_only(family):
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(2, 8, seed=4)
    plain = model(input_ids=ids, use_cache=False).logits
    for point in _points(hm):
        name = f"blocks.1.{point}"
        for what, in_place, clone in _edits(hm, model.config.hidden_size):
            stream = {}  # the residual stream itself ("live"): no write at the copies may reach it
            hooks = {name: in_place, "blocks.1.hook_resid_pre": [_keep(stream, "pre"), _keep(stream, "live", False)]}
            a = hm.run(ids, hooks=hooks, logits=True).logits
            assert torch.equal(stream["live"], stream["pre"]), f"{point}, {what}: the write reached the stream"
            b = hm.run(ids, hooks={name: clone}, logits=True).logits
            assert torch.equal(a, b), f"{point}, {what}"
            assert (a - plain).abs().max() > 1e-4 * plain.abs().max(), f"{point}, {what}: no effect"


@pytest.mark.parametrize("family", INPUT_FAMILIES)
@torch.no_grad()
def test_a_write_reaches_only_its_heads_projection(family):
    """Zeroing key/value head h's copy in place: hook_k's other heads keep the plain forward's values (exactly with one
    thread; within 1e-6 of the largest |k| with more, where the GEMM over the copies splits its work across threads
    otherwise than the model's projection: float32 rounding, while the zeroed head moves by its whole size); head h's
    becomes the projection of ln1(0), i.e. the bias's part (or 0)."""
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(1, 7, seed=5)
    kv = hm._heads[1]
    head = min(1, kv - 1)
    before, after = {}, {}
    hm.run(ids, hooks={"blocks.0.attn.hook_k": _keep(before, "k")})

    def zero(x, ctx):
        x[:, :, head] = 0

    hm.run(ids, hooks={"blocks.0.hook_k_input": zero, "blocks.0.attn.hook_k": _keep(after, "k")})
    others = [h for h in range(kv) if h != head]
    scale = float(before["k"].abs().max())
    if others:  # (Falcon's multi-query form has one key head)
        assert float((after["k"][:, :, others] - before["k"][:, :, others]).abs().max()) <= 1e-6 * scale
    assert float((after["k"][:, :, head] - before["k"][:, :, head]).abs().max()) > 1e-2 * scale


@torch.no_grad()
def test_a_kept_reference_holds_the_values_of_its_point():
    """A hook that keeps the tensor itself (no copy) still reads resid_pre repeated after the forward, and a write to
    it after the run reaches neither the stream nor the other heads."""
    model = build("gpt_neox")
    hm = HookedModel(model)
    ids = token_batch(1, 6, seed=6)
    kept, resid = {}, {}
    hm.run(ids, hooks={"blocks.1.hook_q_input": _keep(kept, "q", copy=False),
                       "blocks.1.hook_resid_pre": _keep(resid, "x", copy=False)})
    x, q = resid["x"], kept["q"]
    copy = x.clone()
    assert torch.equal(q, x.unsqueeze(2).repeat(1, 1, q.shape[2], 1))
    q[:, :, 0] = 7.0
    assert torch.equal(x, copy) and torch.equal(q[:, :, 1], copy) and bool((q[:, :, 0] == 7.0).all())


@pytest.mark.parametrize("family", RESULT_FAMILIES)
@torch.no_grad()
def test_hook_result_is_the_per_head_einsum_and_writes_take_effect(family):
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(2, 9, seed=7)
    plain = model(input_ids=ids, use_cache=False).logits
    got = {}
    hooks = {"blocks.1.attn.hook_z": _keep(got, "z"), "blocks.1.attn.hook_result": _keep(got, "result"),
             "blocks.1.attn.hook_out": _keep(got, "out")}
    logits = hm.run(ids, hooks=hooks, logits=True).logits
    w_o = hm.W_O[1]  # [H, D, d] each head's rows of W_O, TransformerLens's layout
    ref = torch.einsum("bthk,hkd->bthd", got["z"], w_o)
    assert torch.equal(got["result"], ref)
    assert torch.equal(got["out"], got["result"].sum(-2) + hm.b_O[1])  # attention's output: the values read, summed
    assert torch.equal(logits, heads_summed_twin(model, model.config._attn_implementation, layers=(1,))(
        input_ids=ids, use_cache=False).logits)
    assert (logits - plain).abs().max() <= 1e-5 * plain.abs().max()  # W_O's product and the heads' sum: rounding

    def zero(x, ctx):
        x[:, :, 1] = 0

    def zero_clone(x, ctx):
        y = x.clone()
        y[:, :, 1] = 0
        return y

    a, b = (hm.run(ids, hooks={"blocks.1.attn.hook_result": fn}, logits=True).logits for fn in (zero, zero_clone))
    assert torch.equal(a, b) and (a - plain).abs().max() > 1e-4 * plain.abs().max()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@torch.no_grad()
def test_per_head_results_kept_by_a_hook_are_never_overwritten(family):
    """The per-head results are written into the layer before's buffer only when nothing else holds it: values a hook
    kept as they were handed over (the tensor, or a view of one head) still equal, after the forward, the copies taken
    at each layer; a reader that keeps nothing gets the same values and the same logits."""
    model = build(family, num_hidden_layers=4)
    hm = HookedModel(model)
    ids = token_batch(2, 9, seed=4)
    kept, views, copies = {}, {}, {}

    def keep(x, ctx):
        kept[ctx.layer], views[ctx.layer], copies[ctx.layer] = x, x[:, :, 1], x.clone()

    hooks = {f"blocks.{l}.attn.hook_result": keep for l in range(4)}
    logits = hm.run(ids, hooks=hooks, logits=True).logits
    for l in range(4):
        assert torch.equal(kept[l], copies[l]) and torch.equal(views[l], copies[l][:, :, 1]), l
    assert len({kept[l].untyped_storage().data_ptr() for l in range(4)}) == 4  # each its own memory

    only_views = {}  # a hook that keeps one head's view only: that buffer is held, the next layer gets a new one

    def keep_view(x, ctx):
        only_views[ctx.layer] = (x[:, :, 0], x[:, :, 0].clone())

    hm.run(ids, hooks={f"blocks.{l}.attn.hook_result": keep_view for l in range(4)})
    assert all(torch.equal(v, c) for v, c in only_views.values())

    seen = {}

    def reduce(x, ctx):  # keeps a reduction only: the buffer is reused layer after layer
        seen[ctx.layer] = (x.sum().item(), x.untyped_storage().data_ptr())

    again = hm.run(ids, hooks={f"blocks.{l}.attn.hook_result": reduce for l in range(4)}, logits=True).logits
    assert torch.equal(again, logits)
    assert all(seen[l][0] == copies[l].sum().item() for l in range(4))
    assert len({ptr for _, ptr in seen.values()}) == 1


def _last_position_edits(width: int, seed: int):
    """(in place, on a returned clone): a random vector added at the last position of a [B, T, d] value."""
    vector = torch.randn(width, generator=torch.Generator().manual_seed(seed))

    def add(x, ctx):
        x[:, -1] += vector

    def add_clone(x, ctx):
        y = x.clone()
        y[:, -1] += vector
        return y

    return add, add_clone


@pytest.mark.parametrize("family", RESULT_FAMILIES)
@torch.no_grad()
def test_mlp_in_is_read_without_a_copy_and_a_write_reaches_the_mlp_only(family):
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(2, 8, seed=8)
    plain = model(input_ids=ids, use_cache=False).logits
    parallel = hm.family.layout == "parallel"  # GPT-NeoX, Falcon: a copy of resid_pre (no resid_mid)
    source = "blocks.1.hook_resid_pre" if parallel else "blocks.1.hook_resid_mid"
    got = {}
    hooks = {"blocks.1.hook_mlp_in": _keep(got, "in"), source: _keep(got, "stream")}
    assert torch.equal(hm.run(ids, hooks=hooks, logits=True).logits, plain)
    assert torch.equal(got["in"], got["stream"])
    add, add_clone = _last_position_edits(model.config.hidden_size, seed=12)
    stream, out = {}, {}
    a = hm.run(ids, hooks={"blocks.1.hook_mlp_in": add, source: [_keep(stream, "pre"), _keep(stream, "live", False)],
                           "blocks.1.hook_attn_out": _keep(out, "a")}, logits=True).logits
    b = hm.run(ids, hooks={"blocks.1.hook_mlp_in": add_clone, "blocks.1.hook_attn_out": _keep(out, "b")},
               logits=True).logits
    assert torch.equal(stream["live"], stream["pre"])  # the stream itself is untouched
    assert torch.equal(out["a"], out["b"])  # attention (same layer) does not see the MLP's input
    assert torch.equal(a, b) and (a - plain).abs().max() > 1e-4 * plain.abs().max()


@pytest.mark.parametrize("family", ["gptj", "phi"])
@torch.no_grad()
def test_the_shared_norms_ln2_reads_ln1s_values_and_a_write_there_reaches_the_mlp_only(family):
    """GPT-J and Phi: one norm feeds attention and the MLP; TransformerLens's ln2 is that norm again on the MLP's input.
    Read, ln2's points equal ln1's exactly (the same input, the same operations: handed over as LazyCopies, not
    computed twice) and the logits stay the eager forward's; TransformerLens's in-place write at ln2 acts as the
    returned clone, leaves ln1's values (kept by a reader) and attention untouched, and moves the logits."""
    model = build(family)
    hm = HookedModel(model)
    ids = token_batch(2, 8, seed=9)
    names = [f"blocks.1.{n}.{p}" for n in ("ln1", "ln2") for p in ("hook_scale", "hook_normalized", "hook_out")]
    got = {}
    hooks = {n: _keep(got, n) for n in names}
    reference = hm.run(ids, hooks={"blocks.1.hook_resid_pre": _keep(got, "x")}, logits=True).logits
    assert torch.equal(hm.run(ids, hooks=hooks, logits=True).logits, reference)
    for p in ("hook_scale", "hook_normalized", "hook_out"):
        assert torch.equal(got[f"blocks.1.ln2.{p}"], got[f"blocks.1.ln1.{p}"]), p
    add, add_clone = _last_position_edits(model.config.hidden_size, seed=13)
    for point in ("hook_normalized", "hook_out"):
        kept, out = {}, {}
        hooks = {f"blocks.1.ln1.{p}": _keep(kept, p, copy=False) for p in ("hook_scale", "hook_normalized", "hook_out")}
        a = hm.run(ids, hooks={**hooks, f"blocks.1.ln2.{point}": add, "blocks.1.attn.hook_out": _keep(out, "a")},
                   logits=True).logits
        b = hm.run(ids, hooks={f"blocks.1.ln2.{point}": add_clone, "blocks.1.attn.hook_out": _keep(out, "b")},
                   logits=True).logits
        for p in ("hook_scale", "hook_normalized", "hook_out"):  # ln1's tensors, kept by reference: untouched
            assert torch.equal(kept[p], got[f"blocks.1.ln1.{p}"]), (point, p)
        assert torch.equal(out["a"], out["b"]), point
        assert torch.equal(a, b) and (a - reference).abs().max() > 1e-4 * reference.abs().max(), point
