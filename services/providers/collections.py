"""Loading the local IR test collections: corpora, queries, qrels, content hashes and doc URLs.

Layout per collection (see ``data/collections/MANIFEST.md``): ``<name>/corpus.jsonl`` or
``<name>/corpus.jsonl.gz``, ``<name>/queries.jsonl`` and ``<name>/qrels.tsv``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from urllib.parse import quote, unquote

from services.common.errors import ConfigError
from services.common import paths
from services.providers.config import ALL_COLLECTIONS

COLLECTIONS_DIR_ENV = paths.COLLECTIONS_DIR_ENV
URL_SCHEME = "collection://"
_CORPUS_FILES = ("corpus.jsonl", "corpus.jsonl.gz")


@dataclass(frozen=True, slots=True)
class Doc:
    """One document of a collection."""

    collection: str
    doc_id: str
    title: str
    text: str

    @property
    def url(self) -> str:
        """The stable ``collection://<name>/<doc_id>`` URL of this document."""
        return doc_url(self.collection, self.doc_id)


@dataclass(frozen=True, slots=True)
class Query:
    """One query of a collection."""

    collection: str
    query_id: str
    text: str


@dataclass(frozen=True, slots=True)
class DocRef:
    """What a ``collection://`` URL points at."""

    collection: str
    doc_id: str


def default_collections_dir() -> Path:
    """The collections folder: ``$FANROUTE_COLLECTIONS_DIR``, else the copy bundled in the repository
    (``data/collections``; see :mod:`services.common.paths`)."""
    path = paths.collections_dir()
    if os.environ.get(COLLECTIONS_DIR_ENV):
        source = f"${COLLECTIONS_DIR_ENV}"
    else:
        source = "the copy bundled in the repository"
    if not path.is_dir():
        raise ConfigError(f"collections folder {path} (from {source}) does not exist; "
                          f"set {COLLECTIONS_DIR_ENV} to the folder holding <name>/corpus.jsonl")
    return path


def check_names(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` as a tuple, or a ConfigError naming the known collections if one is unknown."""
    names = tuple(names)
    unknown = [n for n in names if n not in ALL_COLLECTIONS]
    if unknown:
        raise ConfigError(f"unknown collection(s) {', '.join(map(repr, unknown))}; "
                          f"known: {', '.join(ALL_COLLECTIONS)}")
    return names


def corpus_path(directory: Path, name: str) -> Path:
    """The corpus file of collection ``name`` (``.jsonl`` or ``.jsonl.gz``)."""
    check_names([name])
    for filename in _CORPUS_FILES:
        path = Path(directory) / name / filename
        if path.is_file():
            return path
    raise ConfigError(f"collection {name!r} has no corpus.jsonl[.gz] in {Path(directory) / name}")


def _collection_file(directory: Path, name: str, filename: str) -> Path:
    """A file of collection ``name`` that must exist."""
    check_names([name])
    path = Path(directory) / name / filename
    if not path.is_file():
        raise ConfigError(f"collection {name!r} has no {filename} under {path.parent}")
    return path


def _open_text(path: Path) -> IO[str]:
    """Open a UTF-8 text file, gunzipping it if its name ends in ``.gz``."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _jsonl(path: Path) -> Iterator[dict[str, str]]:
    """The JSON objects of a JSON-lines file, skipping blank lines."""
    with _open_text(path) as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def load_corpus(directory: Path, name: str) -> tuple[Doc, ...]:
    """Every document of collection ``name``, in file order."""
    return tuple(Doc(name, str(r["doc_id"]), r.get("title") or "", r.get("text") or "")
                 for r in _jsonl(corpus_path(directory, name)))


def load_queries(directory: Path, name: str) -> tuple[Query, ...]:
    """Every query of collection ``name`` (including unjudged ones), in file order."""
    path = _collection_file(directory, name, "queries.jsonl")
    return tuple(Query(name, str(r["query_id"]), r["text"]) for r in _jsonl(path))


def load_qrels(directory: Path, name: str) -> dict[str, dict[str, int]]:
    """Relevance judgments of collection ``name``: query_id -> {doc_id: grade}."""
    qrels: dict[str, dict[str, int]] = {}
    with _collection_file(directory, name, "qrels.tsv").open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            query_id, doc_id, grade = line.rstrip("\n").split("\t")
            qrels.setdefault(query_id, {})[doc_id] = int(grade)
    return qrels


def collection_hash(directory: Path, names: Iterable[str]) -> str:
    """SHA-256 over the corpus files of ``names`` (order-insensitive), for index cache keys."""
    digest = hashlib.sha256()
    for name in sorted(set(check_names(names))):
        path = corpus_path(directory, name)
        digest.update(f"{name}/{path.name}\0".encode())
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def doc_url(collection: str, doc_id: str) -> str:
    """The stable URL of a document: ``collection://<name>/<doc_id>`` (doc id percent-encoded)."""
    return f"{URL_SCHEME}{collection}/{quote(doc_id, safe='')}"


def parse_doc_url(url: str) -> DocRef:
    """The collection and doc id of a ``collection://`` URL; ValueError if it is not one."""
    if not url.startswith(URL_SCHEME):
        raise ValueError(f"not a {URL_SCHEME} URL: {url!r}")
    collection, sep, doc_id = url[len(URL_SCHEME):].partition("/")
    if not collection or not sep or not doc_id:
        raise ValueError(f"a {URL_SCHEME} URL needs <name>/<doc_id>: {url!r}")
    return DocRef(collection, unquote(doc_id))


@dataclass(frozen=True)
class ReplayQuery:
    """One query to send, with the id that ties its trace back to the collection's qrels."""

    query_id: str
    text: str


def sample_queries(collections: tuple[str, ...] = ALL_COLLECTIONS, *, limit: int | None = None,
                   seed: int = 0, judged_only: bool = True, directory: Path | None = None) -> list[ReplayQuery]:
    """Queries from the collections (ids ``<collection>/<query_id>``), shuffled by ``seed``."""
    directory = directory or default_collections_dir()
    out = []
    for name in check_names(collections):
        judged = load_qrels(directory, name) if judged_only else None
        out += [ReplayQuery(f"{name}/{q.query_id}", q.text) for q in load_queries(directory, name)
                if judged is None or q.query_id in judged]
    random.Random(seed).shuffle(out)
    return out[:limit] if limit is not None else out
