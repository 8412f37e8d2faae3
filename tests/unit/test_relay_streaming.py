"""The relay passes a streamed call on as the sampler decodes it: the first piece reaches the harness
before the sampler has finished, a failure mid-stream is the wire's error event, nothing half-done is
recorded, and a sampler that does not stream still works."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from services.relay.service import HeldText
from tests.support.relay import counting_sampler, relay_served, relay_settings
from tests.support.serving import LoopbackServer
from tests.support.tiny_model import build_tiny_model

MSGS = [{"role": "user", "content": "which provider for proteins?"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("relay-stream") / "base")


def chunk(text: str, ids: list[int], finish: str | None = None, **extra: Any) -> bytes:
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish, "stop_reason": None,
              "logprobs": {"tokens": ["x"] * len(ids), "token_logprobs": [-0.25] * len(ids),
                           "top_logprobs": [{}] * len(ids), "text_offset": [0] * len(ids)}, **extra}
    return b"data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [choice]}).encode() + b"\n\n"


def gated_sampler(gate: threading.Event, *, fail: bool = False) -> tuple[FastAPI, list[dict]]:
    """A vLLM-shaped streaming sampler: one piece, then it waits for ``gate``, then the rest (or a failure)."""
    app, asked = FastAPI(), []

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-base", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        asked.append(await request.json())

        async def events() -> AsyncIterator[bytes]:
            yield chunk("Hello", [5], prompt_token_ids=[1, 2])
            await asyncio.to_thread(gate.wait, 60)
            if fail:
                yield b'data: {"error": {"message": "the engine died", "type": "InternalServerError", "code": 500}}\n\n'
            else:
                yield chunk(" world", [6, 7], "length")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, asked


async def test_the_first_piece_reaches_the_harness_before_the_sampler_finishes(base) -> None:
    gate = threading.Event()
    app, asked = gated_sampler(gate)
    with LoopbackServer(app, "streaming-sampler") as sampler:
        settings = relay_settings(base, sampler_url=sampler.url(), auth=False)
        async with relay_served(settings) as (url, relay):
            client = openai.AsyncOpenAI(base_url=f"{url}/tr/ep-s/v1", api_key="x", max_retries=0)
            stream = await client.chat.completions.create(model="policy", messages=MSGS, max_tokens=8, stream=True,
                                                          stream_options={"include_usage": True})
            parts, usage = [], None
            async for event in stream:
                usage = event.usage or usage
                text = event.choices[0].delta.content if event.choices else None
                if text:
                    parts.append(text)
                    if len(parts) == 1:  # the sampler is still waiting: nothing is recorded yet
                        assert parts == ["Hello"] and await relay.state.calls("ep-s") == []
                        gate.set()
            calls = await relay.state.calls("ep-s")
    assert "".join(parts) == "Hello world" and asked[0]["stream"] is True
    assert len(calls) == 1 and calls[0].text == "Hello world" and calls[0].stream
    assert calls[0].sampled_ids == (5, 6, 7) and calls[0].sampled_logprobs == (-0.25, -0.25, -0.25)
    assert usage is not None and usage.completion_tokens == 3


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
async def test_a_failure_mid_stream_is_the_wires_error_and_records_nothing(base, wire) -> None:
    gate = threading.Event()
    gate.set()
    app, _ = gated_sampler(gate, fail=True)
    with LoopbackServer(app, "failing-sampler") as sampler:
        settings = relay_settings(base, sampler_url=sampler.url(), auth=False)
        async with relay_served(settings) as (url, relay):
            if wire == "openai":
                client = openai.AsyncOpenAI(base_url=f"{url}/tr/ep-f/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.APIError, match="engine died"):
                    async for _ in await client.chat.completions.create(model="policy", messages=MSGS,
                                                                        max_tokens=8, stream=True):
                        pass
            else:
                client = anthropic.AsyncAnthropic(base_url=f"{url}/tr/ep-f", api_key="x", max_retries=0)
                with pytest.raises(anthropic.APIStatusError, match="engine died"):
                    async with client.messages.stream(model="policy", max_tokens=8, messages=MSGS) as s:
                        async for _ in s:
                            pass
            assert await relay.state.calls("ep-f") == []


async def test_anthropic_streams_as_decoded_too(base) -> None:
    gate = threading.Event()
    app, _ = gated_sampler(gate)
    with LoopbackServer(app, "streaming-sampler") as sampler:
        settings = relay_settings(base, sampler_url=sampler.url(), auth=False)
        async with relay_served(settings) as (url, relay):
            client = anthropic.AsyncAnthropic(base_url=f"{url}/tr/ep-a", api_key="x", max_retries=0)
            parts = []
            async with client.messages.stream(model="policy", max_tokens=8, messages=MSGS) as s:
                async for text in s.text_stream:
                    parts.append(text)
                    if len(parts) == 1:
                        assert await relay.state.calls("ep-a") == []
                        gate.set()
                final = await s.get_final_message()
            calls = await relay.state.calls("ep-a")
    assert "".join(parts) == "Hello world" == final.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 3 and [c.wire for c in calls] == ["anthropic"]


@pytest.mark.parametrize("stream_sampler", [True, False])
async def test_a_sampler_that_answers_json_or_a_relay_told_not_to_ask_still_streams(base, stream_sampler) -> None:
    fake = counting_sampler(text="ok then")
    settings = relay_settings(base, auth=False, stream_sampler=stream_sampler)
    async with relay_served(settings, fake) as (url, relay):
        client = openai.AsyncOpenAI(base_url=f"{url}/tr/ep-j/v1", api_key="x", max_retries=0)
        stream = await client.chat.completions.create(model="policy", messages=MSGS, max_tokens=3, stream=True)
        text = "".join([e.choices[0].delta.content or "" async for e in stream if e.choices])
        calls = await relay.state.calls("ep-j")
    assert text == "ok then" and calls[0].sampled_ids == (5, 6, 7)
    assert fake.state.hits[0]["stream"] is stream_sampler


def test_held_text_keeps_a_tool_call_and_what_could_begin_one_back() -> None:
    held = HeldText(tools=True)
    assert [held.add(p) for p in ("Let me ", "look. <tool", "_call>{\"name\"", ": \"x\"}</tool_call>")] == \
        ["Let me", " look.", "", ""]
    assert held.close("Let me look.") == ""
    loose = HeldText(tools=True)
    assert loose.add("a <tool") == "a" and loose.close("a <tool") == " <tool"  # it was not a call after all
    plain = HeldText(tools=False)
    assert plain.add("x <tool_call> ") == "x <tool_call> " and plain.close("x <tool_call> ") == ""
