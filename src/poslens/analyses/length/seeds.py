"""Other seeds of the evaluated model's variant (`poslens length --seed-models`): refused up front when they are
not (the same model again, a copy of its weights, another architecture, training length or tokenizer), and their
weights swapped into the loaded model when their passes start (model-major, so each is loaded once per run and a
resumed run swaps the right ones back)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from poslens.analyses.length.checks import rope_types
from poslens.engine.pipeline import Job
from poslens.errors import UsageError


class SeedWeights:
    """Which model's weights the loaded model holds (0: its own; k: seed model k), and the swap between them."""

    def __init__(self, job: Job, seeds: list[str]) -> None:
        self.job, self.seeds = job, list(seeds)
        self.current = 0
        self.own: dict | None = None  # the loaded model's own weights, kept once before the first swap

    @contextlib.contextmanager
    def use(self, k: int) -> Iterator[None]:
        """A block in which the loaded model holds model k's weights (nothing is done when it does already)."""
        if self.current != k:
            if self.own is None:
                self.own = {n: t.detach().clone() for n, t in self.job.model.state_dict().items()}
            self.job.model.load_state_dict(self.own if k == 0 else load_weights(self.job, self.seeds[k - 1]))
            self.current = k
        yield

    def restore(self) -> None:
        """The loaded model's own weights back, as loaded."""
        if self.own is not None:
            self.job.model.load_state_dict(self.own)
            self.current = 0


def distinct_models(model: str, seeds: list[str]) -> None:
    """Refuse a seed model that names the evaluated model or another seed model again (the same directory: a
    t-interval over copies of one model has zero width and says nothing), before anything is loaded."""
    from poslens.engine.models import resolve

    def where(spec: str) -> str:
        ms = resolve(spec)
        return os.path.realpath(ms.path) if ms.kind in ("local", "gguf") and ms.path else ms.spec

    first: dict[str, str] = {where(model): model}
    for spec in seeds:
        key = where(spec)
        if key in first:
            what = "the evaluated model" if first[key] == model else f"seed model {first[key]}"
            raise UsageError(f"seed_models: {spec} is {what} again; give each seed's model once (a model twice gives "
                             "an interval of zero width over copies of one model)", param="seed_models")
        first[key] = spec


def weights_digest(model) -> str:
    """A digest of every parameter and buffer of `model` (names, shapes, dtypes and bytes): equal for copies."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trained_length(spec: str, model) -> int:
    """The length a model was trained at: the `seq_len` its poslens training run recorded (run.json beside the
    weights), else its max_position_embeddings."""
    from poslens.engine.models import max_positions, resolve

    ms = resolve(spec)
    record = Path(ms.path) / "run.json" if ms.kind == "local" and ms.path else None
    if record is not None and record.is_file():
        try:
            meta = json.loads(record.read_text())
            if meta.get("kind") == "train" and isinstance(meta.get("config", {}).get("seq_len"), int):
                return int(meta["config"]["seq_len"])
        except (OSError, ValueError):
            pass
    return max_positions(model)


def vocabulary(tokenizer) -> tuple | None:
    """What decides how a tokenizer cuts text into ids: its vocabulary (token -> id) and its special ids."""
    if tokenizer is None:
        return None
    return (tuple(sorted(tokenizer.get_vocab().items())), tokenizer.bos_token_id, tokenizer.eos_token_id)


def check_same_variant(job: Job, spec: str, seen: dict[str, str] | None = None) -> str:
    """Check, up front, that `spec` is another seed of the loaded model's variant (same class, parameter shapes,
    positional encoding, windows, rotary settings (type, share of each head turned, base), vocabulary, tokenizer and
    training length, and other weights than every model before it: `seen`, model spec -> weights digest); returns it
    (its weights are loaded when its passes start)."""
    from poslens.engine.families import positional_encoding, sliding_windows
    from poslens.engine.models import load_model, load_tokenizer
    from poslens.engine.pe import rotary_fraction

    cfg = job.config
    other, other_tok = load_model(spec, dtype=cfg.dtype, device="cpu", pe=cfg.pe)
    a, b = job.model, other
    shapes = {n: tuple(t.shape) for n, t in a.state_dict().items()}
    facts = {"architecture": (type(a).__name__, type(b).__name__),
             "parameter shapes": (shapes, {n: tuple(t.shape) for n, t in b.state_dict().items()}),
             "positional encoding": (positional_encoding(a), positional_encoding(b)),
             "sliding windows": (sliding_windows(a.config), sliding_windows(b.config)),
             "rope type": (rope_types(a), rope_types(b)),
             # before the base: rope_base reads the second frequency, base^(-2/d), which moves with the rotary width d
             "share of each head RoPE turns": (rotary_fraction(a.config), rotary_fraction(b.config)),
             "rope base": (rope_base(a), rope_base(b))}
    for what, (x, y) in facts.items():
        if x != y:
            raise UsageError(f"seed_models: {spec} is not another seed of {cfg.model}'s variant: {what} not "
                             "the same; give models trained alike but for the seed", param="seed_models")
    own, theirs = trained_length(cfg.model, a), trained_length(spec, b)
    if own != theirs:
        raise UsageError(f"seed_models: {spec} was trained at length {theirs} and {cfg.model} at {own}; give seeds "
                         "trained at the same length", param="seed_models")
    mine = vocabulary(load_tokenizer(cfg.model) if cfg.tokenizer is not None else job.tokenizer)
    if mine is not None and vocabulary(other_tok) is not None and vocabulary(other_tok) != mine:
        raise UsageError(f"seed_models: {spec} has another tokenizer than {cfg.model} (its vocabulary or special "
                         "ids differ), so the same text would be other ids to it; give seeds trained with the same "
                         "tokenizer", param="seed_models")
    if seen is not None:
        digest = weights_digest(b)
        same = next((name for name, d in seen.items() if d == digest), None)
        if same is not None:
            raise UsageError(f"seed_models: {spec} has the same weights as {same} (a copy of one model gives an "
                             "interval of zero width); give models trained with other seeds", param="seed_models")
        seen[spec] = digest
    del other
    return spec


def rope_base(model) -> float | None:
    from poslens.engine.families import rotary_modules

    for m in rotary_modules(model):
        inv = getattr(m, "inv_freq", None)
        if inv is not None:
            return float(inv[1]) if inv.numel() > 1 else float(inv[0])
    return None


def load_weights(job: Job, spec: str) -> dict:
    from poslens.engine.models import load_model

    other, _ = load_model(spec, dtype=job.config.dtype, device=str(job.dist.device), pe=job.config.pe)
    return other.state_dict()
