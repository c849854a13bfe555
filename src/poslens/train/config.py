"""`TrainConfig`: every knob of `poslens train`, its default, and presets shipped as JSON files.

A preset (``presets/NAME.json``, or any ``.json`` path) sets some fields; command-line flags override
it field by field (`resolve_config`). Unknown presets and unknown fields are one-line errors.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from poslens.engine.pe import PositionalEncoding
from poslens.errors import UsageError, check_choice, check_float, check_int, require
from poslens.options import option

PRESETS = ("tiny", "cpu", "small", "paper-1.5b")
PE = ("none", "rope")
PRECISIONS = ("auto", "fp32", "bf16")
PARALLEL = ("ddp", "fsdp")
ATTENTION = ("auto", "flash", "cudnn", "efficient", "math")  # torch's scaled_dot_product_attention kernels
BLOCKS = ("packed", "doc-start")


@dataclass
class TrainConfig:
    """What `poslens train` trains and how. Defaults are the `tiny` preset's."""

    preset: str = option("tiny", help="preset: tiny, cpu, small, paper-1.5b, or a .json file of fields")
    tokens: str | None = option(None, help="token directory from `poslens tokenize` (default: the embedded "
                                           "corpus, tokenized once with --tokenizer and cached)")
    tokenizer: str = option("bpe:2048", help="tokenizer when --tokens is not given: smollm2 or bpe:VOCAB_SIZE "
                                             "(BPE trained on the corpus)")
    # model: a Llama-style decoder (RMSNorm, SwiGLU, grouped-query attention), saved as SmolLM3
    layers: int = option(4, help="decoder layers")
    hidden: int = option(128, help="hidden size d_model")
    intermediate: int = option(384, help="SwiGLU inner size")
    heads: int = option(4, help="query heads")
    kv_heads: int = option(2, help="key/value heads (grouped-query attention; divides --heads)")
    pe: str = option("none", help="positional encoding of every layer", choices=PE)
    pe_layers: str | None = option(None, help="per-layer pattern, 1 = RoPE, 0 = NoPE: 0,1,1,1 or 0111 "
                                              "(tiled if shorter; overrides --pe)")
    rope_theta: float = option(10000.0, help="RoPE base theta")
    rope_scaling: str | None = option(None, help="RoPE scaling, static: ntk:F (base theta * F^(d/(d-2))), "
                                                 "linear:F (positions / F) or yarn:F (YaRN over the training "
                                                 "length); default none")
    sliding_window: int = option(0, help="sliding-window attention: each query sees itself and the W - 1 keys "
                                         "before it (0: full causal attention)")
    layer_types: str | None = option(None, help="which layers slide: S/F letters or sliding,full per layer, "
                                                "tiled if shorter (SSSF: every 4th layer full); default: every "
                                                "layer when --sliding-window is set")
    bos: bool = option(False, help="start every training and held-out sequence with the BOS token (as Llama "
                                   "is trained); the saved tokenizer then adds BOS by itself")
    blocks: str = option("packed", help="training blocks: packed (cuts of the token stream, documents back to back "
                                        "with their separator) or doc-start (each block one document's start, with "
                                        "--bos the BOS first; a shorter document padded, the padding not counted in "
                                        "the loss; docs/training.md)", choices=BLOCKS)
    seq_len: int = option(128, help="context length in tokens (BOS included with --bos)")
    # optimisation
    steps: int = option(150, help="optimizer steps")
    batch_size: int = option(16, help="global batch in sequences per optimizer step (all ranks together)")
    micro_batch: int = option(16, help="sequences per forward pass per rank (gradient accumulation fills the rest)")
    lr: float = option(3e-3, help="peak learning rate (AdamW)")
    min_lr_ratio: float = option(0.1, help="final learning rate as a fraction of --lr (cosine schedule)")
    warmup: int = option(15, help="linear warm-up steps")
    weight_decay: float = option(0.1, help="AdamW weight decay (matrices only)")
    beta1: float = option(0.9, help="AdamW beta1")
    beta2: float = option(0.95, help="AdamW beta2")
    grad_clip: float = option(1.0, help="clip the gradient norm to this (0: off)")
    seed: int = option(0, help="seed of the initial weights and of the data order")
    # evaluation, logging, checkpoints
    eval_every: int = option(25, help="held-out loss every N steps (and at the end)")
    eval_batches: int = option(4, help="held-out micro-batches per evaluation")
    save_every: int = option(50, help="checkpoint every N steps (0: only at the end)")
    # engine
    device: str = option("auto", help="auto, cpu, cuda or cuda:N")
    precision: str = option("auto", help="auto: bf16 autocast on GPU, fp32 on CPU", choices=PRECISIONS)
    compile: bool = option(False, help="torch.compile the model")
    attention: str = option("auto", help="attention kernel on GPU: auto (torch's choice), flash, cudnn, efficient "
                                         "or math (torch.nn.attention.sdpa_kernel)", choices=ATTENTION)
    parallel: str = option("ddp", help="under torchrun: ddp or fsdp (FSDP2 fully_shard)", choices=PARALLEL)
    tensorboard: bool = option(False, help="also log to TensorBoard (needs the tensorboard package)")

    def check(self) -> TrainConfig:
        """Validate every field (one-line UsageError naming the field); returns self."""
        check_int("layers", self.layers, 1)
        check_int("hidden", self.hidden, 1)
        check_int("intermediate", self.intermediate, 1)
        check_int("heads", self.heads, 1)
        check_int("kv_heads", self.kv_heads, 1, self.heads)
        require(self.heads % self.kv_heads == 0, f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        require(self.hidden % self.heads == 0, f"heads ({self.heads}) must divide hidden ({self.hidden})")
        require((self.hidden // self.heads) % 2 == 0, "hidden / heads (the head size) must be even for RoPE")
        check_choice("pe", self.pe, PE)
        check_choice("blocks", self.blocks, BLOCKS)
        check_int("seq_len", self.seq_len, 3 if self.bos else 2)
        require(self.sliding_window <= self.seq_len, f"sliding_window {self.sliding_window} is longer than seq_len "
                                                     f"{self.seq_len}: it would never bind; use a window <= seq_len")
        self.positional_encoding()
        check_int("steps", self.steps, 1)
        check_int("batch_size", self.batch_size, 1)
        check_int("micro_batch", self.micro_batch, 1)
        check_float("lr", self.lr, 0.0, 1.0, lo_open=True)
        check_float("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_int("warmup", self.warmup, 0)
        require(self.warmup <= self.steps, f"warmup ({self.warmup} steps) is longer than the run ({self.steps} steps), "
                                           f"so the learning rate would never reach lr; give a warmup of at most "
                                           f"{self.steps} steps (a preset sets one for its own steps)")
        check_float("weight_decay", self.weight_decay, 0.0, 1.0)
        check_float("beta1", self.beta1, 0.0, 1.0, hi_open=True)
        check_float("beta2", self.beta2, 0.0, 1.0, hi_open=True)
        check_float("grad_clip", self.grad_clip, 0.0, float("inf"), hi_open=True)
        check_int("seed", self.seed, 0, 2**32 - 1)
        check_int("eval_every", self.eval_every, 1)
        check_int("eval_batches", self.eval_batches, 1)
        check_int("save_every", self.save_every, 0)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("attention", self.attention, ATTENTION)
        check_choice("parallel", self.parallel, PARALLEL)
        parse_tokenizer(self.tokenizer)
        return self

    def positional_encoding(self) -> PositionalEncoding:
        """The model's positional encoding (`poslens.engine.pe`), from pe, pe_layers, rope_theta, rope_scaling,
        sliding_window and layer_types."""
        return PositionalEncoding.build(self.layers, pe=self.pe, pe_layers=self.pe_layers, rope_theta=self.rope_theta,
                                        rope_scaling=self.rope_scaling, sliding_window=self.sliding_window,
                                        layer_types=self.layer_types)

    def model_fields(self) -> dict[str, Any]:
        """The fields that fix the architecture and the data convention (a checkpoint must agree on all of them)."""
        return {k: getattr(self, k) for k in MODEL_FIELDS}


FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))
MODEL_FIELDS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "pe", "pe_layers", "rope_theta",
                "rope_scaling", "sliding_window", "layer_types", "bos", "blocks")


def parse_tokenizer(spec: str) -> tuple[str, int | None]:
    """``smollm2`` -> ("smollm2", None); ``bpe:4096`` -> ("bpe", 4096)."""
    if spec == "smollm2":
        return "smollm2", None
    if spec.startswith("bpe:"):
        try:
            size = int(spec[4:])
        except ValueError:
            size = 0
        require(size >= 260, f"tokenizer {spec!r}: bpe:VOCAB_SIZE needs an integer size >= 260 (256 bytes + "
                             "specials), e.g. bpe:4096")
        return "bpe", size
    raise UsageError(f"tokenizer must be smollm2 or bpe:VOCAB_SIZE (e.g. bpe:4096); got {spec!r}")


def preset_path(name: str, shipped: tuple[str, ...] = PRESETS, prefix: str = "") -> Path:
    """The JSON file of preset `name`: one of `shipped` (``presets/PREFIXNAME.json``), or a path to a .json file."""
    if name.endswith(".json"):
        path = Path(name).expanduser()
        require(path.is_file(), f"preset {name}: no such file; pass one of {', '.join(shipped)} or a .json file")
        return path
    require(name in shipped, f"unknown preset {name!r}; use one of {', '.join(shipped)} or a .json file")
    return Path(str(resources.files("poslens.train") / "presets" / f"{prefix}{name}.json"))


def load_preset(name: str) -> dict[str, Any]:
    """The fields a preset sets (unknown fields are a one-line error)."""
    path = preset_path(name)
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise UsageError(f"preset {name}: cannot read {path} ({type(e).__name__})") from None
    require(isinstance(fields, dict), f"preset {name}: {path} must hold a JSON object of fields")
    fields = {k: v for k, v in fields.items() if not k.startswith("_")}  # "_comment" keys are documentation
    unknown = sorted(set(fields) - set(FIELDS) - {"preset"})
    if unknown:
        raise UsageError(f"preset {name}: unknown field(s) {', '.join(unknown)}; known fields: {', '.join(FIELDS)}",
                         in_file=True)
    return fields


def resolve_config(preset: str = "tiny", **overrides: Any) -> TrainConfig:
    """The preset's fields, then `overrides` on top (unknown names are a one-line error), validated."""
    unknown = sorted(set(overrides) - set(FIELDS))
    require(not unknown, f"unknown field(s) {', '.join(unknown)}; known fields: {', '.join(FIELDS)}")
    fields = {**load_preset(preset), **overrides, "preset": preset}
    return TrainConfig(**fields).check()
