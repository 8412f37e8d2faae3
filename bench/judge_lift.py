"""Where a provider's positive lift comes from: the pairs in which the judge ranks it higher than the humans do.

For each named provider and each rival in a validation-half trace of the federated market, a pair
with judge sign > human sign is one of: the judge ranks it above and the humans below (a reversal),
above where the humans tie (often both at nDCG 0: qrels judge few documents), or a judge tie where
the humans rank it below (the 0–3 grades are coarser than nDCG).

    python bench/judge_lift.py [PROVIDER ...]   (default: the two generalists)
"""

from __future__ import annotations

import asyncio
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.splits import dev_half  # noqa: E402
from services.judge.calibrate import judge_tiers, offline_traces  # noqa: E402
from services.judge.calibration.human import QrelsStore, human_grades  # noqa: E402
from services.judge.calibration.metrics import tier_scores  # noqa: E402
from services.judge.settings import build_backend, default_judge  # noqa: E402
from services.providers.markets import market  # noqa: E402


def _sign(a: int, b: int) -> int:
    return (a > b) - (a < b)


async def main(names: list[str]) -> None:
    traces = [t for t in await offline_traces(market("federated"), n=None, seed=0, contested_threshold=0.1)
              if dev_half(t.query_id or "") == "validation"]
    backend = build_backend(default_judge())
    await backend.start()
    try:
        tiers = await judge_tiers(backend, traces)
    finally:
        await backend.close()
    store, kinds = QrelsStore(), collections.Counter()
    for t in traces:
        human = human_grades(t, store)
        if human is None:
            continue
        js, hs = tier_scores(tiers[t.trace_id]), tier_scores(human.ordering)
        for name in names:
            for rival in js:
                if rival == name:
                    continue
                j, h = _sign(js[name], js[rival]), _sign(hs[name], hs[rival])
                if j > h:
                    kind = "judge tie, humans below" if j == 0 else (
                        "judge above, humans tie" if h == 0 else "judge above, humans below")
                    kinds[(name, kind)] += 1
                    if h == 0 and human.ndcg[name] == 0:
                        kinds[(name, kind + " (both nDCG 0)")] += 1
    for (name, kind), n in sorted(kinds.items()):
        print(f"{name:<14} {kind:<40} {n:>5} pairs")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:] or ["web-lexical", "web-semantic"]))
