"""Local providers over the real test collections (BM25, LSA, BM25+LSA hybrid, dense) and a synthetic one.

Each adds a simulated network latency after its real compute (see :class:`LatencyModel`), so
that cost and latency differ between providers as they would for real search APIs.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np

from schemas.trace import Citation
from services.common.errors import ProviderError
from services.providers import index as idx
from services.providers.base import Provider, ProviderAnswer, build_answer
from services.providers.collections import (
    Doc,
    check_names,
    collection_hash,
    default_collections_dir,
    doc_url,
    load_corpus,
)
from services.providers.config import (
    BM25Config,
    DenseConfig,
    HybridConfig,
    LatencyModel,
    LSAConfig,
    SyntheticConfig,
)
from services.providers.lsa import LSAIndex, build_lsa, lsa_params

SNIPPET_CHARS = 600  # what the judge reads of each source; 300 left it grading the generalists by the very lead they indexed
SYNTHETIC_COLLECTION = "synthetic"

Corpora = Mapping[str, tuple[Doc, ...]]
RowKeys = list[tuple[str, str]]  # (collection, doc_id) of each index row


def _seed(*parts: str) -> int:
    """A 64-bit seed from the SHA-256 of ``parts`` (NUL-separated, so the split is unambiguous)."""
    return int.from_bytes(hashlib.sha256("\0".join(parts).encode()).digest()[:8], "big")


def simulated_latency_ms(model: LatencyModel, provider: str, query: str) -> float:
    """The simulated latency for ``query`` at ``provider``: log-normal, same query -> same value."""
    if model.median_ms <= 0:
        return 0.0
    if model.sigma == 0:
        return model.median_ms
    z = random.Random(_seed(provider, query)).gauss(0.0, 1.0)
    return model.median_ms * math.exp(model.sigma * z)


def snippet(text: str, max_chars: int = SNIPPET_CHARS) -> str:
    """The first ``max_chars`` or so of ``text``, cut at a word boundary."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    return head.rsplit(" ", 1)[0] if " " in head else head


def top_k(scores: np.ndarray, k: int, *, positive_only: bool) -> list[tuple[int, float]]:
    """The (row, score) of the ``k`` best rows, best first, ties by row; optionally only > 0."""
    k = min(k, len(scores))
    if k <= 0:
        return []
    rows = np.argpartition(-scores, k - 1)[:k]
    rows = rows[np.lexsort((rows, -scores[rows]))]
    if positive_only:
        rows = rows[scores[rows] > 0]
    return [(int(r), float(scores[r])) for r in rows]


def _answer(citations: Sequence[Citation], cost_usd: float,
            meta: Mapping[str, object]) -> ProviderAnswer:
    """A ProviderAnswer with the extractive answer built from ``citations``."""
    cites = tuple(citations)
    return ProviderAnswer(citations=cites, answer=build_answer(cites), cost_usd=cost_usd,
                          raw_meta=dict(meta))


class LocalIndexProvider(Provider):
    """Shared part of the index-backed providers: loading, top-k, citations and latency.

    Subclasses say how to get their index (:meth:`_load_index`) and how to score a query
    against it (:meth:`_scores`); both run in a worker thread.
    """

    kind: ClassVar[str]
    #: Drop documents scoring <= 0 (for BM25 they share no term with the query).
    positive_only: ClassVar[bool] = False

    def __init__(self, config: BM25Config | LSAConfig | HybridConfig | DenseConfig, *,
                 collections_dir: Path | str | None = None,
                 cache_dir: Path | str | None = None) -> None:
        super().__init__(config.name, cost_usd=config.cost_usd, timeout_s=config.timeout_s,
                         k=config.k)
        self.config = config
        self.collections = tuple(sorted(set(check_names(config.collections))))
        self._collections_dir = Path(collections_dir) if collections_dir is not None else None
        self.cache_dir = Path(cache_dir) if cache_dir is not None else idx.default_cache_dir()
        #: Indexes this provider had to build (not load from cache) in :meth:`start`.
        self.index_builds = 0
        self.index_paths: tuple[Path, ...] = ()
        self._docs: tuple[Doc, ...] = ()
        self._started = False
        self._start_lock = asyncio.Lock()

    @property
    def started(self) -> bool:
        """True once :meth:`start` has loaded the index."""
        return self._started

    @property
    def num_docs(self) -> int:
        """Documents in the loaded index."""
        return len(self._docs)

    async def start(self) -> None:
        """Load (building and caching if needed) the corpora and index; idempotent."""
        async with self._start_lock:
            if not self._started:
                await asyncio.to_thread(self._load)
                self._started = True

    def _load(self) -> None:
        """Read the corpora, get the index and line its rows up with the documents."""
        directory = self._collections_dir or default_collections_dir()
        self.index_builds, self.index_paths = 0, ()
        corpora = {name: load_corpus(directory, name) for name in self.collections}
        by_key = {(d.collection, d.doc_id): d for docs in corpora.values() for d in docs}
        rows = self._load_index(directory, corpora)
        missing = [key for key in rows if key not in by_key]
        if missing:
            raise ProviderError(self.name, f"index rows not in the corpus, e.g. {missing[0]}")
        self._docs = tuple(by_key[key] for key in rows)

    def _ensure(self, key: idx.IndexKey, build: Callable[[Path], idx.Params]) -> Path:
        """The cached index for ``key`` (built if missing), counting builds."""
        cached = idx.ensure_index(self.cache_dir, key, build)
        self.index_builds += int(cached.built)
        self.index_paths += (cached.path,)
        return cached.path

    @abc.abstractmethod
    def _load_index(self, directory: Path, corpora: Corpora) -> RowKeys:
        """Get the index ready; return the (collection, doc_id) of each of its rows."""

    @abc.abstractmethod
    def _scores(self, query: str) -> np.ndarray | None:
        """A score for every index row, or None if the query matches nothing at all."""

    def _retrieve(self, query: str) -> list[Citation]:
        """The top-k citations for a non-empty ``query`` (blocking)."""
        scores = self._scores(query)
        if scores is None:
            return []
        hits = top_k(scores, self.k, positive_only=self.positive_only)
        return [self._citation(rank, self._docs[row], score)
                for rank, (row, score) in enumerate(hits, 1)]

    @staticmethod
    def _citation(rank: int, doc: Doc, score: float) -> Citation:
        """The citation of ``doc`` at ``rank``."""
        return Citation(url=doc_url(doc.collection, doc.doc_id), title=doc.title, rank=rank,
                        snippet=snippet(doc.text), score=score)

    async def search(self, query: str) -> ProviderAnswer:
        """Retrieve in a worker thread, then wait out the simulated latency."""
        if not self._started:
            raise ProviderError(self.name, "search() called before start()")
        started = time.perf_counter()
        text = query.strip()
        try:
            citations = await asyncio.to_thread(self._retrieve, text) if text else []
        except ProviderError:
            raise
        except Exception as exc:
            raise ProviderError(self.name, f"retrieval failed: {exc!r}") from exc
        compute_ms = (time.perf_counter() - started) * 1000
        latency_ms = simulated_latency_ms(self.config.latency, self.name, query)
        if latency_ms > 0:
            await asyncio.sleep(latency_ms / 1000)
        meta = {"compute_ms": round(compute_ms, 3), "simulated_latency_ms": round(latency_ms, 3)}
        return _answer(citations, self.cost_usd, meta)


class LexicalIndexProvider(LocalIndexProvider):
    """Providers over one index of the union of their collections' (full or lead) text: BM25, LSA, both."""

    positive_only = True  # BM25 <= 0 shares no term with the query; an LSA cosine <= 0 is no answer
    config: BM25Config | LSAConfig | HybridConfig

    def _docs_of(self, corpora: Corpora) -> list[Doc]:
        return [d for name in self.collections for d in corpora[name]]

    def _bm25(self, directory: Path, corpora: Corpora, k1: float, b: float) -> tuple[object, RowKeys]:
        docs, lead = self._docs_of(corpora), self.config.lead_chars
        key = idx.IndexKey("bm25", collection_hash(directory, self.collections), idx.bm25_params(k1, b, lead))
        path = self._ensure(key, lambda tmp: idx.build_bm25(tmp, docs, k1=k1, b=b, lead_chars=lead))
        return idx.load_bm25(path), idx.read_doc_keys(path)

    def _lsa(self, directory: Path, corpora: Corpora, dim: int) -> tuple[LSAIndex, RowKeys]:
        docs, lead = self._docs_of(corpora), self.config.lead_chars
        key = idx.IndexKey("lsa", collection_hash(directory, self.collections), lsa_params(dim, lead))
        path = self._ensure(key, lambda tmp: build_lsa(tmp, docs, dim=dim, lead_chars=lead))
        return LSAIndex.load(path), idx.read_doc_keys(path)


class BM25Provider(LexicalIndexProvider):
    """BM25 (bm25s, English Snowball stemmer and stopwords) over the union of its collections."""

    kind = "bm25"
    config: BM25Config

    def __init__(self, config: BM25Config, *, collections_dir: Path | str | None = None,
                 cache_dir: Path | str | None = None) -> None:
        super().__init__(config, collections_dir=collections_dir, cache_dir=cache_dir)
        self._retriever: object | None = None

    def _load_index(self, directory: Path, corpora: Corpora) -> RowKeys:
        """One index over all collections, since BM25's IDF depends on the whole corpus."""
        self._retriever, rows = self._bm25(directory, corpora, self.config.k1, self.config.b)
        return rows

    def _scores(self, query: str) -> np.ndarray | None:
        return idx.bm25_scores(self._retriever, query)


class LSAProvider(LexicalIndexProvider):
    """Latent semantic indexing over the union of its collections (see :mod:`.lsa`)."""

    kind = "lsa"
    config: LSAConfig

    def _load_index(self, directory: Path, corpora: Corpora) -> RowKeys:
        self._lsa_index, rows = self._lsa(directory, corpora, self.config.dim)
        return rows

    def _scores(self, query: str) -> np.ndarray | None:
        return self._lsa_index.scores(query)


class HybridProvider(LexicalIndexProvider):
    """BM25 and LSA over the same documents, fused: ``bm25 / max(bm25) + w * max(cosine, 0)``.

    Max-normalising BM25 puts both parts on [0, 1] per query, so one weight means the same thing for
    every query; a document that only LSA finds can still rank (BM25 alone drops it).
    """

    kind = "hybrid"
    config: HybridConfig

    def _load_index(self, directory: Path, corpora: Corpora) -> RowKeys:
        self._retriever, rows = self._bm25(directory, corpora, self.config.k1, self.config.b)
        self._lsa_index, lsa_rows = self._lsa(directory, corpora, self.config.dim)
        if lsa_rows != rows:
            raise ProviderError(self.name, "the BM25 and LSA indexes disagree on their rows")
        return rows

    def _scores(self, query: str) -> np.ndarray | None:
        lexical = idx.bm25_scores(self._retriever, query)
        semantic = self._lsa_index.scores(query)
        if lexical is None and semantic is None:
            return None
        out = np.zeros(len(self._docs), dtype=np.float32)
        if lexical is not None and (top := float(lexical.max())) > 0:
            out += lexical / top
        if semantic is not None:
            out += self.config.lsa_weight * np.clip(semantic, 0.0, None)
        return out


class DenseProvider(LocalIndexProvider):
    """Cosine similarity of sentence-transformers embeddings (all-MiniLM-L6-v2 by default).

    Embeddings are cached per collection (a document's vector does not depend on the others),
    so any subset of collections reuses them.
    """

    kind = "dense"
    config: DenseConfig

    def __init__(self, config: DenseConfig, *, collections_dir: Path | str | None = None,
                 cache_dir: Path | str | None = None) -> None:
        super().__init__(config, collections_dir=collections_dir, cache_dir=cache_dir)
        self._model: idx.DenseModel | None = None
        self._matrix = np.empty((0, 0), dtype=np.float32)

    def _load_index(self, directory: Path, corpora: Corpora) -> RowKeys:
        """Load the model, then each collection's cached embeddings (encoding missing ones)."""
        configured = self.config.model_path
        model_path = Path(configured) if configured else idx.default_model_path()
        params = idx.dense_params(model_path, self.config.max_seq_length)  # checks the path exists
        self._model = idx.load_model(model_path.resolve(), self.config.max_seq_length)
        rows: RowKeys = []
        matrices = []
        for name in self.collections:
            key = idx.IndexKey(self.kind, collection_hash(directory, [name]), params)
            path = self._ensure(key, lambda tmp, name=name: idx.build_dense(
                tmp, corpora[name], self._model, desc=f"dense {name}"))
            matrices.append(idx.load_dense(path))
            rows.extend(idx.read_doc_keys(path))
        self._matrix = np.ascontiguousarray(np.concatenate(matrices, axis=0))
        return rows

    def _scores(self, query: str) -> np.ndarray | None:
        assert self._model is not None
        return self._matrix @ self._model.encode([query])[0]


def synthetic_doc_ids(provider: str, query: str, k: int, corpus_size: int) -> list[int]:
    """``k`` distinct pseudo-random doc ids in ``[0, corpus_size)``, fixed by (provider, query)."""
    return random.Random(_seed(provider, query)).sample(range(corpus_size), min(k, corpus_size))


class SyntheticProvider(Provider):
    """Fixed latency and canned citations, no index: cheap enough for latency benchmarks."""

    def __init__(self, config: SyntheticConfig) -> None:
        super().__init__(config.name, cost_usd=config.cost_usd, timeout_s=config.timeout_s,
                         k=config.k)
        self.config = config

    def _citations(self, query: str) -> list[Citation]:
        """Deterministic citations for ``query`` (none for a blank one)."""
        if not query.strip():
            return []
        ids = synthetic_doc_ids(self.name, query, self.k, self.config.corpus_size)
        return [Citation(url=doc_url(SYNTHETIC_COLLECTION, str(doc_id)),
                         title=f"Synthetic document {doc_id}", rank=rank,
                         snippet=f"Synthetic text of document {doc_id}.", score=1.0 / rank)
                for rank, doc_id in enumerate(ids, 1)]

    async def search(self, query: str) -> ProviderAnswer:
        """Canned citations after exactly ``latency_ms``."""
        citations = self._citations(query)
        if self.config.latency_ms > 0:
            await asyncio.sleep(self.config.latency_ms / 1000)
        return _answer(citations, self.cost_usd, {"simulated_latency_ms": self.config.latency_ms})
