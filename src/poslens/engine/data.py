"""Documents in, token sequences out: text sources, fixed-length sequences, and a split over ranks.

Sources (`iter_documents`):

* ``None``: the embedded default, Python's own documentation (see `default_documents`); no download.
* a ``.txt``/``.text``/``.md``/``.rst`` file: the whole file is one document (UTF-8).
* a ``.jsonl`` file: one JSON object per line, the document in field `text_field`.
* a ``.parquet`` file: one document per row, column `text_field`.
* a directory saved with ``datasets`` ``save_to_disk`` (has ``state.json``/``dataset_info.json`` or
  ``dataset_dict.json``): column `text_field`; a saved DatasetDict must have one split or be named by
  its split folder. This is the format the paper's code read its Fineweb-Edu held-out set from.
* a token directory written by ``poslens tokenize``: its held-out (validation) documents, decoded.
* any other directory: every supported file under it (recursively, hidden paths skipped, sorted by
  relative path), each read as above.

Sequences (`make_sequences`): ``first`` takes the first `seq_len` tokens of each document long enough
(the paper's Section 5.2 choice: the first 1,024 tokens of 1,000 documents); ``pack`` concatenates
documents (EOS between them when the tokenizer has one) and cuts the stream into blocks.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from poslens.errors import UsageError, available_memory, check_choice, check_int, gib, require
from poslens.io.tokenfile import is_token_directory, open_tokens

MODES = ("first", "pack")
BOS_POLICIES = ("auto", "always", "never")
PLAIN_SUFFIXES = (".txt", ".text", ".md", ".rst")
SUFFIXES = PLAIN_SUFFIXES + (".jsonl", ".parquet")
_MARGIN = 16  # tokens past a character cut that must agree before a prefix tokenisation is trusted
_BATCH = 256
NO_TOKENIZER = ("this model has no tokenizer; pass one with --tokenizer SPEC (e.g. --tokenizer smollm2-135m, the "
                "embedded model's)")


# ---------------------------------------------------------------- documents


def default_documents() -> Iterator[str]:
    """The embedded default text (`poslens.engine.corpus`, docs/corpus.md): CPython's documentation, then the
    deduplicated docstrings of poslens's permissively licensed dependencies; read lazily, cached once complete.
    The order is fixed for given package versions; `default_label` names them.
    """
    from poslens.engine import corpus

    return corpus.documents()


def default_label() -> str:
    """A name for the embedded default text, including the versions it was built from."""
    from poslens.engine import corpus

    return corpus.label()


def source_label(source: str | None) -> str:
    """How a `--data` source is recorded in results metadata."""
    return default_label() if source is None else str(Path(source).expanduser().resolve())


def iter_documents(source: str | None, text_field: str = "text") -> Iterator[str]:
    """Documents of `source` (see the module docstring for formats) in a deterministic order.

    The path, its format and (for Parquet and saved datasets) the column are checked right away;
    rows are read lazily.
    """
    if source is None:
        return default_documents()
    path = Path(source).expanduser()
    require(path.exists(), f"--data {source}: no such file or directory")
    if path.is_dir():
        if is_token_directory(path):
            return open_tokens(path, check=("val",)).documents("val")
        if _is_saved_dataset(path):
            return _saved_dataset_documents(path, text_field)
        files = _data_files(path)
        require(bool(files), f"--data {source}: directory has no {', '.join(SUFFIXES)} files and is not "
                             "a datasets save_to_disk directory")
        return itertools.chain.from_iterable(_file_documents(f, text_field) for f in files)
    return _file_documents(path, text_field)


def _data_files(root: Path) -> list[Path]:
    found = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if p.is_file() and p.suffix.lower() in SUFFIXES and not any(part.startswith(".") for part in rel.parts):
            found.append(p)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _file_documents(path: Path, text_field: str) -> Iterator[str]:
    if not path.is_file():  # a device, FIFO or socket could be endless
        raise UsageError(f"--data {path}: not a regular file; point --data at a file or directory of text")
    suffix = path.suffix.lower()
    if suffix in PLAIN_SUFFIXES:
        return iter([_read_text(path)])
    if suffix == ".jsonl":
        return _jsonl_documents(path, text_field)
    if suffix == ".parquet":
        return _parquet_documents(path, text_field)
    raise UsageError(f"--data {path}: unsupported file type {path.suffix or '(none)'}; "
                     f"use one of {', '.join(SUFFIXES)}, a directory, or a datasets save_to_disk directory")


def _read_text(path: Path) -> str:
    """The whole file as one document; refused up front if its text could not fit in memory."""
    try:
        size = path.stat().st_size
        available = available_memory()
        # A str holds up to 4 bytes per character, next to the bytes it was decoded from.
        if available is not None and 5 * size > available:
            raise UsageError(f"--data {path}: a {gib(size)} text file is read whole and would need about "
                             f"{gib(5 * size)} of memory ({gib(available)} available); split it into smaller "
                             "files or use .jsonl")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--data {path}: not UTF-8 text") from None
    except OSError as e:
        raise UsageError(f"--data {path}: cannot read it ({e.strerror or type(e).__name__})") from None


def _as_text(value: Any, where: str, text_field: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UsageError(f"--data {where}: field {text_field!r} is {type(value).__name__}, expected a string; "
                         "pick another --text-field")
    return value


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        f = path.open("rb")
    except OSError as e:
        raise UsageError(f"--data {path}: cannot read it ({e.strerror or type(e).__name__})") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UsageError(f"--data {path}:{lineno}: not UTF-8 text; convert the file to UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"--data {path}:{lineno}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise UsageError(f"--data {path}:{lineno}: JSON nested too deeply to read; flatten the line to "
                                 f"an object with a string field {text_field!r}") from None
            if not isinstance(row, dict):
                raise UsageError(f"--data {path}:{lineno}: expected a JSON object per line")
            if text_field not in row:
                raise UsageError(f"--data {path}:{lineno}: no field {text_field!r} (fields: "
                                 f"{', '.join(map(str, row)) or 'none'}); pass --text-field NAME")
            yield _as_text(row[text_field], f"{path}:{lineno}", text_field)


def _missing_column(where: Path, text_field: str, columns: Iterable[str]) -> UsageError:
    return UsageError(f"--data {where}: no column {text_field!r} (columns: {', '.join(columns)}); "
                      "pass --text-field NAME")


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"--data {path}: not a readable Parquet file ({type(e).__name__})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise _missing_column(path, text_field, names)
    return _parquet_rows(pf, path, text_field)


def _parquet_rows(pf: Any, path: Path, text_field: str) -> Iterator[str]:
    for batch in pf.iter_batches(batch_size=_BATCH, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            yield _as_text(value, str(path), text_field)


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def _saved_dataset_documents(path: Path, text_field: str) -> Iterator[str]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise UsageError(f"--data {path}: cannot read the saved dataset ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = sorted(ds)
        require(len(splits) == 1, f"--data {path}: the dataset has splits {', '.join(splits)}; "
                                  f"point --data at one of them, e.g. {path / splits[0]}")
        ds = ds[splits[0]]
    if text_field not in ds.column_names:
        raise _missing_column(path, text_field, ds.column_names)
    return _dataset_rows(ds.select_columns([text_field]), path, text_field)


def _dataset_rows(ds: Any, path: Path, text_field: str) -> Iterator[str]:
    for batch in ds.iter(batch_size=_BATCH):
        for value in batch[text_field]:
            yield _as_text(value, str(path), text_field)


# ---------------------------------------------------------------- tokens


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """Whether `tokenizer` prepends its BOS token by itself (Gemma, Llama-3: yes; SmolLM2, Qwen: no)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(plain) and with_special[0] == bos


def encode(tokenizer: Any, text: str | list[str]) -> list[int] | list[list[int]]:
    """The ids of `text` (or of each of a list of texts) read as text: no special token added, and a special token's
    spelling inside it (a docstring that writes <|endoftext|> or <|im_start|>) tokenized as the characters it is,
    not as the BOS/EOS/separator id."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]


def leading_ids(tokenizer: Any, text: str, n: int) -> list[int]:
    """The first `n` token ids of `text` (no special tokens), or all of them if there are fewer.

    Long documents are tokenised by growing character prefixes instead of whole: a prefix is trusted
    once it yields `n` + 16 tokens, since a cut only changes the last few tokens before it.
    """
    chars = 6 * (n + _MARGIN)
    while chars < len(text):
        ids = encode(tokenizer, text[:chars])
        if len(ids) >= n + _MARGIN:
            return ids[:n]
        chars *= 2
    return encode(tokenizer, text)[:n]


def make_sequences(tokenizer: Any, documents: Iterable[str], seq_len: int, num_sequences: int,
                   mode: str = "first", bos: str = "auto",
                   minimum: int | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """`num_sequences` token sequences of exactly `seq_len` tokens, as a LongTensor [N, seq_len], and stats.

    mode ``first``: the first tokens of each document long enough, one sequence per document;
    shorter documents are skipped and counted. mode ``pack``: documents concatenated (EOS after each
    when the tokenizer has one) and cut into consecutive blocks; the incomplete tail is dropped.
    bos ``auto`` prepends BOS iff the tokenizer adds it by itself, ``always`` prepends
    ``tokenizer.bos_token_id``, ``never`` prepends nothing. A prepended BOS counts toward `seq_len`
    and starts every sequence (in pack mode too). Documents are read and tokenised only until enough
    sequences are made. Stats: mode, seq_len, sequences, tokens, documents_read/used/skipped,
    bos (policy), bos_prepended, bos_token_id, separator_token_id (pack mode only).
    minimum: accept as few as this many sequences when the text runs out (default: exactly num_sequences).
    """
    require(tokenizer is not None, NO_TOKENIZER)
    check_choice("--mode", mode, MODES)
    num_sequences = check_int("--num-sequences", num_sequences, 1)
    minimum = num_sequences if minimum is None else min(check_int("minimum", minimum, 1), num_sequences)
    prepend, bos_id = _bos_policy(tokenizer, bos)
    seq_len = check_int("--seq-len", seq_len, 2 if prepend else 1)
    body = seq_len - int(prepend)

    stats: dict[str, Any] = {"mode": mode, "seq_len": seq_len, "bos": bos, "bos_prepended": prepend,
                             "bos_token_id": bos_id if prepend else None}
    if mode == "first":
        rows, counts = _first_tokens(tokenizer, documents, body, num_sequences, seq_len, minimum)
    else:
        sep = getattr(tokenizer, "eos_token_id", None)
        rows, counts = _packed_tokens(tokenizer, documents, body, num_sequences, sep, seq_len, minimum)
        stats["separator_token_id"] = sep
    rows = _with_bos(rows, bos_id if prepend else None)
    stats.update(counts, sequences=rows.shape[0], tokens=rows.numel())
    return rows, stats


def _bos_policy(tokenizer: Any, bos: str) -> tuple[bool, int | None]:
    """(prepend a BOS?, its id) for a --bos policy (see make_sequences)."""
    check_choice("--bos", bos, BOS_POLICIES)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos == "always":
        require(bos_id is not None, "--bos always: this tokenizer has no BOS token; use --bos never or auto")
    return bos == "always" or (bos == "auto" and tokenizer_adds_bos(tokenizer)), bos_id


def _with_bos(rows: torch.Tensor, bos_id: int | None) -> torch.Tensor:
    if bos_id is None:
        return rows
    return torch.cat([torch.full((rows.shape[0], 1), bos_id, dtype=torch.long), rows], dim=1)


def document_windows(tokenizer: Any, documents: Iterable[str], seq_len: int, num_sequences: int, *,
                     min_offset: int, max_offset: int | None = None, seed: int = 0,
                     bos: str = "auto") -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Two windows of `seq_len` tokens from each of `num_sequences` documents: its start and a window starting
    at a random offset inside it, as LongTensors [N, seq_len] (start, inside), and stats.

    The body (seq_len minus a prepended BOS) of the start window is tokens [0, body) of the document, that of
    the inside window tokens [o, o + body), o uniform on [min_offset, min(max_offset, len - body)] (seeded
    per document; max_offset None: 8 x seq_len); both get the same BOS policy (see make_sequences). Documents
    with fewer than body + min_offset tokens are skipped and counted. Stats: those of make_sequences plus
    `offsets` (a list) and min_offset, max_offset.
    """
    require(tokenizer is not None, NO_TOKENIZER)
    num_sequences = check_int("--num-sequences", num_sequences, 1)
    prepend, bos_id = _bos_policy(tokenizer, bos)
    seq_len = check_int("--seq-len", seq_len, 2 if prepend else 1)
    body = seq_len - int(prepend)
    min_offset = check_int("min_offset", min_offset, 1)
    max_offset = check_int("max_offset", 8 * seq_len if max_offset is None else max_offset, min_offset)
    gen = torch.Generator().manual_seed(check_int("seed", seed, 0))
    counts = {"documents_read": 0, "documents_skipped": 0}
    start, inside, offsets = [], [], []
    for ids in itertools.islice(_long_documents(tokenizer, documents, body + max_offset, body + min_offset, counts),
                                num_sequences):
        o = int(torch.randint(min_offset, min(max_offset, len(ids) - body) + 1, (1,), generator=gen))
        start.append(ids[:body])
        inside.append(ids[o:o + body])
        offsets.append(o)
    if len(start) < num_sequences:
        raise UsageError(f"the text gives only {len(start)} of {num_sequences} documents of at least "
                         f"{body + min_offset} tokens ({counts['documents_read']} read) for windows inside "
                         "documents; use fewer --num-sequences, a shorter --seq-len, a smaller offset, or more "
                         "text with --data")
    bos_or_none = bos_id if prepend else None
    rows = [_with_bos(torch.tensor(r, dtype=torch.long), bos_or_none) for r in (start, inside)]
    stats = {"mode": "windows", "seq_len": seq_len, "bos": bos, "bos_prepended": prepend,
             "bos_token_id": bos_or_none, "sequences": num_sequences, "tokens": 2 * rows[0].numel(), **counts,
             "documents_used": num_sequences, "min_offset": min_offset, "max_offset": max_offset, "offsets": offsets}
    return rows[0], rows[1], stats


def _long_documents(tokenizer: Any, documents: Iterable[str], n: int, need: int,
                    counts: dict[str, int]) -> Iterator[list[int]]:
    """The first `n` token ids of each document that has at least `need`, counting documents read and skipped."""
    for text in documents:
        counts["documents_read"] += 1
        ids = leading_ids(tokenizer, text, n)
        if len(ids) < need:
            counts["documents_skipped"] += 1
            continue
        yield ids


def _first_tokens(tokenizer: Any, documents: Iterable[str], body: int, num: int,
                  seq_len: int, minimum: int) -> tuple[torch.Tensor, dict[str, int]]:
    counts = {"documents_read": 0, "documents_skipped": 0}
    rows = list(itertools.islice(_long_documents(tokenizer, documents, body, body, counts), num))
    if len(rows) < minimum:
        raise UsageError(f"the text gives only {len(rows)} of {num} sequences in --mode first "
                         f"({counts['documents_read']} documents read, {counts['documents_skipped']} shorter than "
                         f"--seq-len {seq_len}); use --mode pack, fewer --num-sequences, a shorter --seq-len, or "
                         "more text with --data")
    counts["documents_used"] = len(rows)
    return torch.tensor(rows, dtype=torch.long), counts


def _packed_tokens(tokenizer: Any, documents: Iterable[str], body: int, num: int, sep: int | None,
                   seq_len: int, minimum: int) -> tuple[torch.Tensor, dict[str, int]]:
    total = num * body
    chunks: list[torch.Tensor] = []
    have = read = used = skipped = 0
    for text in documents:
        read += 1
        ids = leading_ids(tokenizer, text, total - have)
        if not ids:
            skipped += 1
            continue
        used += 1
        if sep is not None:
            ids = ids + [sep]
        chunks.append(torch.tensor(ids, dtype=torch.long))
        have += len(ids)
        if have >= total:
            break
    if have < minimum * body:
        raise UsageError(f"the text has only {have} tokens ({read} documents), enough for {have // body} of "
                         f"{num} sequences of --seq-len {seq_len}; use fewer --num-sequences, a shorter "
                         "--seq-len, or more text with --data")
    counts = {"documents_read": read, "documents_used": used, "documents_skipped": skipped}
    num = min(num, have // body)
    return torch.cat(chunks)[: num * body].view(num, body), counts


# ---------------------------------------------------------------- ranks


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, stop) of `n` sequences that `rank` of `world_size` processes; see `shard`."""
    world_size = check_int("world_size", world_size, 1)
    rank = check_int("rank", rank, 0, world_size - 1)
    require(n >= world_size, f"{n} sequences cannot be split over {world_size} ranks; "
                             "use more --num-sequences or fewer processes")
    return rank * n // world_size, (rank + 1) * n // world_size


def shard(input_ids: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The contiguous block of rows of `input_ids` that `rank` processes (torchrun: RANK, WORLD_SIZE).

    Rank r gets rows [r*N//W, (r+1)*N//W): blocks are disjoint, cover every row once, follow the
    original order and differ in size by at most one; every rank gets at least one row.
    """
    start, stop = shard_bounds(input_ids.shape[0], rank, world_size)
    return input_ids[start:stop]
