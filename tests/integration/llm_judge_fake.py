"""An auto-answering OpenAI-compatible judge on loopback (slow on purpose), for worker tests."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


class AutoJudgeServer:
    """Answers /v1/chat/completions with grade 3 for 'excellent' answers, 1 otherwise, after a delay."""

    def __init__(self, delay_s: float = 0.05) -> None:
        self.delay_s = delay_s
        self.calls = 0
        self.prompts: list[str] = []
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> AutoJudgeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

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
