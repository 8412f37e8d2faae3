"""Each service's resident memory when it runs as its own process, beside the bare interpreter's.

Every service is started the way a deployment starts it (``python -m services.<name>``, settings from
``FANROUTE_*``) against one local Kafka + Redis (``FANROUTE_KAFKA__BOOTSTRAP_SERVERS`` and
``FANROUTE_REDIS__URL`` when set, else a devstack of its own), one after the other. A service is
*ready* when its HTTP endpoint answers (gateway, publisher, sampler) or, for a topic worker (judge,
episode builder), when its RSS has moved less than 1 % for 5 s; then it gets a little work (the gateway
``--requests`` fan-out searches, the sampler one 16-token completion) and its RSS is sampled for
``--window`` seconds. Reported: steady RSS (the window's median), the process's peak (``VmHWM``), and
the ratio to the baseline — a ``python -c`` that imports what every service imports (pydantic, FastAPI,
uvicorn, aiokafka, redis, the project's bus) and waits.

    python bench/service_rss.py --json-out bench/results/service_rss.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx

from bench.sampler_support import stop  # noqa: E402
from services.common import rss
from services.tools.serving import free_port

BASELINE = ("import time, pydantic, fastapi, uvicorn, aiokafka, redis, services.common.bus; "
            "print('ready', flush=True); time.sleep(3600)")
SERVICES = ("baseline", "gateway", "judge", "episodes", "publisher", "sampler")


def _http_ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


def _settled(pid: int, since: float, min_age_s: float = 10.0, flat_s: float = 5.0) -> bool:
    """RSS moved less than 1 % over the last ``flat_s`` (and the process is ``min_age_s`` old)."""
    if time.monotonic() - since < min_age_s:
        return False
    a = rss.rss_mb(pid)
    time.sleep(flat_s)
    b = rss.rss_mb(pid)
    return b > 0 and abs(b - a) / b < 0.01


def _work(name: str, url: str, requests: int) -> str:
    """A little of the service's own work, once ready; returns what it was."""
    if name == "gateway":
        from services.providers.collections import sample_queries

        for q in sample_queries(limit=requests, seed=0):
            httpx.post(f"{url}/v1/search", json={"query": q.text}, timeout=60).raise_for_status()
        return f"{requests} fan-out searches"
    if name == "sampler":
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Which provider", "max_tokens": 16},
                   timeout=300).raise_for_status()
        return "one 16-token completion"
    return "idle" if name in ("publisher", "baseline") else "idle, consuming"


def measure(name: str, env: dict[str, str], work_dir: Path, window_s: float, requests: int,
            timeout_s: float = 600) -> dict:
    """Start one service, wait until ready, give it its work, sample its RSS; stop it."""
    port = free_port()
    env = {**env, "FANROUTE_PORT": str(port), "FANROUTE_STORAGE_DIR": str(work_dir / "publisher"),
           "FANROUTE_PUBLIC_URL": f"http://127.0.0.1:{port}", "FANROUTE_GROUP_ID": f"rss-{name}-{port}"}
    cmd = [sys.executable, "-c", BASELINE] if name == "baseline" else [sys.executable, "-m", f"services.{name}"]
    health = {"gateway": "/healthz", "publisher": "/healthz", "sampler": "/v1/models"}.get(name)
    log = (work_dir / f"{name}.log").open("wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode} before it was ready (log: {log.name})")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{name} not ready within {timeout_s:.0f} s (log: {log.name})")
            if (_http_ready(url + health) if health else _settled(proc.pid, t0)):
                break
            time.sleep(0.5)
        ready_s = time.monotonic() - t0
        ready_mb = rss.rss_mb(proc.pid)
        did = _work(name, url, requests)
        samples = []
        end = time.monotonic() + window_s
        while time.monotonic() < end:
            samples.append(rss.rss_mb(proc.pid))
            time.sleep(0.5)
        result = {"ready_s": round(ready_s, 1), "ready_mb": round(ready_mb, 1),
                  "steady_mb": round(statistics.median(samples), 1), "peak_mb": round(rss.hwm_mb(proc.pid) or 0, 1),
                  "work": did}
    finally:
        stop(proc)
        log.close()
    print(f"  {name:<10} ready in {result['ready_s']:>6.1f} s, steady {result['steady_mb']:>7.0f} MiB, "
          f"peak {result['peak_mb']:>7.0f} MiB ({did})", flush=True)
    return result


def run(services: list[str], window_s: float, requests: int, bootstrap: str, redis_url: str) -> dict:
    ns = f"rss{uuid.uuid4().hex[:6]}."
    env = {**os.environ, "FANROUTE_KAFKA__BOOTSTRAP_SERVERS": bootstrap, "FANROUTE_KAFKA__TOPIC_NAMESPACE": ns,
           "FANROUTE_REDIS__URL": redis_url, "FANROUTE_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="service-rss-") as tmp:
        results = {name: measure(name, env, Path(tmp), window_s, requests) for name in services}
    base = results.get("baseline", {}).get("steady_mb")
    for r in results.values():
        r["vs_baseline"] = round(r["steady_mb"] / base, 2) if base else None
    return {"services": results, "window_s": window_s, "requests": requests,
            "note": "RSS counts shared library pages in every process; steady = median over the window"}


def render(report: dict) -> str:
    lines = [f"{'service':<12}{'ready s':>9}{'steady MiB':>12}{'peak MiB':>10}{'× baseline':>12}  work"]
    for name, r in report["services"].items():
        ratio = f"{r['vs_baseline']:.2f}" if r["vs_baseline"] else "-"
        lines.append(f"{name:<12}{r['ready_s']:>9.1f}{r['steady_mb']:>12.0f}{r['peak_mb']:>10.0f}{ratio:>12}  "
                     f"{r['work']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--services", default=",".join(SERVICES), help="comma-separated, from " + ", ".join(SERVICES))
    p.add_argument("--window", type=float, default=10.0, help="seconds of sampling once ready")
    p.add_argument("--requests", type=int, default=20, help="fan-out searches the gateway answers first")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    wanted = [s.strip() for s in args.services.split(",") if s.strip()]
    if bad := [s for s in wanted if s not in SERVICES]:
        p.error(f"--services: unknown {bad}; choose from {', '.join(SERVICES)}")
    bootstrap, redis_url = os.environ.get("FANROUTE_KAFKA__BOOTSTRAP_SERVERS"), os.environ.get("FANROUTE_REDIS__URL")
    stack_dir = None
    if not (bootstrap and redis_url):
        import devstack

        stack_dir = ROOT / ".stack" / "service-rss"
        info = devstack.up(stack_dir, 0, 0, libs_dir=ROOT / ".stack" / "kafka-libs")
        bootstrap, redis_url = info.bootstrap_servers, info.redis_url
    try:
        report = run(wanted, args.window, args.requests, bootstrap, redis_url)
    finally:
        if stack_dir is not None:
            import devstack

            devstack.down(stack_dir)
    print(render(report))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
