"""Local providers' simulated latency (deterministic per provider and query, log-normal, reported and
waited) and the synthetic provider (deterministic, cheap, capped by its corpus)."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import pytest

from services.providers.base import build_answer
from services.providers.collections import parse_doc_url
from services.providers.config import BM25Config, LatencyModel, SyntheticConfig
from services.providers.local import BM25Provider, SyntheticProvider, simulated_latency_ms, synthetic_doc_ids


# --------------------------------------------------------------------------- latency


def test_simulated_latency_is_deterministic_per_provider_and_query() -> None:
    model = LatencyModel(median_ms=200, sigma=0.5)
    a = simulated_latency_ms(model, "bm25", "solar wind")
    assert a == simulated_latency_ms(model, "bm25", "solar wind")
    assert a != simulated_latency_ms(model, "bm25", "solar winds")
    assert a != simulated_latency_ms(model, "dense", "solar wind")
    draws = [simulated_latency_ms(model, "bm25", f"q{i}") for i in range(4000)]
    assert all(d > 0 for d in draws)
    assert 180 < statistics.median(draws) < 220
    log_sd = statistics.pstdev(math.log(d) for d in draws)
    assert 0.45 < log_sd < 0.55


def test_simulated_latency_constant_or_zero() -> None:
    assert simulated_latency_ms(LatencyModel(median_ms=75, sigma=0), "p", "any") == 75
    assert simulated_latency_ms(LatencyModel(median_ms=75, sigma=0), "p", "other") == 75
    assert simulated_latency_ms(LatencyModel(), "p", "any") == 0.0


async def test_search_reports_the_simulated_latency(tmp_path: Path) -> None:
    latency = LatencyModel(median_ms=5, sigma=0.3)
    provider = BM25Provider(BM25Config(name="bm25", collections=("adi",), latency=latency),
                            cache_dir=tmp_path)
    await provider.start()
    query = "information retrieval systems"
    started = time.perf_counter()
    answer = await provider.search(query)
    elapsed_ms = (time.perf_counter() - started) * 1000
    expected = simulated_latency_ms(latency, "bm25", query)
    assert answer.raw_meta["simulated_latency_ms"] == pytest.approx(expected, abs=1e-3)
    assert elapsed_ms >= expected - 1  # the loop may wake a hair early


# --------------------------------------------------------------------------- synthetic


async def test_synthetic_is_deterministic_and_cheap() -> None:
    config = SyntheticConfig(name="synth", latency_ms=0, corpus_size=500, k=7, cost_usd=0.01)
    provider = SyntheticProvider(config)
    await provider.start()
    a = await provider.search("quantum tunnelling")
    b = await SyntheticProvider(config).search("quantum tunnelling")
    c = await provider.search("quantum tunneling")
    assert a == b
    assert a.citations != c.citations
    ids = [int(parse_doc_url(x.url).doc_id) for x in a.citations]
    assert len(ids) == len(set(ids)) == 7 and all(0 <= i < 500 for i in ids)
    assert [x.rank for x in a.citations] == list(range(1, 8))
    assert a.cost_usd == 0.01 and a.answer == build_answer(a.citations)
    assert (await provider.search("  ")).citations == ()


def test_synthetic_doc_ids_capped_by_corpus_size() -> None:
    assert sorted(synthetic_doc_ids("s", "q", 10, 3)) == [0, 1, 2]
    assert synthetic_doc_ids("s", "q", 5, 10**7) == synthetic_doc_ids("s", "q", 5, 10**7)


async def test_synthetic_waits_its_fixed_latency() -> None:
    provider = SyntheticProvider(SyntheticConfig(name="synth", latency_ms=20))
    started = time.perf_counter()
    answer = await provider.search("anything")
    assert (time.perf_counter() - started) * 1000 >= 19  # the loop may wake a hair early
    assert answer.raw_meta["simulated_latency_ms"] == 20
