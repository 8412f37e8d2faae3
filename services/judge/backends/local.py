"""A local judge that needs no network: lexical evidence, optionally blended with MiniLM similarity.

Each blind candidate is graded 0–3 from how well its sources (title + snippet; never URLs or
provider names) cover the query:

* **Lexical score** (always). The query and each source are lower-cased, split into word
  tokens, stripped of English stopwords (NLTK's list, as shipped with bm25s) and Snowball-stemmed
  (PyStemmer). A source's *coverage* is the IDF-weighted share of the query's distinct content
  stems it contains. IDF is estimated from the request itself: the pool is the N distinct
  sources the judge reads (each candidate's first ``top_sources``),
  ``idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5))``. So a query term that
  every candidate's sources contain counts for little (it does not separate them), and one that
  no source contains counts for much (everyone fails it equally). No background corpus needed.
* **Cosine score** (``use_embeddings``). MiniLM cosine between the query and ``"title. snippet"``,
  clipped to [0, 1].

Per candidate, each per-source score is averaged over the first ``top_sources`` sources with a
``1 / log2(rank + 1)`` discount; missing sources count as 0, so fewer sources is less evidence.
The candidate's score is ``(1 - w) * lexical + w * cosine`` (``w = embedding_weight`` with
embeddings, else 0) and maps to a grade through ``thresholds`` (per-variant defaults in
:mod:`services.judge.settings_local`). The ordering is the grades as
tiers, best first: candidates with equal grades are tied.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import ConfigError
from services.judge.backends.embed_cache import EmbeddingCache, default_cache_path
from services.judge.base import (
    JudgeBackend,
    JudgeFailed,
    JudgeIdentity,
    JudgeRequest,
    JudgeResult,
    Source,
)
from services.judge.settings_local import LocalJudgeConfig
from services.providers import index as idx
from services.providers.config import DenseConfig, ProviderConfig

LEXICAL_MODEL = "local-lexical-v1"
EMBEDDING_MODEL_PREFIX = "local-lexical+minilm-v1"
_TOKEN = re.compile(r"\w+")
_stemmers = threading.local()


def _stopwords() -> frozenset[str]:
    """NLTK's English stopword list (179 words), as bm25s ships it."""
    from bm25s.stopwords import STOPWORDS_EN_PLUS

    return frozenset(STOPWORDS_EN_PLUS)


STOPWORDS = _stopwords()


def _stemmer() -> Any:
    """This thread's English Snowball stemmer (PyStemmer objects are not thread-safe)."""
    stemmer = getattr(_stemmers, "stemmer", None)
    if stemmer is None:
        import Stemmer

        stemmer = _stemmers.stemmer = Stemmer.Stemmer("english")
    return stemmer


def content_stems(text: str) -> set[str]:
    """The distinct stemmed content terms of ``text`` (lower-cased, stopwords and 1-letter words out)."""
    words = [w for w in _TOKEN.findall(text.lower())
             if w not in STOPWORDS and (len(w) > 1 or w.isdigit())]
    return set(_stemmer().stemWords(words))


def source_text(source: Source) -> str:
    """What the judge reads of a source: ``"title. snippet"`` (either part may be empty)."""
    title, body = source.title.strip(), source.snippet.strip()
    return f"{title}. {body}" if title and body else title or body


def request_idf(query_terms: set[str], pool: Sequence[set[str]]) -> dict[str, float]:
    """BM25-style IDF of each query term over the request's source pool (always > 0)."""
    n = len(pool)
    return {t: math.log(1 + (n - (df := sum(t in s for s in pool)) + 0.5) / (df + 0.5))
            for t in query_terms}


def coverage(query_idf: dict[str, float], source_terms: set[str]) -> float:
    """IDF-weighted share of the query terms found in one source, in [0, 1]."""
    total = sum(query_idf.values())
    if total <= 0:
        return 0.0
    return sum(w for t, w in query_idf.items() if t in source_terms) / total


def discounted_mean(per_source: Sequence[float], top: int) -> float:
    """Rank-discounted mean of the first ``top`` per-source scores; absent sources count 0."""
    weights = [1 / math.log2(r + 1) for r in range(1, top + 1)]
    return sum(w * s for w, s in zip(weights, per_source[:top])) / sum(weights)


def grade_of(score: float, thresholds: Sequence[float]) -> int:
    """0–3: how many of the (increasing) thresholds ``score`` reaches."""
    return sum(score >= t for t in thresholds)


def tiers_by_grade(grades: dict[str, int]) -> tuple[tuple[str, ...], ...]:
    """Letters grouped by equal grade, best first; letters keep their given order in a tier."""
    return tuple(tuple(k for k, g in grades.items() if g == level)
                 for level in sorted(set(grades.values()), reverse=True))


class LocalJudge(JudgeBackend):
    """Grades candidates 0–3 from query–source evidence, offline and deterministically.

    The lexical judge is the default. With ``use_embeddings`` the score blends in MiniLM
    cosine similarity, but when a dense provider uses the same MiniLM model such a judge would
    systematically favour it (it grades with the very similarity that provider ranked by), so
    the judge worker refuses that combination (see :func:`conflicting_providers`). The lexical
    judge has the mirror-image bias towards BM25 providers (term overlap is what BM25 ranks by).
    On 199 dev queries the lexical judge put bm25-all in its top tier for 92% of traces where
    qrels put it there for 48%; the MiniLM blend did the same for dense-all (96% vs 60%).
    Measure it with the calibration report before trusting its verdicts.
    """

    def __init__(self, config: LocalJudgeConfig | None = None) -> None:
        self.config = config or LocalJudgeConfig()
        self._model_path: Path | None = None
        self._model: idx.DenseModel | None = None
        self._cache: EmbeddingCache | None = None
        self._start_lock = threading.Lock()
        if self.config.use_embeddings:
            self._model_path = judge_model_path(self.config)
            fingerprint = idx.model_fingerprint(self._model_path)  # ConfigError if missing
            self.identity = JudgeIdentity(kind="local",
                                          model=f"{EMBEDDING_MODEL_PREFIX}:{fingerprint[:12]}")
            cache_path = None if self.config.embedding_cache == "off" else default_cache_path()
            self._cache = EmbeddingCache(cache_path, f"{fingerprint}:{self.config.max_seq_length}")
        else:
            self.identity = JudgeIdentity(kind="local", model=LEXICAL_MODEL)

    @property
    def rubric_extra(self) -> str:
        """The scoring settings as canonical JSON, for ``rubric_hash(extra)``.

        The identity names only the method and model, so changed thresholds or weights must
        change the rubric hash instead, or old and new verdicts would share an id.
        """
        c = self.config
        return json.dumps({"thresholds": list(c.cut_points), "top_sources": c.top_sources,
                           "embedding_weight": c.embedding_weight if c.use_embeddings else 0.0,
                           "max_seq_length": c.max_seq_length if c.use_embeddings else None,
                           "stopwords": len(STOPWORDS), "stemmer": "snowball-english"},
                          sort_keys=True, separators=(",", ":"))

    async def start(self) -> None:
        """Load the embedding model once (only with ``use_embeddings``); idempotent."""
        if self.config.use_embeddings and self._model is None:
            await asyncio.to_thread(self._load_model)

    def _load_model(self) -> None:
        with self._start_lock:
            if self._model is None:
                assert self._model_path is not None
                self._model = idx.load_model(self._model_path, self.config.max_seq_length)

    async def close(self) -> None:
        """Close the embedding cache."""
        if self._cache is not None:
            self._cache.close()

    @property
    def embedding_stats(self) -> dict[str, int]:
        """Source texts embedded vs found in the cache so far (the judge's cost driver)."""
        c = self._cache
        return {"embedded": c.misses, "cached": c.hits} if c is not None else {"embedded": 0, "cached": 0}

    async def judge(self, request: JudgeRequest) -> JudgeResult:
        """Grade every candidate and order them in tiers of equal grade."""
        letters = request.letters
        if len(set(letters)) != len(letters):
            raise JudgeFailed(f"trace {request.trace_id}: duplicate letters {letters}")
        if self.config.use_embeddings:
            if self._model is None:
                raise JudgeFailed("LocalJudge.judge() called before start() loaded the model")
            scores = await asyncio.to_thread(self.scores, request)
        else:
            scores = self.scores(request)
        grades = {k: grade_of(s, self.config.cut_points) for k, s in scores.items()}
        raw = json.dumps({"scores": scores}, sort_keys=True)
        return JudgeResult(grades=grades, ordering=tiers_by_grade(grades), raw=raw)

    def scores(self, request: JudgeRequest) -> dict[str, float]:
        """The combined score in [0, 1] of each letter (rounded to 6 places, for stable grades)."""
        top = self.config.top_sources
        shown = [c.sources[:top] for c in request.candidates]
        lexical = self._lexical(request.query, shown)
        w = self.config.embedding_weight if self.config.use_embeddings else 0.0
        cosine = self._cosine(request.query, shown) if w > 0 else [0.0] * len(shown)
        return {c.letter: round((1 - w) * lex + w * cos, 6)
                for c, lex, cos in zip(request.candidates, lexical, cosine)}

    def _lexical(self, query: str, shown: list[tuple[Source, ...]]) -> list[float]:
        """Each candidate's rank-discounted mean IDF coverage of the query's content terms."""
        terms = {s: content_stems(source_text(s)) for srcs in shown for s in srcs}
        query_idf = request_idf(content_stems(query), list(terms.values()))
        top = self.config.top_sources
        return [discounted_mean([coverage(query_idf, terms[s]) for s in srcs], top)
                for srcs in shown]

    def _cosine(self, query: str, shown: list[tuple[Source, ...]]) -> list[float]:
        """Each candidate's rank-discounted mean query–source cosine (clipped to [0, 1])."""
        assert self._model is not None
        texts = list(dict.fromkeys(source_text(s) for srcs in shown for s in srcs))
        if not texts:
            return [0.0] * len(shown)
        assert self._cache is not None
        query_d = self._model.encode([query])[0]
        sources_nd = self._cache.get_many(texts, self._model.encode)
        sims_n = np.clip(sources_nd @ query_d, 0.0, 1.0)
        sim_of = {t: float(v) for t, v in zip(texts, sims_n)}
        top = self.config.top_sources
        return [discounted_mean([sim_of[source_text(s)] for s in srcs], top) for srcs in shown]


def judge_model_path(config: LocalJudgeConfig) -> Path:
    """The embedding model folder the judge uses (configured, else the bundled MiniLM)."""
    return (Path(config.model_path) if config.model_path else idx.default_model_path()).resolve()


def conflicting_providers(config: LocalJudgeConfig,
                          providers: Iterable[ProviderConfig]) -> list[str]:
    """Enabled dense providers embedding with the judge's own model; the worker refuses any.

    Same model means the same resolved folder or the same file fingerprint. A lexical judge
    (``use_embeddings`` off) conflicts with nothing here.
    """
    if not config.use_embeddings:
        return []
    mine = judge_model_path(config)
    my_print = idx.model_fingerprint(mine)
    out = []
    for p in providers:
        if not isinstance(p, DenseConfig) or not p.enabled:
            continue
        theirs = (Path(p.model_path) if p.model_path else idx.default_model_path()).resolve()
        if theirs == mine:
            out.append(p.name)
            continue
        try:
            same = idx.model_fingerprint(theirs) == my_print
        except ConfigError as exc:
            raise ConfigError(f"cannot tell whether dense provider {p.name!r} shares the judge's "
                              f"model: {exc}") from exc
        if same:
            out.append(p.name)
    return out

