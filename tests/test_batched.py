"""Many small models trained as one computation (`poslens.train.batched`): equal to training each alone, each saved
as its own stock checkpoint that keeps its encoding, and resumable after an interruption, on micro models."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from poslens.errors import UsageError
from poslens.train.batched import BatchedDecoder, batch_key, groups, stack_parameters, train_batched
from poslens.train.config import resolve_config
from poslens.train.model import build_model

pytest_plugins = ("train_fixtures",)  # the session's token directory (fixture `tokens`)
# two micro-batches per step (accumulation) and a clipping threshold every step binds at (per-model clipping)
MICRO = dict(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, seq_len=16, steps=4, batch_size=4,
             micro_batch=2, warmup=1, eval_every=2, eval_batches=1, save_every=0, grad_clip=0.5, lr=0.01,
             device="cpu")
# every variant kind the sweep batches: NoPE, RoPE, NTK-scaled RoPE, a sliding window (8 < 16 binds), a per-layer
# pattern with YaRN; two seeds of RoPE
VARIANTS = [dict(pe="none"), dict(pe="rope"), dict(pe="rope", rope_scaling="ntk:8"),
            dict(pe="rope", sliding_window=8), dict(pe_layers="01", rope_scaling="yarn:4")]


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """Real text with many documents shorter than a block: the first 300 documents of the embedded corpus, each cut
    to its first 2 to 24 words (in turn), tokenized with a 512-entry BPE; at seq_len 16 many document-start blocks
    are padded."""
    from poslens.engine.data import default_documents
    from poslens.train.tokens import tokenize_corpus

    root = tmp_path_factory.mktemp("short")
    docs = [" ".join(d.split()[:2 + i % 23]) for i, d in zip(range(300), default_documents())]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenize_corpus(str(root / "docs.jsonl"), root / "bpe512", tokenizer="bpe:512", progress=False)
    return root / "bpe512"


def _doc_cfgs(tokens):
    """Document-start models, BOS first and not, two seeds, RoPE and NoPE, and one packed model beside them: one
    computation (`batch_key` leaves the data convention to each model)."""
    base = dict(**MICRO, blocks="doc-start", tokens=str(tokens))
    return [resolve_config("tiny", **base, pe="rope", bos=True, seed=0),
            resolve_config("tiny", **base, pe="rope", bos=True, seed=1),
            resolve_config("tiny", **base, pe="rope", bos=False, seed=0),
            resolve_config("tiny", **base, pe="none", bos=False, seed=1),
            resolve_config("tiny", **{**base, "blocks": "packed"}, pe="rope", bos=True, seed=0)]


def _cfgs(tokens, bos=True):
    out = [resolve_config("tiny", **MICRO, **v, bos=bos, seed=0, tokens=str(tokens)) for v in VARIANTS]
    return out + [resolve_config("tiny", **MICRO, pe="rope", bos=bos, seed=1, tokens=str(tokens))]


def _rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("padded", [False, True])
def test_the_batched_forward_is_the_stock_forward_in_float64(monkeypatch, padded):
    """In float64 the batched forward and backward equal each stock model's own to 1e-12 (relative): the same
    computation (a wrong rotary table or mask differs at 1e-3 or more), so what remains in float32 training is
    rounding. Stock RMSNorm rounds through float32 even in a float64 model (1e-10 to 1e-7 here); for this
    comparison it computes in the model's dtype, the same formula. `padded`: rows ending in PAD, as document-start
    blocks do (3 to 16 counted targets per row), against cross-entropy with PAD ignored and a padded input read as
    0, as `poslens.train.loop.next_token_loss` computes it (in float64 here)."""
    from transformers.models.smollm3 import modeling_smollm3

    from poslens.train.data import PAD

    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_smollm3.SmolLM3RMSNorm, "forward", norm)
    torch.manual_seed(0)
    cfgs = [resolve_config("tiny", **MICRO, **v, bos=True, seed=s) for v in VARIANTS for s in (0, 1)]
    models = [build_model(c, 512).double() for c in cfgs]
    decoder = BatchedDecoder(models, 16, torch.device("cpu"))
    params = stack_parameters(models, torch.device("cpu"))
    block = torch.randint(0, 512, (len(models), 3, 17))
    if padded:
        ends = torch.randint(4, 18, (len(models), 3, 1))  # row r's tokens past its end are PAD
        block = torch.where(torch.arange(17) < ends, block, PAD)
        assert (block == PAD).any(dim=-1).float().mean() > 0.5
    losses = decoder.losses(params, block)
    losses.sum().backward()
    for i, m in enumerate(models):
        logits = m(input_ids=block[i, :, :-1].clamp(min=0)).logits  # a padded input reads as 0, as in training
        ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), block[i, :, 1:].flatten(), ignore_index=PAD)
        ref.backward()
        assert abs(losses[i].item() - ref.item()) < 1e-12 * ref.item()
        for name, p in params.items():
            g = m.get_parameter(name).grad
            assert (p.grad[i] - g).abs().max() <= 1e-12 * g.abs().max()


def test_a_computation_of_nope_models_reaches_the_compiled_layer_with_the_identity_rotation():
    """Where no model of a computation rotates a layer (a chunk of NoPE models), the compiled layer gets rotary
    tables all the same, cos 1 and sin 0, so the graph compiled for RoPE chunks of that size serves it (compiling
    a second graph costs 36 s of CPU cold); the identity rotation changes no bit of the forward or the gradients
    against the eager layer, which skips the rotation (x * 1 + roll(x) * 0 = x exactly in float32)."""
    from poslens.train.batched import decoder_layer

    torch.manual_seed(0)
    models = [build_model(resolve_config("tiny", **MICRO, pe="none", bos=True, seed=s), 512) for s in (0, 1)]
    seen = []

    def recorder(x, weights, cos, sin, *rest):  # in place of the compiled code: the eager layer, recording its tables
        seen.append((cos, sin))
        return decoder_layer(x, weights, cos, sin, *rest)

    block = torch.randint(0, 512, (2, 3, 17))
    out = {}
    for kind, compiled in (("eager", None), ("compiled", recorder)):
        params = stack_parameters(models, torch.device("cpu"))  # fresh leaves each time
        decoder = BatchedDecoder(models, 16, torch.device("cpu"), compiled)
        loss = decoder.losses(params, block)
        loss.sum().backward()
        out[kind] = (loss.detach(), {k: v.grad for k, v in params.items()})
    assert len(seen) == MICRO["layers"] and all(c is not None and torch.equal(c, torch.ones_like(c)) and
                                                torch.equal(s, torch.zeros_like(s)) for c, s in seen)
    assert torch.equal(out["eager"][0], out["compiled"][0])
    assert all(torch.equal(out["eager"][1][k], out["compiled"][1][k]) for k in out["eager"][1])


def assert_rows_close(a: dict, b: dict, model: int) -> None:
    """One logged step of a model trained alone (a) and batched (b): loss and held-out loss within 2e-5 (absolute; a
    few nats, float32 rounding of batched against plain matrix products: ~1e-6 seen), the gradient norm within 1e-4 of
    its size (a sum of squares over every parameter, whose rounding AdamW's first steps amplify where a gradient is
    near 0: 1.6e-5 relative seen on an AMD AVX2 CPU). A computation that differed (a mask, a rotary table, the
    clipping, a padded target counted) moves both by far more (1e-2 and up)."""
    for key in ("loss", "eval_loss"):
        if key in a:
            assert abs(a[key] - b[key]) < 2e-5, (model, key, a, b)
    if "grad_norm" in a:
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"]), (model, "grad_norm", a, b)


def test_batched_training_equals_training_each_alone(tmp_path, tokens):
    """N models (every variant kind, two seeds; with and without BOS first) trained as one computation give each
    model's loss per step within 2e-5 of training it alone (gradient norm: `assert_rows_close`) and final weights
    within lr / 100 = 1e-4 (absolute):
    float32 rounding of batched against plain matrix products, which AdamW's first steps amplify where a gradient
    is near 0 (2.4e-5 seen); a model whose computation differed (a mask, a rotary table, the clipping, its data)
    moves its weights by up to lr per step, 1e-2.
    Each saved model reloads with stock `from_pretrained`, keeps its positional encoding and computes the alone
    model's logits within 1e-4."""
    from transformers import AutoModelForCausalLM

    from poslens.engine.pe import PositionalEncoding
    from poslens.train.loop import train

    cfgs = _cfgs(tokens) + _cfgs(tokens, bos=False)[:2]
    assert [len(g) for g in groups(cfgs)] == [8]  # BOS first or not, one computation: each model reads its own blocks
    for group in groups(cfgs):
        train_batched([cfgs[i] for i in group], [tmp_path / f"b{i}" for i in group], progress=False)
    block = torch.randint(0, 512, (2, 16))
    for i, cfg in enumerate(cfgs):
        alone = tmp_path / f"a{i}"
        train(cfg, alone, progress=False)
        rows_a, rows_b = _rows(alone), _rows(tmp_path / f"b{i}")
        assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
        for a, b in zip(rows_a, rows_b):
            assert_rows_close(a, b, i)
        wa, wb = load_file(str(alone / "model.safetensors")), load_file(str(tmp_path / f"b{i}" / "model.safetensors"))
        assert wa.keys() == wb.keys()
        assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4
        ma = AutoModelForCausalLM.from_pretrained(alone)
        mb = AutoModelForCausalLM.from_pretrained(tmp_path / f"b{i}")
        assert PositionalEncoding.of(mb).record() == PositionalEncoding.of(ma).record()
        assert PositionalEncoding.of(mb).label() == cfg.positional_encoding().label()
        assert mb.config.poslens_variant == ma.config.poslens_variant
        with torch.no_grad():
            assert (ma(input_ids=block).logits - mb(input_ids=block).logits).abs().max() < 1e-4
        run = json.loads((tmp_path / f"b{i}" / "run.json").read_text())
        assert run["config"]["seed"] == cfg.seed and run["metrics"]["batched_models"] == len(
            [g for g in groups(cfgs) if i in g][0])


@pytest.mark.parametrize("blocks", ["packed", "doc-start"])
def test_resume_after_an_interruption_equals_an_uninterrupted_run(tmp_path, request, blocks):
    """Stopped after 2 of 4 steps (each model's checkpoint, in the plain trainer's format) and rerun, the batched
    models are bit-identical to an uninterrupted batched run: loss curves and weights (also when the resumed part
    holds 3 of the 4 models: a model's arithmetic does not depend on the others); the fourth model resumes under
    the plain trainer (`poslens train`) from its batched checkpoint. Packed models, and document-start ones (BOS
    first and not, padded blocks)."""
    from poslens.train.loop import train

    if blocks == "packed":
        cfgs = _cfgs(request.getfixturevalue("tokens"))[:4]
    else:
        cfgs = _doc_cfgs(request.getfixturevalue("short_documents"))[:4]
    cfgs = [dataclasses.replace(c, save_every=2) for c in cfgs]
    whole = [tmp_path / f"w{i}" for i in range(4)]
    parts = [tmp_path / f"p{i}" for i in range(4)]
    train_batched(cfgs, whole, progress=False)
    train_batched(cfgs, parts, progress=False, stop_after=2)
    assert not any(p.exists() for p in parts)
    assert all((p.parent / f".{p.name}.partial" / "checkpoint" / "trainer.pt").is_file() for p in parts)
    train(cfgs[3], parts[3], progress=False)  # the plain trainer resumes a batched checkpoint
    train_batched(cfgs[:3], parts[:3], progress=False)
    for i, (w, p) in enumerate(zip(whole, parts)):
        ra, rb = _rows(w), _rows(p)
        wa, wb = load_file(str(w / "model.safetensors")), load_file(str(p / "model.safetensors"))
        if i < 3:
            timing = ("step_s", "tokens_per_s", "mfu", "models")  # the resumed part trained 3 models as one, not 4
            assert [{k: v for k, v in r.items() if k not in timing} for r in ra] == \
                [{k: v for k, v in r.items() if k not in timing} for r in rb]
            assert all(torch.equal(wa[k], wb[k]) for k in wa)
        else:  # the last two steps alone: within the float32 tolerance of the test above
            assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4


def test_models_that_differ_in_more_than_encoding_and_seed_do_not_train_together(tokens):
    from poslens.errors import UsageError

    a = resolve_config("tiny", **MICRO, pe="rope", tokens=str(tokens))
    assert batch_key(a) == batch_key(dataclasses.replace(a, pe="none", sliding_window=4, seed=3))
    assert batch_key(a) != batch_key(dataclasses.replace(a, lr=0.02))
    with pytest.raises(UsageError, match="share every training field"):
        train_batched([a, dataclasses.replace(a, hidden=64)], ["x", "y"], progress=False)


def test_a_part_trained_in_chunks_equals_it_trained_as_one(tmp_path, tokens):
    """A part of six models trained two at a time within each step (`chunk`, as `chunk_models` cuts a large part on
    the CPU) gives each model the loss curve and weights of the part trained as one computation, bit for bit: a
    model's arithmetic does not depend on which others share its computation (the batched products and attention
    compute each model's slice alone)."""
    cfgs = _cfgs(tokens)
    whole = [tmp_path / f"w{i}" for i in range(len(cfgs))]
    parts = [tmp_path / f"c{i}" for i in range(len(cfgs))]
    train_batched(cfgs, whole, progress=False)
    train_batched(cfgs, parts, progress=False, chunk=2)
    timing = ("step_s", "tokens_per_s", "mfu")
    for w, p in zip(whole, parts):
        assert [{k: v for k, v in r.items() if k not in timing} for r in _rows(w)] == \
            [{k: v for k, v in r.items() if k not in timing} for r in _rows(p)]
        wa, wb = load_file(str(w / "model.safetensors")), load_file(str(p / "model.safetensors"))
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_document_start_models_trained_as_one_equal_each_trained_alone(tmp_path, short_documents):
    """Document-start models (padded blocks, PAD targets not counted; BOS first and not) trained as one computation,
    with a packed model beside them, are each the model trained alone by the plain loop within the tolerances of
    `test_batched_training_equals_training_each_alone` (loss and held-out loss per step 2e-5, gradient norm 1e-4 of
    its size: `assert_rows_close`; final weights 1e-4: float32 rounding). The data pads: a step whose micro-batches
    weigh by their counted targets (`loss_shares`) is trained, so a batched loss that counted a padded target, or
    weighed micro-batches equally, would differ by far more (a padded target's cross-entropy is several nats). Each
    saved model reloads with stock `from_pretrained`, keeps its encoding and data convention, and its tokenizer adds
    the BOS exactly when it was trained with one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from poslens.engine.pe import PositionalEncoding
    from poslens.train.data import loss_shares, train_batches
    from poslens.train.loop import train
    from poslens.train.tokens import open_tokens

    cfgs = _doc_cfgs(short_documents)
    assert [len(g) for g in groups(cfgs)] == [len(cfgs)]
    tf = open_tokens(short_documents)
    weighed = [loss_shares(train_batches(tf.train, 16, s, 4, 2, 0, 1, c.seed, tf.bos_id("test") if c.bos else None,
                                         tf.separator_id)) is not None for c in cfgs[:4] for s in range(4)]
    assert sum(weighed) >= 4, weighed  # padded blocks in many of the steps trained
    train_batched(cfgs, [tmp_path / f"b{i}" for i in range(len(cfgs))], progress=False)
    for i, cfg in enumerate(cfgs):
        alone, both = tmp_path / f"a{i}", tmp_path / f"b{i}"
        train(cfg, alone, progress=False)
        rows_a, rows_b = _rows(alone), _rows(both)
        assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
        for a, b in zip(rows_a, rows_b):
            assert_rows_close(a, b, i)
        wa, wb = load_file(str(alone / "model.safetensors")), load_file(str(both / "model.safetensors"))
        assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4
        mb = AutoModelForCausalLM.from_pretrained(both)
        assert PositionalEncoding.of(mb).label() == cfg.positional_encoding().label()
        assert mb.config.poslens_variant == AutoModelForCausalLM.from_pretrained(alone).config.poslens_variant
        run = json.loads((both / "run.json").read_text())
        assert (run["config"]["blocks"], run["config"]["bos"], run["config"]["seed"]) == (cfg.blocks, cfg.bos,
                                                                                          cfg.seed)
        ids = AutoTokenizer.from_pretrained(both)("a text")["input_ids"]
        assert (ids[0] == tf.bos_id("test")) == cfg.bos


def _fallback_lines(text):
    return [line for line in text.splitlines() if "compiled training is unavailable" in line]


def test_compiled_batched_training_equals_the_eager_one(tmp_path, tokens, capfd):
    """The batched models trained with each decoder layer compiled (`compile=True`: inductor's fused kernels for
    RMSNorm, the rotary products, SiLU times up and their backward) equal the eager batched training within the
    tolerances of `test_batched_training_equals_training_each_alone` (loss, held-out loss and gradient norm per step
    2e-5, final weights lr / 100 = 1e-4): the same arithmetic, summed in another order at float32 rounding; a wrong
    fused kernel (a norm, a rotation, a mask) moves the loss by 1e-3 or more. The compiled code really ran: dynamo
    made a graph, no fallback line was printed, and its compiled kernels were written to the inductor cache under the
    poslens cache. An interrupted compiled run resumes to the uninterrupted compiled run's curves and weights, bit
    for bit (compiled code is as deterministic as eager code)."""
    import os

    from torch._dynamo.utils import counters

    from poslens.train.compiled import cache_dir

    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # this test process's poslens cache (tests/conftest.py)
    cfgs = [dataclasses.replace(c, save_every=2) for c in _cfgs(tokens)[:4]]
    eager = [tmp_path / f"e{i}" for i in range(4)]
    whole = [tmp_path / f"w{i}" for i in range(4)]
    parts = [tmp_path / f"p{i}" for i in range(4)]
    graphs = counters["stats"]["unique_graphs"]
    train_batched(cfgs, eager, progress=False)
    train_batched(cfgs, whole, progress=False, compile=True)
    assert counters["stats"]["unique_graphs"] > graphs
    assert not _fallback_lines(capfd.readouterr().err)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache_dir()) and any(cache_dir().rglob("*.so"))
    for e, w in zip(eager, whole):
        rows_e, rows_w = _rows(e), _rows(w)
        assert [r["step"] for r in rows_e] == [r["step"] for r in rows_w]
        for a, b in zip(rows_e, rows_w):
            for key in ("loss", "eval_loss", "grad_norm"):
                if key in a:
                    assert abs(a[key] - b[key]) < 2e-5, (a, b)
        we, ww = load_file(str(e / "model.safetensors")), load_file(str(w / "model.safetensors"))
        assert max((we[k] - ww[k]).abs().max().item() for k in we) < 1e-4
    train_batched(cfgs, parts, progress=False, stop_after=2, compile=True)
    train_batched(cfgs, parts, progress=False, compile=True)
    timing = ("step_s", "tokens_per_s", "mfu")
    for w, p in zip(whole, parts):
        assert [{k: v for k, v in r.items() if k not in timing} for r in _rows(w)] == \
            [{k: v for k, v in r.items() if k not in timing} for r in _rows(p)]
        ww, wp = load_file(str(w / "model.safetensors")), load_file(str(p / "model.safetensors"))
        assert all(torch.equal(ww[k], wp[k]) for k in ww)


def test_compiled_training_falls_back_to_eager_in_one_line(tmp_path, tokens, capfd, monkeypatch):
    """Where the C++ compiler does not work (here: inductor pointed at one that does not exist), the batched
    training says so in one line on stderr, naming the cause under the compiler's wrappers, and trains eagerly:
    the models are bit-identical to an eager run. The process asks the compiler no more: a second compiled
    training prints nothing and trains eagerly."""
    import torch._dynamo
    from torch._inductor import config

    from poslens.train import compiled

    monkeypatch.setattr(compiled, "_FAILED", False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing compiled to load from
    monkeypatch.setattr(config.cpp, "cxx", ("/nonexistent/c++",))
    torch._dynamo.reset()
    # a shape no other test compiles, so no compiled module of this process is reused
    cfgs = [dataclasses.replace(c, hidden=48, heads=4, kv_heads=2) for c in _cfgs(tokens)[:2]]
    train_batched(cfgs, [tmp_path / "e0", tmp_path / "e1"], progress=False)
    capfd.readouterr()
    train_batched(cfgs, [tmp_path / "c0", tmp_path / "c1"], progress=False, compile=True)
    lines = _fallback_lines(capfd.readouterr().err)
    assert len(lines) == 1 and "training eagerly" in lines[0] and "No working C++ compiler" in lines[0], lines
    timing = ("step_s", "tokens_per_s", "mfu")
    for i in range(2):
        assert [{k: v for k, v in r.items() if k not in timing} for r in _rows(tmp_path / f"e{i}")] == \
            [{k: v for k, v in r.items() if k not in timing} for r in _rows(tmp_path / f"c{i}")]
        we = load_file(str(tmp_path / f"e{i}" / "model.safetensors"))
        wc = load_file(str(tmp_path / f"c{i}" / "model.safetensors"))
        assert all(torch.equal(we[k], wc[k]) for k in we)
    assert compiled.compile_static(compiled.cache_dir) is None
    train_batched(cfgs[:1], [tmp_path / "d0"], progress=False, compile=True)
    assert not _fallback_lines(capfd.readouterr().err)
    torch._dynamo.reset()


def test_the_chunk_follows_the_machines_l2_cache(tmp_path):
    """`chunk_models` reads the L2 size of the machine (sysfs: the level-2 data or unified cache, not level 1 or 3):
    a 1 MiB L2 holds half the models of a 2 MiB one; an unreadable tree gives the 2 MiB default."""
    from poslens.train.batched import chunk_models, l2_cache_bytes

    def cache(name, level, kind, size):
        d = tmp_path / name / f"index{level}{kind[0]}"
        d.mkdir(parents=True)
        for f, v in (("level", level), ("type", kind), ("size", size)):
            (d / f).write_text(f"{v}\n")
        return tmp_path / name

    for level, kind, size in ((1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                              (3, "Unified", "300M")):
        root = cache("a", level, kind, size)
    assert l2_cache_bytes(root=root) == 1 << 20
    assert l2_cache_bytes(root=cache("b", 2, "Unified", "2M")) == 2 << 20
    assert l2_cache_bytes(root=tmp_path / "none") == 2 << 20
    cfg = resolve_config("tiny", **{**MICRO, "micro_batch": 8, "seq_len": 64, "intermediate": 256, "batch_size": 8})
    cpu = torch.device("cpu")
    assert chunk_models(cfg, cpu, 2 << 20) == 4 and chunk_models(cfg, cpu, 1 << 20) == 2  # pe-sinks' shape
    assert chunk_models(cfg, cpu, 1000) == 1 and chunk_models(cfg, torch.device("meta")) > 1000


def test_a_sweep_compiles_only_parts_that_repay_it():
    """`compile="auto"` compiles a part of at least MIN_COMPILE_MODEL_STEPS model-steps on the CPU (a `pe-sinks`
    part: 16 models x 2,000 steps), not a short one (a test's 4 models x 4 steps) nor where it was not measured (a
    GPU); a sweep's `compile` takes auto, on or off (one line otherwise)."""
    from poslens.errors import UsageError
    from poslens.train.batched import MIN_COMPILE_MODEL_STEPS, worth_compiling
    from poslens.train.sweep import SweepConfig, resolve_matrix

    sinks = resolve_matrix(SweepConfig(preset="pe-sinks")).members[0].config
    cpu = torch.device("cpu")
    assert worth_compiling(sinks, 16, cpu) and not worth_compiling(sinks, 16, torch.device("meta"))
    assert not worth_compiling(resolve_config("tiny", **MICRO), 4, cpu)
    assert worth_compiling(sinks, MIN_COMPILE_MODEL_STEPS // sinks.steps, cpu)
    assert not worth_compiling(sinks, MIN_COMPILE_MODEL_STEPS // sinks.steps - 1, cpu)
    with pytest.raises(UsageError, match="compile must be one of auto, on, off"):
        resolve_matrix(SweepConfig(preset="pe-sinks", compile="yes"))


def test_compiled_code_goes_to_the_poslens_cache_after_torch_named_its_default(tmp_path, monkeypatch):
    """Importing transformers' models makes torch's inductor write its default cache directory into
    TORCHINDUCTOR_CACHE_DIR (its ``cache_dir()``); every command line's process had done so before the batched
    trainer asked for the poslens cache, so the compiled code went to /tmp/torchinductor_USER and every sweep
    compiled again after a reboot. That default is not a user's choice: the poslens cache is used; a directory the
    user named is kept."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as torch_cache_dir

    from poslens.train.compiled import CACHE_ENV, cache_dir, use_disk_cache

    monkeypatch.setenv("POSLENS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(CACHE_ENV, raising=False)
    torch_cache_dir()  # what importing transformers.models.llama does in a fresh process
    assert os.environ[CACHE_ENV] != str(cache_dir())
    assert use_disk_cache() == cache_dir() == tmp_path / "cache" / "inductor" and cache_dir().is_dir()
    assert os.environ[CACHE_ENV] == str(cache_dir())
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert use_disk_cache() == tmp_path / "mine" and os.environ[CACHE_ENV] == str(tmp_path / "mine")


@pytest.mark.parametrize("n,size", [(1, 4), (4, 4), (6, 4), (9, 4), (10, 4), (7, 3), (5, 1), (3, 8)])
def test_a_part_is_cut_into_the_fewest_chunks_of_nearly_equal_size(n, size):
    """`chunk_slices` covers the part's models once, in order, in ceil(n / size) computations of at most `size`
    models whose sizes differ by at most one (9 models at 4: 3, 3, 3; compiled code is built once per size)."""
    from poslens.train.batched import chunk_slices

    cut = chunk_slices(n, size)
    sizes = [s.stop - s.start for s in cut]
    assert [i for s in cut for i in range(s.start, s.stop)] == list(range(n))
    assert len(cut) == -(-n // size) and max(sizes) <= size and max(sizes) - min(sizes) <= 1
    with pytest.raises(UsageError):
        chunk_slices(0, 4)


def test_training_reads_subnormals_as_zero_and_restores_the_mode(tmp_path, tokens, monkeypatch):
    """Both trainers step with float32 subnormals flushed to 0 on the CPU (`subnormals_flushed`: an x86 core is about
    a hundred times slower on them, and training tensors come to hold them), and leave the thread's mode as they
    found it, off or on."""
    import poslens.train.batched as batched
    import poslens.train.loop as loop
    from poslens.subnormals import flushing_subnormals, subnormals_flushed

    seen = []
    clip, step = batched.clip_per_model, loop._step
    monkeypatch.setattr(batched, "clip_per_model", lambda *a: seen.append(("batched", flushing_subnormals()))
                        or clip(*a))
    monkeypatch.setattr(loop, "_step", lambda *a, **k: seen.append(("alone", flushing_subnormals())) or step(*a, **k))
    cfgs = [dataclasses.replace(c, steps=2) for c in _cfgs(tokens)[:2]]
    assert not flushing_subnormals()
    train_batched(cfgs, [tmp_path / "a", tmp_path / "b"], progress=False)
    loop.train(cfgs[0], tmp_path / "alone", progress=False)
    assert seen == [("batched", True)] * 2 + [("alone", True)] * 2 and not flushing_subnormals()
    torch.set_flush_denormal(True)
    try:
        with subnormals_flushed(torch.device("cpu")):
            pass
        assert flushing_subnormals()  # on before, on after
    finally:
        torch.set_flush_denormal(False)
    assert torch.tensor([1e-39]).mul(1.0).item() > 0  # off: a subnormal survives
