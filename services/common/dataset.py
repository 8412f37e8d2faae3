"""The episode dataset as of a time: the ``episodes`` topic read up to a timestamp.

Kafka keeps every episode record, so the dataset as of T is reproducible after more episodes
land: records appended after T are ignored, records of one episode are merged additively (the
first record's conversation; the union of reward components by id, first value kept — a new
rubric adds, nothing overwrites), and the result is in one canonical order (episode id) with
one canonical encoding, so two builds as of the same T are identical byte for byte.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from schemas.episode import Episode
from schemas.topics import topic
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings


def merge(first: Episode, later: Episode) -> Episode:
    """``first`` with ``later``'s reward components added (by component id; existing ones kept)."""
    have = {c.component_id for c in first.rewards}
    extra = tuple(c for c in later.rewards if c.component_id not in have)
    if not extra:
        return first
    return first.model_copy(update={"rewards": tuple(sorted(first.rewards + extra, key=lambda c: c.name))})


async def dataset_as_of(kafka: KafkaSettings, as_of: datetime) -> list[Episode]:
    """Episodes whose records were appended at or before ``as_of``, merged, sorted by id."""
    out: dict[str, Episode] = {}
    # Unreadable records are skipped (the consumers dead-letter them); "at or before" is "before + 1 ms".
    async for ep in read_topic(kafka, topic("episodes"), model=Episode, until=as_of + timedelta(milliseconds=1)):
        out[ep.episode_id] = merge(out[ep.episode_id], ep) if ep.episode_id in out else ep
    return [out[k] for k in sorted(out)]


def write_jsonl(episodes: list[Episode], path: Path) -> Path:
    """One canonical JSON object per line, in the given order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(ep.to_bytes() + b"\n" for ep in episodes))
    return path
