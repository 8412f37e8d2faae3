"""The relay's renderer: fresh renders are the chat template's, splices keep the sampled ids (the real
SmolLM2 template's naive re-render changes them), the template's end-of-turn token is not repeated,
tools render only through a template that reads them, and Hermes-style tool calls come back as calls."""

from __future__ import annotations

import httpx
import openai
import pytest

from services.relay.render import Prior, Renderer, RenderRefused, build_prompt, parse_tool_calls, template_reads
from tests.support.relay import counting_sampler, relay_served, relay_settings
from tests.support.tiny_model import build_tokenizer

HERMES = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{% for t in tools %}{{ t | tojson }}\\n{% endfor %}"
    "{{ 'Answer a call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ '<tool_call>' + (c.function | tojson) + '</tool_call>' }}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "search", "description": "search the web",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct's own tokenizer and chat template (prepared by `fanroute models prepare`)."""
    from transformers import AutoTokenizer

    from services.models import prepare

    if not prepare.is_prepared(prepare.default_base_dir()):
        prepare.prepare_base()
    return AutoTokenizer.from_pretrained(prepare.default_base_dir())


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory):
    tok = build_tokenizer()
    tok.chat_template = HERMES
    path = tmp_path_factory.mktemp("hermes-tok")
    tok.save_pretrained(path)
    return path


def test_a_fresh_render_is_the_chat_templates(smol):
    r = Renderer(smol)
    msgs = [{"role": "system", "content": "Route."}, {"role": "user", "content": "cells"}]
    ids, spliced = build_prompt(r, msgs, [])
    assert spliced is None
    assert ids == smol.encode(smol.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    assert not r.tools and "tools" not in template_reads(smol.chat_template)


def test_a_splice_keeps_sampled_ids_the_naive_re_render_would_change(smol):
    """The model sampled 'Ġcap' + 'ital' (two tokens), then the end of its turn; re-rendering the
    conversation from text merges them into 'Ġcapital'. The splice keeps what was sampled."""
    r = Renderer(smol)
    msgs = [{"role": "user", "content": "What is Paris?"}]
    prompt, _ = build_prompt(r, msgs, [])
    sampled = [*smol.encode(" The cap", add_special_tokens=False), *smol.encode("ital", add_special_tokens=False),
               smol.eos_token_id]
    reply = r.decode(sampled)
    assert reply == " The capital" and smol.encode(reply, add_special_tokens=False) != sampled[:-1]
    prior = Prior(0, tuple(msgs), (), {"role": "assistant", "content": reply}, tuple(prompt), tuple(sampled))
    turn2 = [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": "And Rome?"}]
    ids, spliced = build_prompt(r, turn2, [], [prior])
    naive = smol.encode(smol.apply_chat_template(turn2, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    assert spliced == 0 and ids[:len(prompt) + len(sampled)] == [*prompt, *sampled]
    assert ids != naive and len(ids) == len(naive) + 1  # one token differs in count: the split word
    assert ids.count(smol.eos_token_id) == naive.count(smol.eos_token_id)  # <|im_end|> not repeated
    assert r.decode(ids, skip_special_tokens=False) == r.decode(naive, skip_special_tokens=False)


def test_a_changed_reply_system_or_tools_is_rendered_afresh(smol):
    r = Renderer(smol)
    msgs = [{"role": "user", "content": "q"}]
    prompt, _ = build_prompt(r, msgs, [])
    prior = Prior(0, tuple(msgs), (), {"role": "assistant", "content": "a"}, tuple(prompt), (64, 2))
    for turn in ([*msgs, {"role": "assistant", "content": "b"}, {"role": "user", "content": "x"}],
                 [{"role": "system", "content": "s"}, *msgs, {"role": "assistant", "content": "a"}]):
        assert build_prompt(r, turn, [], [prior])[1] is None


def test_a_final_assistant_turn_is_a_prefill(smol):
    r = Renderer(smol)
    ids, _ = build_prompt(r, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer:"}], [])
    text = r.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nThe answer:") and not text.endswith("<|im_end|>\n")


def test_tools_render_only_through_a_template_that_reads_them(smol, hermes_dir):
    from transformers import AutoTokenizer

    with pytest.raises(RenderRefused, match="tool definitions"):
        build_prompt(Renderer(smol), [{"role": "user", "content": "q"}], TOOLS)
    with pytest.raises(RenderRefused, match="tool calls"):
        build_prompt(Renderer(smol), [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "name": "search", "arguments": {}}]}], [])
    with pytest.raises(RenderRefused, match="renderer"):
        build_prompt(Renderer(smol, "chatml"), [{"role": "user", "content": "q"}], TOOLS)
    r = Renderer(AutoTokenizer.from_pretrained(hermes_dir))
    assert r.tools and r.tool_calls and r.hermes
    ids, _ = build_prompt(r, [{"role": "user", "content": "q"}], TOOLS)
    assert '"name": "search"' in r.decode(ids, skip_special_tokens=False)


def test_parse_tool_calls():
    text, calls = parse_tool_calls('Let me look. <tool_call>{"name": "search", "arguments": {"q": "cells"}}</tool_call>'
                                   "<tool_call>not json</tool_call>", "call_x_")
    assert text == "Let me look." and calls == [{"id": "call_x_0", "name": "search", "arguments": {"q": "cells"}}]
    assert parse_tool_calls("plain", "c") == ("plain", [])


async def test_tool_calls_round_trip_through_the_openai_sdk(hermes_dir):
    """The sampler writes a Hermes tool call; the SDK gets tool_calls; the harness answers with the tool's
    result and the next call extends the first (its tool call rendered from the sampled ids)."""
    fake = counting_sampler(reply_ids=(5, 6, 7), text='<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>')
    async with relay_served(relay_settings(hermes_dir, auth=False), fake) as (url, relay):
        client = openai.AsyncOpenAI(base_url=f"{url}/tr/ep-t/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "find cells"}]
        r = await client.chat.completions.create(model="p", messages=msgs, tools=TOOLS, max_tokens=8)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "search" and call.function.arguments == '{"q": "x"}'
        msgs += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "cells are small"}]
        await client.chat.completions.create(model="p", messages=msgs, tools=TOOLS, max_tokens=8)
        calls = await relay.state.calls("ep-t")
        async with httpx.AsyncClient(base_url=url) as c:
            assert (await c.get("/healthz")).json()["renderer"] == "template"
    assert [c.disposition for c in calls] == ["new_segment:first", "extend"] and calls[1].spliced_from == 0
    assert list(calls[1].prompt_ids[:len(calls[0].prompt_ids) + 3]) == [*calls[0].prompt_ids, 5, 6, 7]
    assert len(fake.state.hits) == 2
