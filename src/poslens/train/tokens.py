"""Token files for training: `poslens tokenize` writes them, `TokenFile` memory-maps them.

A token directory holds ``train.bin`` and ``val.bin`` (raw little-endian uint16 when the vocabulary
has at most 65,536 entries, else uint32), ``header.json`` (dtype, counts, separator token, source) and
the tokenizer (``save_pretrained`` files). The split is by document: each document goes whole to the
validation file with probability `val_fraction` (a seeded hash of its index decides), so no held-out
text is ever seen in training. Documents are packed back to back with the separator token (EOS,
``<|endoftext|>``) after each one; there is no padding.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from poslens.errors import UsageError, check_choice, check_float, require
from poslens.train.config import parse_tokenizer

FORMAT = "poslens-tokens"
VERSION = 1
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


def dtype_for(vocab_size: int) -> str:
    """uint16 when every id fits, else uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


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

    tokenizer: ``smollm2`` (the embedded SmolLM2 tokenizer) or ``bpe:VOCAB_SIZE`` (byte-level BPE trained
    on the training documents only). The directory is written atomically; returns its header.
    """
    from tqdm.auto import tqdm

    from poslens.engine.data import iter_documents, source_label
    from poslens.io.results import run_directory

    kind, vocab = parse_tokenizer(tokenizer)
    val_fraction = check_float("val_fraction", val_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
    docs = iter_documents(source, text_field)  # checks the source before any work
    with run_directory(out, force) as tmp:
        if kind == "bpe":
            tok = train_bpe(_train_documents(source, text_field, val_fraction, seed), vocab)
        else:
            from poslens.engine.models import load_tokenizer

            tok = load_tokenizer("smollm2-135m")
        sep, size = separator_id(tok), len(tok)
        dtype = np.dtype(dtype_for(size))
        counts = {"train": {"tokens": 0, "documents": 0}, "val": {"tokens": 0, "documents": 0}}
        bar = tqdm(desc="tokenizing", unit=" docs", disable=not progress)
        with open(tmp / "train.bin", "wb") as ftrain, open(tmp / "val.bin", "wb") as fval:
            files = {"train": ftrain, "val": fval}
            for batch in _batches(enumerate(docs), _BATCH):
                texts = [t for _, t in batch]
                ids = tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
                for (i, text), row in zip(batch, ids):
                    if not text:
                        continue
                    split = "val" if is_validation(i, val_fraction, seed) else "train"
                    np.asarray(row + [sep], dtype=dtype).tofile(files[split])
                    counts[split]["tokens"] += len(row) + 1
                    counts[split]["documents"] += 1
                bar.update(len(batch))
        bar.close()
        require(counts["val"]["documents"] > 0 and counts["train"]["documents"] > 0,
                f"the text has {counts['train']['documents'] + counts['val']['documents']} documents: too few to "
                f"split with val_fraction {val_fraction:g}; use more text or another --val-fraction")
        tok.save_pretrained(tmp / "tokenizer")
        header = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab_size": size,
                  "separator_token_id": sep, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                  "tokenizer": tokenizer, "source": source_label(source), "text_field": text_field,
                  "val_fraction": val_fraction, "seed": seed, **counts}
        (tmp / "header.json").write_text(json.dumps(header, indent=2) + "\n")
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


# ---------------------------------------------------------------- reading


@dataclass
class TokenFile:
    """A token directory, memory-mapped: `train` and `val` are 1-D numpy arrays of token ids."""

    path: Path
    header: dict[str, Any]
    train: np.ndarray
    val: np.ndarray

    @property
    def vocab_size(self) -> int:
        return int(self.header["vocab_size"])

    def tokenizer(self) -> Any:
        """The tokenizer that wrote the ids."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path / "tokenizer")

    def documents(self, split: str = "val") -> Iterator[str]:
        """The documents of `split` as text: the ids cut at the separator and decoded (lossless for the tokenizers
        `tokenize_corpus` writes, so re-encoding a document gives its ids back)."""
        check_choice("split", split, ("train", "val"))
        ids = np.asarray(getattr(self, split))
        ends = np.flatnonzero(ids == int(self.header["separator_token_id"]))
        tok, start = self.tokenizer(), 0
        for end in ends:
            if end > start:
                yield tok.decode(ids[start:end].tolist(), skip_special_tokens=False)
            start = end + 1


def open_tokens(path: str | os.PathLike) -> TokenFile:
    """Memory-map a token directory written by `tokenize_corpus` (one-line error if it is not one)."""
    path = Path(path).expanduser()
    require((path / "header.json").is_file(), f"{path}: not a token directory (no header.json); "
                                              "write one with `poslens tokenize`")
    try:
        header = json.loads((path / "header.json").read_text())
        dtype = np.dtype(header["dtype"])
        arrays = {}
        for split in ("train", "val"):
            expected = int(header[split]["tokens"]) * dtype.itemsize
            size = (path / f"{split}.bin").stat().st_size
            if size != expected:
                raise ValueError(f"{split}.bin has {size} bytes, the header says {expected}")
            arrays[split] = np.memmap(path / f"{split}.bin", dtype=dtype, mode="r")
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise UsageError(f"{path}: corrupt token directory ({type(e).__name__}: {e}); rerun "
                         "`poslens tokenize`") from None
    require(header.get("format") == FORMAT, f"{path}: not a {FORMAT} directory")
    return TokenFile(path=path, header=header, train=arrays["train"], val=arrays["val"])


def default_tokens(tokenizer: str, progress: bool = True) -> Path:
    """The embedded corpus tokenized with `tokenizer`, cached under the poslens cache directory."""
    from poslens.engine.data import default_documents
    from poslens.engine.models import cache_root

    digest = hashlib.sha256(f"{tokenizer}|v{VERSION}".encode())
    for text in default_documents():  # the key follows the text itself, so an enlarged corpus is re-tokenized
        digest.update(text.encode("utf-8", "surrogatepass"))
    key = digest.hexdigest()[:12]
    path = cache_root() / "tokens" / f"embedded-{re.sub(r'[^A-Za-z0-9]+', '-', tokenizer)}-{key}"
    if not (path / "header.json").is_file():
        tokenize_corpus(None, path, tokenizer=tokenizer, force=True, progress=progress)
    return path
