"""Every HTTP app of fanroute built for an API-contract run, without Kafka, Redis or a real model.

- :func:`gateway_app`: static providers on the in-memory bus;
- :func:`publisher_app`: a store in ``tmp``, the in-memory bus and stamp store, seeded once it serves
  (:func:`seed_publisher`: two blobs, version 1 of :data:`SEED_MODEL`, promoted) so generated requests
  that ``hooks.py`` points at the seed reach the operations behind an existing version;
- :func:`sampler_app`: the tiny random model of :mod:`tests.support.tiny_model`;
- :func:`relay_app`: the tiny model's tokenizer, the counting stand-in for the sampler of
  :mod:`tests.support.relay` (in process), credentials in memory with one token minted for
  :data:`RELAY_TRACE_ID`, the admin routes on; :func:`client_headers` is what a client sends it (the
  episode token as ``x-api-key``, the admin token as a Bearer token);
- :func:`console_app`: the console over a store holding six judged ADI traces, one run to chart, reviews
  published on the in-memory bus (the contract headers carry its token);
- :class:`ThreadServer`: uvicorn in a background thread, lifespan on (the app starts as in production).

``python -m tests.support.contract [gateway|publisher|sampler|relay ...]`` serves them and prints their
URLs (and the headers to send), to point the schemathesis CLI at them by hand.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.serving import loopback_socket


def gateway_app(tmp: Path) -> Any:
    from services.common.settings import KafkaSettings
    from services.gateway.app import build_gateway, create_app
    from services.gateway.settings import GatewaySettings
    from services.providers.config import BM25Config
    from tests.support.fakes import StaticProvider

    settings = GatewaySettings(kafka=KafkaSettings(bootstrap_servers="memory://"),
                               providers=[BM25Config(name="unused")], max_query_chars=200,
                               max_push_lines=20, spool_dir=tmp / "gateway-spool")
    providers = [StaticProvider("a", ("u1", "u2")), StaticProvider("b", ("u2", "u3"))]
    gw = build_gateway(settings, providers=providers)
    return create_app(settings, gateway=gw)


def publisher_app(tmp: Path) -> Any:
    from services.common.bus import Bus
    from services.common.settings import KafkaSettings, RedisSettings
    from services.common.stamps import MemoryStampStore
    from services.publisher.app import Publisher, create_app
    from services.publisher.settings import PublisherSettings

    settings = PublisherSettings(kafka=KafkaSettings(bootstrap_servers="memory://"),
                                 redis=RedisSettings(url="memory://"), storage_dir=tmp / "publisher",
                                 max_blob_bytes=65_536)
    publisher = Publisher(settings, Bus(settings.kafka), MemoryStampStore())
    app = create_app(settings, publisher=publisher)
    app.state.contract_seed = seed_publisher
    return app


#: What :func:`seed_publisher` stores: the model id, its one version, and the files (name → bytes).
SEED_MODEL = "contract-router"
SEED_VERSION = 1
SEED_FILES = {"adapter_config.json": b'{"peft_type": "LORA", "r": 4}', "adapter_model.safetensors": b"weights"}


def seed_sha256() -> dict[str, str]:
    """File name → sha256 of :data:`SEED_FILES`."""
    import hashlib

    return {name: hashlib.sha256(body).hexdigest() for name, body in SEED_FILES.items()}


def seed_publisher(url: str) -> None:
    """Through the publisher's own API: upload the seed's blobs, publish version 1, promote it."""
    import httpx

    with httpx.Client(base_url=url, timeout=30) as client:
        for name, sha in seed_sha256().items():
            client.put(f"/v1/blobs/{sha}", content=SEED_FILES[name],
                       headers={"content-type": "application/octet-stream"}).raise_for_status()
        r = client.post(f"/v1/adapters/{SEED_MODEL}/versions", json={"base_model": "tiny", "files": seed_sha256()})
        r.raise_for_status()
        assert r.json()["version"] == SEED_VERSION, r.text
        client.post(f"/v1/adapters/{SEED_MODEL}/promote", json={"version": SEED_VERSION}).raise_for_status()


def sampler_app(tmp: Path) -> Any:
    from services.common.settings import KafkaSettings
    from services.sampler.app import create_app
    from services.sampler.engine import Engine
    from services.sampler.serving import Sampler
    from services.sampler.settings import SamplerSettings
    from tests.support.tiny_model import build_tiny_model

    base = build_tiny_model(tmp / "tiny-base", context=128)
    # Short generations and small batches: the contract is the same, the run is seconds, not minutes.
    settings = SamplerSettings(base_model="unused", served_model_name="tiny-base", consume_adapters=False,
                               max_tokens_limit=8, default_max_tokens=4, max_prompts=2, max_logprobs=5,
                               adapter_cache_dir=tmp / "sampler-cache",
                               kafka=KafkaSettings(bootstrap_servers="memory://"))
    return create_app(settings, sampler=Sampler(settings, engine=Engine(base)))


#: The episode the relay's contract run holds a token for (``hooks.py`` points ``/tr/`` requests at it).
RELAY_TRACE_ID = "contract-episode"
RELAY_ADMIN_TOKEN = "contract-admin-token"


def relay_app(tmp: Path) -> Any:
    import asyncio

    import httpx

    from services.common.settings import KafkaSettings, RedisSettings
    from services.relay.app import create_app
    from services.relay.credentials import MemoryCredentialStore
    from services.relay.render import Renderer
    from services.relay.sampling import SamplerClient
    from services.relay.service import Relay
    from services.relay.settings import RelaySettings
    from tests.support.relay import counting_sampler
    from tests.support.tiny_model import build_tokenizer

    settings = RelaySettings(tokenizer="unused", admin_token=RELAY_ADMIN_TOKEN, max_tokens_limit=16,
                             default_max_tokens=4, max_stop_sequences=4, max_body_bytes=65_536,
                             kafka=KafkaSettings(bootstrap_servers="memory://"), redis=RedisSettings(url="memory://"))
    credentials = MemoryCredentialStore()
    token = asyncio.run(credentials.mint(RELAY_TRACE_ID, 86_400))
    fake = counting_sampler()
    sampler = SamplerClient("http://sampler", 30, transport=httpx.ASGITransport(app=fake))
    relay = Relay(settings, renderer=Renderer(build_tokenizer()), sampler=sampler, credentials=credentials)
    app = create_app(settings, relay=relay)
    app.state.contract_headers = {"x-api-key": token, "Authorization": f"Bearer {RELAY_ADMIN_TOKEN}"}
    return app


def console_app(tmp: Path) -> Any:
    from services.common.settings import KafkaSettings, RedisSettings
    from services.console.app import create_app
    from services.console.settings import ConsoleSettings
    from tests.support.console import console_records, write_run

    write_run(tmp / "runs")
    settings = ConsoleSettings(kafka=KafkaSettings(bootstrap_servers="memory://"), redis=RedisSettings(url="memory://"),
                               store_path=tmp / "console.sqlite3", runs_dir=tmp / "runs", console_token=CONSOLE_TOKEN)
    app = create_app(settings)
    traces, verdicts = console_records("test", "judge-a", "rubric-1")
    for message in (*traces, *verdicts):
        app.state.console.store.put(message)
    app.state.contract_headers = {"Authorization": f"Bearer {CONSOLE_TOKEN}"}
    return app


#: The console's token in its contract run (sent as a Bearer token, so generated reviews reach the handler).
CONSOLE_TOKEN = "contract-console-token"
#: A trace and a run the console's contract store holds (``hooks.py`` points positive cases at them).
CONSOLE_TRACE = "console-adi-1"
CONSOLE_RUN = "train/run"


def console_verdict_id() -> str:
    """The id of the verdict on :data:`CONSOLE_TRACE` in the console's contract store."""
    from tests.support.console import console_records

    return next(v.verdict_id for v in console_records("test", "judge-a", "rubric-1")[1] if v.trace_id == CONSOLE_TRACE)


def client_headers(app: Any) -> dict[str, str]:
    """The headers a contract run sends ``app`` (credentials), none for most apps."""
    return dict(getattr(app.state, "contract_headers", {}))


APPS: dict[str, Callable[[Path], Any]] = {"gateway": gateway_app, "publisher": publisher_app,
                                           "sampler": sampler_app, "relay": relay_app, "console": console_app}


def seed(app: Any, url: str) -> None:
    """Store what ``app``'s contract run needs to find (nothing, for most apps)."""
    seeder = getattr(app.state, "contract_seed", None)
    if seeder is not None:
        seeder(url)


class StatusRecorder:
    """ASGI wrapper counting each answered (endpoint function, status): which operations a run reached."""

    def __init__(self, app: Any) -> None:
        from collections import Counter

        self.app = app
        self.statuses: Counter[tuple[str, int]] = Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def record(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                endpoint = scope.get("endpoint")  # set by the router once a route matched
                self.statuses[(getattr(endpoint, "__name__", "?"), int(message["status"]))] += 1
            await send(message)

        await self.app(scope, receive, record)

    def reached(self, endpoint: str) -> bool:
        """Whether ``endpoint`` answered a 2xx at least once."""
        return any(name == endpoint and 200 <= status < 300 for name, status in self.statuses)


class ThreadServer:
    """``app`` served by uvicorn on 127.0.0.1:<free port> in a daemon thread, lifespan on; :attr:`recorder`
    counts the statuses each endpoint answered."""

    def __init__(self, app: Any, name: str) -> None:
        import uvicorn

        self._sock = loopback_socket()
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.recorder = StatusRecorder(app)
        self._server = uvicorn.Server(uvicorn.Config(self.recorder, log_level="warning", access_log=False,
                                                     lifespan="on", timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"contract-{name}", daemon=True)

    def __enter__(self) -> ThreadServer:
        self._thread.start()
        deadline = time.monotonic() + 120
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self._thread.name} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


if __name__ == "__main__":
    import sys
    from contextlib import ExitStack

    names = sys.argv[1:] or list(APPS)
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        for name in names:
            app = APPS[name](Path(d))
            server = stack.enter_context(ThreadServer(app, name))
            seed(app, server.url)
            headers = " ".join(f"-H '{k}: {v}'" for k, v in client_headers(app).items())
            print(f"{name} {server.url}/openapi.json {headers}".rstrip(), flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
