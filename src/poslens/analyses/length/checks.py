"""Up-front checks for evaluating a model past its training length, and what transformers does there.

What transformers (5.x) does with a RoPE or NoPE model past `max_position_embeddings` (read from its rotary
modules and mask code, and tested in tests/test_length_checks.py):

* default, linear, yarn, llama3 RoPE: nothing changes. cos and sin are computed from the position ids on the fly
  (no table, no truncation, no warning); yarn's attention factor applies at every length.
* `dynamic` RoPE: the base is recomputed from the longest position of the batch, max(position_ids) + 1, once it
  exceeds `max_position_embeddings`, and then applies to every position of that batch, early ones included. The
  module keeps the grown base for later, shorter batches until one is shorter than `max_position_embeddings`, so
  a run at 8L followed by one at 2L evaluates the 2L batch with the 8L base. `reset_rotary` restores the
  module's original state; `run_pass` calls it before every batch, so each batch is evaluated as if alone.
* `longrope` (Phi-3.5): switches from short to long factors for the whole batch once max(position_ids) + 1 exceeds
  `original_max_position_embeddings`.
* Masks do not read `max_position_embeddings`; position ids that do not step by +1 are read as packed-sequence
  boundaries when no mask is passed (masks.py).
* A learned or absolute position table (GPT-2's `wpe`, OPT's `embed_positions`) has no row past its size:
  `poslens.engine.models.position_table` finds one in any future family by its modules.
* GPT-J's rotary angles are a fixed sin/cos table of `max_position_embeddings` rows (base 10000): no angle past it
  (`check_eval_length` refuses), and no frequencies to rescale (NTK and YaRN refuse).

poslens's Capture refuses sequences longer than `max_position_embeddings`; `context_limit_lifted` lifts that
guard for the duration of a capture when the model computes positions on the fly and nothing it runs reads
`max_position_embeddings` (checked by `check_maps_length`, which a run calls up front), so the maps past L are the
model's own.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from poslens.engine.families import positional_encoding, rotary_modules
from poslens.engine.models import CONTEXT_FIELDS, max_positions, position_limit
from poslens.errors import UsageError, check_int, check_memory, gib

# rope types whose frequencies do not depend on max_position_embeddings during a forward
STATIC_ROPE = ("default", "linear", "yarn", "llama3", "proportional")
CAPTURE_CHUNK = 1 << 28  # Capture's default chunk_bytes for per-head score blocks


def rope_types(model: nn.Module) -> set[str]:
    """The rope types of the model's rotary modules (empty for a model without RoPE in any layer, also where a rotary
    module exists unused: Falcon's ALiBi form)."""
    if not any(p in ("rope", "partial-rope") for p in positional_encoding(model)):
        return set()
    out: set[str] = set()
    for m in rotary_modules(model):
        t = getattr(m, "rope_type", "default")
        out |= set(t.values()) if isinstance(t, dict) else {t}
    return out


def check_eval_length(model: nn.Module, eval_len: int, train_len: int | None = None) -> None:
    """Refuse, in one line, an evaluation length a model cannot represent: past a learned position table. With the
    run's `train_len` at or past the table (its default on such a model: the table's size), nothing past it can be
    measured at all, and the line says what can: the loss by position inside the table, from a shorter train_len."""
    eval_len = check_int("eval_len", eval_len, 2)
    limit = position_limit(model)
    if limit is None or eval_len <= limit[1]:
        return
    n = limit[1]
    if train_len is not None and train_len >= n:
        raise UsageError(f"eval_lens: {eval_len} tokens reach past the {limit[0]}, and so does every length past "
                         f"train_len {train_len}: such a model has no position past its table; to compare positions "
                         f"inside it, set a shorter train_len, e.g. train_len {n // 2} with eval_lens {n // 2},{n}",
                         param="eval_lens")
    raise UsageError(f"eval_lens: {eval_len} tokens reach past the {limit[0]}: it has nothing for later positions; "
                     f"evaluate at most {n} tokens", param="eval_lens")


def length_notes(model: nn.Module, eval_len: int) -> list[str]:
    """What transformers changes for this model at `eval_len` tokens (for the run record); empty when nothing."""
    limit = max_positions(model)
    notes = []
    for t in sorted(rope_types(model)):
        if "dynamic" in t and eval_len > limit:
            notes.append(f"rope_type {t}: past max_position_embeddings ({limit}) transformers recomputes the rotary "
                         f"base from the batch's length, for every position of the batch")
        if t == "longrope":
            notes.append("rope_type longrope: past original_max_position_embeddings transformers uses the long "
                         "factors for every position of the batch")
    return notes


def reset_rotary(model: nn.Module) -> None:
    """Undo what a previous batch did to a dynamic or longrope rotary module (see the module docstring)."""
    for m in rotary_modules(model):
        kind = getattr(m, "rope_type", "default")  # GPT-J's fixed table has none
        types = kind if isinstance(kind, dict) else {None: kind}
        for layer_type, t in types.items():
            if "dynamic" not in t:
                continue
            prefix = "" if layer_type is None else f"{layer_type}_"
            original = getattr(m, f"{prefix}original_inv_freq")
            m.register_buffer(f"{prefix}inv_freq", original.clone(), persistent=False)
            setattr(m, f"{prefix}max_seq_len_cached", m.original_max_seq_len)


def check_maps_length(model: nn.Module, eval_len: int) -> None:
    """Refuse, in one line, capturing the averaged maps at `eval_len` tokens: past a position table, or past
    `max_position_embeddings` for a rope type that reads that limit during the forward."""
    check_eval_length(model, eval_len)
    limit = max_positions(model)
    moving = sorted(t for t in rope_types(model) if t not in STATIC_ROPE)
    if eval_len > limit and moving:
        raise UsageError(f"eval_len {eval_len}: the averaged maps cannot be captured past max_position_embeddings "
                         f"({limit}) for rope_type {moving[0]}, whose frequencies transformers computes from that "
                         "limit during the forward; capture maps at lengths up to it", param="eval_lens")


@contextmanager
def context_limit_lifted(model: nn.Module, eval_len: int):
    """Let Capture run `eval_len` tokens past `max_position_embeddings` (its guard reads the config) while the
    model computes the same thing: refused (`check_maps_length`) for a position table or a rope type that reads the
    limit in a forward."""
    check_maps_length(model, eval_len)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = max_positions(model)
    if eval_len <= limit:
        yield
        return
    name = next((n for n in CONTEXT_FIELDS if isinstance(getattr(config, n, None), int)), None)
    if name is None:  # BLOOM: the config records no length, so nothing reads one
        yield
        return
    setattr(config, name, eval_len)
    try:
        yield
    finally:
        setattr(config, name, limit)


def memory_estimate(model: nn.Module, eval_len: int, batch_size: int, groups: int = 0, map_layers: int = 0,
                    map_keys: int = 0, chunk_bytes: int = 1 << 26, window_mask: bool = False) -> dict[str, int]:
    """Bytes an evaluation at `eval_len` tokens needs on top of the loaded weights, by part.

    forward: the largest transient of one layer in no-grad mode (hidden states, q/k/v, the MLP's inner width; SDPA
    streams its scores); readers: the chunked LM head and attention readers (a few chunks of `chunk_bytes`);
    maps: Capture's float32 sums, `map_keys` maps of `map_layers` layers for each of `groups` groups, twice (the
    metrics read a copy of the sums), float64 means while finishing, the Toeplitz fits' pseudo-inverse (about
    2.5 T levels squared) and Capture's chunks of per-head scores; mask: an explicit window mask, one byte per
    (query, key)."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    item = model.get_input_embeddings().weight.element_size()
    heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size  # GPT-2: n_inner
    width = 4 * c.hidden_size + (heads + 2 * kv) * head_dim + 3 * ffn
    parts = {"forward": batch_size * eval_len * width * item,
             "readers": 4 * chunk_bytes,
             "maps": (map_layers * (2 * groups * map_keys * 4 + 8 * (map_keys + 1)) * eval_len**2
                      + 3 * 8 * (5 * eval_len // 2) ** 2 + 4 * CAPTURE_CHUNK) if map_keys else 0,
             "mask": batch_size * eval_len**2 if window_mask else 0}
    parts["total"] = sum(parts.values())
    return parts


def check_eval_memory(model: nn.Module, eval_len: int, batch_size: int, available: int | None = None,
                      **sizes) -> dict[str, int]:
    """Refuse, before any work, an evaluation whose `memory_estimate` exceeds the available memory; returns it."""
    est = memory_estimate(model, eval_len, batch_size, **sizes)
    device = model.get_input_embeddings().weight.device
    if available is None and device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    big = max((k for k in est if k != "total"), key=est.get)
    check_memory(est["total"], f"evaluating {eval_len} tokens in batches of {batch_size}",
                 f"most of it is {big} ({gib(est[big])}); lower the evaluation length or the batch size"
                 + (", or capture maps at fewer layers, groups or lengths" if big == "maps" else ""), available)
    return est
