"""A persistent cache of the local judge's source embeddings: the same document is embedded once.

Fan-out traces repeat documents all the time (every query of a domain hits the same papers), and
embedding is the judge's whole cost, so vectors are kept in SQLite keyed by (model fingerprint,
sha256 of the text): safe for several judge processes on one host, and a changed model is a new
key, never a stale vector.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from services.common import paths
from services.common.errors import ConfigError

CACHE_DIR_ENV = paths.JUDGE_CACHE_DIR_ENV


def default_cache_path() -> Path:
    """``<judge cache>/embeddings.sqlite`` (:func:`services.common.paths.judge_cache_dir`)."""
    return paths.judge_cache_dir() / "embeddings.sqlite"


class EmbeddingCache:
    """Vectors by (model, text) on disk, with hit and miss counts for the cost report."""

    def __init__(self, path: Path | None, model_key: str) -> None:
        self.model_key = model_key
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._db = sqlite3.connect(str(path), check_same_thread=False, timeout=30)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("CREATE TABLE IF NOT EXISTS emb (model TEXT, text_hash TEXT, vec BLOB, "
                                 "PRIMARY KEY (model, text_hash))")
            except sqlite3.DatabaseError as exc:
                raise ConfigError(f"the judge's embedding cache {path} cannot be used ({exc}); move it away, "
                                  f"point ${CACHE_DIR_ENV} elsewhere or set embedding_cache='off'") from exc
        self._memory: dict[str, np.ndarray] = {}

    @staticmethod
    def _hash(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()

    def get_many(self, texts: Sequence[str], encode: Callable[[list[str]], np.ndarray]) -> np.ndarray:
        """Embeddings of ``texts`` (one row each), encoding only those not cached yet."""
        keys = [self._hash(t) for t in texts]
        with self._lock:
            found = {k: self._memory[k] for k in keys if k in self._memory}
            wanted = [k for k in dict.fromkeys(keys) if k not in found]
            if wanted and self._db is not None:
                for i in range(0, len(wanted), 500):
                    chunk = wanted[i:i + 500]
                    rows = self._db.execute(
                        f"SELECT text_hash, vec FROM emb WHERE model = ? AND text_hash IN ({','.join('?' * len(chunk))})",
                        [self.model_key, *chunk]).fetchall()
                    for k, blob in rows:
                        found[k] = self._memory[k] = np.frombuffer(blob, dtype=np.float32)
        missing = list(dict.fromkeys(k for k in keys if k not in found))
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if missing:
            text_of = dict(zip(keys, texts))
            vecs = np.asarray(encode([text_of[k] for k in missing]), dtype=np.float32)
            with self._lock:
                for k, v in zip(missing, vecs):
                    found[k] = self._memory[k] = v
                if self._db is not None:
                    self._db.executemany("INSERT OR IGNORE INTO emb VALUES (?, ?, ?)",
                                         [(self.model_key, k, v.tobytes()) for k, v in zip(missing, vecs)])
                    self._db.commit()
        return np.stack([found[k] for k in keys]) if keys else np.empty((0, 0), dtype=np.float32)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
