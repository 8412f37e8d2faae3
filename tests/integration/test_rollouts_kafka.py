"""The rollout runner on the real broker and redis-server: a task on ``tasks`` becomes a group of 2 rollouts
of the shipped router harness (official OpenAI SDK) in each sandbox backend (bubblewrap; Docker, a container
built from the task's Dockerfile), through the real relay (admin routes for the one-episode credentials and
the episode end) in front of the real CPU sampler serving ``router@1`` (the Redis stamp); the group on
``rollouts`` carries each rollout's harness output, calls, datums and reward."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import httpx
import pytest

from schemas import topic
from schemas.rollout import RolloutGroup
from services.common.bus import publish_once
from services.common.settings import KafkaSettings, RedisSettings
from services.common.stamps import RedisStampStore
from services.episodes.tasks import build_task
from services.relay.settings import RelaySettings
from services.rollouts import worker
from services.rollouts.settings import RolloutSettings
from services.sampler.app import create_app as sampler_app
from services.sampler.settings import SamplerSettings
from tests.support.records import NOW, judged_trace, verdict_for
from tests.support.relay import relay_served
from tests.support.serving import free_port, served
from services.common.adapter_files import dir_digest
from tests.support.tiny_model import build_lora_adapter, build_tiny_model
from tests.support.topics import wait_for_records

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]
ADMIN = "rollouts-admin-token"


async def test_a_task_becomes_a_group_of_rollouts_with_calls_datums_and_rewards(kafka_bootstrap, redis_url, tmp_path,
                                                                                 sandbox_backend):
    ns = f"ro{uuid.uuid4().hex[:8]}."
    kafka, redis = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_namespace=ns), RedisSettings(url=redis_url)
    base = build_tiny_model(tmp_path / "base", context=4096)
    lora = build_lora_adapter(base, tmp_path / "lora", seed=3)
    stamps = RedisStampStore(redis_url, ns)
    assert await stamps.incr("router") == 1  # what the publisher does when it publishes router@1
    await stamps.close()
    sport = free_port()
    s_settings = SamplerSettings(kafka=kafka, redis=redis, port=sport, base_model=str(base), served_model_name="base",
                                 consume_adapters=False, adapter_cache_dir=tmp_path / "cache")
    relay = RelaySettings(kafka=kafka, redis=redis, sampler_url=f"http://127.0.0.1:{sport}", tokenizer=str(base),
                          adapter_model_id="router", admin_token=ADMIN)
    task = build_task(judged_trace(), verdict_for("t-1"), now=NOW)
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        surl = await stack.enter_async_context(served(sampler_app(s_settings), sport, what="sampler",
                                                      start_timeout_s=120))
        async with httpx.AsyncClient(base_url=surl, timeout=60) as sampler:
            r = await sampler.post("/v1/load_lora_adapter", json={"lora_name": "router@1", "lora_path": str(lora)})
            assert r.status_code == 200, r.text
        url, _ = await stack.enter_async_context(relay_served(relay))
        settings = RolloutSettings(kafka=kafka, redis=redis, relay_url=url, admin_token=ADMIN, model_id="router",
                                   group_size=2, max_parallel=2, sandbox_timeout_s=120, command_timeout_s=90,
                                   work_dir=tmp_path, group_id=f"rollouts-{ns}".rstrip(".").lower(),
                                   sandbox=sandbox_backend)
        running = asyncio.create_task(worker.run(settings, stop))
        try:
            await publish_once(kafka, topic("tasks"), task, client_id="test")
            groups = await wait_for_records(kafka, "rollouts", RolloutGroup, 1, timeout_s=240,
                                            what="the task's group on rollouts")
        finally:
            stop.set()
            await asyncio.wait_for(running, 60)

    group = groups[0]
    assert (group.task_id, group.model_id, group.adapter_version, group.sandbox, group.harness) == (
        task.task_id, "router", 1, sandbox_backend.type, "router")
    assert len(group.rollouts) == 2 and group.reward_mean == pytest.approx(sum(group.rewards_G) / 2)
    for ro in group.rollouts:
        # the harness ran to the end, made its one call through the forwarded socket, and the verifier scored it
        assert ro.outcome == "completed", (ro.reason, ro.harness)
        assert ro.harness.exit_code == 0 and "router harness: model replied" in ro.harness.stdout
        assert ro.verifier is not None and ro.reward_source == "reward.txt" and 0.0 <= ro.reward <= 1.0
        assert [c.call_index for c in ro.calls] == [0] and ro.calls[0].trace_id == ro.trace_id
        call = ro.calls[0]
        assert call.adapter == "router@1" and call.wire == "openai" and call.request["max_tokens"] == 48
        assert call.adapter_sha256 == dir_digest(lora)  # the content that sampled, as the sampler named it
        assert call.request["messages"][0]["content"].startswith("You route search queries")
        assert call.text and f"model replied {call.text!r}" in ro.harness.stdout  # the reply it wrote from
        assert ro.dispositions == {"new_segment:first": 1} and ro.segments == 1 and len(ro.datums) == 1
        datum = ro.datums[0]
        inputs = datum.loss_fn_inputs
        sampled = [i for i, w in enumerate(inputs.weights) if w == 1.0]
        assert len(sampled) == len(call.sampled_ids) > 0
        assert [inputs.target_tokens[i] for i in sampled] == list(call.sampled_ids)
        assert [inputs.logprobs[i] for i in sampled] == pytest.approx(list(call.sampled_logprobs))
        assert all(inputs.advantages[i] == pytest.approx(ro.advantage) for i in sampled)
        assert ro.advantage == pytest.approx(0.0 if group.uniform else ro.reward - group.reward_mean)
