"""The linear router: TF-IDF features of the query, multinomial logistic regression onto the judge's
cost-aware first choice — the strongest cheap baseline, distilled from the same episodes as the student.

Why it exists: a learned LM router is only worth its cost when it beats what a linear classifier learns
from the very same labels in milliseconds. ``fanroute eval`` reports it beside every candidate, and the
promotion rule requires an LM candidate to beat it.

Its scores are log-probabilities per provider, so it decides exactly like the scoring LM router
(:func:`services.router.scoring.decide`: P(best) − λ · cost). The regularisation strength is chosen by
cross-validation on the training episodes only (never on the queries it is evaluated on).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.episode import Episode
from services.common.prompt import providers_of, query_of
from services.router.rates import RatesError, judge_tiers, table_from, top_tier_rates

#: Regularisation grid the cross-validation chooses from (inverse strength, scikit-learn's C).
C_GRID = (0.25, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0)
#: A provider the router never saw as a label gets this log-probability (it is never preferred, but an
#: ordering still lists it).
UNSEEN_LOGPROB = -30.0


class LinearRouterError(ValueError):
    """The episodes cannot train a linear router (too few, or a single label)."""


def first_choice(ep: Episode) -> str | None:
    """The episode's label: the first name of its (cost-aware) ordering; None when it does not parse."""
    tiers = judge_tiers(ep)
    return tiers[0][0] if tiers else None


@dataclass
class LinearRouter:
    """A fitted TF-IDF + logistic-regression router; :meth:`scores` gives log P(provider is best | query)."""

    providers: tuple[str, ...]
    classes: tuple[str, ...]
    pipeline: Any
    c: float
    cv_accuracy: float
    train_episodes: int
    labels: dict[str, int] = field(default_factory=dict)
    rates: dict[str, dict[str, float]] | None = None  # the top-tier table (services/router/rates.py)

    _compiled: Any = field(default=None, init=False, repr=False, compare=False)

    def scores(self, query: str, providers: Sequence[str] | None = None) -> dict[str, float]:
        """Provider → log-probability (every provider asked about; an unseen label gets :data:`UNSEEN_LOGPROB`).

        Computed by :class:`CompiledScorer` — the pipeline's own numbers without its per-call machinery
        (the gateway asks it once per routed request, on its event loop)."""
        if self._compiled is None:
            self._compiled = CompiledScorer(self.pipeline)
        probs = self._compiled.proba(query)
        logp = {c: math.log(max(float(p), 1e-300)) for c, p in zip(self.classes, probs, strict=True)}
        return {n: logp.get(n, UNSEEN_LOGPROB) for n in (providers or self.providers)}

    def describe(self) -> dict[str, Any]:
        """What the report records about it."""
        return {"kind": "tfidf+logreg", "C": self.c, "cv_accuracy": round(self.cv_accuracy, 4),
                "train_episodes": self.train_episodes, "labels": self.labels}


class CompiledScorer:
    """``pipeline.predict_proba([query])[0]`` for a fitted FeatureUnion of TfidfVectorizers + a
    LogisticRegression, computed directly: each vectorizer's own analyzer, a dictionary lookup per
    n-gram, (sublinear) tf × idf, l2 norm, then the coefficients of the features present.

    scikit-learn's pipeline builds sparse matrices and validates its input at every step, ≈ 1 ms for
    one query; this is the same arithmetic on the few hundred n-grams a query has
    (``tests/unit/test_router_linear.py`` checks it equals ``predict_proba``)."""

    def __init__(self, pipeline: Any) -> None:
        import numpy as np

        union, clf = pipeline.steps[0][1], pipeline.steps[-1][1]
        self._features = []
        offset = 0
        for _name, vec in union.transformer_list:
            vocabulary = getattr(vec, "vocabulary_", None) or dict(vec.vocabulary)
            if vec.norm not in ("l2", None) or not vec.use_idf or vec.binary:
                raise LinearRouterError(f"a vectorizer with norm={vec.norm!r}, use_idf={vec.use_idf}, "
                                        f"binary={vec.binary} is not what this router fits")
            self._features.append((vec.build_analyzer(), vocabulary, np.asarray(vec.idf_, dtype=float),
                                   bool(vec.sublinear_tf), vec.norm == "l2", offset))
            offset += len(vocabulary)
        self._coef = np.asarray(clf.coef_, dtype=float)  # [classes, features] (one row: two classes)
        self._intercept = np.asarray(clf.intercept_, dtype=float)
        if self._coef.shape[1] != offset:
            raise LinearRouterError("coef does not match the vocabularies")

    def proba(self, query: str) -> Any:
        """Class probabilities in ``classes_`` order."""
        import numpy as np

        logits = self._intercept.copy()
        for analyzer, vocabulary, idf, sublinear, l2, offset in self._features:
            counts = Counter(i for gram in analyzer(query) if (i := vocabulary.get(gram)) is not None)
            if not counts:
                continue
            index = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
            tf = np.fromiter(counts.values(), dtype=float, count=len(counts))
            w = (np.log(tf) + 1.0 if sublinear else tf) * idf[index]
            if l2:
                w /= math.sqrt(float(w @ w))
            logits += self._coef[:, offset + index] @ w
        if logits.shape[0] == 1:  # two classes: the logistic of the one row
            p = 1.0 / (1.0 + math.exp(-float(logits[0])))
            return np.array([1.0 - p, p])
        logits -= logits.max()
        e = np.exp(logits)
        return e / e.sum()


#: The artifact's file name and format version (JSON: vocabularies, idf, coefficients — no pickle, so a
#: consumer never unpickles what it pulled).
ARTIFACT_FILE = "linear_router.json"
ARTIFACT_VERSION = 1
_VECTORIZER_PARAMS = ("analyzer", "ngram_range", "sublinear_tf", "min_df", "lowercase")


def to_artifact(router: LinearRouter) -> dict[str, Any]:
    """The fitted router as plain JSON-able data (what is published and served)."""
    union, clf = router.pipeline.steps[0][1], router.pipeline.steps[1][1]
    features = []
    for name, vec in union.transformer_list:
        params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vec.get_params().items()
                  if k in _VECTORIZER_PARAMS}
        features.append({"name": name, "params": params, "idf": [float(x) for x in vec.idf_],
                         "vocabulary": {t: int(i) for t, i in sorted(vec.vocabulary_.items())}})
    return {"format": "fanroute-linear-router", "version": ARTIFACT_VERSION, "providers": list(router.providers),
            "classes": list(router.classes), "features": features,
            "coef": [[float(x) for x in row] for row in clf.coef_], "intercept": [float(x) for x in clf.intercept_],
            "C": router.c, "cv_accuracy": None if math.isnan(router.cv_accuracy) else router.cv_accuracy,
            "train_episodes": router.train_episodes, "labels": router.labels,
            **({"top_tier_rates": router.rates} if router.rates is not None else {})}


def write_artifact(router: LinearRouter, directory: Path) -> Path:
    """Write the fitted router's artifact file into ``directory`` (created); returns its path."""
    from services.common.adapter_files import LINEAR_ARTIFACT

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LINEAR_ARTIFACT
    path.write_text(json.dumps(to_artifact(router), sort_keys=True) + "\n")
    return path


def from_artifact(data: dict[str, Any]) -> LinearRouter:
    """A router from :func:`to_artifact`'s data; a malformed artifact is a LinearRouterError naming the field."""
    import numpy as np
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import FeatureUnion, make_pipeline

    try:
        if data.get("format") != "fanroute-linear-router" or data.get("version") != ARTIFACT_VERSION:
            raise LinearRouterError(f"not a version-{ARTIFACT_VERSION} fanroute linear router artifact")
        vecs = []
        for f in data["features"]:
            params = dict(f["params"])
            params["ngram_range"] = tuple(params["ngram_range"])
            vec = TfidfVectorizer(**params, vocabulary=dict(f["vocabulary"]))
            vec.idf_ = np.asarray(f["idf"], dtype=float)
            vecs.append((f["name"], vec))
        clf = LogisticRegression(C=float(data["C"]))
        clf.classes_ = np.asarray(data["classes"])
        clf.coef_ = np.asarray(data["coef"], dtype=float)
        clf.intercept_ = np.asarray(data["intercept"], dtype=float)
        clf.n_features_in_ = clf.coef_.shape[1]
        if clf.coef_.shape[0] != (len(clf.classes_) if len(clf.classes_) > 2 else 1) \
                or sum(len(f["vocabulary"]) for f in data["features"]) != clf.n_features_in_:
            raise LinearRouterError("coef does not match the classes and the vocabularies")
        pipeline = make_pipeline(FeatureUnion(vecs), clf)
        cv = data.get("cv_accuracy")
        rates = table_from(data["top_tier_rates"]) if "top_tier_rates" in data else None
        return LinearRouter(providers=tuple(data["providers"]), classes=tuple(data["classes"]), pipeline=pipeline,
                            c=float(data["C"]), cv_accuracy=float("nan") if cv is None else float(cv),
                            train_episodes=int(data["train_episodes"]), labels=dict(data.get("labels", {})),
                            rates=rates)
    except (LinearRouterError, RatesError):
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise LinearRouterError(f"malformed linear router artifact: {type(exc).__name__}: {exc}") from exc


def _pipeline(c: float) -> Any:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import FeatureUnion, make_pipeline

    features = FeatureUnion([
        ("words", TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1, lowercase=True)),
        ("chars", TfidfVectorizer(analyzer="char_wb", ngram_range=(3, 5), sublinear_tf=True, min_df=2,
                                  lowercase=True)),
    ])
    return make_pipeline(features, LogisticRegression(C=c, max_iter=2000))


def fit(episodes: Sequence[Episode], *, seed: int = 0, folds: int = 5) -> LinearRouter:
    """Fit on the episodes' queries and first choices; C by stratified cross-validation on them."""
    from sklearn.model_selection import StratifiedKFold, cross_val_score

    # sorted by content: the folds are shuffled from the rows' order, and episodes come in the order of their
    # ids, which derive from random trace ids, so the same judged traffic would pick another C run to run
    rows = sorted((query_of(ep), label, providers_of(ep)) for ep in episodes if (label := first_choice(ep)))
    if len(rows) < 10:
        raise LinearRouterError(f"{len(rows)} episodes with a readable ordering: too few to fit a linear router")
    queries, labels = [q for q, _, _ in rows], [lab for _, lab, _ in rows]
    counts = Counter(labels)
    if len(counts) < 2:
        raise LinearRouterError(f"every episode's first choice is {labels[0]!r}: nothing to learn")
    # Stratified over every label; a rare label (fewer episodes than folds) is in some folds only, which
    # scikit-learn warns about and handles: one rare label must not switch model selection off.
    n_folds = max(2, min(folds, max(counts.values())))
    cv = StratifiedKFold(n_splits=n_folds, shuffle=True, random_state=seed)
    best_c, best_acc = C_GRID[0], -1.0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*least populated class.*")
        for c in C_GRID:
            acc = float(cross_val_score(_pipeline(c), queries, labels, cv=cv).mean())
            if acc > best_acc + 1e-12:
                best_c, best_acc = c, acc
    pipeline = _pipeline(best_c).fit(queries, labels)
    providers = tuple(sorted({n for _, _, names in rows for n in names} | set(labels)))
    return LinearRouter(providers=providers, classes=tuple(pipeline.classes_), pipeline=pipeline, c=best_c,
                        cv_accuracy=best_acc, train_episodes=len(rows), labels=dict(sorted(counts.items())),
                        rates=top_tier_rates(episodes))


def decide_timed(router: LinearRouter, query: str, providers: Sequence[str], cost_usd: Mapping[str, float],
                 cost_weight: float, *, top_tier: bool = True) -> tuple[tuple[str, ...], dict[str, float], float]:
    """(ordering, scores, decision time in ms) for one query, decided as the scoring router decides
    (``top_tier``: with the router's top-tier table, when it has one)."""
    from services.router.scoring import decide

    t0 = time.perf_counter()
    scores = router.scores(query, providers)
    ordering = decide(scores, cost_usd, cost_weight, router.rates if top_tier else None)
    return ordering, scores, (time.perf_counter() - t0) * 1000.0
