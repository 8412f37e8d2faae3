"""``docker compose up --build`` of the whole stack, end to end (``make test-compose``).

Kafka, Redis, gateway, judge, episode builder, publisher, sampler, relay and rollout runner each in their
container, from compose.yaml with docker/local.env (the offline stand-in images). The test publishes and
promotes an adapter through the publisher's published port, replays queries through the gateway's, and
reads the topics from the host: traces → verdicts → episodes → tasks, a routed request answered by the
sampler's ``router@1``, and rollout groups run in Docker sandboxes (the runner in a container driving
the host's daemon) whose harness calls reached the relay. Timings and image sizes go to
``out/compose/compose-run.json`` (docs/operations.md quotes them).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from schemas import Episode, RolloutGroup, Task, Trace, Verdict, topic
from services.common.publisher_client import PublisherClient
from services.common.replay_topic import read_topic
from services.common.settings import KafkaSettings
from tests.support.compose import REPO, compose_stack
from tests.support.poll import eventually
from tests.support.tiny_model import build_lora_adapter, build_tiny_model

pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]

MODEL = "tiny-llama"
QUERIES = (
    "measurement of flow separation on a swept wing at high angle of attack",
    "effect of insulin on glucose uptake in skeletal muscle cells",
    "information retrieval evaluation with relevance judgments",
    "compiler optimisation of loops for parallel machines",
    "electron scattering cross sections in the upper atmosphere",
    "classification schemes for library catalogues",
    "heat transfer in laminar boundary layers",
    "protein expression in tumour cells after radiation",
    "automatic indexing of documents by term weighting",
    "storage allocation in operating systems",
    "plasma oscillations in a magnetic field",
    "citation analysis of scientific journals",
)


async def _count(kafka: KafkaSettings, name: str, model: type) -> list:
    return [m async for m in read_topic(kafka, topic(name), model=model)]


async def test_the_whole_stack_serves_judges_builds_episodes_and_rolls_out_in_docker(tmp_path: Path):
    models = tmp_path / "models"
    base = build_tiny_model(models / MODEL)
    adapter = build_lora_adapter(base, tmp_path / "adapter", seed=1)
    for path in models.rglob("*"):  # safetensors writes 0600; the services read /models as uid 10001
        path.chmod(0o755 if path.is_dir() else 0o644)
    t0 = time.monotonic()
    # Half the requests fan out (fresh traces for the judge); the rest are routed by the promoted router.
    # A short host path: each rollout's relay socket lives under it, and AF_UNIX paths stop at 107 bytes.
    work = Path(tempfile.mkdtemp(prefix="fr-", dir="/var/tmp"))
    with compose_stack(models, MODEL, work, FANROUTE_FANOUT_FRACTION="0.5",
                       FANROUTE_GROUP_SIZE="2") as stack:
        kafka = KafkaSettings(bootstrap_servers=stack.kafka_bootstrap)

        def publish_and_promote() -> dict:
            with PublisherClient(stack.url("publisher"), timeout_s=60) as pc:
                pc.publish("router", adapter, MODEL, {})
                return pc.promote("router", 1, fallback_provider="web-lexical")

        promoted = await asyncio.to_thread(publish_and_promote)
        assert promoted["version"] == 1

        async with httpx.AsyncClient(base_url=stack.url("gateway"), timeout=60) as http:
            async def routed_by_router() -> dict | None:
                """A routed request the sampler's router@1 answered (the sampler pulls the adapter first)."""
                for i, q in enumerate(QUERIES):
                    r = await http.post("/v1/search", json={"query": q, "request_id": f"probe-{i}-{time.time()}"})
                    assert r.status_code == 200, r.text
                    body = r.json()
                    route = body.get("route") or {}
                    if body["mode"] == "routed" and route.get("router") == "router@1" and not route.get("fallback"):
                        return body
                return None

            routed = await eventually(routed_by_router, timeout_s=300, interval_s=2,
                                      what="a routed request answered by router@1 (sampler)")
            assert routed["route"]["ordering"] and routed["route"]["called"][0] in routed["route"]["ordering"]
            replies = [(await http.post("/v1/search", json={"query": q, "request_id": f"replay-{i}"})).json()
                       for i, q in enumerate(QUERIES)]
        fanned = {r["trace_id"] for r in replies if r["mode"] == "fanout"}
        assert fanned, [r["mode"] for r in replies]

        async def judged_and_built() -> tuple | None:
            traces = await _count(kafka, "traces", Trace)
            verdicts = await _count(kafka, "verdicts", Verdict)
            episodes = await _count(kafka, "episodes", Episode)
            tasks = await _count(kafka, "tasks", Task)
            done = fanned <= {v.trace_id for v in verdicts} and fanned <= {e.trace_id for e in episodes}
            return (traces, verdicts, episodes, tasks) if done and tasks else None

        traces, verdicts, episodes, tasks = await eventually(
            judged_and_built, timeout_s=600, interval_s=3, what="verdicts and episodes for every fan-out trace")
        assert fanned <= {t.trace_id for t in traces}

        async def rolled_out() -> list[RolloutGroup]:
            return await _count(kafka, "rollouts", RolloutGroup)

        groups = await eventually(rolled_out, timeout_s=900, interval_s=5, what="a rollout group on `rollouts`")
        group = groups[0]
        assert group.sandbox == "docker" and len(group.rollouts) == 2
        assert group.task_id in {t.task_id for t in tasks}
        # Each rollout's harness ran in its container and its calls went through the relay to the sampler.
        assert all(r.harness is not None for r in group.rollouts), group
        assert any(r.calls for r in group.rollouts), [(r.outcome, r.reason) for r in group.rollouts]
        record = {"command": "make test-compose", "timings_s": {**stack.timings,
                                                               "total_before_down": round(time.monotonic() - t0, 1)},
                  "image_bytes": stack.image_sizes(), "traces": len(traces), "verdicts": len(verdicts),
                  "episodes": len(episodes), "tasks": len(tasks), "rollout_groups": len(groups),
                  "rollout_outcomes": sorted(r.outcome for g in groups for r in g.rollouts)}
    shutil.rmtree(work, ignore_errors=True)
    record["timings_s"]["down_s"] = stack.timings.get("down_s")
    out = REPO / "out" / "compose"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compose-run.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
