"""The capture on a CUDA device: the paths the CPU suite can only emulate (skipped without a GPU).

On the GPU the default bfloat16 score GEMM is the fused hi + lo tensor-core GEMM accumulating into float32
sums (`torch.addmm(out_dtype=float32)`), and `result()` finishes the maps on the device and copies them to
the host through page-locked staging buffers. These tests hold those paths to the same references as the CPU
suite. TF32 stays off (PyTorch's default), so float32 GEMMs are IEEE float32.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_identical, assert_within_sdpa_rounding
from test_capture import ALL, MAPS, TOL32, assert_maps_close, assert_single_rank_all_reduce_is_identity, reference
from test_scores import cfg, model_dir  # noqa: F401  (model_dir is a fixture)
from tiny_models import ALL_FAMILIES, build, heads_summed_twin, randomize_norm_gains, token_batch

import poslens
from poslens.analyses.scores import run_scores
from poslens.engine.capture import Capture
from poslens.engine.hooks import HookedModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.fixture(autouse=True)
def _no_tf32():
    m = torch.backends.cuda.matmul
    saved = m.allow_tf32
    m.allow_tf32 = False
    yield
    m.allow_tf32 = saved


@pytest.mark.parametrize("family", ALL_FAMILIES)  # learned tables, ALiBi, partial rotary and parallel blocks too
def test_float32_maps_on_gpu_match_float64_reference(family):
    """Every map of a float32 model run on the GPU equals the float64 CPU reference (tolerances as on the CPU:
    the GPU's float32 SDPA kernels round differently, by the same order)."""
    model = build(family)
    first, second = token_batch(2, 32, seed=1), token_batch(2, 24, seed=2)
    cap = Capture(model.cuda(), **ALL)
    cap.update(first.cuda())
    cap.update(second.cuda())
    got = cap.result()
    assert got["scores"].device.type == "cpu"
    want = reference(model.cpu(), [*first, *second], list(range(model.config.num_hidden_layers)))
    for key in MAPS:
        assert_maps_close(got[key], want[key], TOL32[key.removesuffix("_per_head")], f"{family} {key}")


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma3"])
def test_fused_bf16_gemm_matches_float32_gemm_on_the_same_forward(family):
    """bfloat16 model: the default fused hi + lo GEMM equals the float32 GEMM of the same head sums. The
    hi + lo split represents the float32 head sums to 2^-17 relative; the rest is float32 summation order,
    ~1e-6 on scores of a few units, so 1e-5."""
    model = build(family, dtype=torch.bfloat16, max_position_embeddings=4096).cuda()
    ids = token_batch(2, 2500, seed=3).cuda()  # three 1,024-row query blocks
    maps = {}
    for gemm in ("float32", "split-bf16"):
        cap = Capture(model, gemm=gemm)
        cap.update(ids[:1, :1500])
        cap.update(ids)  # a second, longer batch: the sums grow
        maps[gemm] = cap.result()["scores"]
    assert_maps_close(maps["split-bf16"], maps["float32"], 1e-5, family)


@pytest.mark.parametrize("family", ALL_FAMILIES)
@torch.no_grad()
def test_hooked_forward_on_the_gpu_equals_hugging_face(family):
    """tests/test_family_tl.py's check on CUDA: with a reader on every point the logits equal, bit for bit, those of
    the eager twin whose W_O output is the per-head results' sum (the same kernels on the same shapes); without a
    reader of the scores, the pattern or the results, those of the plain forward; hook_resid_pre is the twin's hidden
    states and hook_pattern its eager attentions within 1e-5 (probabilities from float32 softmaxes). Falcon-RW has no
    eager reference (transformers' eager Falcon adds the ALiBi bias twice; tests/test_falcon.py): its logits are held
    to SDPA rounding of the plain forward."""
    model = randomize_norm_gains(build(family))
    # the twin made on the CPU beside the model, then moved: a buffer computed when a model is built (GPT-J's sin/cos
    # table, not in the state dict) holds the model's floats (built on the GPU, its sines differ by an ulp)
    twin = heads_summed_twin(model).cuda()
    model.cuda()
    hm = HookedModel(model)
    ids = token_batch(2, 16, seed=3).cuda()
    plain = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    logits, cache = hm.run_with_cache(ids, hm.points)
    no_pattern = [p for p in hm.points if not p.endswith(("attn.hook_attn_scores", "attn.hook_pattern",
                                                              "attn.hook_result"))]
    assert torch.equal(hm.run_with_cache(ids, no_pattern)[0], plain.logits)
    assert logits.is_cuda
    if family == "falcon_rw":
        assert_within_sdpa_rounding(logits, plain.logits, "falcon-rw on the GPU, every point read")
        return
    reference = twin(input_ids=ids, use_cache=False, output_hidden_states=True, output_attentions=True)
    assert torch.equal(logits, reference.logits)
    for l in range(hm.n_layers):
        assert torch.equal(cache[f"blocks.{l}.hook_resid_pre"], reference.hidden_states[l]), l
        assert (cache[f"blocks.{l}.attn.hook_pattern"] - reference.attentions[l]).abs().max() < 1e-5, l


def test_outputs_bitwise_equal_to_plain_forward_on_gpu():
    model = build("llama", dtype=torch.bfloat16).cuda()
    ids = token_batch(3, 64, seed=4).cuda()
    with torch.no_grad():
        plain = model(ids, output_hidden_states=True)
    out = Capture(model, **ALL).forward(ids, output_hidden_states=True)
    assert torch.equal(out.logits, plain.logits)
    for a, b in zip(out.hidden_states, plain.hidden_states, strict=True):
        assert torch.equal(a, b)


def test_sums_on_the_host_give_the_same_maps():
    """Capture(device="cpu") keeps the sums on the host while the model runs on the GPU: same maps to the
    float32 summation order (the per-block products are added on the host instead of inside the GEMM)."""
    model = build("llama", dtype=torch.bfloat16).cuda()
    ids = token_batch(2, 96, seed=5).cuda()
    a, b = Capture(model, probs=True), Capture(model, probs=True, device="cpu")
    a.update(ids)
    b.update(ids)
    ra, rb = a.result(), b.result()
    for key in ("scores", "probs"):
        assert_maps_close(ra[key], rb[key], 1e-5, key)


def test_nccl_single_rank_all_reduce_is_identity(tmp_path):
    """The NCCL path of all_reduce (sums moved to the GPU, reduced, moved back) with one rank."""
    cap = Capture(build("llama").cuda(), probs=True, device="cpu")
    cap.update(token_batch(2, 16, seed=12).cuda())
    assert_single_rank_all_reduce_is_identity(cap, "nccl", tmp_path)


def test_result_on_the_gpu_equals_result_on_the_host(monkeypatch):
    """result(device="cuda") leaves the maps on the GPU; the default copies them to the host in chunks through
    two page-locked staging buffers (here 1,000 elements each, so every map takes many chunks and a ragged
    last one). Same finishing arithmetic on the same device, so bit-identical."""
    import poslens.engine.capture as capture

    monkeypatch.setattr(capture, "_STAGE_ELEMENTS", 1000)
    monkeypatch.setattr(capture, "_STAGES", {})
    model = build("llama", dtype=torch.bfloat16).cuda()
    cap = Capture(model, per_head=True, probs=True, log_probs=True, hidden_cosine=True)
    cap.update(token_batch(2, 80, seed=6).cuda())
    host, dev = cap.result(), cap.result(device="cuda")
    assert dev["scores"].is_cuda and host["scores"].device.type == "cpu"
    for key in MAPS:
        assert_identical(host[key], dev[key].cpu(), key)
    state = cap.state_dict()  # the sums, through the same staging path (float64 log-partition sums too)
    for key in ("scores", "log_partition"):
        sums = cap.sums.sums[f"{key}/{cap.layers[1]}"]  # [groups, ...] on the GPU
        assert state[f"{key}_sum"].dtype == sums.dtype
        assert torch.equal(state[f"{key}_sum"][1], sums.cpu()), key


def test_scores_command_on_the_gpu_equals_the_cpu_run(model_dir, tmp_path):  # noqa: F811
    """`poslens scores --device cuda` end to end (data, model, capture, staging copy, run directory) gives the
    CPU run's maps: a float32 model, so only float32 rounding of two different forwards (~1e-6 on scores of
    a few units; 1e-4 as in TOL32)."""
    cpu = poslens.load(run_scores(cfg(model_dir), tmp_path / "cpu", progress=False))
    gpu = poslens.load(run_scores(cfg(model_dir, device="cuda"), tmp_path / "gpu", progress=False))
    torch.testing.assert_close(gpu["scores"], cpu["scores"], rtol=0, atol=1e-4, equal_nan=True)
    assert gpu.meta["data"] == cpu.meta["data"]
