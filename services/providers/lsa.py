"""Latent semantic indexing (Deerwester et al., 1990): a semantic retriever with no neural model.

Documents become sublinear-TF x IDF vectors over the same stemmed terms BM25 uses, L2-normalised;
a truncated SVD keeps ``dim`` latent dimensions. A query is folded into that space (its TF-IDF
vector times the term factors) and documents are ranked by cosine. It matches documents that
share no term with the query but share its co-occurring vocabulary, which is what a hybrid with
BM25 adds. Building it takes seconds on these collections, so no model is shipped or shared.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.providers import index as idx
from services.providers.collections import Doc

DOCS_FACTORS_FILE = "lsa_docs.npy"
TERM_FACTORS_FILE = "lsa_terms.npy"
IDF_FILE = "lsa_idf.npy"
VOCAB_FILE = "lsa_vocab.json"
SVD_SEED = 0
POWER_ITERATIONS = 2
OVERSAMPLE = 20


def lsa_params(dim: int, lead_chars: int | None) -> dict[str, str | int]:
    """The cache-key parameters of an LSA index."""
    params: dict[str, str | int] = {"dim": dim, "weighting": "log-tf.idf, l2", "svd": f"randomized-{POWER_ITERATIONS}-{OVERSAMPLE}-{SVD_SEED}",
                                    "stemmer": idx.STEMMER_LANGUAGE, "stopwords": idx.STOPWORDS,
                                    "vocab": "sorted"}  # indexes built in hash order (before 2026-12-06) are not reused
    if lead_chars is not None:
        params["lead_chars"] = lead_chars
    return params


def build_lsa(path: Path, docs: Sequence[Doc], *, dim: int, lead_chars: int | None) -> idx.Params:
    """Factorise the TF-IDF matrix of ``docs`` and save the factors into ``path``."""
    import scipy.sparse as sp

    tokens = idx.tokenize_docs(docs, lead_chars)
    vocab, remap = sorted_vocab(tokens.vocab)
    rows, cols, counts = [], [], []
    for row, ids in enumerate(tokens.ids):
        uniq, n = np.unique(remap[np.asarray(ids, dtype=np.int64)], return_counts=True)
        rows.extend([row] * len(uniq))
        cols.extend(uniq.tolist())
        counts.extend(n.tolist())
    tf_DV = sp.csr_matrix((1 + np.log(np.asarray(counts, dtype=np.float32)), (rows, cols)),
                          shape=(len(docs), len(vocab)), dtype=np.float32)
    df_V = np.bincount(tf_DV.indices, minlength=len(vocab))
    idf_V = (np.log((1 + len(docs)) / (1 + df_V)) + 1).astype(np.float32)
    x_DV = tf_DV.multiply(idf_V).tocsr()
    norms_D = np.sqrt(np.asarray(x_DV.multiply(x_DV).sum(axis=1)).ravel())
    x_DV = sp.diags(1 / np.where(norms_D > 0, norms_D, 1)) @ x_DV
    k = max(1, min(dim, min(x_DV.shape) - 1))
    u_DK, s_K, vt_KV = randomized_svd(x_DV, k)
    docs_DK = (u_DK * s_K).astype(np.float32)
    docs_DK /= np.linalg.norm(docs_DK, axis=1, keepdims=True) + 1e-9
    np.save(path / DOCS_FACTORS_FILE, docs_DK)
    np.save(path / TERM_FACTORS_FILE, np.ascontiguousarray(vt_KV.T, dtype=np.float32))
    np.save(path / IDF_FILE, idf_V)
    (path / VOCAB_FILE).write_text(json.dumps(vocab))
    idx.write_doc_keys(path, docs)
    return {"docs": len(docs), "vocab": len(vocab), "dim": k}


def sorted_vocab(vocab: dict[str, int]) -> tuple[dict[str, int], np.ndarray]:
    """``vocab`` renumbered in the terms' sorted order, and the old id → new id map.

    Why: bm25s numbers terms in the order of a Python set, which changes with every process's string
    hashing (``PYTHONHASHSEED``). The seeded random projection of :func:`randomized_svd` then met the
    columns in another order in every build, so each machine built other factors, its LSA providers
    ranked differently, and the judge's labels — and the demo's student — differed from run to run."""
    terms = sorted(vocab)
    remap = np.empty(max(vocab.values(), default=-1) + 1, dtype=np.int64)
    for new_id, term in enumerate(terms):
        remap[vocab[term]] = new_id
    return {term: i for i, term in enumerate(terms)}, remap


def randomized_svd(x_DV, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-``k`` singular triplets by a seeded randomized range finder (Halko, Martinsson, Tropp 2011).

    ARPACK took minutes for k=200 on the 29,790 documents; this takes seconds and, with a few power
    iterations, loses nothing measurable in retrieval quality.
    """
    rng = np.random.default_rng(SVD_SEED)
    q_DL, _ = np.linalg.qr(x_DV @ rng.standard_normal((x_DV.shape[1], k + OVERSAMPLE), dtype=np.float32))
    for _ in range(POWER_ITERATIONS):
        q_DL, _ = np.linalg.qr(x_DV @ np.asarray(x_DV.T @ q_DL))
    b_LV = np.asarray((x_DV.T @ q_DL).T)
    # the SVD of the small L x V matrix through the eigenvectors of its L x L Gram matrix
    eig_L, u_LL = np.linalg.eigh(b_LV @ b_LV.T)
    order = np.argsort(eig_L)[::-1][:k]
    s_K = np.sqrt(np.clip(eig_L[order], 1e-12, None))
    u_LK = u_LL[:, order]
    vt_KV = (u_LK.T @ b_LV) / s_K[:, None]
    return q_DL @ u_LK, s_K, vt_KV


@dataclass(frozen=True)
class LSAIndex:
    """The saved factors of an LSA index, ready to score queries."""

    docs_DK: np.ndarray
    terms_VK: np.ndarray
    idf_V: np.ndarray
    vocab: dict[str, int]

    @classmethod
    def load(cls, path: Path) -> LSAIndex:
        return cls(np.load(path / DOCS_FACTORS_FILE), np.load(path / TERM_FACTORS_FILE),
                   np.load(path / IDF_FILE), json.loads((path / VOCAB_FILE).read_text()))

    def scores(self, query: str) -> np.ndarray | None:
        """Cosine of every document with the folded-in query; None if no query term is indexed."""
        ids = [self.vocab[t] for t in idx.query_terms(query) if t in self.vocab]
        if not ids:
            return None
        uniq, n = np.unique(np.asarray(ids), return_counts=True)
        q_K = ((1 + np.log(n.astype(np.float32))) * self.idf_V[uniq]) @ self.terms_VK[uniq]
        norm = float(np.linalg.norm(q_K))
        if norm == 0:
            return None
        return self.docs_DK @ (q_K / norm)
