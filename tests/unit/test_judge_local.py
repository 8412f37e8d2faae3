"""The local judge: 0–3 grades from query–source evidence, tiers of equal grade, no network."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from services.judge.backends.local import (
    LEXICAL_MODEL,
    LocalJudge,
    conflicting_providers,
    content_stems,
    coverage,
    discounted_mean,
    grade_of,
    request_idf,
)
from services.judge.base import BlindCandidate, JudgeFailed, JudgeRequest, Source
from services.judge.settings_local import (
    EMBEDDING_THRESHOLDS,
    LEXICAL_THRESHOLDS,
    LocalJudgeConfig,
)
from services.providers.collections import (
    default_collections_dir,
    load_corpus,
    load_qrels,
    load_queries,
)
from services.providers.config import BM25Config, DenseConfig

QUERY = "heat transfer to the wings of hypersonic aircraft"
ON_TOPIC = (
    Source("Heat transfer in hypersonic flow", "Measurements of heat transfer to a swept wing of a "
           "hypersonic aircraft model at Mach 7."),
    Source("Aerodynamic heating of wings", "Wing surface temperatures and heat transfer rates for "
           "aircraft flying at hypersonic speeds."),
    Source("Hypersonic aircraft design", "Design of aircraft wings for hypersonic flight."),
)
OFF_TOPIC = (
    Source("Library cataloguing rules", "Rules for descriptive cataloguing of serials in "
           "university libraries."),
    Source("Citation indexing", "Citation indexes as a tool for searching the literature."),
)
PARTIAL = (Source("Heat transfer measurements", "Heat transfer rates on a flat plate in a wind tunnel."),
           Source("Wing heating", "Heating of wings at high speed."))


def request(*candidates: BlindCandidate, query: str = QUERY) -> JudgeRequest:
    return JudgeRequest(trace_id="t1", attempt=1, query=query, candidates=tuple(candidates))


def cand(letter: str, sources: tuple[Source, ...]) -> BlindCandidate:
    return BlindCandidate(letter=letter, answer="", sources=sources)


def assert_consistent(result, letters) -> None:
    """Every letter graded 0–3 once; tiers partition the letters, equal grade within, best first."""
    assert set(result.grades) == set(letters)
    assert all(isinstance(g, int) and 0 <= g <= 3 for g in result.grades.values())
    flat = [x for tier in result.ordering for x in tier]
    assert sorted(flat) == sorted(letters)
    tier_grades = [{result.grades[x] for x in tier} for tier in result.ordering]
    assert all(len(g) == 1 for g in tier_grades)
    levels = [g.pop() for g in tier_grades]
    assert levels == sorted(levels, reverse=True) and len(set(levels)) == len(levels)


async def test_relevant_beats_unrelated_and_empty_gets_zero():
    judge = LocalJudge(LocalJudgeConfig())
    await judge.start()
    res = await judge.judge(request(cand("A", OFF_TOPIC), cand("B", ON_TOPIC), cand("C", ()),
                                    cand("D", PARTIAL)))
    assert_consistent(res, "ABCD")
    assert res.grades["B"] == 3
    assert res.grades["B"] > res.grades["D"] > res.grades["A"]  # D covers some query terms
    assert res.grades["A"] == 0 and res.grades["C"] == 0
    assert res.ordering[0] == ("B",)
    assert res.ordering[-1] == ("A", "C")  # tied: one tier, letters in request order
    assert set(json.loads(res.raw)["scores"]) == set("ABCD")


async def test_equal_evidence_is_one_tier():
    judge = LocalJudge()
    res = await judge.judge(request(cand("A", ON_TOPIC), cand("B", OFF_TOPIC), cand("C", ON_TOPIC)))
    assert_consistent(res, "ABC")
    assert res.grades["A"] == res.grades["C"]
    assert res.ordering[0] == ("A", "C")


async def test_deterministic_and_independent_of_candidate_order():
    judge = LocalJudge()
    cands = [cand("A", OFF_TOPIC), cand("B", ON_TOPIC), cand("C", PARTIAL), cand("D", ON_TOPIC[:1])]
    first = await judge.judge(request(*cands))
    again = await judge.judge(request(*cands))
    assert first == again
    shuffled = cands[:]
    random.Random(3).shuffle(shuffled)
    other = await judge.judge(request(*shuffled))
    assert other.grades == first.grades
    assert [set(t) for t in other.ordering] == [set(t) for t in first.ordering]


async def test_a_query_of_stopwords_only_grades_everything_zero():
    res = await LocalJudge().judge(request(cand("A", ON_TOPIC), cand("B", OFF_TOPIC),
                                           query="what is the of and"))
    assert res.grades == {"A": 0, "B": 0}
    assert res.ordering == (("A", "B"),)


async def test_duplicate_letters_fail():
    with pytest.raises(JudgeFailed, match="duplicate letters"):
        await LocalJudge().judge(request(cand("A", ON_TOPIC), cand("A", OFF_TOPIC)))


async def test_only_top_sources_count():
    judge = LocalJudge(LocalJudgeConfig(top_sources=2))
    buried = OFF_TOPIC + ON_TOPIC  # on-topic sources only after rank 2
    res = await judge.judge(request(cand("A", buried), cand("B", ON_TOPIC)))
    assert res.grades["A"] == 0 < res.grades["B"]


async def test_real_collection_relevant_docs_outgrade_random_ones():
    """On Cranfield, judged-relevant abstracts mostly score and grade above random ones."""
    cdir = default_collections_dir()
    docs = {d.doc_id: d for d in load_corpus(cdir, "cranfield")}
    qrels = load_qrels(cdir, "cranfield")
    queries = [q for q in load_queries(cdir, "cranfield") if q.query_id in qrels][:30]
    judge, rng, wins, losses, score_wins = LocalJudge(), random.Random(0), 0, 0, 0
    for q in queries:
        rel = [d for d, g in sorted(qrels[q.query_id].items(), key=lambda x: -x[1]) if g >= 2][:5]
        rand = rng.sample(sorted(set(docs) - set(qrels[q.query_id])), 5)
        src = {i: Source(docs[i].title, docs[i].text[:300]) for i in rel + rand}
        req = request(cand("A", tuple(src[i] for i in rel)), cand("B", tuple(src[i] for i in rand)),
                      query=q.text)
        res, scores = await judge.judge(req), judge.scores(req)
        score_wins += scores["A"] > scores["B"]
        wins += res.grades["A"] > res.grades["B"]
        losses += res.grades["A"] < res.grades["B"]
    assert score_wins >= 25 and wins >= 15 and losses <= 1  # coarse grades tie the rest


def test_scoring_parts():
    assert content_stems("The Wings of aircraft, WINGED flight!") == {"wing", "aircraft", "flight"}
    idf = request_idf({"wing", "rare"}, [{"wing"}, {"wing", "x"}, {"y"}])
    assert idf["rare"] > idf["wing"] > 0
    assert coverage(idf, {"wing"}) == pytest.approx(idf["wing"] / (idf["wing"] + idf["rare"]))
    assert coverage({}, {"wing"}) == 0.0
    assert discounted_mean([1.0] * 5, 5) == pytest.approx(1.0)
    assert discounted_mean([1.0], 5) < discounted_mean([1.0, 1.0], 5) < 1.0
    assert [grade_of(s, (0.1, 0.2, 0.3)) for s in (0.0, 0.1, 0.25, 0.3, 1.0)] == [0, 1, 2, 3, 3]


def test_config_is_bounded_frozen_and_strict():
    c = LocalJudgeConfig()
    assert c.type == "local" and not c.use_embeddings and c.cut_points == LEXICAL_THRESHOLDS
    assert LocalJudgeConfig(use_embeddings=True).cut_points == EMBEDDING_THRESHOLDS
    assert LocalJudgeConfig(thresholds=(0.2, 0.4, 0.6)).cut_points == (0.2, 0.4, 0.6)
    for bad in ({"thresholds": (0.3, 0.2, 0.4)}, {"thresholds": (0.0, 0.2, 0.4)},
                {"thresholds": (0.1, 0.2, 1.5)}, {"top_sources": 0}, {"embedding_weight": 2},
                {"type": "openai"}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            LocalJudgeConfig(**bad)
    with pytest.raises(ValidationError):
        c.use_embeddings = True  # type: ignore[misc]
    assert LocalJudgeConfig.model_validate({"type": "local", "top_sources": 3}).top_sources == 3


def test_identity_and_rubric_extra():
    judge = LocalJudge()
    assert judge.identity.kind == "local" and judge.identity.model == LEXICAL_MODEL
    assert judge.identity.model == "local-lexical-v1"
    other = LocalJudge(LocalJudgeConfig(thresholds=(0.2, 0.4, 0.6)))
    assert other.identity == judge.identity and other.rubric_extra != judge.rubric_extra


def test_conflicting_providers():
    dense = DenseConfig(name="dense-all")
    providers = [BM25Config(name="bm25-all"), dense,
                 DenseConfig(name="off", enabled=False)]
    assert conflicting_providers(LocalJudgeConfig(), providers) == []
    assert conflicting_providers(LocalJudgeConfig(use_embeddings=True), providers) == ["dense-all"]


@pytest.mark.slow
async def test_embedding_variant():
    judge = LocalJudge(LocalJudgeConfig(use_embeddings=True))
    assert judge.identity.model.startswith("local-lexical+minilm-v1:")
    assert len(judge.identity.model.rsplit(":", 1)[1]) == 12
    with pytest.raises(JudgeFailed, match="before start"):
        await judge.judge(request(cand("A", ON_TOPIC)))
    await judge.start()
    await judge.start()  # idempotent
    req = request(cand("A", OFF_TOPIC), cand("B", ON_TOPIC), cand("C", ()))
    res = await judge.judge(req)
    assert_consistent(res, "ABC")
    assert res.grades["B"] > res.grades["A"] and res.grades["C"] == 0
    assert res.ordering[0] == ("B",)
    assert await judge.judge(req) == res
    # Semantic evidence without shared terms still counts with embeddings, not without.
    paraphrase = (Source("Thermal loads on lifting surfaces", "Temperatures reached by the lifting "
                         "surfaces of vehicles flying far faster than sound."),)
    scored = judge.scores(request(cand("A", OFF_TOPIC), cand("B", paraphrase)))
    assert scored["B"] > scored["A"]


def test_embedding_cache_embeds_each_text_once_and_persists(tmp_path):
    import numpy as np

    from services.judge.backends.embed_cache import EmbeddingCache

    calls: list[list[str]] = []

    def encode(texts: list[str]) -> np.ndarray:
        calls.append(list(texts))
        return np.asarray([[len(t), 1.0] for t in texts], dtype=np.float32)

    path = tmp_path / "e.sqlite"
    cache = EmbeddingCache(path, "model-a")
    out = cache.get_many(["ab", "abc", "ab"], encode)
    assert out.tolist() == [[2, 1], [3, 1], [2, 1]] and calls == [["ab", "abc"]]
    cache.get_many(["abc"], encode)
    assert len(calls) == 1 and (cache.misses, cache.hits) == (2, 2)
    cache.close()
    again = EmbeddingCache(path, "model-a")  # a new process: read from disk, nothing re-embedded
    assert again.get_many(["abc", "ab"], encode).tolist() == [[3, 1], [2, 1]] and len(calls) == 1
    other = EmbeddingCache(path, "model-b")  # another model never sees model-a's vectors
    other.get_many(["ab"], encode)
    assert calls[-1] == ["ab"] and len(calls) == 2
