"""``fanroute doctor``: each missing tool is named with the command that installs it (tools hidden via PATH)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.common import paths
from services.tools import doctor

TOOLS = ("java", "redis-server", "bwrap", "docker", "mvn")


def _path_without(tmp_path: Path, hidden: str) -> str:
    """A PATH folder holding links to every tool of :data:`TOOLS` present here but ``hidden``."""
    bin_dir = tmp_path / f"bin-without-{hidden}"
    bin_dir.mkdir()
    for tool in TOOLS:
        real = shutil.which(tool)
        if tool != hidden and real:
            (bin_dir / tool).symlink_to(real)
    return str(bin_dir)


@pytest.mark.parametrize(("tool", "check", "package"), [
    ("java", doctor.check_java, "openjdk-17-jre-headless"),
    ("redis-server", lambda: doctor.check_tool("redis-server", "redis-server"), "redis-server"),
    ("bwrap", doctor.check_bwrap, "bubblewrap"),
])
def test_a_missing_tool_is_named_with_its_install_command(tool, check, package, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", _path_without(tmp_path, tool))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    result = check()
    assert not result.ok and "not on PATH" in result.found
    assert f"apt-get install -y {package}" in result.fix
    text = doctor.render([result])
    assert f"fix: apt-get install -y {package}" in text


def test_present_tools_pass(monkeypatch) -> None:
    """On this machine (bootstrapped by .ci/run) the same checks find every tool: the test above can fail."""
    for check in (doctor.check_java, lambda: doctor.check_tool("redis-server", "redis-server"), doctor.check_bwrap):
        result = check()
        assert result.ok, result


def test_the_command_fails_and_says_what_to_install(tmp_path: Path) -> None:
    """The real command line with redis-server and Java hidden: exit 1, each fix printed."""
    env = {**os.environ, "PATH": _path_without(tmp_path, "redis-server") + os.pathsep + str(Path(sys.executable).parent)}
    env.pop("JAVA_HOME", None)
    (tmp_path / "bin-without-redis-server" / "java").unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "services.cli", "doctor"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=paths.REPO_ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "apt-get install -y redis-server" in proc.stdout and "apt-get install -y openjdk-17-jre-headless" in proc.stdout
    assert "not ready: java, redis-server must be fixed first" in proc.stdout


def test_json_output_and_ready_exit_code(tmp_path: Path, monkeypatch) -> None:
    import json

    monkeypatch.setattr(doctor, "checks", lambda: [lambda: doctor.Check("a", True, "x"),
                                                   lambda: doctor.Check("b", False, "y", "do z", required=False)])
    assert doctor.main() == 0
    monkeypatch.setattr(doctor, "checks", lambda: [lambda: doctor.Check("a", False, "x", "fix a")])
    assert doctor.main(as_json=True) == 1


def test_a_crashing_check_is_a_failed_check(monkeypatch) -> None:
    def boom() -> doctor.Check:
        raise RuntimeError("no")

    monkeypatch.setattr(doctor, "checks", lambda: [boom])
    [result] = doctor.run_checks()
    assert not result.ok and "RuntimeError" in result.found


def test_memory_disk_and_writable(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:  1000000 kB\n")
    low = doctor.check_memory(meminfo)
    assert not low.ok and "1.0 GB available" in low.found and not low.required
    meminfo.write_text("MemAvailable:  9000000 kB\n")
    assert doctor.check_memory(meminfo).ok
    assert doctor.check_disk(tmp_path / "not" / "yet").ok  # judged on the nearest existing parent
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = doctor.check_writable("cache", blocker / "cache", paths.CACHE_DIR_ENV)
    assert not bad.ok and "$FANROUTE_CACHE_DIR" in bad.fix
    missing = tmp_path / "new" / "cache"
    assert doctor.check_writable("cache", missing, paths.CACHE_DIR_ENV).ok and not missing.exists()


def test_collections_override_that_lacks_data(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(paths.COLLECTIONS_DIR_ENV, str(tmp_path))
    result = doctor.check_collections()
    assert not result.ok and "$FANROUTE_COLLECTIONS_DIR" in result.found
    monkeypatch.delenv(paths.COLLECTIONS_DIR_ENV)
    assert doctor.check_collections().ok


def test_the_router_dtype_follows_the_cpu_flags(tmp_path):
    """bf16 is recommended for the router's scoring copy only with AMX; no CPU flags is not an error."""
    info = tmp_path / "cpuinfo"
    for flags, says in (("fpu avx512f avx512_bf16 amx_bf16 amx_tile", "FANROUTE_MERGED_DTYPE=auto"),
                        ("fpu avx512f avx512_bf16", "slower than float32"), ("fpu sse2", "no bf16")):
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        check = doctor.check_router_dtype(info)
        assert check.ok and not check.required and says in check.found
    assert "unknown" in doctor.check_router_dtype(tmp_path / "absent").found
