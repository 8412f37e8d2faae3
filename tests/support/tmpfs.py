"""A small tmpfs mounted for a block of a test: a disk that really fills up (``ENOSPC``), not a mock."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """``path`` as a fresh tmpfs of ``size_bytes`` (rounded up to pages by the kernel) for the block.

    Mounting needs root (CI runs as root); anywhere else the test is skipped with that reason, never
    passed. A root that still cannot mount (a container without ``CAP_SYS_ADMIN``) fails the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a {size_bytes}-byte tmpfs at {path}: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
