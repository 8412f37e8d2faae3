"""The policy's renderer: a conversation (chat-template messages, tool definitions) to prompt token ids.

One renderer per model family: ``template`` (the tokenizer's own chat template, the default) or a
family of :data:`services.common.prompt.RENDERERS` (``chatml``). Tools are rendered only by a template
that reads them (the ``tools`` variable, and ``tool_calls`` for calls in the history); anything else is
refused with the reason (:class:`RenderRefused`, a 400). The relay never re-tokenizes what the sampler
generated: :func:`build_prompt` splices an earlier call's exact ids in where the harness sent its reply
back unchanged, and renders (and tokenizes) only what the harness added after it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import FanrouteError
from services.common.prompt import RENDERERS

#: Stands for a reply's text while the rest of the conversation is rendered around it.
PLACEHOLDER = "FANROUTEREPLYPLACEHOLDER7e1f"


class RenderRefused(FanrouteError):
    """The conversation cannot be rendered by the policy's renderer (a 400 with this reason)."""


def template_reads(template: str) -> set[str]:
    """The variables a Jinja chat template reads from its context (``messages``, ``tools``, ...)."""
    import jinja2
    from jinja2 import meta

    try:
        return set(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return set()


class Renderer:
    """Renders conversations for one tokenizer with one model family's renderer."""

    def __init__(self, tokenizer: Any, kind: str = "template") -> None:
        self.tokenizer, self.kind = tokenizer, kind
        template = getattr(tokenizer, "chat_template", None)
        if kind == "template":
            if not isinstance(template, str) or not template:
                raise RenderRefused("the tokenizer has no chat template; choose a renderer of "
                                    f"{sorted(RENDERERS)} with FANROUTE_RENDERER")
            reads = template_reads(template)
            self.tools = "tools" in reads
            self.tool_calls = self.tools and "tool_calls" in template
            self.hermes = self.tools and "<tool_call>" in template
        elif kind in RENDERERS:
            self.tools = self.tool_calls = self.hermes = False
        else:
            raise RenderRefused(f"unknown renderer {kind!r}; known: 'template', {sorted(RENDERERS)}")
        self.eos_ids = frozenset(i for i in (tokenizer.eos_token_id,) if i is not None)
        self.name = kind

    # -------------------------------------------------------------------------- checks
    def check(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> None:
        """Refuse what this renderer cannot render faithfully (tools, tool calls, tool results)."""
        what = ("tool definitions" if tools else
                "tool calls in the history" if any(m.get("tool_calls") for m in messages) else
                "tool results in the history" if any(m["role"] == "tool" for m in messages) else None)
        if what is None:
            return
        can = self.tools if what == "tool definitions" else self.tool_calls
        if not can:
            where = ("its chat template does not render them" if self.kind == "template" else
                     f"the {self.kind!r} renderer does not render them")
            raise RenderRefused(f"the policy's renderer cannot render {what}: {where}, and the relay does not "
                                "guess a format the model was not trained on")

    # ------------------------------------------------------------------------- text, ids
    def text(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = (),
             *, add_generation_prompt: bool = True) -> str:
        msgs = [_template_message(m) for m in messages]
        if self.kind != "template":
            return RENDERERS[self.kind](msgs, add_generation_prompt=add_generation_prompt)
        try:
            return self.tokenizer.apply_chat_template(msgs, tools=list(tools) or None, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # a template may raise on roles or orders it does not support
            raise RenderRefused(f"the chat template refused the conversation: {type(exc).__name__}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (the template wrote any special tokens itself)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A normalised message as chat templates expect it (tool-call arguments as objects)."""
    out = {k: v for k, v in m.items() if k != "tool_calls"}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for c in m["tool_calls"]]
    return out


@dataclass(frozen=True)
class Prior:
    """What an earlier call of the trace left for splicing: its conversation, its reply, its ids."""

    index: int
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...]
    reply: dict[str, Any]
    prompt_ids: tuple[int, ...]
    sampled_ids: tuple[int, ...]


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def splice_source(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]],
                  priors: Sequence[Prior]) -> Prior | None:
    """The earlier call whose conversation + reply the new conversation starts with (the longest; the
    latest among equals), or None."""
    best: Prior | None = None
    for p in priors:
        n = len(p.messages)
        if (len(messages) > n and _same(list(tools), list(p.tools)) and _same(list(messages[:n]), list(p.messages))
                and _same(messages[n], p.reply) and (best is None or n >= len(best.messages))):
            best = p
    return best


def build_prompt(renderer: Renderer, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]],
                 priors: Sequence[Prior] = ()) -> tuple[list[int], int | None]:
    """(prompt ids, the call they were spliced from or None).

    Where the conversation starts with an earlier call's conversation and the reply the relay gave it,
    the prompt is that call's prompt ids + sampled ids, then the tokens of whatever the template writes
    after the reply (the end of the turn, the harness's new messages, the generation prompt). The
    template's own end-of-turn token is not repeated when the model already sampled it.
    """
    renderer.check(messages, tools)
    prefill = messages[-1]["role"] == "assistant"
    source = splice_source(messages, tools, priors)
    if source is None:
        return _render_fresh(renderer, messages, tools, prefill), None
    n = len(source.messages)
    msgs = [*messages[:n], {"role": "assistant", "content": PLACEHOLDER}, *messages[n + 1:]]
    after = _after_placeholder(renderer, msgs, tools, prefill)
    if source.sampled_ids and source.sampled_ids[-1] in renderer.eos_ids:
        eos_text = renderer.token_text(source.sampled_ids[-1])
        if after.startswith(eos_text):
            after = after[len(eos_text):]
    return [*source.prompt_ids, *source.sampled_ids, *renderer.encode(after)], source.index


def _render_fresh(renderer: Renderer, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]],
                  prefill: bool) -> list[int]:
    if not prefill:
        return renderer.encode(renderer.text(messages, tools))
    # a final assistant turn is a prefill: the reply continues its text
    msgs = [*messages[:-1], {**messages[-1], "content": PLACEHOLDER}]
    text = renderer.text(msgs, tools, add_generation_prompt=False)
    at = text.find(PLACEHOLDER)
    if at < 0:
        raise RenderRefused("the chat template dropped the final assistant turn (prefill)")
    return renderer.encode(text[:at] + str(messages[-1].get("content") or ""))


def _after_placeholder(renderer: Renderer, msgs: list[dict[str, Any]], tools: Sequence[dict[str, Any]],
                       prefill: bool) -> str:
    if prefill:  # the new final assistant turn is a prefill: cut the render where its text begins
        last = msgs[-1]
        msgs = [*msgs[:-1], {**last, "content": PLACEHOLDER + "B"}]
        text = renderer.text(msgs, tools, add_generation_prompt=False)
        cut = text.find(PLACEHOLDER + "B")
        text = text[:cut] + str(last.get("content") or "") if cut >= 0 else text
    else:
        text = renderer.text(msgs, tools)
    first = text.find(PLACEHOLDER)
    if first < 0 or text.find(PLACEHOLDER, first + 1) >= 0:
        raise RenderRefused("the chat template does not render an earlier reply as written")
    return text[first + len(PLACEHOLDER):]


TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, id_prefix: str) -> tuple[str, list[dict[str, Any]]]:
    """Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (what templates that
    write ``<tool_call>`` teach the model) → (the text before the first one, the calls). Text that does
    not parse as a call is left as text."""
    calls, first = [], None
    for i, found in enumerate(_TOOL_CALL.finditer(text)):
        try:
            data = json.loads(found.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            continue
        args = data.get("arguments", data.get("parameters", {}))
        calls.append({"id": f"{id_prefix}{i}", "name": data["name"],
                      "arguments": args if isinstance(args, dict) else {"value": args}})
        first = found.start() if first is None else first
    return (text if first is None else text[:first].rstrip()), calls
