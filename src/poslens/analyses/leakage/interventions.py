"""Interventions on position 0 and the null checks, as (input ids, write hooks, position ids) for HookedModel.run.

Specs (the `--interventions` values):
    mean       position 0's embedding replaced by the mean token embedding (over the whole vocabulary)
    random     ... by a random vector of the same norm as the original (seeded)
    token:ID   ... by the embedding of token ID
    nobos      position 0 dropped altogether (the maps are one position shorter)
    freeze     position 0's whole trajectory (embedding and every layer's output) replaced by that of the first
               sequence: with a fixed first token a no-op (it is already identical), otherwise it removes the
               variation of the position-0 fingerprint across inputs
    shift:K    every position id moved by K (a null: RoPE depends on i - j only, so nothing may change)
The embedding replacements act on `hook_embed` (after any embedding scale, e.g. Gemma's sqrt(d)), i.e. what
enters the first layer, before the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from poslens.errors import UsageError

NAMES = ("mean", "random", "token", "nobos", "freeze", "shift")


def parse(spec: str) -> tuple[str, int | None]:
    """('token', 17) from 'token:17'; a one-line UsageError naming --interventions for anything else."""
    name, _, arg = str(spec).partition(":")
    ok = name in NAMES and ((name in ("token", "shift")) == bool(arg))
    try:
        value = int(arg) if arg else None
    except ValueError:
        ok = False
    if not ok:
        raise UsageError(f"interventions: unknown intervention {spec!r}; use mean, random, token:ID, nobos, "
                         "freeze or shift:K")
    return name, value


def _embedding_matrix(model) -> torch.Tensor:
    return model.get_input_embeddings().weight


def _replace0(vector: Callable[[torch.Tensor], torch.Tensor]):
    def hook(x, ctx):
        out = x.clone()
        out[:, 0] = vector(x[:, 0]).to(x.dtype)
        return out

    return hook


def prepare(spec: str, model, hm, ids: torch.Tensor, reference: torch.Tensor | None = None, seed: int = 0):
    """The inputs of one intervention on a batch `ids` [B, T]: (ids, hooks, position_ids).

    `reference` [T] is the sequence whose position-0 trajectory `freeze` imposes (default: ids[0]).
    """
    name, arg = parse(spec)
    emb = _embedding_matrix(model)
    if name == "nobos":
        if ids.shape[1] < 3:
            raise UsageError("interventions: nobos needs seq_len >= 3")
        return ids[:, 1:], {}, None
    if name == "shift":
        pos = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1) + arg
        return ids, {}, pos
    if name == "freeze":
        ref = (ids[0] if reference is None else reference)[None].to(ids.device)
        states: dict[str, torch.Tensor] = {}
        points = ["hook_embed"] + [f"blocks.{l}.hook_resid_post" for l in range(hm.n_layers)]

        def keep(x, ctx):
            states[ctx.name] = x[0, 0].clone()
            return None

        hm.run(ref, hooks={p: keep for p in points})
        return ids, {p: _replace0(lambda x0, p=p: states[p].expand_as(x0)) for p in points}, None
    if name == "mean":
        mean = emb.detach().float().mean(0)
        hook = _replace0(lambda x0: mean.to(x0.device).expand_as(x0))
    elif name == "random":
        gen = torch.Generator().manual_seed(int(seed))
        direction = torch.randn(emb.shape[1], generator=gen)
        direction = direction / direction.norm()

        def rand(x0):
            return direction.to(x0.device) * x0.float().norm(dim=-1, keepdim=True)

        hook = _replace0(rand)
    else:
        if not 0 <= arg < emb.shape[0]:
            raise UsageError(f"interventions: token:{arg} is outside the vocabulary (0-{emb.shape[0] - 1})")
        other = emb.detach()[arg]
        scale = _embed_scale(model)
        hook = _replace0(lambda x0: (other.float() * scale).to(x0.device).expand_as(x0))
    return ids, {"hook_embed": hook}, None


def _embed_scale(model) -> float:
    """The factor the model's embedding module applies to a looked-up row (Gemma: sqrt(d); else 1)."""
    module = model.get_input_embeddings()
    scale = getattr(module, "embed_scale", None)
    return float(scale) if scale is not None else 1.0
