"""Kafka paused (SIGSTOP) for 15 s under steady gateway traffic: every request answered, the ones during
the outage ``spooled`` in bounded time, and afterwards every trace on the topic exactly once."""

from __future__ import annotations

import uuid

import pytest

from bench.gateway_outage import outage
from services.common.settings import KafkaSettings
from tests.support import fault_matrix
from tests.support.broker_pause import broker_pauser

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
PUBLISH_WAIT_S = 0.5
PAUSE_S = 15.0


async def test_a_broker_outage_loses_no_trace_and_holds_no_request(kafka_bootstrap, _services, tmp_path):
    pause, resume, how = broker_pauser(_services, kafka_bootstrap)  # the session's broker: outage() resumes it
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=f"outage{uuid.uuid4().hex[:8]}.")
    res = await outage(kafka, pause, resume, spool_dir=tmp_path / "spool", rate=6.0, before_s=3.0,
                       pause_s=PAUSE_S, after_s=3.0, publish_wait_s=PUBLISH_WAIT_S)
    row = fault_matrix.report(fault_matrix.count(
        "Kafka paused 15 s (SIGSTOP) under 6 req/s", "gateway (trace outbox)", "test_gateway_outage_kafka",
        records_in=res["requests"], expected=res["answered_ids"],
        results=res["topic_ids"], spooled=res["trace_status"].get("spooled", 0),
        outage_p99_ms=res["latency_ms"]["outage"]["p99"], topic_records=res["on_topic_records"], broker=how,
        republished=res["spool_republished"], found_on_topic=res["spool_found_on_topic"]))
    summary = {k: v for k, v in res.items() if k not in ("answered_ids", "topic_ids")}
    assert res["answered_200"] == res["requests"], summary  # every request answered
    assert res["trace_status_by_phase"]["outage"].get("spooled", 0) > 0, summary  # and told the truth
    assert set(res["topic_ids"]) == set(res["answered_ids"]), summary  # 0 lost
    assert row.lost == 0 and res["lost"] == 0, summary
    assert res["duplicates"] == 0, f"{res['duplicates']} traces on the topic more than once: {summary}"
    assert res["spool_left"] == 0, summary
    # Bounded: a request during the outage waits publish_wait_s, then one fsynced append (generous margin
    # for a loaded CI machine; before the outbox these took the whole 5 s publish timeout).
    assert res["latency_ms"]["outage"]["p99"] < (PUBLISH_WAIT_S + 2.0) * 1000, summary
