"""The token-directory format (`poslens tokenize` writes it, training and the data layer read it): one module, so
that the engine (`engine/data.py`, `--data TOKEN_DIR`) and training (`train/`) share it without importing each other.

A token directory holds

    train.bin, val.bin   token ids back to back, raw little-endian uint16 when the vocabulary has at most 65,536
                         entries, else uint32; every document followed by the separator token
    header.json          format, version, dtype, vocab_size, separator/BOS/EOS ids, tokens and documents per split,
                         tokenizer spec, source, split seed and fraction, the SHA-256 of each .bin file
    tokenizer/           the tokenizer that wrote the ids (``save_pretrained`` files)
    run.json, tensors.safetensors   the poslens run-directory files, so that ``tokenize --force`` may replace it

`open_tokens` checks all of it before anything reads the ids: every header field's type and range, the file
sizes against the header's counts, every id below vocab_size (one pass over the files, in chunks), and that the
tokenizer folder is there. Each problem is a one-line `UsageError` naming the path and the field.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from poslens.errors import UsageError, check_choice, require
from poslens.io.space import disk_space
from poslens.io.writing import check_size, remember, write_text

FORMAT = "poslens-tokens"
VERSION = 1
HEADER = "header.json"
TOKENIZER = "tokenizer"
SPLITS = ("train", "val")
DTYPES = ("uint16", "uint32")
_CHUNK = 1 << 24  # ids per chunk of the range check


def dtype_for(vocab_size: int) -> str:
    """uint16 when every id fits, else uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def bin_path(directory: str | os.PathLike, split: str) -> Path:
    """``train.bin`` or ``val.bin`` of a token directory."""
    return Path(directory) / f"{check_choice('split', split, SPLITS)}.bin"


class Corrupt(UsageError):
    """A token directory that is there but unusable (the cache rebuilds such an entry; `tokenize --force` replaces
    it). `reason` says what is wrong."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: corrupt token directory ({reason}); rerun `poslens tokenize` with --force")
        self.reason = reason


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

    @property
    def separator_id(self) -> int:
        return int(self.header["separator_token_id"])

    def bos_id(self, why: str) -> int:
        """The BOS id; a one-line error naming `why` it is needed when the header has none."""
        bos = self.header.get("bos_token_id")
        require(bos is not None, f"{self.path}: the token directory has no bos_token_id, which {why} needs; tokenize "
                                 "with a tokenizer that has a BOS token (smollm2 or bpe:N)")
        return int(bos)

    def tokenizer(self) -> Any:
        """The tokenizer that wrote the ids (a one-line error if it does not load or disagrees with the header)."""
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(self.path / TOKENIZER)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise Corrupt(self.path, f"its {TOKENIZER}/ folder does not load: {type(e).__name__}") from None
        require(len(tok) <= self.vocab_size, f"{self.path}: the tokenizer has {len(tok)} entries but header.json says "
                                             f"vocab_size {self.vocab_size}; rerun `poslens tokenize` with --force")
        return tok

    def documents(self, split: str = "val") -> Iterator[str]:
        """The documents of `split` as text: the ids cut at the separator and decoded (lossless for the tokenizers
        `poslens tokenize` writes, so re-encoding a document gives its ids back)."""
        check_choice("split", split, SPLITS)
        ids = np.asarray(getattr(self, split))
        ends = np.flatnonzero(ids == self.separator_id)
        tok, start = self.tokenizer(), 0
        for end in ends:
            if end > start:
                yield tok.decode(ids[start:end].tolist(), skip_special_tokens=False)
            start = end + 1


def is_token_directory(path: str | os.PathLike) -> bool:
    """A directory whose header.json names the token format (it may still be corrupt: `open_tokens` says)."""
    try:
        header = json.loads((Path(path) / HEADER).read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(header, dict) and header.get("format") == FORMAT


def _int_field(header: dict, key: str, path: Path, lo: int = 0, optional: bool = False) -> int | None:
    value = header.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise Corrupt(path, f"header.json: {key} must be an integer >= {lo}, got {value!r}")
    return value


def check_header(header: Any, path: Path) -> dict[str, Any]:
    """Every header field `open_tokens` relies on, with its type and range (one-line error naming the field)."""
    require(isinstance(header, dict) and header.get("format") == FORMAT,
            f"{path}: not a {FORMAT} directory (header.json names another format)")
    if header.get("dtype") not in DTYPES:
        raise Corrupt(path, f"header.json: dtype must be uint16 or uint32, got {header.get('dtype')!r}")
    vocab = _int_field(header, "vocab_size", path, lo=1)
    if vocab > np.iinfo(np.dtype(header["dtype"])).max + 1:
        raise Corrupt(path, f"vocab_size {vocab} does not fit {header['dtype']}")
    for key in ("separator_token_id", "bos_token_id", "eos_token_id"):
        value = _int_field(header, key, path, optional=key != "separator_token_id")
        if value is not None and value >= vocab:
            raise Corrupt(path, f"header.json: {key} {value} is not below vocab_size {vocab}")
        header[key] = value  # an optional id left out reads None, as `tokenize` writes it
    for split in SPLITS:
        if not isinstance(header.get(split), dict):
            raise Corrupt(path, f"header.json: no {split} counts")
        _int_field(header[split], "tokens", path)
    return header


def _largest_id(ids: np.ndarray) -> int:
    """The largest id of a memory-mapped split, read in chunks (-1 when empty)."""
    top = -1
    for start in range(0, len(ids), _CHUNK):
        top = max(top, int(ids[start:start + _CHUNK].max()))
    return top


def open_tokens(path: str | os.PathLike, check: tuple[str, ...] = SPLITS) -> TokenFile:
    """Memory-map a token directory written by `poslens tokenize` after checking it (see the module docstring);
    `check`: the splits whose ids are range-checked (a reader of the held-out text alone need not read train.bin)."""
    path = Path(path).expanduser()
    require(path.is_dir() and (path / HEADER).is_file(), f"{path}: not a token directory (no {HEADER}); write one "
                                                         "with `poslens tokenize`")
    try:
        header = json.loads((path / HEADER).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise Corrupt(path, f"header.json: {type(e).__name__}") from None
    check_header(header, path)
    dtype = np.dtype(header["dtype"])
    arrays = {}
    for split in SPLITS:
        file, expected = bin_path(path, split), int(header[split]["tokens"]) * dtype.itemsize
        try:
            size = file.stat().st_size
        except OSError as e:
            raise Corrupt(path, f"{file.name}: {e.strerror}") from None
        if size != expected:
            raise Corrupt(path, f"{file.name} has {size} bytes, the header says {expected}")
        arrays[split] = np.memmap(file, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
        if split not in check or header["vocab_size"] > np.iinfo(dtype).max:
            continue  # not asked for, or every id the dtype holds is in the vocabulary
        top = _largest_id(arrays[split])
        if top >= header["vocab_size"]:
            raise Corrupt(path, f"{file.name} holds id {top}, header.json says vocab_size {header['vocab_size']}")
    if not (path / TOKENIZER).is_dir():
        raise Corrupt(path, f"no {TOKENIZER}/ folder, which decodes the ids and goes with every trained model")
    return TokenFile(path=path, header=header, train=arrays["train"], val=arrays["val"])


# ---------------------------------------------------------------- writing


class TokenWriter:
    """Write a token directory's files into `directory` (a run directory being built): `add` documents' ids split
    by split, then `finish` with the tokenizer and the header's descriptive fields; returns the header."""

    def __init__(self, directory: str | os.PathLike, vocab_size: int):
        self.directory, self.vocab_size = Path(directory), int(vocab_size)
        self.dtype = np.dtype(dtype_for(self.vocab_size))
        self.counts = {split: {"tokens": 0, "documents": 0} for split in SPLITS}
        self.files = {split: open(bin_path(self.directory, split), "wb") for split in SPLITS}
        self.hashes = {split: hashlib.sha256() for split in SPLITS}  # hashed as written, for the run's manifest

    def add(self, split: str, ids: list[int]) -> None:
        """Append one document's ids (its separator included) to `split` (a failed write: one line, `disk_space`)."""
        data = np.asarray(ids, dtype=self.dtype).tobytes()
        with disk_space(bin_path(self.directory, split), self._bytes(split) + len(data)):
            self.files[split].write(data)
        self.hashes[split].update(data)
        self.counts[split]["tokens"] += len(ids)
        self.counts[split]["documents"] += 1

    def _bytes(self, split: str) -> int:
        return self.counts[split]["tokens"] * self.dtype.itemsize

    def close(self, quiet: bool = False) -> None:
        """Close the files, flushing them (a failed flush is one line; `quiet`: ignored, when another error is on
        its way out)."""
        for split, f in self.files.items():
            if not f.closed:
                try:
                    with disk_space(bin_path(self.directory, split), self._bytes(split)):
                        f.close()
                except (UsageError, OSError):
                    if not quiet:
                        raise

    def finish(self, tok: Any, separator_token_id: int, **fields: Any) -> dict[str, Any]:
        """Close the files (checking that every byte reached them), save the tokenizer `tok` into tokenizer/ and write
        header.json; returns the header."""
        self.close()
        for split in SPLITS:
            check_size(bin_path(self.directory, split), self._bytes(split))
            remember(bin_path(self.directory, split), self.hashes[split].hexdigest())
        tok.save_pretrained(self.directory / TOKENIZER)
        header = {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name, "vocab_size": self.vocab_size,
                  "separator_token_id": int(separator_token_id), "bos_token_id": tok.bos_token_id,
                  "eos_token_id": tok.eos_token_id, **fields, **self.counts,
                  "sha256": {split: self.hashes[split].hexdigest() for split in SPLITS}}
        check_header(header, self.directory)
        write_text(self.directory / HEADER, json.dumps(header, indent=2) + "\n")
        return header
