"""The scoring batcher's wait (services/sampler/batching.py): it gathers requests that keep arriving and
as many as the last forward answered, a lone request waits once, and the cap holds — on a fake clock, so
no real time passes."""

from __future__ import annotations

import asyncio

import pytest

from services.sampler.batching import ScoreBatcher


class Arrivals:
    """A fake clock whose sleeps advance time and submit the requests due by then."""

    def __init__(self, due_ms: list[float | tuple[float, str]]) -> None:
        due = [d if isinstance(d, tuple) else (d, None) for d in due_ms]  # (ms, adapter entry)
        self.now, self.due, self.sleeps = 0.0, sorted(due, key=lambda d: d[0]), []
        self.batcher: ScoreBatcher | None = None
        self.tasks: list[asyncio.Task] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds * 1000, 6))
        self.now += seconds
        await self.arrive()

    async def arrive(self) -> None:
        """Submit every request due by now and let each join the queue."""
        while self.due and self.due[0][0] <= self.now * 1000 + 1e-9:
            ms, entry = self.due.pop(0)
            self.tasks.append(asyncio.ensure_future(self.batcher.score(entry, [[1]], [f"t={ms}"])))
        await asyncio.sleep(0)  # the new tasks run up to their wait


async def batches(due_ms: list[float | tuple[float, str]], *, wait_ms: float, max_wait_ms: float | None,
                  max_batch: int = 32, first: str | None = None, by_entry: bool = False):
    """The batch sizes the batcher runs for one request at t=0 (for adapter ``first``) and more at ``due_ms``
    (``(ms, adapter)`` or ms for the base model), and its sleeps; ``by_entry``: each size with its adapter."""
    sizes: list = []
    arrivals = Arrivals([(0, first), *due_ms])

    def run(entry, jobs):
        sizes.append((entry, len(jobs)) if by_entry else len(jobs))
        return [[j.ks[0]] for j in jobs]

    waits: list[float] = []
    arrivals.batcher = ScoreBatcher(run, max_batch=max_batch, wait_s=wait_ms / 1000,
                                    max_wait_s=None if max_wait_ms is None else max_wait_ms / 1000,
                                    clock=arrivals.clock, sleep=arrivals.sleep, on_wait=waits.append)
    await arrivals.arrive()
    while arrivals.due or not all(t.done() for t in arrivals.tasks):
        await asyncio.gather(*arrivals.tasks)
        if arrivals.due:  # the rest arrive after the forwards so far (which took no fake time)
            arrivals.now = max(arrivals.now, arrivals.due[0][0] / 1000)
            await arrivals.arrive()
    assert not arrivals.due and sum(n[1] if by_entry else n for n in sizes) == len(arrivals.tasks)
    assert all(t.result()[0].startswith("t=") for t in arrivals.tasks)
    assert len(waits) == len(sizes)  # one gathering time per batch, what the sampler's histogram observes
    assert sum(waits) == pytest.approx(sum(arrivals.sleeps) / 1000)
    return sizes, arrivals.sleeps


async def test_requests_that_keep_arriving_share_one_forward_up_to_the_cap():
    due = [1, 3, 5, 7, 9, 11, 13]  # a caller every 2 ms, as answered callers come back
    sizes, sleeps = await batches(due, wait_ms=2, max_wait_ms=10)
    assert sizes[0] == 6 and sum(sizes) == 8  # t=0 .. t=9 by the 10 ms cap; the rest in later forwards
    assert sum(sleeps[:5]) == pytest.approx(10)


async def test_a_single_wait_when_nothing_else_arrives():
    sizes, sleeps = await batches([], wait_ms=2, max_wait_ms=10)
    assert sizes == [1] and sleeps == [2]


async def test_without_a_longer_cap_the_wait_is_the_old_fixed_one():
    sizes, sleeps = await batches([1, 3, 5], wait_ms=2, max_wait_ms=None)
    assert sizes[0] == 2 and sleeps[0] == 2  # t=0 and t=1; t=3 and t=5 go to the next forward


async def test_a_full_batch_does_not_wait():
    sizes, _ = await batches([0, 0, 0], wait_ms=2, max_wait_ms=10, max_batch=2)
    assert sizes[0] == 2


async def test_answered_callers_coming_back_slower_than_the_wait_still_share_one_forward():
    """Four callers answered at once come back 3 ms apart (> the 2 ms wait): the batch waits for as many as
    the last forward answered, within the cap, instead of starting with the first and splitting the round."""
    sizes, _ = await batches([0, 0, 0, 20, 23, 26, 29], wait_ms=2, max_wait_ms=10)
    assert sizes == [4, 4]


async def test_when_traffic_drops_one_batch_waits_the_cap_and_the_next_expects_what_came():
    sizes, sleeps = await batches([0, 0, 0, 50, 100], wait_ms=2, max_wait_ms=10)
    assert sizes == [4, 1, 1]
    assert sleeps[0] == 2 and sum(sleeps[1:-1]) == pytest.approx(10) and sleeps[-1] == 2


async def test_the_expected_count_is_each_adapters_own():
    """Four callers of one adapter answered together do not make a lone request for another adapter (a
    promotion's new version) wait the cap for them: it waits once, as any first request does."""
    a = [(0, "a")] * 3
    sizes, sleeps = await batches([*a, (20, "b"), (40, "a"), (43, "a"), (46, "a"), (49, "a")], wait_ms=2,
                                  max_wait_ms=10, first="a", by_entry=True)
    assert sizes == [("a", 4), ("b", 1), ("a", 4)]
    assert sleeps[:2] == [2, 2]  # the first batch, then b's single wait


def test_a_cap_below_the_wait_is_refused():
    with pytest.raises(ValueError, match="max_wait_s"):
        ScoreBatcher(lambda e, j: [], max_batch=4, wait_s=0.01, max_wait_s=0.005)


@pytest.mark.parametrize(("env", "value"), [("FANROUTE_SCORE_BATCH_MAX_WAIT_MS", "soon"),
                                            ("FANROUTE_SCORE_BATCH_MAX_WAIT_MS", "-1"),
                                            ("FANROUTE_SCORE_BATCH_MAX_WAIT_MS", "5000"),
                                            ("FANROUTE_FUSED_LAYERS", "maybe")])
def test_a_bad_batching_or_fusion_setting_is_refused_by_name(monkeypatch, env, value):
    from pydantic import ValidationError

    from services.sampler.settings import SamplerSettings

    monkeypatch.setenv(env, value)
    with pytest.raises(ValidationError, match=env.removeprefix("FANROUTE_").lower()):
        SamplerSettings()


def test_the_cap_is_never_below_the_wait(monkeypatch):
    from services.sampler.settings import SamplerSettings

    monkeypatch.setenv("FANROUTE_SCORE_BATCH_WAIT_MS", "50")
    assert SamplerSettings().score_batch_max_wait_s == pytest.approx(0.05)  # the default 10 ms cap is lifted
    monkeypatch.setenv("FANROUTE_SCORE_BATCH_MAX_WAIT_MS", "80")
    assert SamplerSettings().score_batch_max_wait_s == pytest.approx(0.08)
