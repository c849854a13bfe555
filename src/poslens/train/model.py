"""The trained decoder: a stock transformers SmolLM3 (RMSNorm, SwiGLU, grouped-query attention).

SmolLM3 reads `no_rope_layers` from its config (1 = the layer applies RoPE, 0 = it does not), so a
saved checkpoint reloads with plain ``AutoModelForCausalLM.from_pretrained(dir)``, positional encoding
intact, with no poslens import.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from poslens.errors import UsageError, require
from poslens.train.config import TrainConfig


def rope_layers(pe: str, pattern: str | None, layers: int) -> list[int]:
    """Per-layer RoPE flags (1 = RoPE, 0 = NoPE) from `pe` or from a pattern (``0,1,1,1`` or ``0111``).

    A pattern shorter than `layers` is tiled when its length divides `layers` (``1110`` on 8 layers gives
    1,1,1,0,1,1,1,0).
    """
    if pattern is None or str(pattern).strip() == "":
        return [int(pe == "rope")] * layers
    text = str(pattern).replace(" ", "")
    chars = text.split(",") if "," in text else list(text)
    require(all(c in ("0", "1") for c in chars) and chars,
            f"pe_layers must be 0/1 flags such as 0,1,1,1 or 0111 (1 = RoPE, 0 = NoPE); got {pattern!r}")
    require(layers % len(chars) == 0, f"pe_layers has {len(chars)} flags, which does not divide layers "
                                      f"({layers}); give one flag per layer or a repeating unit")
    return [int(c) for c in chars] * (layers // len(chars))


def model_config(cfg: TrainConfig, vocab_size: int, bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> SmolLM3Config:
    """The SmolLM3 config of `cfg` for a vocabulary of `vocab_size` tokens."""
    flags = rope_layers(cfg.pe, cfg.pe_layers, cfg.layers)
    return SmolLM3Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden // cfg.heads, max_position_embeddings=cfg.seq_len, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        no_rope_layers=flags, use_sliding_window=False, tie_word_embeddings=True,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=None,
        initializer_range=0.02, rms_norm_eps=1e-6, attention_dropout=0.0, use_cache=False,
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
    """One-line error if a checkpoint's configuration `saved` differs from `cfg` in a field that matters."""
    current = {**cfg.model_fields(), "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "steps": cfg.steps,
               "lr": cfg.lr, "warmup": cfg.warmup, "min_lr_ratio": cfg.min_lr_ratio, "seed": cfg.seed,
               "preset": cfg.preset, "weight_decay": cfg.weight_decay, "beta1": cfg.beta1, "beta2": cfg.beta2,
               "grad_clip": cfg.grad_clip}
    diff = [k for k, v in current.items() if saved.get(k) != v]
    if diff:
        k = diff[0]
        raise UsageError(f"{what} was written for another configuration ({k}: {saved.get(k)!r} there, {current[k]!r} "
                         f"now{', and ' + str(len(diff) - 1) + ' more' if len(diff) > 1 else ''}); delete it or "
                         "choose another --out")
