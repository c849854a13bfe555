"""Interventions on the residual stream and the null checks, as (input ids, write hooks, position ids) for
HookedModel.run (docs/leakage.md, "Interventions").

Specs (the `--interventions` values):
    mean       position 0's embedding replaced by the mean token embedding (over the whole vocabulary), times the
               model's embedding scale
    random     ... by a random vector of the same norm as the original (seeded)
    token:ID   ... by the embedding of token ID (times the embedding scale: what the model writes for that token)
    nobos      position 0 dropped altogether (the maps are one position shorter)
    patch:SOURCE:K@L
               the residual stream entering layer L (`blocks.L.hook_resid_pre`, L from 0) at positions 0..K-1
               (K = 1: position 0 alone; larger K: the prefix) replaced by the states, at the same layer and
               positions, of SOURCE: `other` (another sequence of the batch), `inside` (a window of the same
               document starting at a random offset inside it, without a BOS: its position 0 is a content
               token), `start` (another document's start, without its BOS: its position 0 is that document's
               first token, a real token where the model saw document starts; with a fixed BOS at position 0,
               `patch:start:1@0` is the in-distribution counterpart of `mean`), `mean` (the mean over the
               batch's sequences). The mask and the other positions are kept.
    freeze     position 0's whole trajectory (embedding and every layer's output) replaced by that of a reference
               sequence: with a fixed first token a no-op by causality (a test of the code, not a finding)
    shift:K    every position id moved by K: for RoPE without length-dependent scaling a no-op by construction
               (a test of the code); for other encodings a real intervention
The embedding replacements act on `hook_embed` (the embedding module's output, after any embedding scale, e.g.
Gemma's sqrt(d)), i.e. what enters the first layer, before the forward pass; so an embedding row written there is
multiplied by the model's scale (`engine.families.embedding_scale`), as the model multiplies its own rows (BLOOM:
and put through its LayerNorm after the embedding, as the model does: `engine.families.embedded_rows`).
`check` refuses parameters outside the model (a token beyond the vocabulary, a shift past its positions, a layer
it lacks) before any work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from poslens.engine.families import embedded_rows
from poslens.errors import UsageError

NAMES = ("mean", "random", "token", "nobos", "freeze", "shift", "patch")
SOURCES = ("other", "inside", "start", "mean")
USAGE = ("use mean, random, token:ID, nobos, freeze, shift:K or patch:SOURCE:K@L (SOURCE other, inside, start "
         "or mean)")


@dataclass(frozen=True)
class Spec:
    """A parsed intervention: `value` is the token id, the shift or the number of patched positions."""

    name: str
    value: int | None = None
    source: str | None = None
    layer: int | None = None


def parse(spec: str) -> Spec:
    """Spec('token', 17) from 'token:17', Spec('patch', 1, 'inside', 3) from 'patch:inside:1@3'; a one-line
    UsageError naming --interventions for anything else."""
    text = str(spec)
    name, _, arg = text.partition(":")
    try:
        if name == "patch":
            source, _, rest = arg.partition(":")
            count, at, layer = rest.partition("@")
            if source in SOURCES and at:
                return Spec(name, int(count), source, int(layer))
        elif name in ("token", "shift") and arg:
            return Spec(name, int(arg))
        elif name in ("mean", "random", "nobos", "freeze") and not arg:
            return Spec(name)
    except ValueError:
        pass
    raise UsageError(f"interventions: unknown intervention {text!r}; {USAGE}")


def check(specs: list[str], model_or_config, seq_len: int, batch_size: int | None = None) -> list[Spec]:
    """Parse every spec and refuse, in one line, any whose parameters the model or the run cannot take (call it
    while validating, before any forward): token:ID outside the vocabulary, shift:K with K + seq_len past the
    model's positions or K < 0, patch layers the model lacks, patched positions outside the sequence (at most
    seq_len - 1: an `inside` source has no BOS), `other`/`mean` sources with batches of one, nobos below 3
    tokens."""
    from poslens.engine.models import max_positions

    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    out = []
    for text in specs:
        s = parse(text)
        bad = None
        if s.name == "token" and not 0 <= s.value < config.vocab_size:
            bad = f"token id {s.value} is outside the vocabulary (0-{config.vocab_size - 1})"
        elif s.name == "shift" and not 0 <= s.value <= max_positions(config) - seq_len:
            bad = (f"positions {s.value}-{s.value + seq_len - 1} are outside the model's {max_positions(config)} "
                   f"positions; use 0 <= K <= {max_positions(config) - seq_len}")
        elif s.name == "nobos" and seq_len < 3:
            bad = "nobos needs seq_len >= 3"
        elif s.name == "patch":
            layers = config.num_hidden_layers
            if not 0 <= s.layer < layers:
                bad = f"layer {s.layer} is outside the model's layers (0-{layers - 1})"
            elif not 1 <= s.value <= seq_len - 1:
                bad = f"{s.value} patched positions: use 1 to seq_len - 1 = {seq_len - 1}"
            elif s.source in ("other", "start", "mean") and batch_size is not None and batch_size < 2:
                bad = f"a {s.source} source needs batch_size >= 2"
        if bad:
            raise UsageError(f"interventions: {text}: {bad}")
        out.append(s)
    return out


def describe(spec: str) -> str:
    """One line on what intervention `spec` changes (positions from 0, as the papers count them: the BOS is position
    0; layers from 1, with the hook point that names it)."""
    s = parse(spec)
    if s.name == "patch":
        where = "position 0" if s.value == 1 else f"positions 0-{s.value - 1}"
        source = {"other": "another sequence of the batch", "mean": "the batch's mean",
                  "start": "another document's start without its BOS (that document's first token first)",
                  "inside": "a window starting inside the same document (a content token first, no BOS)"}[s.source]
        return (f"the residual stream entering layer {s.layer + 1} (blocks.{s.layer}.hook_resid_pre) at {where} "
                f"replaced by the states of {source}")
    return {"mean": "position 0's embedding replaced by the mean token embedding (at the model's embedding scale)",
            "random": "position 0's embedding replaced by a random direction of the same norm",
            "token": f"position 0's embedding replaced by token {s.value}'s",
            "nobos": "position 0 dropped (maps one position shorter)",
            "freeze": "position 0's trajectory replaced by a reference sequence's (a no-op with a fixed first token)",
            "shift": f"every position id moved by {s.value} (a no-op for RoPE without length-dependent scaling, which "
                     "is relative, and for ALiBi and NoPE, which read no position ids; a learned table's rows move)"
            }[s.name]


def _embedding_matrix(model) -> torch.Tensor:
    return model.get_input_embeddings().weight


def prepare(spec: str, model, hm, ids: torch.Tensor, reference: torch.Tensor | None = None, seed: int = 0, *,
            inside: torch.Tensor | None = None, bos_prepended: bool = True, starts: torch.Tensor | None = None):
    """The inputs of one intervention on a batch `ids` [B, T]: (ids, hooks, position_ids).

    `reference` [T] is the sequence whose position-0 trajectory `freeze` imposes (default: ids[0]); `inside`
    [B, T] are the batch's windows starting inside the same documents (`engine.data.document_windows`, same BOS
    policy as ids: with `bos_prepended` their BOS is dropped, so the source's position 0 is a content token);
    `starts` [B, T] the documents' starts a `start` patch copies from (default: ids, which are starts).
    """
    s = check([spec], model, ids.shape[1], ids.shape[0])[0]
    emb = _embedding_matrix(model)
    if s.name == "nobos":
        return ids[:, 1:], {}, None
    if s.name == "shift":
        pos = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1) + s.value
        return ids, {}, pos
    if s.name == "freeze":
        ref = (ids[0] if reference is None else reference)[None].to(ids.device)
        points = ["hook_embed"] + [f"blocks.{l}.hook_resid_post" for l in range(hm.n_layers)]
        states = _states(hm, ref, points)
        return ids, {p: _replace(1, lambda x0, p=p: states[p][:, :1].expand_as(x0)) for p in points}, None
    if s.name == "patch":
        point = f"blocks.{s.layer}.hook_resid_pre"
        source = _patch_source(s, ids if starts is None else starts.to(ids.device), inside, bos_prepended)
        state = _states(hm, source, [point])[point][:, : s.value]  # [B', K, d]
        if s.source == "mean":
            state = state.float().mean(0, keepdim=True)
        return ids, {point: _replace(s.value, lambda x0: state.to(x0.device).expand_as(x0))}, None
    if s.name == "mean":
        mean = embedded_rows(model, emb.detach().float().mean(0))  # times the scale (BLOOM: its embedding norm)
        hook = _replace(1, lambda x0: mean.to(x0.device).expand_as(x0))
    elif s.name == "random":
        gen = torch.Generator().manual_seed(int(seed))
        direction = torch.randn(emb.shape[1], generator=gen)
        direction = direction / direction.norm()

        def rand(x0):
            return direction.to(x0.device) * x0.float().norm(dim=-1, keepdim=True)

        hook = _replace(1, rand)
    else:
        other = embedded_rows(model, emb.detach()[s.value].float())
        hook = _replace(1, lambda x0: other.to(x0.device).expand_as(x0))
    return ids, {"hook_embed": hook}, None


def _patch_source(s: Spec, ids: torch.Tensor, inside: torch.Tensor | None, bos_prepended: bool) -> torch.Tensor:
    """The token ids whose states a patch copies (row b is the source of sequence b; `mean` averages them)."""
    if s.source == "inside":
        if inside is None:
            raise UsageError(f"interventions: patch:{s.source} needs windows inside the documents")
        return inside[:, 1:] if bos_prepended else inside
    if s.source == "start":  # the previous sequence of the batch, its BOS dropped
        other = ids.roll(1, 0)
        return other[:, 1:] if bos_prepended else other
    return ids.roll(1, 0) if s.source == "other" else ids


def _states(hm, ids: torch.Tensor, points: list[str]) -> dict[str, torch.Tensor]:
    """The values at `points` of a forward of `ids` (it stops after the deepest point)."""
    states: dict[str, torch.Tensor] = {}

    def keep(x, ctx):
        states[ctx.name] = x.clone()

    hm.run(ids, hooks={p: keep for p in points})
    return states


def _replace(count: int, value: Callable[[torch.Tensor], torch.Tensor]):
    """A write hook setting positions 0..count-1 of x [B, T, d] to value(x[:, :count])."""
    def hook(x, ctx):
        out = x.clone()
        out[:, :count] = value(x[:, :count]).to(x.dtype)
        return out

    return hook

