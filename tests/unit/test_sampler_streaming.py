"""The CPU sampler's streamed completions: tokens leave as they are decoded, and join to the unstreamed answer."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from services.common.adapter_files import ADAPTER_SHA256_HEADER
from services.sampler.streaming import TextStream
from tests.support.poll import eventually
from tests.support.sampler_harness import PROMPT, harness, tiny  # noqa: F401  (the sampler fixtures)

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


async def events(client: httpx.AsyncClient, path: str, body: dict) -> tuple[httpx.Response, list[dict | str]]:
    """The server-sent events of one streamed request, each ``data`` parsed (``[DONE]`` kept as text)."""
    out: list[dict | str] = []
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return r, out


async def test_a_streamed_completion_joins_to_the_unstreamed_one(harness) -> None:
    body = {"prompt": PROMPT, **GREEDY, "logprobs": 2, "return_token_ids": True}
    whole = (await harness.complete(**body))["choices"][0]
    _, got = await events(harness.client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert got[-1] == "[DONE]"
    chunks, usage = got[:-2], got[-2]
    assert len(chunks) > 1, "one chunk per decoded piece, not one at the end"
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert [t for c in choices for t in c["token_ids"]] == whole["token_ids"]
    assert [lp for c in choices for lp in c["logprobs"]["token_logprobs"]] == whole["logprobs"]["token_logprobs"]
    assert [o for c in choices for o in c["logprobs"]["text_offset"]] == whole["logprobs"]["text_offset"]
    assert choices[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in choices[1:])
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(whole["token_ids"])


async def test_a_stop_string_never_reaches_the_client(harness) -> None:
    whole = (await harness.complete(**GREEDY))["choices"][0]
    text = whole["text"]
    stop = text[3:6] if len(text) > 6 else None
    if stop is None:
        pytest.fail(f"the tiny model's greedy answer is too short to cut: {text!r}")
    cut = (await harness.complete(**GREEDY, stop=[stop]))["choices"][0]
    _, got = await events(harness.client, "/v1/completions", {"prompt": PROMPT, **GREEDY, "stop": [stop]})
    choices = [c["choices"][0] for c in got[:-1]]
    assert "".join(c["text"] for c in choices) == cut["text"] == text[:text.find(stop)]
    assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == stop
    assert all(stop not in c["text"] for c in choices)


async def test_a_batch_streams_each_prompt_by_its_index(harness) -> None:
    prompts = [PROMPT, "a second prompt", "and a third"]
    whole = await harness.complete(prompt=prompts, **GREEDY)
    _, got = await events(harness.client, "/v1/completions", {"prompt": prompts, **GREEDY})
    for i, expected in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in got[:-1] if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == expected["text"]
        assert mine[-1]["finish_reason"] == expected["finish_reason"]


async def test_streamed_chat_through_the_official_openai_sdk(harness) -> None:
    client = openai.AsyncOpenAI(base_url="http://sampler/v1", api_key="x",
                                http_client=httpx.AsyncClient(transport=harness.client._transport))
    messages = [{"role": "user", "content": "hello"}]
    whole = await client.chat.completions.create(model="tiny-base", messages=messages, temperature=0, max_tokens=10,
                                                 extra_body={"ignore_eos": True})
    stream = await client.chat.completions.create(model="tiny-base", messages=messages, temperature=0, max_tokens=10,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    parts, usage, roles = [], None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            parts.append(c.delta.content or "")
    assert roles == ["assistant"] and "".join(parts) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 10


async def test_a_streamed_adapter_answer_names_its_content(harness, tiny) -> None:
    assert (await harness.load("lora-a", tiny["a"])).status_code == 200
    r, got = await events(harness.client, "/v1/completions", {"model": "lora-a", "prompt": PROMPT, **GREEDY})
    assert r.headers[ADAPTER_SHA256_HEADER] and got[-1] == "[DONE]"


async def test_refusals_come_before_the_stream_starts(harness) -> None:
    for body, status in (({"prompt": PROMPT, "prompt_logprobs": 0}, 400), ({"prompt": PROMPT, "model": "nope"}, 404),
                         ({"prompt": PROMPT, "max_tokens": 100_000}, 400)):
        r = await harness.client.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == status and r.headers["content-type"].startswith("application/json"), r.text
        assert r.json()["reason"]


async def test_a_client_that_leaves_cancels_its_generation(harness) -> None:
    async with harness.client.stream("POST", "/v1/completions",
                                     json={"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break  # the first chunk came: leave
    decoder = harness.sampler.decoder
    await eventually(lambda: decoder.active == 0 and decoder.queued == 0, timeout_s=30,
                     what="the abandoned row to leave the decoder")  # at its next step, long before 100 tokens
    assert decoder.stats.rows_stepped < 100


def test_text_stream_holds_back_what_a_stop_string_or_a_split_character_could_change() -> None:
    texts = {1: "ab", 2: "abc", 3: "abc\ufffd", 4: "abcé"}
    stream = TextStream(lambda ids: texts[len(ids)], ("xyz",))
    assert [stream.add([0]), stream.add([0]), stream.add([0]), stream.add([0])] == ["", "a", "", "b"]
    assert stream.close("abcé!") == "cé!"
    plain = TextStream(lambda ids: texts[len(ids)], ())
    assert [plain.add([0]), plain.add([0]), plain.add([0])] == ["ab", "c", ""] and plain.close("abc") == ""
