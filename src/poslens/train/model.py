"""The trained decoder: a stock transformers SmolLM3 (RMSNorm, SwiGLU, grouped-query attention).

SmolLM3 reads `no_rope_layers` (1 = the layer applies RoPE, 0 = it does not), `rope_parameters`,
`sliding_window` and `layer_types` from its config, so a saved checkpoint reloads with plain
``AutoModelForCausalLM.from_pretrained(dir)``, positional encoding intact, with no poslens import.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from poslens.engine.pe import CONFIG_FIELD
from poslens.errors import UsageError
from poslens.train.config import TrainConfig

CAUSAL = "poslens_causal"  # SDPA told `is_causal` instead of handed an explicit causal mask (`causal_attention`)


def _causal_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask for a layer with a window (`local_size`), None for every other layer (SDPA then runs
    with `is_causal=True`). A CAUSAL model takes input ids only (`_plain_inputs`: one sequence per row from position 0,
    no padding mask, no cache), so a full layer's mask is the plain causal one, also where transformers hands it in
    the packed-sequence form it builds under torch.compile (it cannot read the position ids inside a graph to rule
    packing out). Decided on a Python value, so a compiled graph never reads a tensor to decide."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs) if args or kwargs.get("local_size") is not None else None


def _plain_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a CAUSAL model: only input ids (and labels), so that `_causal_mask` may drop the mask."""
    given = [k for k in ("attention_mask", "position_ids", "past_key_values", "cache_position", "inputs_embeds")
             if kwargs.get(k) is not None]
    if args or given:
        raise UsageError(f"a model set to {CAUSAL} (`causal_attention`) takes input_ids only, not "
                         f"{', '.join(given) or 'positional arguments'}: call it with input_ids=..., or reload it "
                         "without causal_attention")


@functools.cache
def _register_causal() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL, _causal_mask)


def causal_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Have `model`'s attention call SDPA with ``is_causal=True`` in every layer without a window (`_causal_mask`), as
    transformers itself does in eager mode. Under torch.compile, transformers before torch 2.14 builds an explicit
    [B, 1, T, T] mask, which keeps SDPA off its causal flash kernels (`benchmarks/sdpa_kernels.py`). The same attention
    for the inputs the trainers give (input ids only; anything else is refused). Not saved with the model (a
    checkpoint's config names no attention implementation)."""
    _register_causal()
    model.set_attn_implementation(CAUSAL)
    model.register_forward_pre_hook(_plain_inputs, with_kwargs=True)
    return model


def model_config(cfg: TrainConfig, vocab_size: int, bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> SmolLM3Config:
    """The SmolLM3 config of `cfg` for a vocabulary of `vocab_size` tokens: its positional encoding
    (`TrainConfig.positional_encoding`) as SmolLM3 fields, and the training convention (``poslens_variant``:
    label, RoPE base and scaling as given, bos, seq_len) so that a reload can say how it was trained."""
    head_dim = cfg.hidden // cfg.heads
    pe_fields = cfg.positional_encoding().config_fields(head_dim, cfg.seq_len)
    pe_fields[CONFIG_FIELD] = {**pe_fields[CONFIG_FIELD], "bos": cfg.bos, "seq_len": cfg.seq_len}
    return SmolLM3Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=head_dim, max_position_embeddings=cfg.seq_len, hidden_act="silu", tie_word_embeddings=True,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=None,
        initializer_range=0.02, rms_norm_eps=1e-6, attention_dropout=0.0, use_cache=False, **pe_fields,
    )


def build_model(cfg: TrainConfig, vocab_size: int, device: str | torch.device = "cpu",
                bos_token_id: int | None = None, eos_token_id: int | None = None) -> SmolLM3ForCausalLM:
    """A freshly initialised float32 model (weights seeded by ``cfg.seed``); ``device="meta"`` allocates nothing."""
    config = model_config(cfg, vocab_size, bos_token_id, eos_token_id)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        if str(device) != "meta":
            torch.manual_seed(cfg.seed)
        return SmolLM3ForCausalLM(config)


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Parameter counts: total (tied weights once), embedding, and the rest."""
    seen: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        seen[id(p)] = p
    total = sum(p.numel() for p in seen.values())
    embed = model.get_input_embeddings().weight.numel()
    return {"total": total, "embedding": embed, "non_embedding": total - embed}


def parameter_count(cfg: TrainConfig, vocab_size: int) -> int:
    """Parameters of the model `cfg` describes (tied embeddings counted once), from its shape alone."""
    d, hd, f = cfg.hidden, cfg.hidden // cfg.heads, cfg.intermediate
    per_layer = d * hd * (2 * cfg.heads + 2 * cfg.kv_heads) + 3 * d * f + 2 * d
    return vocab_size * d + cfg.layers * per_layer + d


def memory_estimate(cfg: TrainConfig, vocab_size: int, world: int = 1, bf16: bool = False) -> int:
    """A lower estimate of the bytes one rank needs to train `cfg`: weights, gradients and the two AdamW moments in
    float32 (16 bytes per parameter; sharded over the ranks with FSDP), one micro-batch's float32 logits, and the
    activations kept for the backward pass, at least 4 d + 2 f values per token and layer (2 bytes each under bf16
    autocast, `bf16`, else 4). Meant to refuse sizes that cannot run, never one that can."""
    params = parameter_count(cfg, vocab_size) * 16 / (world if cfg.parallel == "fsdp" else 1)
    tokens = cfg.micro_batch * cfg.seq_len
    width = 2 if bf16 else 4
    acts = tokens * cfg.layers * (4 * cfg.hidden + 2 * cfg.intermediate) * width
    return int(params + tokens * vocab_size * 4 + acts)


def check_memory_fits(cfg: TrainConfig, vocab_size: int, device: torch.device, world: int = 1) -> None:
    """Refuse, before anything is allocated, a model whose `memory_estimate` exceeds the device's free memory."""
    from poslens.errors import check_memory

    cuda = device.type == "cuda"
    free = torch.cuda.mem_get_info(device)[0] if cuda else None
    n = parameter_count(cfg, vocab_size)
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and cuda)
    check_memory(memory_estimate(cfg, vocab_size, world, bf16),
                 f"training {n / 1e6:,.1f}M parameters (layers {cfg.layers}, hidden {cfg.hidden}, intermediate "
                 f"{cfg.intermediate}, vocabulary {vocab_size:,}) with micro_batch {cfg.micro_batch} x seq_len "
                 f"{cfg.seq_len}", "choose a smaller model (hidden, intermediate, layers) or micro_batch", free)


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token: 6 N (matmul weights, LM head included) + attention scores and mixing.

    N counts every weight matrix a token passes through (the LM head too; the embedding lookup is free).
    Attention: Q K^T and A V cost 2 * 2 * T * d_head * heads per token per layer in the forward pass with
    a full mask; the causal mask halves it on average; backward is twice the forward: 6 * L * T * H * d_head.
    """
    d, f, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    hd = config.head_dim
    attn = d * hd * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    n_matmul = L * (attn + 3 * d * f) + d * config.vocab_size
    return 6.0 * n_matmul + 6.0 * L * seq_len * config.num_attention_heads * hd


def check_compatible(saved: dict[str, Any], cfg: TrainConfig, what: str) -> None:
    """One-line error if a checkpoint's configuration `saved` differs from `cfg` in a field that matters (a field
    the checkpoint's release did not have counts as its default)."""
    current = {**cfg.model_fields(), "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "steps": cfg.steps,
               "lr": cfg.lr, "warmup": cfg.warmup, "min_lr_ratio": cfg.min_lr_ratio, "seed": cfg.seed,
               "preset": cfg.preset, "weight_decay": cfg.weight_decay, "beta1": cfg.beta1, "beta2": cfg.beta2,
               "grad_clip": cfg.grad_clip}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    # the held-out set: the first eval_batches x micro_batch blocks (either may change alone, not the set)
    held_out = "held-out blocks (eval_batches x micro_batch)"
    current[held_out] = cfg.eval_batches * cfg.micro_batch
    saved = {**saved, held_out: saved.get("eval_batches", defaults["eval_batches"])
             * saved.get("micro_batch", defaults["micro_batch"])}
    diff = [k for k, v in current.items() if saved.get(k, defaults.get(k)) != v]
    if diff:
        k = diff[0]
        raise UsageError(f"{what} was written for another configuration ({k}: {saved.get(k)!r} there, {current[k]!r} "
                         f"now{', and ' + str(len(diff) - 1) + ' more' if len(diff) > 1 else ''}); delete it or "
                         "choose another --out")
