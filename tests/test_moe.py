"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): the router's and every expert's points, as
TransformerLens 3.9's MoE names and lays them out (hook_expert_weights [B*T, E], hook_expert_indices [B*T, k],
experts.{e}.hook_gate/hook_pre/hook_post [n_e, M]), against a float64 recomputation from the layer's own weights;
writes at them taking effect as the model edited by hand; the weights in TransformerLens's nn.Linear layouts as views.
Mixtral's and OLMoE's points are also checked against TransformerLens itself (tests/test_family_tl.py, reference
tests/reference/tl39_families_moe.json); the family-parametrised tests (maps against a float64 reference, padded
batches, cached generation, in-place edits, the analyses end to end with the positional encoding recorded) run on all
four.

Tolerances: a float32 forward against its float64 recomputation from the same inputs agrees to about 1e-6 of the
largest |value| at these widths (64 -> 2 x 48); 1e-5 of it is the bar, which a wrong expert, slot or token order
misses by orders of magnitude (a value of another token or expert is unrelated)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_alibi import assert_config_refused
from tiny_models import MOE, build, randomize_norm_gains, token_batch

from poslens.engine.activation_cache import NoEquivalent
from poslens.engine.families import sparse_mlp
from poslens.engine.hooks import HookedModel
from poslens.errors import UsageError

TOL = 1e-5


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if want.numel():
        scale = float(want.abs().max())
        assert float((got.double() - want).abs().max()) <= TOL * max(scale, 1e-12), what


KERNELS = ("eager", "grouped_mm")  # transformers' experts kernels poslens copies (grouped_mm: its default)


def _model(family: str, kernel: str = "eager"):
    model = randomize_norm_gains(build(family))
    model.set_experts_implementation(kernel)
    return model


def _reference(block, x: torch.Tensor, chosen: torch.Tensor | None = None, probs: torch.Tensor | None = None):
    """The float64 recomputation of a mixture-of-experts block on x [N, d] from its weights: (router probabilities
    [N, E], chosen [N, k], per-expert (tokens, gate, up, post), output [N, d]). `chosen` / `probs`: used instead of the
    router's (a written value)."""
    x = x.double()
    router = block.gate.weight.double()
    if probs is None:
        probs = torch.softmax(x @ router.T, dim=-1)
    top, picked = torch.topk(probs.double(), block.gate.top_k, dim=-1)
    if getattr(block.gate, "norm_topk_prob", True):  # Mixtral's router has no switch: it always renormalises
        top = top / top.sum(-1, keepdim=True)
    chosen = picked if chosen is None else chosen
    fused, down = block.experts.gate_up_proj.double(), block.experts.down_proj.double()
    m = fused.shape[1] // 2
    act = block.experts.act_fn
    out = torch.zeros_like(x)
    experts = []
    for e in range(fused.shape[0]):
        slot, token = torch.where((chosen == e).T)  # by choice slot, then token: the model's order
        gate, up = x[token] @ fused[e, :m].T, x[token] @ fused[e, m:].T
        post = act(gate) * up
        out.index_add_(0, token, (post @ down[e].T) * top[token, slot, None])
        experts.append((token, gate, up, post))
    shared = getattr(block, "shared_expert", None)
    if shared is not None:  # Qwen2-MoE: + sigmoid(x W_sg^T) * down(act(gate(x)) * up(x))
        s = shared.act_fn(x @ shared.gate_proj.weight.double().T) * (x @ shared.up_proj.weight.double().T)
        out = out + torch.sigmoid(x @ block.shared_expert_gate.weight.double().T) * (s @ shared.down_proj.weight
                                                                                      .double().T)
    return probs, chosen, experts, out


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("kernel", KERNELS)
@torch.no_grad()
def test_router_and_expert_points_equal_a_float64_recomputation(family, kernel):
    model = _model(family, kernel)
    hm = HookedModel(model)
    ids = token_batch(2, 12, seed=5)
    _, cache = hm.run_with_cache(ids, hm.points)
    sparse_layers = 0
    for l, layer in enumerate(hm.layers):
        block = sparse_mlp(hm.family, layer)
        p = f"blocks.{l}.mlp."
        if block is None:  # Qwen2-MoE's layer 1 (mlp_only_layers): a dense MLP with the dense points
            assert f"{p}hook_pre_linear" in cache and not any(k.startswith(p + "experts.") for k in cache)
            continue
        sparse_layers += 1
        x = cache[f"blocks.{l}.ln2.hook_out"].reshape(-1, model.config.hidden_size)
        probs, chosen, experts, out = _reference(block, x)
        assert cache[p + "hook_expert_weights"].dtype == torch.float32  # the router's softmax, before the top k
        _close(cache[p + "hook_expert_weights"], probs, p + "hook_expert_weights")
        assert torch.equal(cache[p + "hook_expert_indices"], chosen)
        for e, (_, gate, up, post) in enumerate(experts):
            _close(cache[f"{p}experts.{e}.hook_gate"], gate, f"{p}experts.{e}.hook_gate")
            _close(cache[f"{p}experts.{e}.hook_pre"], up, f"{p}experts.{e}.hook_pre")
            _close(cache[f"{p}experts.{e}.hook_post"], post, f"{p}experts.{e}.hook_post")
        _close(cache[p + "hook_out"].reshape(x.shape), out, p + "hook_out")
        if hasattr(block, "shared_expert"):
            h = x.double()
            _close(cache[p + "shared_expert.hook_pre"].reshape(len(h), -1),
                   h @ block.shared_expert.gate_proj.weight.double().T, p + "shared_expert.hook_pre")
    assert sparse_layers == (2 if family == "qwen2_moe" else 3)


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("kernel", KERNELS)
@torch.no_grad()
def test_reading_every_router_and_expert_point_keeps_the_logits(family, kernel):
    """Read at every router, expert and shared-expert point, poslens's copy of the model's experts kernel runs
    (transformers' eager loop, or its grouped_mm: the pairs sorted by expert, two grouped GEMMs): the logits are the
    model's bit for bit; read only at the router, the model's own experts module runs: bit for bit. A 64-expert
    OLMoE, whose two kernels differ by 4.3e-7 of the largest logit, tells the copies apart."""
    model = _model(family, kernel)
    hm = HookedModel(model)
    ids = token_batch(2, 16, seed=3)
    plain = model(input_ids=ids, use_cache=False).logits
    routed = [p for p in hm.points if ".mlp.experts." in p or ".mlp.hook_expert_" in p or ".shared_expert." in p]
    logits = hm.run(ids, hooks=dict.fromkeys(routed, lambda x, ctx: None), logits=True).logits
    assert torch.equal(logits, plain)
    router = [p for p in routed if ".mlp.hook_expert_" in p]
    assert torch.equal(hm.run(ids, hooks=dict.fromkeys(router, lambda x, ctx: None), logits=True).logits, plain)


@torch.no_grad()
def test_each_kernel_is_copied_where_the_two_kernels_differ():
    """An OLMoE of 16 experts, 4 per token, 32 wide, whose grouped_mm and eager forwards differ (by about 2e-7 of the
    largest logit on this CPU): read at every expert point, each kernel's logits are its own bit for bit (the eager
    loop under grouped_mm, or the grouped copy under eager, would give the other's)."""
    model = randomize_norm_gains(build("olmoe", num_experts=16, num_experts_per_tok=4, intermediate_size=32))
    hm = HookedModel(model)
    ids = token_batch(2, 32, seed=4)
    experts = dict.fromkeys([p for p in hm.points if ".mlp.experts." in p], lambda x, ctx: None)
    plain = {}
    for kernel in KERNELS:
        model.set_experts_implementation(kernel)
        plain[kernel] = model(input_ids=ids, use_cache=False).logits
        assert torch.equal(hm.run(ids, hooks=experts, logits=True).logits, plain[kernel]), kernel
    assert not torch.equal(plain["eager"], plain["grouped_mm"])


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("kernel", KERNELS)
@torch.no_grad()
def test_a_zeroed_expert_equals_the_model_with_its_down_projection_zeroed(family, kernel):
    """Zeros written at experts.1.hook_post of layer 2 give the logits of the same model with that expert's rows of
    down_proj zeroed by hand (bit for bit: the same operations on zeros)."""
    model = _model(family, kernel)
    ids = token_batch(2, 12, seed=7)
    edited = copy.deepcopy(model)
    sparse_mlp(HookedModel(edited).family, HookedModel(edited).layers[2]).experts.down_proj[1].zero_()
    got = HookedModel(model).run(ids, hooks={"blocks.2.mlp.experts.1.hook_post": lambda x, ctx: torch.zeros_like(x)},
                                 logits=True).logits
    want = edited(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, model(input_ids=ids, use_cache=False).logits)


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("kernel", KERNELS)
@torch.no_grad()
def test_written_routing_is_what_the_experts_then_compute(family, kernel):
    """A write at hook_expert_indices (each token's two chosen experts swapped: the weights go to the other one), and
    at hook_expert_weights (every token's probability on expert 0: the top k are expert 0 with weight 1 and one with
    weight 0; the probabilities squared: the same experts with other weights, renormalised where the router
    renormalises) give the MLP output the float64 recomputation gives with that routing."""
    model = _model(family, kernel)
    hm = HookedModel(model)
    ids = token_batch(2, 12, seed=9)
    d = model.config.hidden_size
    block = sparse_mlp(hm.family, hm.layers[0])
    one_hot = torch.nn.functional.one_hot
    for point, write in (("hook_expert_indices", lambda x, ctx: x.flip(-1)),
                         ("hook_expert_weights", lambda x, ctx: one_hot(torch.zeros(len(x), dtype=torch.long),
                                                                        x.shape[-1]).float()),
                         ("hook_expert_weights", lambda x, ctx: x.pow(2))):  # the same experts, other weights
        cache = {}
        hm.run(ids, hooks={"blocks.0.ln2.hook_out": lambda x, ctx, c=cache: c.__setitem__("x", x),
                           f"blocks.0.mlp.{point}": write,
                           "blocks.0.mlp.hook_out": lambda x, ctx, c=cache: c.__setitem__("out", x)})
        x = cache["x"].reshape(-1, d)
        if point == "hook_expert_indices":
            chosen = _reference(block, x)[1].flip(-1)
            want = _reference(block, x, chosen=chosen)[3]
            # the weights stay with their slots: the recomputation pairs slot j's weight with the swapped expert
            unswapped = _reference(block, x)[3]
            assert float((want - unswapped).abs().max()) > 100 * TOL * float(unswapped.abs().max())
        else:
            probs = write(torch.softmax(x.double() @ block.gate.weight.double().T, dim=-1), None)
            want = _reference(block, x, probs=probs.double())[3]
        _close(cache["out"].reshape(-1, d), want, point)


@torch.no_grad()
def test_qwen2_moe_shared_expert_write_equals_the_model_edited_by_hand():
    """Qwen2-MoE: zeros at shared_expert.hook_post give the logits of the model whose shared expert's down projection
    is zeroed (bit for bit); the dense layer's points act as a dense MLP's."""
    model = _model("qwen2_moe")
    ids = token_batch(2, 12, seed=2)
    edited = copy.deepcopy(model)
    edited.model.layers[0].mlp.shared_expert.down_proj.weight.zero_()
    got = HookedModel(model).run(ids, hooks={"blocks.0.mlp.shared_expert.hook_post":
                                             lambda x, ctx: torch.zeros_like(x)}, logits=True).logits
    assert torch.equal(got, edited(input_ids=ids, use_cache=False).logits)
    edited = copy.deepcopy(model)
    edited.model.layers[1].mlp.down_proj.weight.zero_()  # the dense layer
    got = HookedModel(model).run(ids, hooks={"blocks.1.mlp.hook_post": lambda x, ctx: torch.zeros_like(x)},
                                 logits=True).logits
    assert torch.equal(got, edited(input_ids=ids, use_cache=False).logits)


@pytest.mark.parametrize("family", MOE)
@torch.no_grad()
def test_weights_read_in_transformer_lens_layouts_as_views(family):
    """hm.blocks[l].mlp.W_gate.weight is the router's [E, d]; experts[e].W_gate, W_in [M, d] and W_out [d, M] are the
    rows of the fused gate_up_proj and down_proj (an edit reaches the model); experts[e](x) is the expert's output; the
    per-layer stacks TransformerLens has only for dense MLPs (hm.W_in, ...) refuse in one line; hm.cfg carries
    TransformerLens's MoE fields."""
    model = _model(family)
    hm = HookedModel(model)
    cfg = model.config
    block = sparse_mlp(hm.family, hm.layers[0])
    mlp = hm.blocks[0].mlp
    assert mlp.W_gate.weight.data_ptr() == block.gate.weight.data_ptr()
    experts = mlp.experts
    assert len(experts) == 4 and hm.cfg.num_experts == 4 and hm.cfg.experts_per_token == 2 and hm.cfg.d_mlp == 48
    assert hm.cfg.norm_topk_prob == (family in ("mixtral", "qwen3_moe"))
    fused = block.experts.gate_up_proj
    assert torch.equal(experts[2].W_gate.weight, fused[2, :48]) and torch.equal(experts[2].W_in.weight, fused[2, 48:])
    assert torch.equal(experts[2].W_out.weight, block.experts.down_proj[2])
    experts[2].W_in.weight[0, 0] = 7.0
    assert float(fused[2, 48, 0]) == 7.0
    ids = token_batch(1, 10, seed=1)
    _, cache = hm.run_with_cache(ids, hm.points)
    x = cache["blocks.0.ln2.hook_out"].reshape(-1, cfg.hidden_size)
    token = torch.where((cache["blocks.0.mlp.hook_expert_indices"] == 2).T)[1]
    post = cache["blocks.0.mlp.experts.2.hook_post"]
    assert torch.allclose(experts[2](x[token]), torch.nn.functional.linear(post, block.experts.down_proj[2]),
                          rtol=0, atol=1e-6)
    assert mlp.hook_expert_weights.name == "blocks.0.mlp.hook_expert_weights"
    assert experts[3].hook_post.name == "blocks.0.mlp.experts.3.hook_post"
    with pytest.raises(NoEquivalent, match=r"W_in: a .* layer has one W_in per expert"):
        _ = hm.W_in


def test_olmoe_clip_qkv_is_refused_in_one_line(tmp_path, capsys):
    """OLMoE clamps q and k after their norms (OLMo's clamp comes before any); no released OLMoE sets clip_qkv."""
    assert_config_refused("olmoe", {"clip_qkv": 8.0}, "OLMoE with clip_qkv is not supported", tmp_path, capsys)


@torch.no_grad()
def test_a_dense_mlp_point_on_a_sparse_layer_is_refused_with_the_points_it_has():
    hm = HookedModel(build("mixtral"))
    with pytest.raises(UsageError, match=r"no hook point 'blocks.1.mlp.hook_pre' .*layer 1's MLP is a mixture of 4 "
                                         r"experts: .*blocks.1.mlp.experts.\{0-3\}.hook_gate"):
        hm.run(token_batch(1, 4), hooks={"blocks.1.mlp.hook_pre": lambda x, ctx: None})
    with pytest.raises(UsageError, match=r"no hook point 'blocks.1.mlp.experts.4.hook_pre'"):
        hm.run(token_batch(1, 4), hooks={"blocks.1.mlp.experts.4.hook_pre": lambda x, ctx: None})


def test_grouped_kernel_points_take_in_place_edits_with_autograd_on():
    """Under transformers' grouped_mm, an expert's points are its rows gathered from the grouped buffers: an edit in
    place there acts as the same edit on a returned clone (bit for bit), with autograd on, and the backward pass runs
    through the rows put back."""
    model = _model("olmoe", "grouped_mm")
    hm = HookedModel(model)
    ids = token_batch(2, 9, seed=3)
    for point in [p for p in hm.points if p.startswith("blocks.1.mlp.experts.2.")]:
        runs = [hm.run_with_hooks(ids, fwd_hooks=[(point, fn)]).detach() for fn in (
            lambda x, hook: x.clone().mul_(1.5), lambda x, hook: x.mul_(1.5))]
        assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], model(input_ids=ids).logits.detach()), point
    hm.run_with_hooks(ids, fwd_hooks=[("blocks.1.mlp.experts.2.hook_post", lambda x, hook: x.mul_(1.5))]).sum() \
        .backward()
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0
