"""The judge worker's load-bearing rules on the in-memory bus: blind, sampled, idempotent, additive."""

from __future__ import annotations

import pytest

from schemas import topic
from services.common.errors import ConfigError
from services.common.idempotency import MemoryKeyStore
from services.judge.base import JudgeIdentity
from services.judge.blind import blind, shuffle_seed
from services.judge.guard import check_not_a_provider, guard
from services.judge.rubric import render_user
from services.judge.sampling import sample_reason, unit_hash
from services.judge.settings import JudgeSettings
from services.judge.settings_local import LocalJudgeConfig
from services.judge.worker import JudgeWorker, verdict_id
from services.providers.config import BM25Config, DenseConfig, SearxngConfig
from tests.support.bus import collecting
from tests.support.fakes import KeywordJudge
from tests.support.records import judged_trace

PROVIDERS = ("bm25-all", "dense-all", "eng-bm25", "lib-bm25")


@pytest.fixture
async def harness():
    async with collecting(topic("verdicts")) as (bus, got):
        yield bus, got


def test_blind_relabels_shuffles_deterministically_and_leaks_no_provider():
    t = judged_trace()
    a, b = blind(t, 0), blind(t, 0)
    assert a == b and a.seed == shuffle_seed(t.trace_id, 0)
    assert set(a.letters) == {"A", "B", "C"} and set(a.letters.values()) == set(PROVIDERS[:3])
    assert a.not_shown == ("lib-bm25",)
    orders = {tuple(blind(judged_trace(f"t-{i}"), 0).letters.values()) for i in range(20)}
    assert len(orders) > 1  # the shuffle really depends on the trace id
    assert blind(t, 0).letters != blind(t, 1).letters or blind(t, 0).letters != blind(t, 2).letters
    prompt = render_user(a.request).lower()
    for name in PROVIDERS + ("bm25", "dense", "https://", "x.org"):
        assert name not in prompt, name
    assert "[source]" in prompt  # the provider name in the snippets was scrubbed


def test_blind_scrubs_extra_hosts():
    t = judged_trace()
    seen = blind(t, 0, hide=("text from",))
    assert all("text from" not in s.snippet.lower() for c in seen.request.candidates for s in c.sources)


def test_sampling_contested_always_rest_at_rate_deterministically():
    assert sample_reason(judged_trace(contested=True), 0.0) == "contested"
    calm = [judged_trace(f"calm-{i}", contested=False) for i in range(2000)]
    picked = [t for t in calm if sample_reason(t, 0.25) == "sampled"]
    assert 0.2 < len(picked) / len(calm) < 0.3
    assert picked == [t for t in calm if sample_reason(t, 0.25) == "sampled"]
    assert all(sample_reason(t, 0.0) is None for t in calm)
    assert all(0 <= unit_hash(t.trace_id) < 1 for t in calm)


def test_a_judge_that_is_a_provider_is_refused():
    providers = [BM25Config(name="bm25-all"), DenseConfig(name="dense-all"),
                 SearxngConfig(name="searx", base_url="http://10.1.2.3:8888/")]
    check_not_a_provider(JudgeIdentity("openai", "qwen2.5-7b", "http://127.0.0.1:9000/v1"), providers)
    with pytest.raises(ConfigError, match="is provider 'bm25-all'"):
        check_not_a_provider(JudgeIdentity("openai", "BM25-all", "http://127.0.0.1:9000/v1"), providers)
    with pytest.raises(ConfigError, match="is provider 'searx'.*endpoint:10.1.2.3:8888"):
        check_not_a_provider(JudgeIdentity("openai", "m", "http://10.1.2.3:8888/v1"), providers)
    # a local judge embedding with a dense provider's own model would flatter it
    with pytest.raises(ConfigError, match=r"same model as provider\(s\) \['dense-all'\]"):
        guard(JudgeSettings(judge=LocalJudgeConfig(use_embeddings=True), providers=providers))
    guard(JudgeSettings(judge=LocalJudgeConfig(use_embeddings=False), providers=providers))
    # a disabled provider is not being judged
    check_not_a_provider(JudgeIdentity("openai", "bm25-all"), [BM25Config(name="bm25-all", enabled=False)])


async def test_verdict_grades_ordering_audit_and_failed_provider(harness):
    bus, got = harness
    judge = KeywordJudge()
    worker = JudgeWorker(bus, judge, MemoryKeyStore(), sample_rate=0.0)
    t = judged_trace()
    await worker.handle(t)
    [v] = got
    assert v.status == "ok" and v.sampled_because == "contested" and v.trace_id == t.trace_id
    assert v.verdict_id == verdict_id(t.trace_id, judge, worker.rubric)
    assert {g.provider: g.grade for g in v.grades} == {"bm25-all": 3, "dense-all": 1, "eng-bm25": 3,
                                                       "lib-bm25": 0}
    assert v.ordering == (("bm25-all", "eng-bm25"), ("dense-all",), ("lib-bm25",))
    assert {g.provider: g.judged for g in v.grades}["lib-bm25"] is False
    assert set(v.letters.values()) == {"bm25-all", "dense-all", "eng-bm25"}
    for g in v.grades:
        assert g.letter is None or v.letters[g.letter] == g.provider
    assert v.judge_model == "keyword-judge" and v.judge_kind == "test" and v.rubric_hash


async def test_replay_is_judged_once_and_new_rubric_is_additive(harness):
    bus, got = harness
    store = MemoryKeyStore()
    worker = JudgeWorker(bus, KeywordJudge(), store, sample_rate=0.0)
    t = judged_trace()
    for _ in range(3):
        await worker.handle(t)
    assert len(got) == 1 and worker.metrics.replays._value.get() == 2
    other = JudgeWorker(bus, KeywordJudge(), store, sample_rate=0.0)
    other.rubric = "another-rubric-hash"
    await other.handle(t)
    assert len(got) == 2 and got[0].verdict_id != got[1].verdict_id  # beside, not over


async def test_unsampled_traces_are_counted_once(harness):
    bus, got = harness
    store = MemoryKeyStore()
    worker = JudgeWorker(bus, KeywordJudge(), store, sample_rate=0.0)
    calm = judged_trace("calm", contested=False)
    await worker.handle(calm)
    await worker.handle(calm)
    assert got == [] and await store.count("unsampled") == 1


async def test_failed_judge_stores_a_failed_verdict_with_reason_never_grades(harness):
    bus, got = harness
    worker = JudgeWorker(bus, KeywordJudge(fail=True), MemoryKeyStore(), sample_rate=0.0)
    await worker.handle(judged_trace())
    [v] = got
    assert v.status == "failed" and "500, 500, unparseable" in v.failure_reason
    assert v.grades == () and v.ordering == ()
