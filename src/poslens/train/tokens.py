"""`poslens tokenize`: text to a token directory (the format is `poslens.io.tokenfile`), and the embedded corpus's
token directories cached per tokenizer.

The split is by document: each document goes whole to the validation file with probability `val_fraction` (a
seeded hash of its index decides), so no held-out text is ever seen in training. Documents are packed back to
back with the separator token (EOS, ``<|endoftext|>``) after each one; there is no padding.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from poslens.errors import UsageError, check_float, check_int, require
from poslens.io.lock import entry_lock
from poslens.io.tokenfile import VERSION, TokenFile, TokenWriter, open_tokens
from poslens.train.config import parse_tokenizer

__all__ = ["TokenFile", "default_tokens", "is_validation", "open_tokens", "separator_id", "tokenize_corpus",
           "train_bpe"]

SEPARATOR = "<|endoftext|>"
_BATCH = 128


# ---------------------------------------------------------------- tokenizers


def train_bpe(documents: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer with `vocab_size` entries trained on `documents` (``tokenizers`` library).

    ``<|endoftext|>`` (id 0) is its only special token and serves as BOS, EOS and document separator.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SEPARATOR], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SEPARATOR, eos_token=SEPARATOR)


def separator_id(tokenizer: Any) -> int:
    """The token put after every document: ``<|endoftext|>`` when the vocabulary has it, else EOS."""
    sep = tokenizer.convert_tokens_to_ids(SEPARATOR) if SEPARATOR in tokenizer.get_vocab() else None
    sep = tokenizer.eos_token_id if sep is None else sep
    require(sep is not None, "this tokenizer has neither <|endoftext|> nor an EOS token to separate documents")
    return int(sep)


# ---------------------------------------------------------------- writing


def is_validation(index: int, val_fraction: float, seed: int) -> bool:
    """Whether document `index` is held out: a seeded hash of the index, uniform on [0, 1), below the fraction."""
    h = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < val_fraction


def _train_documents(source: str | None, text_field: str, val_fraction: float, seed: int) -> Iterator[str]:
    from poslens.engine.data import iter_documents

    for i, text in enumerate(iter_documents(source, text_field)):
        if text and not is_validation(i, val_fraction, seed):
            yield text


def tokenize_corpus(source: str | None, out: str | os.PathLike, tokenizer: str = "smollm2",
                    val_fraction: float = 0.05, seed: int = 0, text_field: str = "text", force: bool = False,
                    progress: bool = True) -> dict[str, Any]:
    """Tokenize every document of `source` (None: the embedded corpus) into the token directory `out`.

    tokenizer: ``smollm2`` (the embedded SmolLM2 tokenizer) or ``bpe:VOCAB_SIZE`` (byte-level BPE trained on
    the training documents only; a text with fewer distinct pairs than that gives a smaller vocabulary, which
    the header records beside the size asked for: ``vocab_size`` and ``vocab_requested``). The directory is
    written atomically and is a poslens run directory (``tokenize --force`` replaces it); returns its header.
    """
    from tqdm.auto import tqdm

    from poslens.engine.data import encode, iter_documents, source_label
    from poslens.io.results import run_directory, write_run

    kind, vocab = parse_tokenizer(tokenizer)
    val_fraction = check_float("val_fraction", val_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
    seed = check_int("seed", seed, 0, 2**32 - 1)
    docs = iter_documents(source, text_field)  # checks the source before any work
    with run_directory(out, force, inputs=[source] if source is not None else []) as tmp:
        if kind == "bpe":
            tok = train_bpe(_train_documents(source, text_field, val_fraction, seed), vocab)
        else:
            from poslens.engine.models import load_tokenizer

            tok = load_tokenizer("smollm2-135m")
        sep = separator_id(tok)
        writer = TokenWriter(tmp, len(tok))
        bar = tqdm(desc="tokenizing", unit=" docs", disable=not progress)
        try:
            for batch in _batches(enumerate(docs), _BATCH):
                # special tokens' spellings inside a text are text: only the separator written after each
                # document ends one
                ids = encode(tok, [t for _, t in batch])
                for (i, text), row in zip(batch, ids):
                    if text:
                        writer.add("val" if is_validation(i, val_fraction, seed) else "train", row + [sep])
                bar.update(len(batch))
        except BaseException:
            writer.close(quiet=True)  # the error on its way out is the one to report
            raise
        finally:
            bar.close()
        counts = writer.counts
        total = counts["train"]["documents"] + counts["val"]["documents"]
        require(total > 1, f"the text has {total} document{'' if total == 1 else 's'}, and the held-out split takes "
                           "whole documents: give several (a .txt file is one document: a directory of files, or a "
                           ".jsonl or .parquet with one document per row)")
        require(counts["val"]["documents"] > 0 and counts["train"]["documents"] > 0,
                f"the text has {total} documents: too few to split with val_fraction {val_fraction:g}; use more "
                "text or another --val-fraction")
        fields = {"tokenizer": tokenizer, "vocab_requested": vocab, "source": source_label(source),
                  "text_field": text_field, "val_fraction": val_fraction, "seed": seed}
        header = writer.finish(tok, sep, **fields)
        write_run(tmp, {}, {"kind": "tokens", "command": "tokenize", "config": fields, "metrics": counts})
    return header


def _batches(items: Iterable[Any], n: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def default_tokens(tokenizer: str, progress: bool = True) -> Path:
    """The embedded corpus tokenized with `tokenizer`, cached under the poslens cache directory.

    Built once: a second process asking for it meanwhile waits for the first (one line says so) and uses its
    result; a cached entry that does not open (`poslens.io.tokenfile.open_tokens`) or whose files differ from the
    content hashes of its manifest is rebuilt, saying why.
    """
    import shutil
    import sys

    from poslens.engine.data import default_documents
    from poslens.engine.models import cache_root
    from poslens.io.manifest import foreign, read_manifest
    from poslens.io.tokenfile import Corrupt, is_token_directory

    # "specials as text": built since special tokens' spellings inside a document are tokenized as text
    digest = hashlib.sha256(f"{tokenizer}|v{VERSION}|specials as text".encode())
    for text in default_documents():  # the key follows the text itself, so an enlarged corpus is re-tokenized
        digest.update(text.encode("utf-8", "surrogatepass"))
    key = digest.hexdigest()[:12]
    path = cache_root() / "tokens" / f"embedded-{re.sub(r'[^A-Za-z0-9]+', '-', tokenizer)}-{key}"
    with entry_lock(path, f"the embedded corpus tokenized with {tokenizer}"):
        if path.exists():
            try:
                open_tokens(path)
                changed = foreign(path) if read_manifest(path) is not None else None  # content, by its SHA-256
                if changed is None:
                    return path
                raise Corrupt(path, changed)
            except Corrupt as e:
                print(f"{path}: the cached token directory is corrupt ({e.reason}); rebuilding it", file=sys.stderr,
                      flush=True)
                shutil.rmtree(path)  # poslens's own cache entry (one of 0.2 has no manifest to go by)
            except UsageError:
                if is_token_directory(path):
                    raise
        tokenize_corpus(None, path, tokenizer=tokenizer, force=True, progress=progress)
    return path
