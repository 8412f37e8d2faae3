"""A consumer killed with SIGKILL mid-stream and restarted loses nothing (real broker).

Delivery is at least once: the record being handled when the process died may be handled
again after the restart. Consumers stay idempotent by keying their results on content-derived
ids (trace_id here), so the set of results is exactly the set sent.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from schemas import topic
from services.common.bus import Bus
from services.common.settings import KafkaSettings
from tests.support.fault_matrix import count, report, test_id
from tests.support.poll import eventually_sync
from tests.support.processes import running
from tests.support.records import trace

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _consumer(bootstrap: str, ns: str, out: Path, *, crash: bool = False):
    return running("tests/integration/consumer_proc.py", bootstrap, ns, str(out), "restart-group", crash=crash)


async def test_sigkill_and_restart_loses_nothing(kafka_bootstrap, tmp_path, request):
    ns = f"kill{uuid.uuid4().hex[:8]}."
    bus = Bus(KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns))
    await bus.start((topic("traces"),))
    sent = [f"trace-{i:03d}" for i in range(80)]
    try:
        for tid in sent:
            await bus.publish(topic("traces"), trace(tid))
    finally:
        await bus.stop()
    out = tmp_path / "handled.txt"
    with _consumer(kafka_bootstrap, ns, out, crash=True):
        eventually_sync(lambda: len(_lines(out)) >= 15, timeout_s=90, what="the first consumer to handle 15 traces")
    handled_before = len(_lines(out))
    assert handled_before < len(sent), "the kill must land mid-stream for this test to mean anything"
    with _consumer(kafka_bootstrap, ns, out):
        eventually_sync(lambda: set(_lines(out)) >= set(sent), timeout_s=120, what="the restarted consumer to finish")
    handled = _lines(out)
    report(count("kill -9 mid-stream, restart (a bare bus consumer, no idempotency)", "bus consumer",
                 test_id(request), records_in=len(sent), expected=sent,
                 results=handled, before_kill=handled_before))
    assert set(handled) == set(sent)  # nothing lost
    assert len(handled) - len(sent) <= 2, f"{len(handled) - len(sent)} redeliveries"  # at most in-flight ones
