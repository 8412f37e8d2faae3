"""What the sampler benchmarks share: the sampler as a served process (or inline), a fresh LoRA adapter,
the held-out queries of a demo's evaluation, and percentiles.

Used by bench/router_decision.py, bench/promotion_stall.py, bench/relay_overhead.py,
bench/relay_streaming.py, bench/sampler_engines.py and bench/linear_decision.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def pct(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {"n": len(a), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "max": float(a.max())}


def fresh_adapter(base: str, out: Path, seed: int = 0) -> Path:
    """A freshly initialised LoRA adapter on ``base`` (peft's init: B = 0), saved to ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model

    from services.models.load import load_causal_lm

    torch.manual_seed(seed)
    model = get_peft_model(load_causal_lm(base, torch.float32), LoraConfig(task_type="CAUSAL_LM", **LORA))
    model.save_pretrained(str(out))
    return out


def load_queries(path: Path) -> list[str]:
    """The queries of a traces or episodes JSONL (``query``, or the episode's user turn), in file order, or
    of a ``fanroute eval`` report (``eval.json``: exactly the held-out queries it measured)."""
    if path.suffix == ".json":
        return [q["query"] for q in json.loads(path.read_text())["queries"]]
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out.append(rec["query"] if "query" in rec else
                       next(m["content"] for m in rec["messages"] if m["role"] == "user"))
    return out


def start(module: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """``python -m module`` from the repository root with ``env`` over this environment, output to ``log``."""
    return subprocess.Popen([sys.executable, "-m", module], env={**os.environ, **env}, cwd=ROOT,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Terminate ``proc``; kill it if it has not exited within ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def wait_ready(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen, what: str, log: Path) -> None:
    """Until ``url`` answers 200; the log's tail in the error when ``proc`` exits first."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            async with http.get(url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{what} did not start in 300 s")


@contextlib.asynccontextmanager
async def sampler_server(settings: Any, where: str) -> AsyncIterator[tuple[str, Any, Any]]:
    """The sampler for ``settings``: (base URL, ``metric(name, **labels)``, its tokenizer).

    ``process`` (the default) runs ``python -m services.sampler`` in its own process, as deployed: the
    gateway reaches it over HTTP from another process. ``inline`` serves it in this process (uvicorn on
    loopback), sharing the interpreter with the load generator — how this bench ran before 2026-12-06,
    ≈ 30 ms slower a decision on 2 cores."""
    from transformers import AutoTokenizer

    from services.sampler.app import create_app
    from services.sampler.serving import Sampler
    from services.tools.serving import free_port, served

    if where == "inline":
        sampler = Sampler(settings)
        async with served(create_app(settings, sampler=sampler), free_port(), what="sampler") as base:
            async def metric(name: str, **labels: str) -> float | None:
                return sampler.metrics.registry.get_sample_value(name, labels)

            yield base, metric, sampler.eng.tokenizer
        return
    port = free_port()
    env = {**{f"FANROUTE_{k.upper()}": str(v) for k, v in settings.model_dump(
        include={"base_model", "served_model_name", "dtype", "score_batch_wait_ms", "score_batch_max_wait_ms",
                 "merged_copies", "merged_build_attempts", "merged_dtype",
                 "fused_layers", "adapter_cache_dir"}).items()},
           "FANROUTE_CONSUME_ADAPTERS": "false", "FANROUTE_KAFKA__BOOTSTRAP_SERVERS": "memory://",
           "FANROUTE_HOST": "127.0.0.1", "FANROUTE_PORT": str(port), "FANROUTE_LOG_LEVEL": "WARNING",
           **({"FANROUTE_THREADS": str(settings.threads)} if settings.threads else {})}
    log = Path(tempfile.mkdtemp(prefix="bench-rd-sampler-")) / "sampler.log"
    proc = start("services.sampler", env, log)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, base + "/v1/models", proc, "sampler", log)

            async def metric(name: str, **labels: str) -> float | None:
                from prometheus_client.parser import text_string_to_metric_families

                async with http.get(base + "/metrics") as r:
                    text = await r.text()
                return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                             if s.name == name and s.labels == labels), None)

            yield base, metric, AutoTokenizer.from_pretrained(settings.base_model)
    finally:
        stop(proc)

