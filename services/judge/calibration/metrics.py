"""Agreement between the judge's and humans' tiered orderings: Kendall's tau-b and top-1.

An ordering is a tuple of tiers, best first; the names in one tier are tied. Both sides of a
comparison are first restricted to the names they share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

Tiers = tuple[tuple[str, ...], ...]


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b of two paired score lists, ties handled (O(n²), fine for a few candidates).

    ``tau_b = (C - D) / sqrt((n0 - n1) * (n0 - n2))`` over the ``n0 = n(n-1)/2`` pairs, with ``C``
    and ``D`` the concordant and discordant pairs and ``n1`` / ``n2`` the pairs tied in ``x`` /
    ``y``. It is **nan** when either side is all ties (or there are fewer than two items): the
    denominator is 0 and no ordering exists to agree with (scipy returns nan there too).
    """
    if len(x) != len(y):
        raise ValueError(f"x and y differ in length ({len(x)} vs {len(y)})")
    n = len(x)
    concordant = discordant = tied_x = tied_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = x[i] - x[j], y[i] - y[j]
            tied_x += dx == 0
            tied_y += dy == 0
            s = dx * dy
            concordant += s > 0
            discordant += s < 0
    n0 = n * (n - 1) // 2
    denom = math.sqrt((n0 - tied_x) * (n0 - tied_y))
    return (concordant - discordant) / denom if denom > 0 else math.nan


def tier_scores(tiers: Tiers) -> dict[str, int]:
    """Each name's score from its tier: the top tier gets the highest, tied names equal."""
    return {name: -level for level, tier in enumerate(tiers) for name in tier}


def restrict(tiers: Tiers, names: Iterable[str]) -> Tiers:
    """``tiers`` keeping only ``names``, with tiers left empty dropped."""
    keep = set(names)
    kept = (tuple(n for n in tier if n in keep) for tier in tiers)
    return tuple(t for t in kept if t)


def shared_names(a: Tiers, b: Tiers) -> list[str]:
    """Names in both orderings, sorted."""
    return sorted(set(tier_scores(a)) & set(tier_scores(b)))


def tiers_tau(judge_tiers: Tiers, human_tiers: Tiers) -> float:
    """Kendall's tau-b between two tiered orderings over their shared names (nan if undefined)."""
    names = shared_names(judge_tiers, human_tiers)
    js, hs = tier_scores(judge_tiers), tier_scores(human_tiers)
    return kendall_tau_b([js[n] for n in names], [hs[n] for n in names])


def top1_agreement(judge_tiers: Tiers, human_tiers: Tiers) -> bool:
    """True when the judge's top tier and the human's top tier share at least one name.

    Both orderings are first restricted to their shared names, so the top tiers are the best
    of what both sides saw. With ties this is lenient: if the human ties everything, any judge
    agrees (:func:`agreement_report` counts such traces apart). False if nothing is shared.
    """
    names = shared_names(judge_tiers, human_tiers)
    j, h = restrict(judge_tiers, names), restrict(human_tiers, names)
    return bool(j and h and set(j[0]) & set(h[0]))


@dataclass(frozen=True)
class TracePair:
    """The judge's and the human's ordering of one trace's providers."""

    trace_id: str
    judge: Tiers
    human: Tiers


@dataclass(frozen=True)
class OverallAgreement:
    """Agreement over all traces, with the counts behind each figure.

    * ``n``: traces compared; ``n_informative``: those where the human ordering has at least two
      tiers (a human who ties everything cannot be agreed or disagreed with);
    * ``tau``: mean per-trace tau-b over the ``n_tau`` traces where it is defined (neither side
      all tied); ``tau_informative``: mean over the ``n_informative`` traces, a judge that ties
      everything counting 0 there (so tying is no way to dodge a bad tau);
    * ``top1``: top-1 agreement rate over the ``n_informative`` traces; ``top1_all`` over all ``n``.
    """

    n: int
    n_informative: int
    n_tau: int
    tau: float
    tau_informative: float
    top1: float
    top1_all: float


@dataclass(frozen=True)
class ProviderAgreement:
    """How the judge treats one provider compared with the humans, over the ``n`` traces it is in.

    Per-trace tau-b is the same for every provider in a trace, so the per-provider figures look
    at the ``n_pairs`` pairs (this provider, a rival) pooled over those traces instead:

    * ``tau``: tau-b of the judge's vs the human's preference signs over those pairs (nan when
      either side ties every pair);
    * ``lift``: mean of ``(judge sign - human sign) / 2`` over the pairs, in [-1, 1]: above 0 the
      judge puts it above its rivals more often than the humans do (a bias in its favour);
    * ``judge_top`` / ``human_top`` / ``both_top``: shares of the ``n`` traces where the judge / the
      human / both put it in the top tier.
    """

    provider: str
    n: int
    n_pairs: int
    tau: float
    lift: float
    judge_top: float
    human_top: float
    both_top: float


@dataclass(frozen=True)
class AgreementReport:
    """Overall and per-provider agreement."""

    overall: OverallAgreement
    per_provider: dict[str, ProviderAgreement] = field(default_factory=dict)


def _mean(values: Sequence[float]) -> float:
    """Mean, or nan for no values."""
    return sum(values) / len(values) if values else math.nan


def _sign(v: float) -> int:
    return (v > 0) - (v < 0)


@dataclass
class _ProviderTally:
    """Running counts for one provider's :class:`ProviderAgreement`."""

    judge_signs: list[int] = field(default_factory=list)
    human_signs: list[int] = field(default_factory=list)
    judge_top: list[bool] = field(default_factory=list)
    human_top: list[bool] = field(default_factory=list)

    def result(self, provider: str) -> ProviderAgreement:
        both = [j and h for j, h in zip(self.judge_top, self.human_top)]
        lifts = [(j - h) / 2 for j, h in zip(self.judge_signs, self.human_signs)]
        return ProviderAgreement(
            provider=provider, n=len(both), n_pairs=len(lifts),
            tau=kendall_tau_b(self.judge_signs, self.human_signs), lift=_mean(lifts),
            judge_top=_mean(self.judge_top), human_top=_mean(self.human_top), both_top=_mean(both))


def agreement_report(pairs: Iterable[TracePair]) -> AgreementReport:
    """Overall and per-provider tau-b and top-1 figures, each with its count.

    Each trace is compared over the providers both orderings name; traces sharing none are
    skipped.
    """
    taus: list[float] = []
    taus_informative: list[float] = []
    top1_informative: list[bool] = []
    top1_all: list[bool] = []
    tallies: dict[str, _ProviderTally] = {}
    for pair in pairs:
        names = shared_names(pair.judge, pair.human)
        if not names:
            continue
        judge, human = restrict(pair.judge, names), restrict(pair.human, names)
        tau = tiers_tau(judge, human)
        agree = top1_agreement(judge, human)
        top1_all.append(agree)
        if not math.isnan(tau):
            taus.append(tau)
        if len(human) >= 2:
            top1_informative.append(agree)
            taus_informative.append(0.0 if math.isnan(tau) else tau)
        js, hs = tier_scores(judge), tier_scores(human)
        for name in names:
            tally = tallies.setdefault(name, _ProviderTally())
            tally.judge_top.append(name in judge[0])
            tally.human_top.append(name in human[0])
            for rival in names:
                if rival != name:
                    tally.judge_signs.append(_sign(js[name] - js[rival]))
                    tally.human_signs.append(_sign(hs[name] - hs[rival]))
    overall = OverallAgreement(n=len(top1_all), n_informative=len(top1_informative),
                               n_tau=len(taus), tau=_mean(taus),
                               tau_informative=_mean(taus_informative),
                               top1=_mean(top1_informative), top1_all=_mean(top1_all))
    per_provider = {name: tallies[name].result(name) for name in sorted(tallies)}
    return AgreementReport(overall=overall, per_provider=per_provider)


def render_report(report: AgreementReport, title: str = "judge vs human") -> str:
    """A plain-text table of an :class:`AgreementReport`."""
    o = report.overall
    lines = [f"{title}: {o.n} traces, {o.n_informative} where the human ranks at least two tiers",
             f"  tau-b  {o.tau:+.3f} over {o.n_tau} traces where defined; "
             f"{o.tau_informative:+.3f} over the {o.n_informative} (judge all tied = 0)",
             f"  top-1  {o.top1:.3f} over the {o.n_informative}; {o.top1_all:.3f} over all {o.n}",
             f"  {'provider':<20} {'n':>5} {'pairs':>6} {'tau-b':>7} {'lift':>7} {'judge top':>10} "
             f"{'human top':>10} {'both top':>9}"]
    for p in report.per_provider.values():
        lines.append(f"  {p.provider:<20} {p.n:>5} {p.n_pairs:>6} {p.tau:>+7.3f} {p.lift:>+7.3f} "
                     f"{p.judge_top:>10.3f} {p.human_top:>10.3f} {p.both_top:>9.3f}")
    return "\n".join(lines)
