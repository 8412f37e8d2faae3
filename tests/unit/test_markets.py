"""Provider markets: the presets, the LSA and hybrid providers they use, and the twin guard against
the default judge."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.common.errors import ConfigError
from services.common.splits import dev_half
from services.gateway.settings import GatewaySettings
from services.judge.settings import JudgeSettings
from services.providers import index as idx
from services.providers.collections import sample_queries
from services.providers.config import BM25Config, DenseConfig, HybridConfig, LSAConfig
from services.providers.local import BM25Provider, HybridProvider, LSAProvider
from services.providers.markets import (
    DOMAINS,
    MARKETS,
    domain_of,
    federated,
    market,
    nested,
)


def test_federated_is_the_default_and_nested_is_the_old_five():
    assert GatewaySettings().providers == federated() == JudgeSettings().providers
    assert [p.name for p in GatewaySettings(market="nested").providers] == [
        "bm25-all", "dense-all", "bio-dense", "lib-bm25", "eng-bm25"]
    assert JudgeSettings(market="nested").providers == nested()
    explicit = [BM25Config(name="only")]
    assert GatewaySettings(market="nested", providers=explicit).providers == explicit  # a list beats the preset
    with pytest.raises(ValueError):
        GatewaySettings(market="bazaar")


def test_federated_shape_verticals_deep_and_cheap_generalists_shallow_and_dear():
    providers = {p.name: p for p in federated()}
    verticals = [p for p in providers.values() if isinstance(p, HybridConfig)]
    generalists = [p for p in providers.values() if not isinstance(p, HybridConfig)]
    assert sorted(v.name for v in verticals) == sorted(DOMAINS)
    for v in verticals:
        assert v.collections == DOMAINS[v.name] and v.lead_chars is None  # the full text of one domain
    covered = sorted(c for v in verticals for c in v.collections)
    assert covered == sorted(set(covered)) and len(covered) == 8  # the domains partition the collections
    assert len(generalists) == 2 and len({type(g) for g in generalists}) == 2  # one method each
    for g in generalists:
        assert len(g.collections) == 8 and g.lead_chars is not None  # everything, shallowly
        assert g.cost_usd > max(v.cost_usd for v in verticals)
    assert not any(isinstance(p, DenseConfig) for p in providers.values())  # no model shared with the judge
    assert domain_of("scifact") == "biomed" and set(MARKETS) == {"federated", "nested"}


def test_dev_halves_split_the_queries_in_two_fixed_halves():
    ids = [q.query_id for q in sample_queries()]
    tune = [i for i in ids if dev_half(i) == "tune"]
    assert 0.4 < len(tune) / len(ids) < 0.6 and dev_half(ids[0]) == dev_half(ids[0])


def test_twin_guard_passes_the_default_judge_in_federated_and_refuses_it_in_nested():
    from services.judge.guard import guard
    from services.judge.settings_local import LocalJudgeConfig

    guard(JudgeSettings())  # no federated provider embeds with MiniLM
    assert JudgeSettings().judge.use_embeddings
    with pytest.raises(ConfigError, match=r"dense-all.*bio-dense|bio-dense.*dense-all"):
        guard(JudgeSettings(market="nested"))
    guard(JudgeSettings(market="nested", judge=LocalJudgeConfig()))  # the lexical judge has no arm there
    twin = [*federated(), DenseConfig(name="web-dense", cost_usd=0.005)]  # a provider adds MiniLM: refused
    with pytest.raises(ConfigError, match="web-dense"):
        guard(JudgeSettings(providers=twin))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("idx")


async def started(provider):
    await provider.start()
    return provider


async def test_lsa_finds_documents_that_share_no_term_with_the_query(cache: Path):
    lsa = await started(LSAProvider(LSAConfig(name="lsa", collections=("med",), dim=64), cache_dir=cache))
    bm25 = await started(BM25Provider(BM25Config(name="b", collections=("med",)), cache_dir=cache))
    ans = await lsa.search("cancer tumour chemotherapy")
    assert len(ans.citations) == 10 and all(c.url.startswith("collection://med/") for c in ans.citations)
    scores = [c.score for c in ans.citations]
    assert scores == sorted(scores, reverse=True) and 0 < scores[0] <= 1.0001
    # documents without any of the query's (stemmed) terms are found too: BM25 cannot do that
    from services.providers.collections import (
        default_collections_dir,
        load_corpus,
        parse_doc_url,
    )

    text = {d.doc_id: f"{d.title} {d.text}" for d in load_corpus(default_collections_dir(), "med")}
    from services.providers.collections import load_queries

    hits = 0
    for q in load_queries(default_collections_dir(), "med"):
        wanted = set(idx.query_terms(q.text))
        cites = (await lsa.search(q.text)).citations
        hits += sum(not wanted & set(idx.query_terms(text[parse_doc_url(c.url).doc_id])) for c in cites)
    assert hits > 0, "LSA should rank some documents that contain none of the query terms"
    assert (await lsa.search("zzzz qqqq")).citations == () and (await bm25.search("zzzz")).citations == ()


async def test_hybrid_fuses_bm25_and_lsa_and_is_cached(cache: Path):
    cfg = HybridConfig(name="h", collections=("med",), dim=64, lsa_weight=0.5)
    hybrid = await started(HybridProvider(cfg, cache_dir=cache))
    pure = await started(HybridProvider(cfg.model_copy(update={"lsa_weight": 0.0}), cache_dir=cache))
    assert pure.index_builds == 0  # same indexes, only the fusion weight differs
    q = "the crystalline lens in vertebrates, including humans"
    lexical = idx.bm25_scores(pure._retriever, q)
    assert np.allclose(pure._scores(q), lexical / lexical.max())
    fused = hybrid._scores(q)
    assert np.all(fused >= pure._scores(q) - 1e-6) and not np.allclose(fused, pure._scores(q))


async def test_shallow_index_reads_only_the_lead(cache: Path):
    from services.providers.collections import default_collections_dir, load_corpus

    idx_dir = default_collections_dir()
    docs = list(load_corpus(idx_dir, "med"))
    deep_word = next(w for d in docs for w in d.text[400:].split() if len(w) > 12 and w.isalpha()
                     and all(w not in x.title + x.text[:200] for x in docs))
    shallow = await started(BM25Provider(BM25Config(name="s", collections=("med",), lead_chars=200), cache_dir=cache))
    deep = await started(BM25Provider(BM25Config(name="d", collections=("med",)), cache_dir=cache))
    assert (await shallow.search(deep_word)).citations == ()
    assert (await deep.search(deep_word)).citations
    assert idx.lead("one two three four", 9) == "one two" and idx.lead("short", None) == "short"
    assert idx_dir.is_dir()


def test_market_presets_are_fresh_lists():
    a, b = market("federated"), market("federated")
    assert a == b and a is not b


def test_market_table_rows_and_targets_from_per_query_scores():
    from services.tools.market import QueryRow, table, targets

    cost = {"v1": 0.001, "v2": 0.001, "gen": 0.003}

    def row(qid: str, domain: str, v1: float, v2: float, gen: float, judge_top=("gen",)) -> QueryRow:
        return QueryRow(qid, domain, "tune", {"v1": v1, "v2": v2, "gen": gen}, cost, judge_top)

    rows = [row("a/1", "d1", 0.8, 0.0, 0.5, ("v1", "gen")), row("a/2", "d1", 0.6, 0.0, 0.6),
            row("b/1", "d2", 0.0, 0.9, 0.5), row("b/2", "d2", 0.0, 0.3, 0.4, ("v2",))]
    by = {r.policy.split(" (")[0]: r for r in table(rows, rows)}
    assert by["best single"].picks == {"*": "gen"} and by["best single"].ndcg == pytest.approx(0.5)
    assert by["per-domain best"].picks == {"d1": "v1", "d2": "v2"}
    assert by["per-domain best"].ndcg == pytest.approx((0.8 + 0.6 + 0.9 + 0.3) / 4)
    assert by["per-domain best"].cost_usd == pytest.approx(0.001)
    # oracle: per query the best, ties (a/2: v1 = gen = 0.6) to the cheaper
    assert by["oracle"].ndcg == pytest.approx((0.8 + 0.6 + 0.9 + 0.4) / 4)
    # judge-oracle: the judge's first tier, cheapest inside it (a/1: v1 over gen), scored on the humans
    assert by["judge-oracle"].ndcg == pytest.approx((0.8 + 0.6 + 0.5 + 0.3) / 4)
    t = targets(table(rows, rows))
    assert t["per_domain_over_single"] == pytest.approx(0.65 / 0.5) and t["met"] is True
    flat = [row("a/1", "d1", 0.5, 0.0, 0.5), row("b/1", "d2", 0.0, 0.5, 0.5)]
    assert targets(table(flat, flat))["met"] is False  # nothing to win: the generalist ties everywhere


def test_market_cli_refuses_an_unknown_market(capsys: pytest.CaptureFixture) -> None:
    from services.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["market", "--market", "bazaar"])
    assert exc.value.code == 2 and "bazaar" in capsys.readouterr().err


@pytest.mark.slow
def test_market_cli_prints_and_writes_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    import json

    from services.cli import main

    monkeypatch.setenv("FANROUTE_JUDGE", '{"type": "local"}')  # the lexical judge: no model to load here
    assert main(["market", "--market", "federated", "--queries", "40", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "market 'federated': " in out and "per-domain best" in out and "judge-oracle" in out
    report = json.loads((tmp_path / "market.json").read_text())["federated"]
    rows = {r["policy"].split(" (")[0]: r for r in report["all"]}
    assert set(rows) >= {"aero", "web-lexical", "best single", "per-domain best", "oracle", "judge-oracle"}
    assert rows["oracle"]["ndcg"] >= rows["per-domain best"]["ndcg"] >= 0
    assert (tmp_path / "market.png").stat().st_size > 10_000


def test_market_cli_names_a_missing_collections_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    from services.cli import main

    monkeypatch.setenv("FANROUTE_COLLECTIONS_DIR", str(tmp_path / "nowhere"))
    assert main(["market", "--market", "federated", "--no-judge", "--out", str(tmp_path)]) == 2
    assert "nowhere" in capsys.readouterr().err and not (tmp_path / "market.json").exists()


def test_a_providers_file_with_bad_new_fields_is_refused_naming_the_field(tmp_path: Path) -> None:
    from services.providers.markets import load_providers_file

    cases = {'type = "lsa"\nname = "s"\ndim = 0': "dim",
             'type = "hybrid"\nname = "h"\nlsa_weight = -1': "lsa_weight",
             'type = "bm25"\nname = "b"\nlead_chars = 5': "lead_chars",
             'type = "lsa"\nname = "s"\nsnippets = 3': "snippets"}
    for body, field_name in cases.items():
        path = tmp_path / "p.toml"
        path.write_text("[[providers]]\n" + body + "\n")
        with pytest.raises(ConfigError, match=field_name):
            load_providers_file(path)


def test_calibrate_report_refuses_an_unknown_half(capsys: pytest.CaptureFixture) -> None:
    from services.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "report", "--half", "third"])
    assert exc.value.code == 2 and "third" in capsys.readouterr().err


def test_a_corrupt_embedding_cache_is_a_clear_error_and_leaves_the_file(tmp_path: Path) -> None:
    from services.judge.backends.embed_cache import EmbeddingCache

    path = tmp_path / "embeddings.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ConfigError, match="embeddings.sqlite cannot be used"):
        EmbeddingCache(path, "m")
    assert path.read_bytes().startswith(b"this is not a database")  # nothing overwritten


def test_an_lsa_build_does_not_depend_on_the_process_string_hashing(tmp_path: Path):
    """bm25s numbers terms in a set's order, which changes with PYTHONHASHSEED; the LSA factors (and so
    every LSA provider's ranking, the judge's labels and the demo's student) must not."""
    import os
    import subprocess
    import sys

    from services.providers.lsa import DOCS_FACTORS_FILE, IDF_FILE, TERM_FACTORS_FILE, VOCAB_FILE

    code = ("import sys; from pathlib import Path; "
            "from services.providers.collections import default_collections_dir, load_corpus; "
            "from services.providers.lsa import build_lsa; out = Path(sys.argv[1]); out.mkdir(); "
            "build_lsa(out, list(load_corpus(default_collections_dir(), 'med')), dim=32, lead_chars=None)")
    root = Path(__file__).resolve().parents[2]
    for seed in ("1", "2"):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / seed)], cwd=root, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)})
    for name in (VOCAB_FILE, IDF_FILE, DOCS_FACTORS_FILE, TERM_FACTORS_FILE):
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes(), name


def test_the_lsa_vocabulary_is_numbered_in_sorted_order():
    from services.providers.lsa import sorted_vocab

    vocab, remap = sorted_vocab({"wing": 0, "aero": 2, "drag": 1})
    assert vocab == {"aero": 0, "drag": 1, "wing": 2}
    assert remap.tolist() == [2, 1, 0]  # old id → new id
