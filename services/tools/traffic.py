"""``fanroute traffic synth``: pseudo-queries drawn from the bundled corpora, to be replayed through the
gateway so the judge and the episode builder label them exactly as live traffic.

Why: labels are free once the judge is honest; what the embedded default lacks is volume. Thousands of
judged queries per domain let a student learn the domain-level regularity that a few hundred noisy
per-query labels only approximate. Evaluation stays on the human-labelled development queries: a
synthetic query is never the text of one (normalised; checked and counted), never contains one, and its
id (``<collection>/synth-<doc>-<kind>``) has no qrels, so it never enters a human measure.

Each query is one of: a document's title, the leading words of its first sentence, or a short window of
its text (a key phrase) — seeded and deterministic, mixed across collections in a stated proportion
(default: the development queries' own mix).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from services.common.errors import ConfigError
from services.providers.collections import (
    ReplayQuery,
    check_names,
    default_collections_dir,
    load_corpus,
    load_qrels,
    load_queries,
)
from services.providers.config import ALL_COLLECTIONS

KINDS = ("title", "lead", "phrase")
MIN_WORDS, MAX_WORDS = 3, 12
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'-]*")


#: The id part every synthetic query carries (``<collection>/synth-<doc>-<kind>``).
SYNTH_MARK = "/synth-"


def is_synthetic(query_id: str | None) -> bool:
    """Whether a query id names a synthesized query (no qrels: never held out, never in a human measure)."""
    return bool(query_id) and SYNTH_MARK in query_id


def normalise(text: str) -> str:
    """Lower-case words joined by one space (what "the same text" means for the no-dev-text check)."""
    return " ".join(w.lower() for w in _WORD.findall(text))


@dataclass(frozen=True)
class SynthReport:
    """What a synthesis produced and what it refused."""

    queries: int
    by_collection: dict[str, int]
    by_kind: dict[str, int]
    rejected_dev_text: int
    rejected_short: int
    mix: dict[str, float]
    seed: int


def dev_texts(directory: Path) -> tuple[set[str], list[str]]:
    """Every development query's normalised text (all queries, judged or not), and those of 4+ words
    (a synthetic query containing one of these is refused too)."""
    texts = {normalise(q.text) for name in ALL_COLLECTIONS for q in load_queries(directory, name)}
    return texts, sorted(t for t in texts if len(t.split()) >= 4)


def default_mix(directory: Path) -> dict[str, float]:
    """The judged development queries' share per collection."""
    counts = {name: len(load_qrels(directory, name)) for name in ALL_COLLECTIONS}
    total = sum(counts.values())
    return {n: c / total for n, c in counts.items() if c}


def _candidates(doc, rng: random.Random) -> list[tuple[str, str]]:
    words = _WORD.findall(doc.text)
    out = []
    title = " ".join(_WORD.findall(doc.title)[:MAX_WORDS])
    if title:
        out.append(("title", title))
    first = re.split(r"(?<=[.!?])\s", doc.text.strip(), maxsplit=1)[0]
    lead = _WORD.findall(first)[:rng.randint(6, MAX_WORDS)]
    if lead:
        out.append(("lead", " ".join(lead)))
    if len(words) > 8:
        n = rng.randint(4, 8)
        start = rng.randrange(0, len(words) - n)
        out.append(("phrase", " ".join(words[start:start + n])))
    return out


def synthesize(n: int, *, seed: int = 0, mix: Mapping[str, float] | None = None,
               directory: Path | None = None) -> tuple[list[ReplayQuery], SynthReport]:
    """``n`` pseudo-queries (distinct texts) and the report; ConfigError on a bad mix or too few documents."""
    if n < 1:
        raise ConfigError("n must be at least 1")
    directory = directory or default_collections_dir()
    mix = dict(mix) if mix is not None else default_mix(directory)
    check_names(mix)
    if not mix or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise ConfigError(f"mix {mix}: weights must be >= 0 with a positive sum")
    total = sum(mix.values())
    mix = {k: v / total for k, v in sorted(mix.items()) if v > 0}
    quota = _quotas(n, mix)
    forbidden, long_dev = dev_texts(directory)
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[ReplayQuery] = []
    rejected = Counter()
    for name, want in quota.items():
        docs = list(load_corpus(directory, name))
        rng.shuffle(docs)
        got = 0
        for doc in docs * len(KINDS):  # up to one query of each kind per document
            if got >= want:
                break
            options = [c for c in _candidates(doc, rng) if f"{name}/synth-{doc.doc_id}-{c[0]}" not in seen]
            if not options:
                continue
            kind, text = rng.choice(options)
            seen.add(f"{name}/synth-{doc.doc_id}-{kind}")
            norm = normalise(text)
            if len(norm.split()) < MIN_WORDS:
                rejected["short"] += 1
                continue
            if norm in forbidden or any(d in norm for d in long_dev):
                rejected["dev_text"] += 1
                continue
            if norm in seen:
                continue
            seen.add(norm)
            out.append(ReplayQuery(f"{name}{SYNTH_MARK}{doc.doc_id}-{kind}", text))
            got += 1
        if got < want:
            raise ConfigError(f"collection {name}: only {got} distinct pseudo-queries for the {want} its share asks")
    rng.shuffle(out)
    kinds = Counter(q.query_id.rsplit("-", 1)[1] for q in out)
    report = SynthReport(queries=len(out), by_collection=dict(Counter(q.query_id.split("/", 1)[0] for q in out)),
                         by_kind=dict(kinds), rejected_dev_text=rejected["dev_text"],
                         rejected_short=rejected["short"], mix={k: round(v, 6) for k, v in mix.items()}, seed=seed)
    return out, report


def _quotas(n: int, mix: Mapping[str, float]) -> dict[str, int]:
    """Largest-remainder apportionment of ``n`` by ``mix``."""
    raw = {k: n * w for k, w in mix.items()}
    quota = {k: int(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: raw[k] - quota[k], reverse=True)[:n - sum(quota.values())]:
        quota[k] += 1
    return quota


def parse_mix(text: str | None) -> dict[str, float] | None:
    """``adi=1,cacm=2`` → weights; None (the default mix) for None or ``dev``."""
    if text is None or text == "dev":
        return None
    out = {}
    for part in text.split(","):
        name, sep, weight = part.partition("=")
        try:
            out[name.strip()] = float(weight) if sep else 1.0
        except ValueError:
            raise ConfigError(f"--mix {text!r}: {part!r} is not <collection>=<weight>") from None
    return out


def write(queries: Sequence[ReplayQuery], report: SynthReport, out: Path) -> Path:
    """``queries.jsonl`` ({"query_id", "text"} per line, what ``fanroute replay --queries-file`` reads)
    and ``synth.json`` (the report) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "queries.jsonl"
    path.write_text("".join(json.dumps({"query_id": q.query_id, "text": q.text}) + "\n" for q in queries))
    (out / "synth.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    return path


def read_queries_file(path: Path) -> list[ReplayQuery]:
    """A ``queries.jsonl``; a bad line is a ConfigError naming the file and the line."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from exc
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.append(ReplayQuery(str(rec["query_id"]), str(rec["text"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{i}: not a {{\"query_id\", \"text\"}} record ({exc})") from exc
    return out
