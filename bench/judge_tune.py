"""Choose the local judge's embedding weight and grade cut points on the *tuning half* of the dev queries.

The federated market fans every dev query out in-process; each blind candidate's lexical and MiniLM
scores are computed once; a grid over the blend weight and the three cut points is scored by
tau-b against the qrels-derived human orderings on the tuning half (``services.common.splits``).
The validation half only gets the chosen setting's figure, printed for information: it chose
nothing. The chosen values go into ``services/judge/settings_local.py``.

    python bench/judge_tune.py [TOP_SOURCES]
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.splits import dev_half  # noqa: E402
from services.judge.backends.local import LocalJudge, grade_of, tiers_by_grade  # noqa: E402
from services.judge.blind import blind  # noqa: E402
from services.judge.calibrate import offline_traces  # noqa: E402
from services.judge.calibration.human import QrelsStore, human_grades  # noqa: E402
from services.judge.calibration.metrics import TracePair, agreement_report, tiers_tau  # noqa: E402
from services.judge.settings_local import LocalJudgeConfig  # noqa: E402
from services.providers.markets import market  # noqa: E402

WEIGHTS = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
COARSE = tuple(round(0.1 * i, 2) for i in range(1, 9))


def tau(rows, w: float, cuts) -> float:
    """The gate's tau-b (mean over traces whose human ordering has two tiers or more, an all-tied judge
    counting 0) of the judge with weight ``w`` and ``cuts``; the same figure ``agreement_report`` gives,
    without its per-provider tallies (quadratic in the pooled pairs, too slow for a grid)."""
    taus = []
    for tid, names, lex, cos, human in rows:
        if len(human) < 2:
            continue
        grades = {n: grade_of((1 - w) * a + w * b, cuts) for n, a, b in zip(names, lex, cos)}
        t = tiers_tau(tiers_by_grade(grades), human)
        taus.append(0.0 if math.isnan(t) else t)
    return sum(taus) / len(taus)


def search(rows, weights) -> tuple[float, float, tuple[float, float, float]]:
    """Coarse grid of cut points per weight, then a 0.05 refinement around the best."""
    best = max((tau(rows, w, c), w, c) for w in weights for c in itertools.combinations(COARSE, 3))
    _, w, c = best
    near = [sorted({round(x + d, 2) for d in (-0.05, 0.0, 0.05) if 0 < x + d <= 1}) for x in c]
    refined = [(tau(rows, w, cuts), w, cuts) for cuts in itertools.product(*near) if cuts[0] < cuts[1] < cuts[2]]
    return max([best, *refined])


async def main() -> None:
    traces = await offline_traces(market("federated"), n=None, seed=0, contested_threshold=0.1)
    top = int(sys.argv[1]) if len(sys.argv) > 1 else LocalJudgeConfig().top_sources
    judge = LocalJudge(LocalJudgeConfig(use_embeddings=True, top_sources=top))
    await judge.start()
    store, rows = QrelsStore(), {"tune": [], "validation": []}
    t0 = time.perf_counter()
    for t in traces:
        human = human_grades(t, store)
        if human is None:
            continue
        seen = blind(t, 0)
        req = seen.request
        shown = [c.sources[:judge.config.top_sources] for c in req.candidates]
        names = tuple(seen.letters[c.letter] for c in req.candidates)
        lex, cos = judge._lexical(req.query, shown), judge._cosine(req.query, shown)
        # failed candidates are not shown to the judge and get grade 0 by rule, as the worker does
        names += tuple(seen.not_shown)
        lex, cos = [*lex, *([-1.0] * len(seen.not_shown))], [*cos, *([-1.0] * len(seen.not_shown))]
        rows[dev_half(t.query_id or "")].append((t.trace_id, names, lex, cos, human.ordering))
    print(f"scored {sum(map(len, rows.values()))} traces in {time.perf_counter() - t0:.0f}s "
          f"({judge.embedding_stats})", flush=True)
    score, w, cuts = search(rows["tune"], WEIGHTS)
    for half in ("tune", "validation"):  # cross-check the fast figure against the full report
        pairs = [TracePair(tid, tiers_by_grade({n: grade_of((1 - w) * a + w * b, cuts)
                                                for n, a, b in zip(names, lex, cos)}), human)
                 for tid, names, lex, cos, human in rows[half]]
        assert abs(agreement_report(pairs).overall.tau_informative - tau(rows[half], w, cuts)) < 1e-9
    print(f"chosen on the tuning half ({len(rows['tune'])} traces): embedding_weight={w} thresholds={cuts} "
          f"tau-b {score:.3f}; validation half ({len(rows['validation'])} traces): "
          f"{tau(rows['validation'], w, cuts):.3f}")
    lex_score, _, lex_cuts = search(rows["tune"], (0.0,))
    print(f"lexical only, tuned the same way: tune {lex_score:.3f} validation "
          f"{tau(rows['validation'], 0.0, lex_cuts):.3f} (cuts {lex_cuts})")


if __name__ == "__main__":
    asyncio.run(main())
