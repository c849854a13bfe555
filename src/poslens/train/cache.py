"""Trained models cached by their full configuration: ``$POSLENS_CACHE/trained/NAME-KEY``.

The key is a fingerprint of every `TrainConfig` field and of the token directory's identity (its resolved path and
header), so a model is trained once per configuration and data, and reused by `poslens sweep`, `poslens reproduce`
and anything else that asks for the same model. An interrupted training resumes from its checkpoint in the cache
(``.NAME-KEY.partial/``) when the same model is asked for again. A cached model whose files differ from the content
hashes of its manifest (a byte changed on disk) is not used: it is retrained, and a line says so (`finished`,
`clear_corrupt`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from poslens.io.lock import entry_lock
from poslens.train.config import TrainConfig

CACHE_VERSION = 1  # bump when training changes what a cached model would be


def tokens_of(cfg: TrainConfig, progress: bool = False) -> Path:
    """The token directory `cfg` trains on: its `tokens`, or the embedded corpus tokenized with its tokenizer."""
    from poslens.train.tokens import default_tokens

    return Path(cfg.tokens).expanduser().resolve() if cfg.tokens else default_tokens(cfg.tokenizer, progress)


def slug(cfg: TrainConfig) -> str:
    """A readable name of the model: preset (a .json preset's file name), positional encoding (none, rope or
    mixed-PATTERN), scaling, window, bos, blocks other than packed: ``tiny-none``, ``cpu-rope-ntk-8-window-32-bos``,
    ``tiny-rope-bos-doc-start``."""
    name = Path(cfg.preset).stem if cfg.preset.endswith(".json") else cfg.preset
    parts = [name, cfg.pe if cfg.pe_layers is None else "mixed-" + str(cfg.pe_layers).replace(",", "")]
    if cfg.rope_scaling:
        parts.append(cfg.rope_scaling.replace(":", "-"))
    if cfg.sliding_window:
        parts.append(f"window-{cfg.sliding_window}")
    if cfg.bos:
        parts.append("bos")
    if cfg.blocks != "packed":
        parts.append(cfg.blocks)
    return "-".join(parts)


def trained_model_dir(cfg: TrainConfig, tokens: Path) -> Path:
    """Where the cache keeps the model trained with `cfg` on `tokens` (keyed by both)."""
    from poslens.engine.models import cache_root
    from poslens.io.checkpoint import fingerprint
    from poslens.io.tokenfile import HEADER

    header = json.loads((tokens / HEADER).read_text())
    # what the model is: every field but where it runs and logs; the tokens by their resolved path and header
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("device", "tensorboard", "tokens")}
    for name, default in (("blocks", "packed"), ("attention", "auto")):  # added later: at their defaults left out,
        if fields.get(name) == default:                                  # so earlier models keep their keys
            del fields[name]
    key = fingerprint({**fields, "tokens": str(tokens), "tokens_header": header, "cache_version": CACHE_VERSION})
    return cache_root() / "trained" / f"{slug(cfg)}-s{cfg.seed}-{key[:10]}"


def corrupt(target: Path) -> str | None:
    """Why the finished model at `target` cannot be used as it is (a file changed or added after poslens wrote it,
    by its manifest's sizes and SHA-256), or None (also when it is not finished or has no manifest to go by)."""
    from poslens.io.manifest import foreign, read_manifest

    if not (target / "run.json").is_file() or read_manifest(target) is None:
        return None
    return foreign(target)


def finished(target: Path) -> bool:
    """Whether the cache holds a usable finished model at `target` (see `corrupt`)."""
    return (target / "run.json").is_file() and corrupt(target) is None


def clear_corrupt(target: Path) -> None:
    """Remove the cached model at `target` when it is corrupt, saying why on stderr, so that it is trained again;
    the caller holds its entry lock (`poslens.io.lock.entry_lock`)."""
    import shutil
    import sys

    why = corrupt(target)
    if why is not None:
        print(f"{target}: the cached model is corrupt ({why}); training it again", file=sys.stderr, flush=True)
        shutil.rmtree(target)  # poslens's own cache entry, rebuilt from its configuration


def trained_model(cfg: TrainConfig, progress: bool = True, label: str | None = None,
                  tokens: Path | None = None) -> Path:
    """The model trained with `cfg`: from the cache, or trained now into it (resuming an interrupted training).
    `label` names it on the progress bar; `tokens`: its token directory when already known (`tokens_of`)."""
    from poslens.train.loop import train

    tokens = tokens or tokens_of(cfg, progress)
    target = trained_model_dir(cfg, tokens)
    with entry_lock(target, f"the model {target.name}"):
        clear_corrupt(target)
        if not (target / "run.json").is_file():
            train(dataclasses.replace(cfg, tokens=str(tokens)), target, progress=progress, label=label)
    return target
