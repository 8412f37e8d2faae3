"""Every HTTP app of fanroute built for an API-contract run, without Kafka, Redis or a real model.

- :func:`gateway_app`: static providers on the in-memory bus;
- :func:`publisher_app`: a store in ``tmp``, the in-memory bus and stamp store;
- :func:`sampler_app`: the tiny random model of :mod:`tests.support.tiny_model`;
- :class:`ThreadServer`: uvicorn in a background thread, lifespan on (the app starts as in production).

``python -m tests.support.contract [gateway|publisher|sampler ...]`` serves them and prints their
URLs, to point the schemathesis CLI at them by hand.
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
    return create_app(settings, publisher=publisher)


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


APPS: dict[str, Callable[[Path], Any]] = {"gateway": gateway_app, "publisher": publisher_app,
                                           "sampler": sampler_app}


class ThreadServer:
    """``app`` served by uvicorn on 127.0.0.1:<free port> in a daemon thread, lifespan on."""

    def __init__(self, app: Any, name: str) -> None:
        import uvicorn

        self._sock = loopback_socket()
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
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
            server = stack.enter_context(ThreadServer(APPS[name](Path(d)), name))
            print(f"{name} {server.url}/openapi.json", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
