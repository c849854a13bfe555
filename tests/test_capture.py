"""poslens.capture and poslens.engine.ablations on tiny random models of every supported family.

The reference is independent of the capture: the model copied to float64, run one unpadded sequence at a time
with an eager attention function that materialises scaling * q @ repeat_kv(k)^T per head (softcapped for
Gemma-2) and the model's own mask; means, softmax and cosines are then taken entry by entry in float64.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_identical
from tiny_models import ALL_FAMILIES, FAMILIES, build, token_batch
from transformers import AttentionInterface, AttentionMaskInterface, MambaConfig, MambaForCausalLM
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import eager_mask

from poslens.engine.ablations import no_rope
from poslens.engine.capture import CPU_BLOCK_ROWS, Capture, attention_scores, check_supported, chunk_rows
from poslens.engine.families import positional_encoding, positional_encoding_record
from poslens.errors import UsageError
from poslens.io.checkpoint import load_partial, save_partial

ALL = dict(per_head=True, probs=True, log_probs=True, hidden_cosine=True)
MAPS = ("scores", "scores_per_head", "probs", "probs_per_head", "log_probs", "log_probs_per_head",
        "log_partition", "log_partition_per_head", "hidden_cosine")
# float32 forward vs float64 reference: three layers of float32 rounding (relative ~1e-6 each) on scores of
# size up to ~15 give errors ~1e-5; tolerances allow ~5x that. Probabilities are <= 1 and move by p * ds.
TOL32 = {"scores": 1e-4, "probs": 1e-5, "log_probs": 1e-4, "log_partition": 1e-4, "hidden_cosine": 1e-5}
# float64 forward: only the capture's float32 arithmetic (inputs rounded to float32, float32 sums) remains.
TOL64 = {"scores": 2e-5, "probs": 2e-6, "log_probs": 2e-5, "log_partition": 2e-5, "hidden_cosine": 2e-6}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op thread synchronisation costs more than it saves (4x slower on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the independent float64 reference ----------------------------------------------------------------

_RECORD: dict[int, tuple[torch.Tensor, int | None]] = {}


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                         **kwargs):
    s = torch.matmul(query, repeat_kv(key, query.shape[1] // key.shape[1]).transpose(2, 3)) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    _RECORD[module.layer_idx] = (s[0].clone(), kwargs.get("sliding_window"))
    eager = importlib.import_module(type(module).__module__).eager_attention_forward
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap,
                 **kwargs)


AttentionInterface.register("poslens_test_reference", _reference_attention)
AttentionMaskInterface.register("poslens_test_reference", eager_mask)


def _record_alibi(m64) -> list:
    """BLOOM (its attention is its own code, not an interface): hooks that record every layer's scores recomputed in
    float64 from the attention's input, q.k / sqrt(D) + slope_h * (j - i) (TransformerLens's form of the bias, the
    slopes from the model's positional-encoding record)."""
    slopes = torch.tensor(positional_encoding_record(m64)["alibi_slopes"], dtype=torch.float64)

    def record(module, args, kwargs):
        q, k, _ = module._reshape(module.query_key_value(args[0]))
        pos = torch.arange(args[0].shape[1], dtype=torch.float64)
        s = q @ k.transpose(-1, -2) * module.inv_norm_factor + slopes[:, None, None] * (pos[None] - pos[:, None])
        _RECORD[module.layer_idx] = (s[0].clone(), None)

    return [layer.self_attention.register_forward_pre_hook(record, with_kwargs=True) for layer in m64.transformer.h]


def _record_falcon(m64) -> list:
    """Falcon (its attention is its own code, not an interface): hooks that record every layer's scores recomputed in
    float64 from the attention's input, rotated q.k / sqrt(D) (the fused projection split by the model's own
    _split_heads; a multi-query key broadcast to every query head), or with ALiBi (q.k + slope_h (j - i)) / sqrt(D)
    (the slopes from the model's positional-encoding record)."""
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    slopes = torch.tensor(positional_encoding_record(m64).get("alibi_slopes") or [], dtype=torch.float64)

    def record(module, args, kwargs):
        q, k, _ = module._split_heads(module.query_key_value(args[0]))  # [B, T, heads, D]
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if kwargs["alibi"] is None:
            q, k = apply_rotary_pos_emb(q, k, *kwargs["position_embeddings"])
        s = q @ k.transpose(-1, -2) / module.head_dim**0.5
        if kwargs["alibi"] is not None:  # falcon-rw: slope_h * (j - i), added before the 1/sqrt(D) scaling
            pos = torch.arange(args[0].shape[1], dtype=torch.float64)
            s = s + slopes[:, None, None] * (pos[None] - pos[:, None]) / module.head_dim**0.5
        _RECORD[module.layer_idx] = (s[0].clone(), None)

    return [layer.self_attention.register_forward_pre_hook(record, with_kwargs=True) for layer in m64.transformer.h]


def _record_gpt_neo(m64) -> list:
    """GPT-Neo (its attention is its own code, not an interface): hooks that record every layer's scores recomputed
    in float64 from the attention's input, q.k without a scaling, and the layer's window (a local layer's
    window_size, else 0)."""
    def record(module, args, kwargs):
        q, k = (module._split_heads(proj(args[0]), module.num_heads, module.head_dim)
                for proj in (module.q_proj, module.k_proj))
        window = module.config.window_size if module.attention_type == "local" else 0
        _RECORD[module.layer_id] = ((q @ k.transpose(-1, -2))[0].clone(), window)

    return [layer.attn.attention.register_forward_pre_hook(record, with_kwargs=True) for layer in m64.transformer.h]


def _record_mpt(m64) -> list:
    """MPT (its attention is its own code, not an interface): hooks that record every layer's scores recomputed in
    float64 from the attention's input, q.k * softmax_scale + slope_h * (j - i) (TransformerLens's form of the bias;
    the model's own, relative to the last key, differs by a constant per query; the slopes from the model's
    positional-encoding record)."""
    slopes = torch.tensor(positional_encoding_record(m64)["alibi_slopes"], dtype=torch.float64)

    def record(module, args, kwargs):
        t = args[0].shape[1]
        q, k, _ = (x.reshape(t, module.n_heads, -1).transpose(0, 1) for x in module.Wqkv(args[0][0]).chunk(3, -1))
        pos = torch.arange(t, dtype=torch.float64)
        s = q @ k.transpose(-1, -2) * module.softmax_scale + slopes[:, None, None] * (pos[None] - pos[:, None])
        _RECORD[module.layer_idx] = (s.clone(), None)

    return [layer.attn.register_forward_pre_hook(record, with_kwargs=True) for layer in m64.transformer.blocks]


def reference(model, sequences: list[torch.Tensor], layers: list[int]) -> dict[str, torch.Tensor]:
    """Float64 means over `sequences` (1-D, any lengths), with NaN where the softmax sees nothing."""
    m64 = copy.deepcopy(model).double()
    if model.config.model_type == "bloom":
        _record_alibi(m64)
    elif model.config.model_type == "falcon":
        _record_falcon(m64)
    elif model.config.model_type == "gpt_neo":
        _record_gpt_neo(m64)
    elif model.config.model_type == "mpt":
        _record_mpt(m64)
    else:
        m64.set_attn_implementation("poslens_test_reference")
    n, h = max(len(s) for s in sequences), model.config.num_attention_heads
    z = lambda *shape: torch.zeros(len(layers), *shape, dtype=torch.float64)  # noqa: E731
    sums = {"scores": z(h, n, n), "probs": z(h, n, n), "log_probs": z(h, n, n), "log_partition": z(h, n),
            "hidden_cosine": z(n, n)}
    seen = torch.zeros(len(layers), n, n, dtype=torch.bool)
    count = torch.zeros(n, dtype=torch.int64)
    with torch.no_grad():
        for seq in sequences:
            t = len(seq)
            hidden = m64(seq[None], output_hidden_states=True).hidden_states
            i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
            for k, layer in enumerate(layers):
                s, window = _RECORD[layer]
                ok = (j <= i) & ((i - j < window) if window else True)
                logits = s.masked_fill(~ok, float("-inf"))
                lse = torch.logsumexp(logits, -1)
                logp = (logits - lse[..., None]).masked_fill(~ok, 0.0)
                sums["scores"][k, :, :t, :t] += s.masked_fill(~ok, 0.0)
                sums["probs"][k, :, :t, :t] += logp.exp().masked_fill(~ok, 0.0)
                sums["log_probs"][k, :, :t, :t] += logp
                sums["log_partition"][k, :, :t] += lse
                x = F.normalize(hidden[layer][0], dim=-1)
                sums["hidden_cosine"][k, :t, :t] += (x @ x.T).masked_fill(j > i, 0.0)
                seen[k, :t, :t] |= ok
            count[:t] += 1
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    out = {"count": count}
    for key in ("scores", "probs", "log_probs", "log_partition"):
        mask = seen[:, None] if key != "log_partition" else (count > 0)[None, None]
        per_head = sums[key] / count.view(-1, 1) if key != "log_partition" else sums[key] / count
        out[f"{key}_per_head"] = torch.where(mask, per_head, nan)
        out[key] = torch.where(mask[:, 0], per_head.mean(1), nan)
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    out["hidden_cosine"] = torch.where(tril, sums["hidden_cosine"] / count.view(-1, 1), nan)
    return out


def assert_maps_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str = "") -> None:
    """Same NaN pattern (undefined entries) and max |difference| <= atol on the defined ones."""
    assert actual.shape == expected.shape, what
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), f"{what}: NaN patterns differ"
    ok = ~torch.isnan(expected)
    err = (actual.double()[ok] - expected.double()[ok]).abs().max().item() if ok.any() else 0.0
    assert err <= atol, f"{what}: max error {err:.3g} > {atol:g}"


def _padded(sequences: list[torch.Tensor], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), n, dtype=torch.int64)
    mask = torch.zeros(len(sequences), n, dtype=torch.int64)
    for b, s in enumerate(sequences):
        sl = slice(n - len(s), n) if left else slice(0, len(s))
        ids[b, sl], mask[b, sl] = s, 1
    return ids, mask


# ---- agreement with the reference ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", ALL_FAMILIES)  # GPT-2 too: the reference is its own attention (BLOOM: recomputed)
def test_maps_match_float64_reference(family, dtype):
    """Every map of every family, streamed over two batches of different lengths, equals the reference."""
    model = build(family, dtype=dtype)
    first, second = token_batch(2, 32, seed=1), token_batch(2, 24, seed=2)
    cap = Capture(model, **ALL)
    cap.update(first)
    cap.update(second)
    got = cap.result()
    want = reference(model, [*first, *second], list(range(model.config.num_hidden_layers)))
    assert torch.equal(got["count"], want["count"])
    tol = TOL32 if dtype == torch.float32 else TOL64
    for key in MAPS:
        assert_maps_close(got[key], want[key], tol[key.removesuffix("_per_head")], f"{family} {key}")
    windows = got["sliding_window"].tolist()
    windows_of = {"mistral": [12] * 3, "starcoder2": [12] * 3, "gemma3": [12, 0, 12], "gemma2": [12, 0, 12],
                  "cohere2": [12, 0, 12],
                  "gpt_neo": [0, 12, 0]}
    assert windows == windows_of.get(family, [0] * 3)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_maps_in_cpu_blocks_match_float64_reference(family):
    """Past CPU_BLOCK_ROWS queries the chunked path runs in blocks of that many rows (3 blocks at 150 tokens: 64, 64,
    22), each reading keys from the window's start to its last query; the maps still equal the reference (Mistral:
    a window of 12, so later blocks start past key 0; a shorter second sequence pads the first block's keys)."""
    assert chunk_rows(10**9, 150, torch.device("cpu")) == CPU_BLOCK_ROWS < 150
    assert chunk_rows(10**9, 150, torch.device("cuda")) == 150  # a GPU keeps one block (nothing runs there)
    model = build(family)
    seqs = [token_batch(1, 150, seed=4)[0], token_batch(1, 100, seed=5)[0]]
    ids, mask = _padded(seqs, left=False)
    cap = Capture(model, probs=True, log_probs=True)
    cap.update(ids, mask)
    got, want = cap.result(), reference(model, seqs, list(range(model.config.num_hidden_layers)))
    for key in ("scores", "probs", "log_probs", "log_partition"):
        assert_maps_close(got[key], want[key], TOL32[key], f"{family} {key}")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_split_bf16_gemm_matches_float32_gemm(family):
    """On a bfloat16 model the hi + lo bfloat16 GEMMs (the CUDA default; emulated by upcasting on the CPU)
    equal the float32 GEMM on the same forward: representation error 2^-17 relative on scores |s| <= 15
    bounds it by ~1e-4; in practice it is ~1e-6, at the float32 path's own rounding."""
    model = build(family, dtype=torch.bfloat16)
    ids = token_batch(3, 48, seed=3)
    maps = []
    for gemm in ("float32", "split-bf16"):
        cap = Capture(model, gemm=gemm)
        cap.update(ids)
        maps.append(cap.result()["scores"])
    assert_maps_close(maps[1], maps[0], 1e-5)
    with pytest.raises(UsageError, match="gemm"):
        Capture(model, gemm="tf32")


def test_gemma2_scores_are_post_softcap():
    """Gemma-2's maps hold tanh-capped scores (what its softmax sees), measurably unlike the raw ones."""
    model = build("gemma2")
    ids = token_batch(2, 32, seed=3)
    cap = Capture(model)
    cap.update(ids)
    got = cap.result()["scores"]
    raw = copy.deepcopy(model)
    raw.config.attn_logit_softcapping = None
    for layer in raw.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    cap_raw = Capture(raw)
    cap_raw.update(ids)
    diff = (got - cap_raw.result()["scores"]).nan_to_num().abs().max().item()
    assert diff > 0.05  # tanh(s/8)*8 bends scores of size 3-15 by 0.1-5
    assert got.nan_to_num().abs().max().item() <= 8.0  # capped at the softcap


# ---- the forward is untouched -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ALL_FAMILIES)  # GPT-2 too: the reference is its own attention
def test_outputs_bitwise_equal_to_plain_forward(family):
    """Logits and every hidden state of a capturing forward equal the plain sdpa (Gemma-2: eager) forward."""
    model = build(family)
    impl = model.config._attn_implementation
    ids = token_batch(3, 40, seed=4)
    with torch.no_grad():
        plain = model(ids, output_hidden_states=True)
    cap = Capture(model, **ALL)
    out = cap.forward(ids, output_hidden_states=True)
    assert torch.equal(out.logits, plain.logits)
    for a, b in zip(out.hidden_states, plain.hidden_states, strict=True):
        assert torch.equal(a, b)
    assert model.config._attn_implementation == impl  # restored
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain.logits)
    assert cap.result()["count"].tolist() == [3] * 40


def test_early_stop_runs_nothing_past_the_deepest_layer_and_gives_the_same_maps():
    model = build("llama", num_hidden_layers=4)
    ids = token_batch(2, 32, seed=5)
    ran = []
    hooks = [model.model.layers[i].register_forward_hook(lambda *a, i=i: ran.append(i)) for i in range(4)]
    hooks.append(model.lm_head.register_forward_hook(lambda *a: ran.append("lm_head")))
    stopped = Capture(model, layers=[0, 1], probs=True, hidden_cosine=True)
    stopped.update(ids)
    assert ran == [0]  # layer 1 ended inside its attention; layers 2-3 and the LM head never ran
    ran.clear()
    full = Capture(model, layers=[0, 1], probs=True, hidden_cosine=True)
    full.forward(ids)
    assert ran == [0, 1, 2, 3, "lm_head"]
    for h in hooks:
        h.remove()
    a, b = stopped.result(), full.result()
    for key in ("scores", "probs", "hidden_cosine"):
        assert_identical(a[key], b[key])


# ---- streaming, padding, checkpoints ------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_streaming_equals_one_big_batch(family):
    """Batches [1, 3] give the one-batch-of-4 means (float32 sums in another order: ~1e-6 on scores ~10)."""
    model = build(family)
    ids = token_batch(4, 32, seed=6)
    one = Capture(model, per_head=True, probs=True)
    one.update(ids)
    two = Capture(model, per_head=True, probs=True)
    two.update(ids[:1])
    two.update(ids[1:])
    a, b = one.result(), two.result()
    for key in ("scores", "scores_per_head", "probs"):
        assert_maps_close(a[key], b[key], 1e-5, key)


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_equals_the_sequences_unpadded(family):
    """Right- and left-padded batches give the maps of the same sequences run one by one without padding.

    The padded forward uses SDPA with a mask (the unpadded one is_causal) and, left-padded, RoPE at shifted
    positions: equal up to float32 rounding through three layers (tolerances as against the reference).
    """
    model = build(family)
    seqs = [token_batch(1, n, seed=7 + n)[0] for n in (32, 21, 9)]
    single = Capture(model, **ALL)
    for s in seqs:
        single.update(s[None])
    want = single.result()
    assert want["count"].tolist() == [3] * 9 + [2] * 12 + [1] * 11
    for left in (False, True):
        cap = Capture(model, **ALL)
        cap.update(*_padded(seqs, left))
        got = cap.result()
        assert torch.equal(got["count"], want["count"])
        for key in MAPS:
            assert_maps_close(got[key], want[key], TOL32[key.removesuffix("_per_head")],
                              f"{family} {key} {'left' if left else 'right'}")


def test_checkpoint_round_trip_resumes_exactly(tmp_path):
    """state_dict -> save_partial -> load_partial -> load_state_dict, then more batches == never interrupted."""
    model = build("qwen3")
    batches = [token_batch(2, 24, seed=10), token_batch(2, 32, seed=11)]
    opts = dict(layers=[0, 2], per_head=True, log_probs=True, hidden_cosine=True, groups=3)
    whole = Capture(model, **opts)
    for b in batches:
        whole.update(b)
    first = Capture(model, **opts)
    first.update(batches[0])
    save_partial(tmp_path / "c.safetensors", first.state_dict(), 1, {"run": 1})
    sums, done = load_partial(tmp_path / "c.safetensors", {"run": 1})
    resumed = Capture(model, **opts)
    resumed.load_state_dict(sums)
    resumed.update(batches[1])
    a, b = whole.result(), resumed.result()
    assert done == 1 and set(a) == set(b)
    for key in a:
        assert_identical(a[key], b[key], key)
    with pytest.raises(UsageError, match="other layers, options or groups"):
        Capture(model, layers=[0]).load_state_dict(sums)


def assert_single_rank_all_reduce_is_identity(cap: Capture, backend: str, tmp_path) -> None:
    """all_reduce() in a one-rank process group of `backend` leaves every map as it was."""
    import torch.distributed as dist

    before = cap.result()
    cap.all_reduce()  # not initialised: no-op
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        cap.all_reduce()
    finally:
        dist.destroy_process_group()
    after = cap.result()
    for key in before:
        assert_identical(before[key], after[key], key)


def test_all_reduce_single_process_group_is_identity(tmp_path):
    """With one gloo rank the reduced sums are the local ones (the multi-rank sum: tests/test_scores.py)."""
    cap = Capture(build("llama"), probs=True)
    cap.update(token_batch(2, 16, seed=12))
    assert_single_rank_all_reduce_is_identity(cap, "gloo", tmp_path)


def test_attention_scores_helper_matches_capture():
    model = build("phi3")
    ids = token_batch(3, 20, seed=13)
    cap = Capture(model, layers=[1, 2])
    cap.update(ids)
    got = attention_scores(model, ids, layers=[1, 2], batch_size=2)
    assert got.shape == (2, 20, 20)
    assert torch.isnan(got[:, 0, 1:]).all() and not torch.isnan(got[:, 5, :6]).any()
    assert_maps_close(got, cap.result()["scores"], 1e-5)


# ---- ablations ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_no_rope_removes_position_from_the_scores(family):
    """One token repeated: without RoPE every position has the same q, k and hidden state at every layer,
    so each map is constant on the entries the softmax sees; with RoPE scores vary with i - j. Leaving the
    context restores RoPE exactly."""
    model = build(family)
    ids = torch.full((1, 24), 17)
    with_rope = attention_scores(model, ids)
    with no_rope(model):
        flat = attention_scores(model, ids)
    again = attention_scores(model, ids)
    assert_identical(with_rope, again)
    pe = positional_encoding(model)
    for layer in range(flat.shape[0]):
        spread = lambda m: (m.nan_to_num(float("-inf")).max() - m.nan_to_num(float("inf")).min()).item()  # noqa: E731
        assert spread(flat[layer]) < 1e-4, f"layer {layer}: no-rope map not constant"
        if pe[layer] != "none":
            assert spread(with_rope[layer]) > 0.1, f"layer {layer}: rope map unexpectedly flat"
        else:  # SmolLM3's NoPE layer is flat with or without the ablation
            assert spread(with_rope[layer]) < 1e-4, f"layer {layer}: a NoPE layer varies with position"


def test_no_rope_without_rotary_module_is_refused():
    with pytest.raises(UsageError, match="no rotary"), no_rope(torch.nn.Linear(2, 2)):
        pass


# ---- refusals -----------------------------------------------------------------------------------------


def test_unsupported_architectures_are_refused():
    with pytest.raises(UsageError, match=r"'mamba'.*llama"):  # a state-space model: no attention to hook
        check_supported(MambaConfig())
    mamba = MambaForCausalLM(MambaConfig(num_hidden_layers=1, hidden_size=32, state_size=4, vocab_size=64))
    with pytest.raises(UsageError, match="mamba"):
        Capture(mamba)
    with pytest.raises(UsageError, match="bidirectional"):
        check_supported(build("gemma3").config.__class__(use_bidirectional_attention=True))
    check_supported(build("gemma2").config)  # supported (post-softcap scores, eager output)


def test_bad_arguments_are_refused():
    model = build("llama")
    ids = token_batch(2, 8)
    holes = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [1] * 8])
    with pytest.raises(UsageError, match="one run of ones"):
        Capture(model).update(ids, holes)
    with pytest.raises(UsageError, match="at least one real token"):
        Capture(model).update(ids, torch.tensor([[0] * 8, [1] * 8]))
    with pytest.raises(UsageError, match="layers"):
        Capture(model, layers=[3])
    with pytest.raises(UsageError, match="input_ids"):
        Capture(model).update(ids.float())
    with pytest.raises(UsageError, match="nothing to capture"):
        Capture(model, scores=False)
    with pytest.raises(UsageError, match="layers must be an integer"):
        Capture(model, layers=[1.7])
    for bad in (ids.clone().fill_(256), ids.clone().fill_(-1)):  # the tiny vocabulary is [0, 256)
        with pytest.raises(UsageError, match="outside the model's vocabulary"):
            Capture(model).update(bad)
    with pytest.raises(UsageError, match="beyond the model's window"):
        Capture(model).update(token_batch(1, 1025))  # max_position_embeddings 1024
    with pytest.raises(UsageError, match="batch_size"):
        attention_scores(model, ids, batch_size=-1)
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="CUDA is not available"):
            Capture(model, device="cuda")


def test_group_standard_errors_equal_a_jackknife_over_separate_captures():
    """Capture(groups=G): the per-entry SE equals the delete-a-group jackknife computed by hand from G separate
    captures, one per group (batch b in group b mod G); the pooled mean equals one capture of everything."""
    model = build("llama")
    batches = [token_batch(2, 16, seed=20 + b) for b in range(8)]
    cap = Capture(model, probs=True, groups=4)
    single = Capture(model, probs=True)
    parts = [Capture(model, probs=True) for _ in range(4)]
    for b, x in enumerate(batches):
        cap.update(x)
        single.update(x)
        parts[b % 4].update(x)
    got, one = cap.result(), single.result()
    for key in ("scores", "probs"):
        torch.testing.assert_close(got[key], one[key], rtol=0, atol=2e-6, equal_nan=True)
        means = torch.stack([p.result()[key].double() for p in parts])  # each group: 2 batches of 2 sequences
        loo = torch.stack([(means.sum(0) - means[g]) / 3 for g in range(4)])
        se = torch.sqrt(3 / 4 * ((loo - loo.mean(0)) ** 2).sum(0))
        torch.testing.assert_close(got[f"{key}_se"].double(), se, rtol=1e-4, atol=1e-6, equal_nan=True)
    assert int(got["groups"]) == 4 and float(got["t_quantile"]) == pytest.approx(3.18245, abs=1e-4)


def test_capture_is_a_statistic_the_runner_runs_like_any_other():
    """The capture is a `Statistic`: a pass of the runner (its forward, `begin_batch`/`end_batch`, batch b in group
    b mod G) gives exactly the sums and maps of `update` per batch; the registered `attention_maps` is the capture
    itself (no adapter); `estimate` of the identity map is `result`'s mean and SE (both from GroupedSums.estimate)."""
    from poslens.analyses.length.maps import LengthMaps
    from poslens.engine.hooks import HookedModel
    from poslens.engine.runner import run_statistics
    from poslens.engine.statistics import spec
    from poslens.engine.statistics.attention_maps import AttentionMapsOptions
    from poslens.engine.stats import Statistic

    model = build("llama")
    batches = [(token_batch(2, 16, seed=40 + b), None) for b in range(6)]
    run = Capture(model, probs=True, log_probs=True, groups=3)
    assert isinstance(run, Statistic) and issubclass(LengthMaps, Capture)
    run_statistics(model, [run], batches)
    own = Capture(model, probs=True, log_probs=True, groups=3)
    for x, _ in batches:
        own.update(x)
    a, b = run.result(), own.result()
    assert set(a) == set(b) and "scores_se" in a
    for key in a:
        assert_identical(a[key], b[key])
    assert type(spec("attention_maps").build(HookedModel(model), AttentionMapsOptions(), 3)) is Capture
    est = own.estimate(lambda m: m)
    for slot, e in enumerate(est):
        assert_identical(e.value.float(), b["scores"][slot])
        assert_identical(e.se.float(), b["scores_se"][slot])
