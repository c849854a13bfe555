"""The embedded default corpus: English technical text that ships with Python and with poslens's own dependencies.

Nothing is downloaded. The corpus is read from installed files, in this order (docs/corpus.md has sizes, token
counts and licences):

1. CPython's documentation: the reference-manual topics of ``pydoc_data.topics`` (one document per topic, sorted
   by topic name), then the long module docstrings of the standard library (sorted by module name).
2. For each package of `SOURCES` (poslens's declared dependencies, sorted by name) whose licence is permissive:
   one document per module (``.py`` file, sorted by relative path, test folders skipped): the module name, then
   the docstrings of the module, its classes and functions in source order. Read with ``ast``, never imported.

Deduplication (transformers copies docstrings between models): a docstring or a paragraph (blank-line
separated, at least `MIN_PARAGRAPH_CHARS` characters) whose whitespace-collapsed text was already seen earlier
in the order above is dropped. Docstrings shorter than `MIN_DOCSTRING_CHARS` and documents shorter than
`MIN_DOCUMENT_CHARS` are dropped too. The result depends only on the Python version and the versions of the
`SOURCES` packages (all of them required by poslens, so always installed): it is built once and kept in the
poslens cache (``$POSLENS_CACHE/corpus``), keyed by those versions.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import importlib.metadata as metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from poslens.io.lock import cache_lock
from poslens.io.space import disk_space

WHAT = "the embedded corpus"  # for the line a process prints while it waits for another one building it
FORMAT = 1  # bump when the extraction rules change (invalidates cached corpora)
# pyarrow (declared for Parquet input) is not a source: adding it would change the documented corpus
SOURCES = ("accelerate", "datasets", "gguf", "matplotlib", "numpy", "safetensors", "torch", "tqdm", "transformers")
PERMISSIVE = ("MIT", "BSD", "APACHE", "PSF", "PYTHON SOFTWARE FOUNDATION", "ZLIB", "CC0", "BSL-1.0", "ISC")
COPYLEFT = ("GPL", "MPL", "EPL", "CDDL", "EUPL", "OSL", "CC-BY-SA")
MIN_DOCSTRING_CHARS = 200
MIN_STDLIB_DOCSTRING_CHARS = 500
MIN_PARAGRAPH_CHARS = 40
MIN_DOCUMENT_CHARS = 500
SKIP_DIRS = ("tests", "test", "testing", "_vendor", "vendored")


# ---------------------------------------------------------------- licences


def licence(package: str) -> str:
    """The licence an installed package declares: License-Expression, else its licence classifiers, else the
    first line of its License field ('unknown' when none)."""
    meta = metadata.metadata(package)
    if meta.get("License-Expression"):
        return meta["License-Expression"].strip()
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return " AND ".join(classifiers)
    text = (meta.get("License") or "").strip()
    return text.splitlines()[0].strip() if text else "unknown"


def is_permissive(expression: str) -> bool:
    """True when a licence names only permissive terms: at least one of `PERMISSIVE` and none of `COPYLEFT`
    (so 'MPL-2.0 AND MIT' is not permissive: part of that code is under a copyleft licence)."""
    up = expression.upper()
    return any(p in up for p in PERMISSIVE) and not any(c in up for c in COPYLEFT)


# ---------------------------------------------------------------- extraction


def _normal(text: str) -> str:
    return " ".join(text.split())


class _Dedup:
    """Keeps the first occurrence of each docstring and each long paragraph (whitespace-collapsed text)."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self.dropped_docstrings = self.dropped_paragraphs = 0

    def _new(self, text: str) -> bool:
        h = hashlib.blake2b(_normal(text).encode(), digest_size=16).digest()
        if h in self.seen:
            return False
        self.seen.add(h)
        return True

    def docstring(self, doc: str) -> str:
        """`doc` without its already-seen paragraphs ('' when the whole docstring was seen)."""
        if not self._new(doc):
            self.dropped_docstrings += 1
            return ""
        kept = []
        for para in doc.split("\n\n"):
            if len(_normal(para)) >= MIN_PARAGRAPH_CHARS and not self._new(para):
                self.dropped_paragraphs += 1
                continue
            kept.append(para)
        return "\n\n".join(kept).strip()


def _docstrings(path: Path) -> list[str]:
    """Docstrings of a module, then of its classes and functions in source order ([] if it does not parse)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = [tree] + sorted(_definitions(tree.body), key=lambda n: (n.lineno, n.col_offset))
    return [d for d in (ast.get_docstring(n) for n in nodes) if d]


def _definitions(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Class and function definitions among `body`'s statements, at any depth. Definitions are statements, so only
    statement lists are searched, not the expressions `ast.walk` would visit (most of a module's nodes)."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        for name in ("body", "orelse", "finalbody"):
            yield from _definitions(getattr(node, name, None) or [])
        for inner in [*getattr(node, "handlers", []), *getattr(node, "cases", [])]:
            yield from _definitions(inner.body)


def _cpython(dedup: _Dedup) -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a stripped-down Python; the docstrings still follow
        topics = {}
    for name in sorted(topics):
        text = dedup.docstring(topics[name])
        if len(text) >= MIN_DOCUMENT_CHARS:
            yield text
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_"):
            continue
        for path in (stdlib / f"{name}.py", stdlib / name / "__init__.py"):
            if path.is_file():
                doc = _module_docstring(path)
                if len(doc) >= MIN_STDLIB_DOCSTRING_CHARS:
                    text = dedup.docstring(doc)
                    if len(text) >= MIN_STDLIB_DOCSTRING_CHARS:
                        yield text
                break


def _module_docstring(path: Path) -> str:
    try:
        return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""


# a worker process: the docstrings of the files named on stdin (a JSON list), as a JSON list of lists on stdout
_WORKER = ("import json, sys; from pathlib import Path; from poslens.engine.corpus import _docstrings; "
           "json.dump([_docstrings(Path(p)) for p in json.load(sys.stdin)], sys.stdout)")


def _workers() -> int:
    """Processes that parse source files: the usable cores, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))


def _parse(files: list[Path], workers: int) -> list[list[str]]:
    """`_docstrings` of each file, in order. Parsing is most of the corpus's build time, so `workers` fresh Python
    processes (subprocesses, not multiprocessing: nothing of the caller's program is re-imported) each parse every
    workers-th file; if one fails (e.g. poslens not importable in a fresh interpreter) they are parsed here."""
    if workers <= 1 or len(files) < 4 * workers:
        return [_docstrings(p) for p in files]
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL) for _ in range(workers)]
    try:
        for k, proc in enumerate(procs):  # all inputs first, so the workers parse at the same time
            proc.stdin.write(json.dumps([str(p) for p in files[k::workers]]).encode())
            proc.stdin.close()
        parts = [json.loads(proc.stdout.read()) for proc in procs]
        if any(proc.wait() != 0 for proc in procs):
            raise ValueError("a corpus worker failed")
    except (OSError, ValueError):
        for proc in procs:
            proc.kill()
            proc.wait()
        return [_docstrings(p) for p in files]
    out: list[list[str]] = [[] for _ in files]
    for k, part in enumerate(parts):
        out[k::workers] = part
    return out


def _package(name: str, dedup: _Dedup, workers: int = 1) -> Iterator[str]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return
    root = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(p for p in root.rglob("*.py")
                   if not any(part in SKIP_DIRS or part.startswith(".") for part in p.relative_to(root).parts))
    for path, docstrings in zip(files, _parse(files, workers)):
        module = ".".join((name, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        parts = [d for d in (dedup.docstring(x) for x in docstrings if len(x) >= MIN_DOCSTRING_CHARS) if d]
        text = "\n\n".join(parts)
        if len(text) >= MIN_DOCUMENT_CHARS:
            yield f"{module}\n\n{text}"


def _sources(manifest: dict, workers: int | None = None) -> Iterator[str]:
    """Every document in order; fills `manifest` (per source: version, licence, used, documents, characters) as
    it goes, and its totals once the last source is read. `workers`: processes parsing a package's files (default
    `_workers()`; the documents do not depend on it)."""
    workers = _workers() if workers is None else workers
    dedup = _Dedup()
    manifest.update(format=FORMAT, python=platform.python_version(), sources=[])
    total_docs = total_chars = 0
    plan: list[tuple[str, str | None, str | None, bool]] = [("cpython-docs", platform.python_version(), "PSF-2.0",
                                                             True)]
    for name in SOURCES:
        try:
            version, lic = metadata.version(name), licence(name)
        except metadata.PackageNotFoundError:
            version, lic = None, None
        plan.append((name, version, lic, bool(lic) and is_permissive(lic)))
    for name, version, lic, used in plan:
        entry = {"name": name, "version": version, "licence": lic, "used": used, "documents": 0, "chars": 0}
        manifest["sources"].append(entry)
        if not used:
            continue
        for doc in _cpython(dedup) if name == "cpython-docs" else _package(name, dedup, workers):
            entry["documents"] += 1
            entry["chars"] += len(doc)
            yield doc
        total_docs += entry["documents"]
        total_chars += entry["chars"]
    manifest.update(documents=total_docs, chars=total_chars, dropped_docstrings=dedup.dropped_docstrings,
                    dropped_paragraphs=dedup.dropped_paragraphs, versions=versions())


def build(workers: int | None = None) -> tuple[list[str], dict]:
    """Read the whole corpus from the installed files: (documents, manifest)."""
    manifest: dict = {}
    docs = list(_sources(manifest, workers))
    return docs, manifest


# ---------------------------------------------------------------- cache


def versions() -> dict[str, str | None]:
    """What the corpus depends on: the Python version and each source package's version (None if absent)."""
    out: dict[str, str | None] = {"python": platform.python_version(), "format": str(FORMAT)}
    for name in SOURCES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cache_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the corpus for the installed versions is cached."""
    from poslens.engine.models import cache_root

    key = hashlib.sha256(json.dumps(versions(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_root(cache_dir) / "corpus" / f"corpus-{key}.json.gz"


def _read_cache(path: Path) -> tuple[tuple[str, ...], dict] | None:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
        return tuple(data["documents"]), data["manifest"]
    except (OSError, ValueError, KeyError, EOFError):
        return None  # absent or damaged: rebuilt


def _write_cache(path: Path, docs: list[str], manifest: dict) -> None:
    """Write the cache file atomically (a temporary renamed into place; a full disk is one line)."""
    data = gzip.compress(json.dumps({"documents": docs, "manifest": manifest}).encode("utf-8"), compresslevel=3)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with disk_space(path, len(data)):
            tmp.write_bytes(data)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@functools.lru_cache(maxsize=2)
def load(cache_dir: str | None = None) -> tuple[tuple[str, ...], dict]:
    """(documents, manifest) of the whole corpus: from the cache when there, else built (about 20 s on two
    cores) and cached. A second process building it at the same time waits for the first."""
    path = cache_path(cache_dir)
    cached = _read_cache(path)
    if cached is not None:
        return cached
    with cache_lock(path, WHAT):
        cached = _read_cache(path)  # built by another process while this one waited
        if cached is None:
            docs, manifest = build()
            _write_cache(path, docs, manifest)
            cached = tuple(docs), manifest
    return cached


def documents(cache_dir: str | None = None) -> Iterator[str]:
    """The corpus documents in their fixed order. Without a cache they are read lazily, source by source, so a
    caller that needs only the first documents reads only the first sources; reading to the end caches it.
    A cache being built by another process is waited for; an unwritable cache directory is refused up front."""
    path = cache_path(cache_dir)
    cached = _read_cache(path) if path.is_file() else None
    if cached is None:
        with cache_lock(path, WHAT):  # waits for another builder; refuses an unwritable cache before any work
            cached = _read_cache(path)
    if cached is not None:
        yield from cached[0]
        return
    manifest: dict = {}
    docs: list[str] = []
    for doc in _sources(manifest):
        docs.append(doc)
        yield doc
    with cache_lock(path, WHAT):
        if _read_cache(path) is None:
            _write_cache(path, docs, manifest)


def label() -> str:
    """A name for the corpus that pins what it is built from (without building it)."""
    v = versions()
    used = ", ".join(f"{name} {v[name]}" for name in SOURCES if v[name] is not None and is_permissive(licence(name)))
    return f"embedded corpus v{FORMAT}: Python {v['python']} documentation + docstrings of {used} (permissive only)"
