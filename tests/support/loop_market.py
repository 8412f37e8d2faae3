"""A two-domain market over ADI for the loop's tests: a router that learns the domain beats the generalist.

ADI's queries split by id parity into two "domains", marked in the query text (``aero ...`` / ``medic ...``)
so that a linear router can learn them. ``alpha`` cites the relevant documents of the aero queries and
irrelevant ones otherwise, ``beta`` the reverse, ``web`` one relevant document for every query at twice
their price: the best single provider, beaten by routing on the humans' qrels and the judge's grades.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from schemas.episode import Episode
from schemas.trace import Trace
from tests.support.records import adi, candidate, episode, trace

PROVIDERS = ("alpha", "beta", "web")
ROOT = Path(__file__).resolve().parents[2]


def _domain(qid: str) -> str:
    return "alpha" if int(qid) % 2 else "beta"


def query_text(qid: str) -> str:
    return f"{'aero' if _domain(qid) == 'alpha' else 'medic'} {adi()[0][qid]}"


def market_trace(qid: str, trace_id: str | None = None) -> Trace:
    """A fan-out trace of ADI query ``qid`` in the two-domain market."""
    _, qrels, docs = adi()
    rel = sorted(qrels[qid], key=int)
    junk = [d for d in sorted(docs, key=int) if d not in qrels[qid]][:5]
    best = _domain(qid)

    def cand(provider: str, ids: list[str], cost: float):
        return candidate(provider, [f"collection://adi/{i}" for i in ids], answer="answer", cost=cost, latency=50.0,
                         texts=[(docs[i].title, docs[i].text[:300]) for i in ids], score=None)

    cands = [cand("alpha", rel if best == "alpha" else junk, 0.001), cand("beta", rel if best == "beta" else junk, 0.001),
             cand("web", rel[:1] + junk[:4], 0.002)]
    return trace(trace_id or f"mkt-{qid}", cands, query=query_text(qid), query_id=f"adi/{qid}")


def market_episodes(qids: list[str], copies: int = 3) -> list[Episode]:
    """Training episodes: each query (and ``copies - 1`` reworded variants) labelled with its domain's provider."""
    out = []
    for qid in qids:
        best = _domain(qid)
        other = "beta" if best == "alpha" else "alpha"
        for k in range(copies):
            text = query_text(qid) if k == 0 else f"{query_text(qid)} (variant {k})"
            out.append(episode(text, f"{best} > web > {other}", PROVIDERS, f"ep-{qid}-{k}", trace_id=f"tr-{qid}-{k}"))
    return out


def split_queries() -> tuple[list[str], list[str]]:
    """(trained, evaluated) ADI query ids: every third query is evaluated, the rest trained."""
    qids = sorted(adi()[1], key=int)
    return [q for i, q in enumerate(qids) if i % 3], [q for i, q in enumerate(qids) if not i % 3]


def loop_process(env: dict[str, str], *argv: str) -> subprocess.Popen:
    """``python -m services.loop ...`` with its stdout piped (lines read as they come)."""
    return subprocess.Popen([sys.executable, "-m", "services.loop", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
