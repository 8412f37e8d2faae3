"""An auto-answering OpenAI-compatible judge on loopback (slow on purpose), for worker tests."""

from __future__ import annotations

import asyncio
import json
import re

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.support.serving import LoopbackServer


class AutoJudgeServer(LoopbackServer):
    """Answers /v1/chat/completions with grade 3 for 'excellent' answers, 1 otherwise, after a delay."""

    def __init__(self, delay_s: float = 0.05) -> None:
        self.delay_s = delay_s
        self.calls = 0
        self.prompts: list[str] = []
        super().__init__(Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])]),
                         "auto-judge")

    @property
    def base_url(self) -> str:
        return self.url("v1")
    async def _chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        self.calls += 1
        self.prompts.append(prompt)
        await asyncio.sleep(self.delay_s)
        letters = re.search(r"Letters: ([A-Z, ]+)\.", prompt).group(1).split(", ")
        blocks = re.split(r"=== Candidate ([A-Z]) ===", prompt)[1:]
        text = dict(zip(blocks[::2], blocks[1::2]))
        grades = {L: 3 if "excellent" in text[L] else 1 for L in letters}
        ranking = [[L for L in letters if grades[L] == g] for g in (3, 1)]
        content = json.dumps({"grades": grades, "ranking": [t for t in ranking if t]})
        return JSONResponse({"id": "x", "object": "chat.completion", "model": body["model"],
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": content}}]})
