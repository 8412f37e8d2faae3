"""Choose each vertical's BM25 k1/b and LSA weight on the *tuning half* of its domain's dev queries.

The chosen values live in ``services/providers/markets.py`` (``VERTICALS``); this script is
how they were chosen, so anyone can check that the validation half never picked anything. It
prints, per domain, the grid's best on the tuning half and, for information only, what that same
setting scores on the validation half beside the untuned default (k1=1.2, b=0.75, no LSA).

    python bench/market_tune.py
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.ir import ndcg_at_k  # noqa: E402
from services.common.splits import dev_half  # noqa: E402
from services.judge.calibration.human import ranked_doc_ids  # noqa: E402
from services.providers.collections import (  # noqa: E402
    default_collections_dir,
    load_qrels,
    sample_queries,  # noqa: E402
)
from services.providers.config import HybridConfig  # noqa: E402
from services.providers.local import HybridProvider  # noqa: E402
from services.providers.markets import DOMAINS  # noqa: E402

K1S, BS, WEIGHTS = (0.9, 1.2, 1.5, 2.0), (0.4, 0.75, 0.9), (0.0, 0.2, 0.4, 0.6, 1.0)
DEFAULT = (1.2, 0.75, 0.0)


def mean_ndcg(provider: HybridProvider, queries, qrels) -> float:
    scores = []
    for q in queries:
        collection, qid = q.query_id.split("/", 1)
        urls = [c.url for c in provider._retrieve(q.text)]
        scores.append(ndcg_at_k(ranked_doc_ids(urls, collection), qrels[collection][qid], 10))
    return float(np.mean(scores))


async def tune(domain: str, collections: tuple[str, ...]) -> str:
    directory = default_collections_dir()
    qrels = {c: load_qrels(directory, c) for c in collections}
    queries = sample_queries(collections)
    halves = {h: [q for q in queries if dev_half(q.query_id) == h] for h in ("tune", "validation")}
    results = {}
    for k1, b in itertools.product(K1S, BS):
        provider = HybridProvider(HybridConfig(name=domain, collections=collections, k1=k1, b=b))
        await provider.start()
        base = provider.config
        for w in WEIGHTS:
            provider.config = base.model_copy(update={"lsa_weight": w})
            results[(k1, b, w)] = {h: mean_ndcg(provider, qs, qrels) for h, qs in halves.items()}
    best = max(results, key=lambda key: (results[key]["tune"], -key[2]))
    r, d = results[best], results[DEFAULT]
    return (f"{domain:<8} tune {len(halves['tune']):>3} q: best k1={best[0]} b={best[1]} lsa_weight={best[2]} "
            f"tune {r['tune']:.3f} (default {d['tune']:.3f}); validation {r['validation']:.3f} "
            f"(default {d['validation']:.3f}, {len(halves['validation'])} q)")


async def main() -> None:
    for domain, collections in DOMAINS.items():
        print(await tune(domain, collections), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
