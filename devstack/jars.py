"""The Kafka broker jars: resolved with Maven from ``scripts/kafka/pom.xml`` into
``<state-dir>/kafka-libs``, once per pom version."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from devstack.base import (
    DEFAULT_STATE_DIR,
    LOG_TAIL_LINES,
    MAVEN_TIMEOUT_S,
    POM,
    StackError,
    _locked,
    _say,
)


def _pom_digest(pom: Path) -> str:
    return hashlib.sha256(pom.read_bytes()).hexdigest()


def _libs_ready(libs_dir: Path, digest: str) -> bool:
    stamp = libs_dir / ".pom-sha256"
    try:
        ok = stamp.read_text().strip() == digest
    except OSError:
        return False
    return ok and any(libs_dir.glob("kafka_2.13-*.jar")) and any(libs_dir.glob("kafka-server-*.jar"))


def prepare(state_dir: Path | str = DEFAULT_STATE_DIR, *, libs_dir: Path | str | None = None,
            pom: Path = POM) -> Path:
    """Resolve the broker jars with Maven into ``libs_dir`` (default ``<state_dir>/kafka-libs``).

    Skipped when the jars there were resolved from a pom with the same hash.
    """
    libs = (Path(libs_dir) if libs_dir else Path(state_dir) / "kafka-libs").resolve()
    if not pom.is_file():
        raise StackError(f"{pom} is missing: the Kafka jars are resolved from it")
    digest = _pom_digest(pom)
    if _libs_ready(libs, digest):
        return libs
    libs.parent.mkdir(parents=True, exist_ok=True)
    with _locked(libs.parent / f".{libs.name}.lock"):
        if _libs_ready(libs, digest):  # someone else resolved them while we waited
            return libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise StackError("Maven (`mvn`) is not on PATH; it resolves the Kafka jars from Maven "
                             "Central. Run scripts/bootstrap.sh (or `apt-get install -y maven`).")
        tmp = libs.parent / f".{libs.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        _say(f"resolving Kafka jars from {pom} into {libs} (Maven; once per pom version)")
        started = time.monotonic()
        cmd = [mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
               f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=MAVEN_TIMEOUT_S,
                                 stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StackError(f"Maven did not finish within {MAVEN_TIMEOUT_S:.0f} s") from exc
        if res.returncode != 0 or not any(tmp.glob("kafka_2.13-*.jar")):
            shutil.rmtree(tmp, ignore_errors=True)
            out = "\n".join((res.stdout + res.stderr).splitlines()[-LOG_TAIL_LINES:])
            raise StackError(f"Maven could not resolve the Kafka jars (exit {res.returncode}):\n{out}")
        (tmp / ".pom-sha256").write_text(digest + "\n")
        old = libs.parent / f".{libs.name}.old-{os.getpid()}"
        if libs.exists():
            libs.rename(old)
        tmp.rename(libs)
        shutil.rmtree(old, ignore_errors=True)
        n = len(list(libs.glob("*.jar")))
        _say(f"resolved {n} jars in {time.monotonic() - started:.1f} s")
    return libs
