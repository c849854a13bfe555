"""Many small models of one shape trained as one computation: stacked parameters, one batched forward and backward,
one AdamW step for all.

The models of a sweep that share their parameter shapes (its seeds, and variants that differ only in positional
encoding: RoPE, NTK-scaled RoPE, linear or YaRN scaling, a sliding window, NoPE, per-layer patterns; or in the data
convention: a BOS first or not, packed cuts or document starts) are trained together: every weight is stacked over a
leading model axis [N, ...], every matrix product is a batched one over it (``torch.bmm``), and what differs between
the models is data inside the one computation: each model's rotary table per layer (the stock model's own
``rotary_emb`` output, an identity rotation where a layer has no RoPE) and its attention mask per layer (causal, or
causal within a sliding window). Each model keeps its own seed (initial weights: each is built alone by
`poslens.train.model.build_model`, then stacked), its own data (the blocks of its seed and data convention,
`poslens.train.data.train_batches`; a document-start block padded past its document's end, the padding not counted
in its loss, as `poslens.train.loop` counts it), its own gradient clipping (the norm over its own gradients) and its
own record (metrics.jsonl, checkpoints, run directory), exactly as `poslens.train.loop.train` writes them, so a
model's checkpoint resumes under either trainer and each finished model is a stock transformers checkpoint.

AdamW is elementwise, so one AdamW over the stacked parameters is each model's AdamW when the hyperparameters agree
(which `batch_key` makes sure of). What differs from training each model alone is the order in which the batched
matrix products sum, at float32 rounding (tests/test_batched.py states and checks the tolerance).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from poslens.engine.allocator import keep_freed_memory
from poslens.errors import check_int, require
from poslens.train.config import TrainConfig

# the fields that may differ between models trained together (and the seed): none of them changes a parameter shape
PE_FIELDS = ("pe", "pe_layers", "rope_theta", "rope_scaling", "sliding_window", "layer_types")
# the data convention, which may differ too: what a block holds (a BOS first or not, packed cuts or a document's
# start), never its length; each model reads its own blocks, as each reads its own seed's order
DATA_FIELDS = ("bos", "blocks")
_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
          "post_attention_layernorm.weight")


def batch_key(cfg: TrainConfig) -> str:
    """What models trained together must share: every training field but the seed, the positional encoding
    (`PE_FIELDS`) and the data convention (`DATA_FIELDS`), and where the model runs. Two configurations with equal
    keys have equal parameter shapes, token stream, block length, batch, schedule and optimizer."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in PE_FIELDS + DATA_FIELDS and k not in ("seed", "tensorboard", "preset")}
    return json.dumps(fields, sort_keys=True)


def groups(cfgs: Sequence[TrainConfig]) -> list[list[int]]:
    """Indices of `cfgs` grouped by `batch_key`, in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, c in enumerate(cfgs):
        out.setdefault(batch_key(c), []).append(i)
    return list(out.values())


def max_models(cfg: TrainConfig, vocab_size: int, device: torch.device, share: float = 0.25) -> int:
    """How many models of `cfg` to train at once: `share` of the free memory (MemAvailable on the CPU) over one
    model's `poslens.train.model.memory_estimate` twice over (the batched forward keeps a few more [tokens, vocab]
    tensors than the plain one), at least 1."""
    from poslens.train.model import memory_estimate

    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = 8 << 30
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    return max(1, int(share * free // (2 * memory_estimate(cfg, vocab_size))))


def l2_cache_bytes(default: int = 2 << 20, root: str | Path = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """One core's level-2 cache in bytes, read from Linux's sysfs (`root`: ``indexK/level``, ``type`` and ``size``,
    e.g. 2048K); `default` (2 MiB, the development machine's) where it cannot be read."""
    with contextlib.suppress(OSError, ValueError):
        for index in sorted(Path(root).glob("index*")):
            if (index / "level").read_text().strip() == "2" and \
                    (index / "type").read_text().strip() in ("Unified", "Data"):
                size = (index / "size").read_text().strip().upper()
                unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
                return int(size.rstrip("KMG")) * unit
    return default


def chunk_models(cfg: TrainConfig, device: torch.device, cache: int | None = None) -> int:
    """How many models of `cfg` one batched computation holds on the CPU: as many as keep its largest activation,
    the MLP's [models, micro-batch x seq_len, intermediate] float32 tensors, within `cache` bytes (None: this
    machine's L2 per core, `l2_cache_bytes`; 2 MiB on the development machine), at least 1; a part of more models
    trains these in turn within each step (one loop, one data pass, one evaluation). On the 2-core machine, per
    `pe-sinks` model and step, one thread: 34 ms at 4 models as one, 41 ms at 8, 42 ms at 16 (BENCHMARKS.md "Sweep
    training as one computation"). A model's arithmetic does not depend on the chunk, so the chunk changes speed
    only. On a GPU every model of the part is one computation."""
    if device.type != "cpu":
        return 1 << 30
    cache = l2_cache_bytes() if cache is None else cache
    return max(1, cache // (cfg.micro_batch * cfg.seq_len * cfg.intermediate * 4))


def chunk_slices(n: int, size: int) -> list[slice]:
    """`n` models cut into the fewest computations of at most `size` models, of sizes differing by at most one (9 at
    4: 3, 3, 3, not 4, 4, 1): compiled code has static shapes, so each distinct size is compiled once more (36 s of
    CPU cold), and a computation of one model pays a whole step's per-call overhead alone."""
    require(n >= 1 and size >= 1, f"chunk_slices needs n >= 1 and size >= 1, got n {n}, size {size}")
    k = -(-n // size)
    bounds = [i * n // k for i in range(k + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


# a part of fewer model-steps trains eagerly: compiling the layers cost 36 s of CPU cold (5 s warm, from the disk
# cache) against about 5 ms of CPU saved per model and step (`pe-sinks`, one thread, under load; BENCHMARKS.md
# "Compiled layers in the batched trainer"), so it repays itself cold from about 7,000 model-steps
MIN_COMPILE_MODEL_STEPS = 10_000


def worth_compiling(cfg: TrainConfig, models: int, device: torch.device) -> bool:
    """Whether `models` models of `cfg` trained as one part repay compiling their layers: on the CPU (where it was
    measured), at least `MIN_COMPILE_MODEL_STEPS` model-steps (`models` x steps)."""
    return device.type == "cpu" and models * cfg.steps >= MIN_COMPILE_MODEL_STEPS


# ---------------------------------------------------------------- stacked parameters and the batched forward


def parameter_names(model: torch.nn.Module) -> list[str]:
    """The trainable parameter names of a poslens SmolLM3 model in `model.parameters()` order (the tied LM head once,
    as the embedding); refuses a model with parameters the batched forward does not compute (biases, untied head)."""
    names = [n for n, _ in model.named_parameters()]
    layers = model.config.num_hidden_layers
    known = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{p}" for i in range(layers) for p in _LAYER}
    require(set(names) == known and model.config.tie_word_embeddings,
            "batched training needs the poslens decoder (tied embeddings, no biases); train this model alone")
    return names


def stack_parameters(models: Sequence[torch.nn.Module], device: torch.device) -> dict[str, torch.Tensor]:
    """Every parameter of `models` stacked over a new leading model axis, as leaf tensors that require grad."""
    names = parameter_names(models[0])
    own = [dict(m.named_parameters()) for m in models]
    return {n: torch.stack([p[n].detach() for p in own]).to(device).requires_grad_(True) for n in names}


def unstack_into(params: dict[str, torch.Tensor], index: int, model: torch.nn.Module) -> torch.nn.Module:
    """Copy model `index`'s slice of the stacked `params` into `model` (a module of the same configuration)."""
    own = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in params.items():
            own[n].copy_(p[index].to(own[n].device))
    return model


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x` [N, tokens, d] with each model's gain `weight` [N, d]."""
    return weight[:, None, :] * F.rms_norm(x, (x.shape[-1],), eps=eps)


def decoder_layer(x: torch.Tensor, weights: tuple[torch.Tensor, ...], cos: torch.Tensor | None,
                  sin: torch.Tensor | None, mask: torch.Tensor, shape: tuple[int, int, int, int, int, float],
                  attention: Callable[..., torch.Tensor] = F.scaled_dot_product_attention) -> torch.Tensor:
    """One decoder layer of N models over the residual stream `x` [N, B * T, d]: `weights` the layer's stacked
    parameters in `_LAYER`'s order, `cos`/`sin` the models' rotary tables [N, 1, T, 1, hd] (the sine's first half
    negated; None where no model's layer has RoPE), `mask` [N * B, 1, T, T] (True: the query sees the key), `shape`
    (B, T, query heads, key/value heads, head size, the norm's eps), `attention` torch's SDPA or a function of
    its arguments. A pure function of tensors, so one compiled graph serves every layer and every computation of
    the same shapes (`poslens.train.compiled.compile_static`)."""
    wq, wk, wv, wo, wg, wu, wd, norm1, norm2 = weights
    b, t, h, kv, hd, eps = shape
    n = x.shape[0]
    y = _norm(x, norm1, eps)
    qkv = torch.cat((wq, wk, wv), dim=1)  # [N, (H+2K)hd, d]
    qkv = torch.bmm(y, qkv.transpose(1, 2)).view(n, b, t, h + 2 * kv, hd)  # [N, B, T, heads, hd]
    qk, v = qkv[..., :h + kv, :], qkv[..., h + kv:, :]
    if cos is not None and sin is not None:  # queries and keys rotated as one tensor
        qk = qk * cos + torch.roll(qk, hd // 2, dims=-1) * sin
    q, k = qk[..., :h, :], qk[..., h:, :]
    # [N B, heads, T, hd] views; grouped-query attention: key/value head g serves query heads g h/K, ...
    q, k, v = (z.reshape(n * b, t, z.shape[3], hd).transpose(1, 2) for z in (q, k, v))
    a = attention(q, k, v, attn_mask=mask, scale=hd ** -0.5, enable_gqa=kv != h)
    a = a.transpose(1, 2).reshape(n, b * t, h * hd)
    x = x + torch.bmm(a, wo.transpose(1, 2))
    y = _norm(x, norm2, eps)
    gate = torch.bmm(y, wg.transpose(1, 2))
    up = torch.bmm(y, wu.transpose(1, 2))
    return x + torch.bmm(F.silu(gate) * up, wd.transpose(1, 2))


class BatchedDecoder:
    """The forward pass of N SmolLM3 decoders of one shape over stacked parameters, each with its own positional
    encoding: per layer, a rotary table per model (``rotary_emb``'s cos and sin of the model; cos 1 and sin 0, the
    identity, where the model's layer has no RoPE) and an attention mask per model (causal; causal within the
    sliding window where the model's layer slides)."""

    def __init__(self, models: Sequence[torch.nn.Module], seq_len: int, device: torch.device,
                 compiled: Any = None):
        c = models[0].config
        self.compiled = compiled  # decoder_layer's compiled code (`poslens.train.compiled`), or None: eager
        self.n, self.layers, self.heads, self.kv = len(models), c.num_hidden_layers, c.num_attention_heads, \
            c.num_key_value_heads
        self.head_dim, self.eps, self.vocab = c.head_dim, c.rms_norm_eps, c.vocab_size
        for m in models:
            k = m.config
            require((k.num_hidden_layers, k.hidden_size, k.intermediate_size, k.num_attention_heads,
                     k.num_key_value_heads, k.head_dim, k.vocab_size, k.hidden_act) ==
                    (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads,
                     c.num_key_value_heads, c.head_dim, c.vocab_size, "silu"),
                    "batched training needs models of one shape (layers, widths, heads, vocabulary)")
        self.seq_len, self.device = seq_len, device
        pos = torch.arange(seq_len)
        probe = torch.zeros(1, dtype=torch.float32)
        tables = []
        for m in models:
            with torch.no_grad():
                cos, sin = m.model.rotary_emb(probe, pos[None])  # [1, T, hd]: the stock model's own table
            tables.append((cos[0].float(), sin[0].float()))
        self.rope: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.masks: list[torch.Tensor | None] = []
        causal = pos[None, :] <= pos[:, None]  # [T (query), T (key)]
        for layer in range(self.layers):
            uses = [bool(m.model.layers[layer].self_attn.use_rope) for m in models]
            if any(uses):
                cos = torch.stack([t[0] if u else torch.ones_like(t[0]) for t, u in zip(tables, uses)])
                sin = torch.stack([t[1] if u else torch.zeros_like(t[1]) for t, u in zip(tables, uses)])
                # [N, 1 (batch), T, 1 (heads), hd]; rotate_half(x) * sin = roll(x, hd / 2) * sin with the first
                # half of sin negated (the same products: a sign moved from one factor to the other)
                half = sin.shape[-1] // 2
                sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
                self.rope.append((cos[:, None, :, None].to(device), sin[:, None, :, None].to(device)))
            else:
                self.rope.append(None)
            windows = [m.model.layers[layer].self_attn.sliding_window for m in models]
            if any(windows):
                mask = torch.stack([causal & (pos[:, None] - pos[None, :] < w) if w else causal for w in windows])
                self.masks.append(mask[:, None, None].to(device))  # [N, 1, 1, T, T]
            else:
                self.masks.append(None)
        self.causal = causal.to(device)
        hd = c.head_dim
        self.identity = (torch.ones(self.n, 1, seq_len, 1, hd, device=device),
                         torch.zeros(self.n, 1, seq_len, 1, hd, device=device))
        self._expanded: dict[tuple[int, int, int], torch.Tensor] = {}

    def _mask(self, layer: int, n: int, b: int, t: int) -> torch.Tensor:
        """Layer `layer`'s boolean mask [N * B, 1, T, T] (True: the query sees the key). An explicit mask, also where
        every model is causal: CPU SDPA ran forward and backward in 7.1 ms with it against 10.7 ms with
        ``is_causal`` on [32, 8, 64, 8] (one thread)."""
        require(t == self.seq_len, f"batched training reads sequences of {self.seq_len} tokens; got {t}")
        key = (layer, n, b)
        if key not in self._expanded:
            mask = self.masks[layer] if self.masks[layer] is not None else self.causal[None, None, None]
            # materialised: a broadcast (causal) and a stacked (windowed) mask then have the same strides, so the
            # compiled layer's guards hold for both and one graph serves every computation of a size
            self._expanded[key] = mask.expand(n, b, 1, t, t).reshape(n * b, 1, t, t).contiguous()
        return self._expanded[key]

    def logits(self, params: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """Logits [N, B, T, V] of input ids [N, B, T] (row n read by model n)."""
        n, b, t = ids.shape
        x = self.hidden(params, ids)
        return torch.bmm(x, params["model.embed_tokens.weight"].transpose(1, 2)).reshape(n, b, t, self.vocab)

    def hidden(self, params: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """The final norm's output [N, B * T, d] for input ids [N, B, T]; each layer through `decoder_layer`, or its
        compiled code (`compiled`, while gradients are recorded; held-out passes run eagerly)."""
        n, b, t = ids.shape
        embed = params["model.embed_tokens.weight"]  # [N, V, d]
        offsets = (torch.arange(n, device=ids.device) * self.vocab)[:, None, None]
        x = F.embedding((ids + offsets).reshape(n, b * t), embed.reshape(n * self.vocab, -1))  # [N, BT, d]
        step = self.compiled if self.compiled is not None and torch.is_grad_enabled() else decoder_layer
        shape = (b, t, self.heads, self.kv, self.head_dim, self.eps)
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            weights = tuple(params[p + name] for name in _LAYER)
            cos, sin = self.rope[layer] if self.rope[layer] is not None else (None, None)
            if cos is None and step is not decoder_layer:  # compiled: a layer no model rotates gets the identity
                cos, sin = self.identity  # rotation (x * 1 + roll(x) * 0 = x), so one graph serves NoPE chunks too
            x = step(x, weights, cos, sin, self._mask(layer, n, b, t), shape)
        return _norm(x, params["model.norm.weight"], self.eps)

    def losses(self, params: dict[str, torch.Tensor], block: torch.Tensor) -> torch.Tensor:
        """Each model's mean next-token cross-entropy [N] on its rows of `block` [N, B, T + 1] (in the weights'
        dtype) over its counted targets, through `head_loss` (the logits are never held whole). A padded input
        (`poslens.train.data.PAD`) reads as token 0, as in `poslens.train.loop.next_token_loss`: it comes after
        every counted target of its row, so no counted prediction sees it."""
        x = self.hidden(params, block[..., :-1].clamp(min=0))
        targets = block[..., 1:].reshape(x.shape[0], -1)
        return head_loss(x, params["model.embed_tokens.weight"], targets)


class _HeadLoss(torch.autograd.Function):
    """Mean cross-entropy of the tied LM head over each model's counted targets (a `poslens.train.data.PAD` target,
    after a document shorter than a document-start block, is not counted: the plain loop's ``ignore_index``),
    chunked over tokens: each chunk's logits are made, turned into the loss and (when gradients are needed) into the
    gradients of the hidden states and of the embedding, and dropped; the backward pass only scales the stored
    gradients. The [tokens, vocabulary] logits never exist whole, so every step stays in cache (a plain
    cross-entropy of 8 x 64 tokens x 2,048 entries per model reads and writes 4 MB several times per step). A
    model with no counted target (a held-out micro-batch of padding only) has loss 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, grads: bool,
                chunk: int) -> torch.Tensor:
        from poslens.train.data import PAD

        n, t, _ = x.shape
        loss = torch.zeros(n, dtype=x.dtype, device=x.device)
        gx = torch.empty_like(x) if grads else None
        gw = torch.zeros_like(w) if grads else None
        counted = targets != PAD  # [N, tokens]
        count = counted.sum(dim=1).clamp(min=1).tolist()  # the divisor per model: t without padding
        padded = not bool(counted.all())
        for m in range(n):
            for s in range(0, t, chunk):
                xs, ys, keep = x[m, s:s + chunk], targets[m, s:s + chunk].clamp(min=0), counted[m, s:s + chunk]
                logits = xs @ w[m].T  # [c, V]
                lse = torch.logsumexp(logits, dim=-1)
                each = lse - logits.gather(1, ys[:, None])[:, 0]
                loss[m] += (each[keep] if padded else each).sum()
                if grads:  # d loss / d logits = (softmax - one-hot) / count, 0 at a padded target
                    p = logits.sub_(lse[:, None]).exp_()
                    p.scatter_add_(1, ys[:, None], torch.full_like(lse[:, None], -1.0))
                    p.div_(count[m])
                    if padded:
                        p.mul_(keep[:, None])
                    torch.mm(p, w[m], out=gx[m, s:s + chunk])
                    gw[m].addmm_(p.T, xs)
        if grads:
            ctx.save_for_backward(gx, gw)
        return loss / torch.tensor(count, dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gx, gw = ctx.saved_tensors
        return gx * grad[:, None, None], gw * grad[:, None, None], None, None, None


def head_loss(x: torch.Tensor, embed: torch.Tensor, targets: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """Each model's mean next-token cross-entropy [N] of hidden states `x` [N, tokens, d] through its tied LM head
    `embed` [N, V, d] against `targets` [N, tokens] (PAD targets not counted), `chunk` tokens at a time
    (`_HeadLoss`)."""
    grads = torch.is_grad_enabled() and (x.requires_grad or embed.requires_grad)
    return _HeadLoss.apply(x, embed, targets, grads, chunk)


def clip_per_model(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip each model's gradient to norm `max_norm` over its own gradients (``clip_grad_norm_`` applied to each
    model alone: the norm of the per-tensor norms, coefficient max_norm / (norm + 1e-6) capped at 1); returns the
    norms [N] before clipping. `max_norm` inf: measure only."""
    grads = [p.grad for p in params if p.grad is not None]
    per_tensor = torch.stack([g.flatten(1).norm(dim=1) for g in grads])  # [tensors, N]
    total = per_tensor.norm(dim=0)  # [N]
    if max_norm != float("inf"):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.reshape(-1, *[1] * (g.dim() - 1)))
    return total


# ---------------------------------------------------------------- optimizer state, one model's slice of it


def slice_optimizer(state: dict[str, Any], index: int) -> dict[str, Any]:
    """Model `index`'s AdamW state out of the stacked optimizer's `state_dict()`: the state dict of its own AdamW
    (the same parameter indices and groups), as `poslens.train.loop` saves it."""
    own = {}
    for i, s in state["state"].items():
        own[i] = {k: (v.clone() if k == "step" else v[index].clone()) for k, v in s.items()}
    return {"state": own, "param_groups": [dict(g) for g in state["param_groups"]]}


def stack_optimizer(states: Sequence[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """The stacked optimizer's state dict from the models' own AdamW state dicts (their step counts must agree)."""
    first = states[0]
    out = {}
    for i, s in first["state"].items():
        steps = {float(st["state"][i]["step"]) for st in states}
        require(len(steps) == 1, "models trained together must resume from the same step")
        out[i] = {k: (v.clone() if k == "step" else torch.stack([st["state"][i][k] for st in states]).to(device))
                  for k, v in s.items()}
    return {"state": out, "param_groups": [dict(g) for g in first["param_groups"]]}


# ---------------------------------------------------------------- training


@dataclasses.dataclass
class _Member:
    cfg: TrainConfig
    model: torch.nn.Module  # float32, on the CPU: built from the seed, loaded from a checkpoint, written at the end
    work: Any  # poslens.train.loop.Work
    build: Path
    start: int
    trainer: dict[str, Any] | None
    tokenizer: Any = None  # the saved tokenizer: it adds the BOS where the model was trained with one


def train_batched(cfgs: Sequence[TrainConfig], outs: Sequence[str | Path], progress: bool = True,
                  stop_after: int | None = None, label: str | None = None,
                  chunk: int | None = None, compile: bool = False,
                  on_step: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Train every configuration of `cfgs` (equal `batch_key`: one token directory, shape, block length and
    optimisation; each its own seed, positional encoding and data convention: packed cuts or document starts, a BOS
    first or not) as one computation, and write model i into `outs[i]` exactly as
    `poslens.train.loop.train` would (a stock transformers checkpoint and a poslens run directory, resumable from
    ``.OUT.partial/``); returns each model's final metrics.

    Models whose checkpoints are at different steps train in turn, each set of equal steps as one computation.
    `stop_after`: stop (as if interrupted) after that many steps, leaving each model's checkpoint behind. `chunk`:
    models per computation (None: `chunk_models`); the parts of a step run in turn. `compile`: each decoder layer's
    training forward and backward through compiled code (`poslens.train.compiled`, cached on disk; eager where the
    compiler fails, saying so), equal to the eager computation up to float32 rounding. `on_step(step)`: called after
    each training step with the steps done (a sweep's parent process shows its workers' progress with it)."""
    require(len(cfgs) == len(outs) and len(cfgs) >= 1, "train_batched needs one output per configuration")
    for c in cfgs:
        c.check()
    require(len({batch_key(c) for c in cfgs}) == 1,
            "models trained together must share every training field but the seed, the positional encoding and the "
            "data convention (bos, blocks)")
    require(cfgs[0].tokens is not None, "batched training needs a token directory (cfg.tokens)")
    require(not cfgs[0].compile, "batched training does not compile the model; train with compile off")
    if stop_after is not None:
        check_int("stop_after", stop_after, 1)
    if chunk is not None:
        check_int("chunk", chunk, 1)
    keep_freed_memory()
    targets = [Path(o).expanduser().absolute() for o in outs]
    require(len(set(targets)) == len(targets), "train_batched: two configurations share one output directory")
    try:
        return _open_and_train(list(cfgs), targets, progress, stop_after, label, chunk, compile, on_step)
    except _Stopped as stopped:
        return stopped.metrics


def _open_and_train(cfgs: list[TrainConfig], targets: list[Path], progress: bool, stop_after: int | None,
                    label: str | None, chunk: int | None, compile: bool,
                    on_step: Callable[[int], None] | None) -> list[dict[str, Any]]:
    from poslens.io.bars import library_bars
    from poslens.io.results import open_run
    from poslens.train import checkpoint as ckpt
    from poslens.train.loop import Work

    with contextlib.ExitStack() as stack:
        stack.enter_context(library_bars(False))  # no "Writing model shards" bar per model and checkpoint
        runs = [stack.enter_context(open_run(t, False, inputs=[cfgs[0].tokens])) for t in targets]
        works = [Work(r.work) for r in runs]
        try:
            return _train_all(cfgs, works, [r.build for r in runs], progress, stop_after, label, chunk, compile,
                              on_step)
        except BaseException as e:
            if not isinstance(e, _Stopped):
                for w in works:
                    if ckpt.find(w.path) is None:
                        w.metrics.unlink(missing_ok=True)
            raise


class _Stopped(Exception):
    """Raised to leave the run directories unplaced (stop_after reached); carries each model's metrics."""

    def __init__(self, metrics: list[dict[str, Any]]):
        super().__init__("stopped")
        self.metrics = metrics


def _train_all(cfgs: list[TrainConfig], works: list[Any], builds: list[Path], progress: bool,
               stop_after: int | None, label: str | None, chunk: int | None, compile: bool,
               on_step: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    from poslens.engine.distributed import setup
    from poslens.subnormals import subnormals_flushed
    from poslens.train.loop import (
        _finish,
        _truncate_metrics,
        attention_kernel,
        check_attention,
        check_batch,
        check_training_data,
        resume_state,
    )
    from poslens.train.model import build_model
    from poslens.train.tokens import open_tokens

    d = setup(cfgs[0].device)
    require(d.world == 1, "batched training runs in one process (not under torchrun)")
    check_batch(cfgs[0].batch_size, cfgs[0].micro_batch, 1)
    check_attention(cfgs[0], d.device)
    tf = open_tokens(cfgs[0].tokens)
    header = check_training_data(cfgs[0], tf)
    for cfg in {(c.bos, c.blocks): c for c in cfgs}.values():  # each data convention holds a batch and a sequence
        check_training_data(cfg, tf)
    members = []
    for cfg, work, build in zip(cfgs, works, builds):
        model = build_model(cfg, tf.vocab_size, bos_token_id=tf.header["bos_token_id"],
                            eos_token_id=tf.header["eos_token_id"])
        start, trainer = resume_state(work, model, cfg, header, "plain")
        _truncate_metrics(work.metrics, start)
        members.append(_Member(cfg, model, work, build, start, trainer))
    tokenizers = {}
    for m in members:
        if m.cfg.bos not in tokenizers:
            tokenizers[m.cfg.bos] = tf.tokenizer()
            if m.cfg.bos:
                tokenizers[m.cfg.bos].add_bos_token = True  # as `poslens.train.loop.train` saves it
        m.tokenizer = tokenizers[m.cfg.bos]
    results: dict[int, dict[str, Any]] = {}
    starts = sorted({m.start for m in members})
    for start in starts:  # models at different steps (a sweep killed between saves of two groups) train in turn
        idx = [i for i, m in enumerate(members) if m.start == start]
        # `batch_key`: one attention kernel for every model of the computation; subnormals as `loop.train` has them
        with attention_kernel(cfgs[0]), subnormals_flushed(d.device):
            out = _run([members[i] for i in idx], tf, header, d.device, progress, stop_after, label, chunk, compile,
                       on_step)
        results.update(zip(idx, out))
    if any(r.get("stopped") for r in results.values()):
        raise _Stopped([results[i] for i in range(len(members))])
    final = []
    for i, m in enumerate(members):
        _finish(m.build, m.model, None, m.tokenizer, m.cfg, m.work, results[i], tf)
        final.append({**results[i], "tokens_path": str(tf.path.resolve())})
    return final


class _Chunk:
    """Models trained as one computation: their decoder, stacked parameters, AdamW and schedule (`members[sl]`)."""

    def __init__(self, members: list[_Member], sl: slice, cfg: TrainConfig, device: torch.device,
                 compiled: Any = None):
        from poslens.train import checkpoint as ckpt
        from poslens.train.loop import adamw, make_scheduler

        self.sl, own = sl, members[sl]
        self.clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        self.decoder = BatchedDecoder([m.model for m in own], cfg.seq_len, device, compiled)
        self.params = stack_parameters([m.model for m in own], device)
        self.ordered = list(self.params.values())
        dims = [own[0].model.get_parameter(k).dim() for k in self.params]
        # fused AdamW: 1.8-2.1 ms a step for 4 pe-sinks models against 11-14 ms for foreach (one thread)
        self.opt = adamw([p for p, k in zip(self.ordered, dims) if k >= 2],
                         [p for p, k in zip(self.ordered, dims) if k < 2], cfg, fused=True)
        self.sched = make_scheduler(self.opt, cfg)
        if own[0].start:
            self.opt.load_state_dict(stack_optimizer([m.trainer["optimizer"] for m in own], device))
            self.sched.load_state_dict(own[0].trainer["scheduler"])
            ckpt.set_rng_state(own[0].trainer["rng"])

    def gradients(self, blocks: Sequence[torch.Tensor], factors: Sequence[tuple[torch.Tensor, torch.Tensor]]
                  ) -> torch.Tensor:
        """Accumulate each model's gradient over the step's micro-batches `blocks` [N, B, T + 1], micro-batch j's
        losses times factors[j][0] over factors[j][1]; returns each model's loss of the step [N]."""
        total = torch.zeros(self.decoder.n, device=self.decoder.device)
        for block, (mul, div) in zip(blocks, factors):
            loss = self.decoder.losses(self.params, block) * mul / div
            loss.sum().backward()  # the models' parameters are disjoint: each gets its own gradient
            total += loss.detach()
        return total

    def update(self) -> torch.Tensor:
        """Each model's clipping, the AdamW step and the schedule; returns each model's gradient norm before
        clipping [N]."""
        norms = clip_per_model(self.ordered, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        return norms


def _gradients(c: _Chunk, chunks: Sequence[_Chunk], blocks: Sequence[torch.Tensor],
               factors: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """`c.gradients`; where its compiled layer fails (no C++ compiler, a compiler error on another CPU), one line
    says so, every computation of `chunks` runs eagerly from then on, and this step's gradients are computed again
    eagerly (those of the micro-batches before the failure dropped)."""
    from poslens.train.compiled import failed

    try:
        return c.gradients(blocks, factors)
    except Exception as e:  # noqa: BLE001 - a compiler's error, whatever its kind; eager code raises its own again
        if c.decoder.compiled is None:
            raise
        failed(e)
        for other in chunks:
            other.decoder.compiled = None
        for p in c.ordered:
            p.grad = None
        return c.gradients(blocks, factors)


def _stack_rows(blocks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Each model's block [B_i, T + 1] stacked into [N, B, T + 1]; a shorter block (or None: none left) filled with
    rows of `poslens.train.data.PAD`, which the loss does not count (only held-out batches differ in length)."""
    from poslens.train.data import PAD

    present = [b for b in blocks if b is not None]
    if len(present) == len(blocks) and len({b.shape for b in present}) == 1:
        return torch.stack(present)
    rows, width = max(b.shape[0] for b in present), present[0].shape[1]
    out = torch.full((len(blocks), rows, width), PAD, dtype=torch.long)
    for i, b in enumerate(blocks):
        if b is not None:
            out[i, :b.shape[0]] = b
    return out


def _run(members: list[_Member], tf: Any, header: dict, device: torch.device, progress: bool,
         stop_after: int | None, label: str | None, chunk: int | None, compile: bool,
         on_step: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Train `members` (all at the same step) in one loop, `chunk_models` of them at a time as one computation;
    returns each model's metrics. Each model reads the blocks of its own seed and data convention and weighs its
    micro-batches as `poslens.train.loop` does (by their counted targets where a document-start block is padded)."""
    from tqdm.auto import tqdm

    from poslens.train.compiled import compile_static
    from poslens.train.data import counted_rows, eval_batches, loss_shares, train_batches
    from poslens.train.loop import bos_id, document_separator, gemm_flops, peak_flops
    from poslens.train.model import count_parameters, flops_per_token

    cfg, n, start = members[0].cfg, len(members), members[0].start
    data = [(bos_id(m.cfg, tf), document_separator(m.cfg, tf)) for m in members]  # (bos, separator) per model
    size = chunk or chunk_models(cfg, device)
    compiled = compile_static(decoder_layer) if compile else None  # one compiled function: every chunk's layers
    chunks = [_Chunk(members, sl, cfg, device, compiled) for sl in chunk_slices(n, size)]
    logs = [m.work.metrics.open("a") for m in members]
    fpt = flops_per_token(members[0].model.config, cfg.seq_len)
    peak, peak_label = peak_flops(device)
    if peak is None:
        peak, peak_label = gemm_flops(device), "measured float32 GEMM"
    counts = count_parameters(members[0].model)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    val = {k: eval_batches(tf.val, cfg.seq_len, cfg.eval_batches * cfg.micro_batch, cfg.micro_batch, 0, 1, *k)
           for k in set(data)}
    evals = max(len(v) for v in val.values())

    def record(i: int, row: dict[str, Any]) -> None:
        logs[i].write(json.dumps(row) + "\n")
        logs[i].flush()

    def evaluate() -> list[float]:  # `poslens.train.loop.evaluate`: block means weighted by their counted rows
        total = torch.zeros(n, dtype=torch.float64, device=device)
        rows = torch.zeros(n, dtype=torch.float64, device=device)
        with torch.no_grad():
            for j in range(evals):
                for c in chunks:
                    own = [val[k] for k in data[c.sl]]
                    block = _stack_rows([v[j] if j < len(v) else None for v in own])
                    counted = torch.tensor([counted_rows(b) for b in block], dtype=torch.float64, device=device)
                    total[c.sl] += c.decoder.losses(c.params, block.to(device)).double() * counted
                    rows[c.sl] += counted
        return (total / rows).tolist()

    what = label or f"training {n} models as one ({cfg.preset}, {counts['total'] / 1e6:.2f}M params each)"
    bar = tqdm(total=cfg.steps, initial=start, desc=what, disable=not progress, unit="step")
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    stepped = 0.0  # seconds in the optimizer steps this process ran (evaluation and saving left out)
    last: list[dict[str, Any]] = [{} for _ in members]
    try:
        if start == 0:
            for i, e in enumerate(evaluate()):
                record(i, {"step": 0, "eval_loss": e})
        for step in range(start, end):
            t0 = time.perf_counter()
            reads = [(m.cfg.seed, *k) for m, k in zip(members, data)]  # (seed, bos, separator) per model
            batches = {r: train_batches(tf.train, cfg.seq_len, step, cfg.batch_size, cfg.micro_batch, 0, 1, *r)
                       for r in set(reads)}
            # each micro-batch's factor in the step's mean: loss / micro, or loss * its share of the counted targets
            # where a block is padded (`poslens.train.loop._step`: the same two operations)
            scale = {}
            for r, micro_r in batches.items():
                shares = loss_shares(micro_r)
                scale[r] = [(1.0, len(micro_r)) if shares is None else (sh, 1.0) for sh in shares or micro_r]
            micro = len(batches[reads[0]])
            total = torch.zeros(n, device=device)
            norms = torch.zeros(n, device=device)
            for c in chunks:
                blocks = [torch.stack([batches[r][j] for r in reads[c.sl]]).to(device) for j in range(micro)]
                factors = [tuple(torch.tensor(f, device=device) for f in zip(*(scale[r][j] for r in reads[c.sl])))
                           for j in range(micro)]
                total[c.sl] = _gradients(c, chunks, blocks, factors)
                norms[c.sl] = c.update()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            stepped += dt
            tps = tokens_per_step / dt  # each model's own tokens per second of wall time (n of them at once)
            lr = chunks[0].sched.get_last_lr()[0]
            for i, (loss, gnorm) in enumerate(zip(total.tolist(), norms.tolist())):
                last[i] = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": gnorm, "tokens_per_s": tps,
                           "mfu": tps * n * fpt / peak, "step_s": dt, "models": n}
                record(i, last[i])
            bar.set_postfix(loss=f"{sum(total.tolist()) / n:.3f}", tok_s=f"{tps * n:,.0f}")
            bar.update(1)
            done = step + 1
            if on_step is not None:
                on_step(done)
            if done % cfg.eval_every == 0 or done == cfg.steps:
                for i, e in enumerate(evaluate()):
                    last[i]["eval_loss"] = e
                    record(i, {"step": done, "eval_loss": e})
            if done < cfg.steps and ((cfg.save_every and done % cfg.save_every == 0) or done == end):
                for c in chunks:
                    _save(members[c.sl], c.params, c.opt, c.sched, done, header)
    finally:
        bar.close()
        for f in logs:
            f.close()
    for c in chunks:
        for j, m in enumerate(members[c.sl]):
            unstack_into(c.params, j, m.model)
    if end < cfg.steps:
        return [{**r, "stopped": True} for r in last]
    # the run's throughput: every step this process ran over their summed time (each step's own: metrics.jsonl)
    tps = (end - start) * tokens_per_step / stepped if stepped > 0 else None
    return [{"final_loss": r.get("loss"), "final_eval_loss": r.get("eval_loss"), "tokens_per_s": tps,
             "mfu": tps * n * fpt / peak if tps else None, "mfu_reference": peak_label, "mfu_peak_flops": peak,
             "flops_per_token": fpt, "parameters": counts, "ranks": 1, "tokens_seen": cfg.steps * tokens_per_step,
             "batched_models": n}
            for r in last]


def _save(members: list[_Member], params: dict[str, torch.Tensor], opt: torch.optim.Optimizer, sched: Any, step: int,
          header: dict) -> None:
    """Each model's own checkpoint, in `poslens.train.loop`'s format (its weights, its slice of AdamW's state)."""
    from poslens.train import checkpoint as ckpt

    state = opt.state_dict()
    for i, m in enumerate(members):
        unstack_into(params, i, m.model)
        trainer = {"step": step, "config": dataclasses.asdict(m.cfg), "tokens": header,
                   "optimizer": slice_optimizer(state, i), "optimizer_format": "plain",
                   "scheduler": sched.state_dict(), "rng": ckpt.rng_state()}
        ckpt.save(m.work.path, m.model, None, trainer, m.tokenizer)

