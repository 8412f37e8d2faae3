"""A bus consumer in its own process, for kill -9 tests: logs each handled trace id to a file."""

from __future__ import annotations

import asyncio
import os
import sys

from schemas import Trace, topic
from services.common.bus import Bus
from services.common.settings import KafkaSettings


async def main(bootstrap: str, namespace: str, out_path: str, group: str) -> None:
    bus = Bus(KafkaSettings(bootstrap_servers=bootstrap, topic_namespace=namespace))
    out = open(out_path, "a", buffering=1)

    async def handle(t: Trace) -> None:
        out.write(t.trace_id + "\n")
        out.flush()
        os.fsync(out.fileno())
        await asyncio.sleep(0.02)  # a slow consumer, so that the kill lands mid-stream

    bus.subscribe(topic("traces"), handle, group_id=group)
    await bus.start((topic("traces"),))
    print("consumer ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
