"""``<state-dir>/stack.json``: the endpoints, ports and pids of what runs from a state dir."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from devstack.base import StackInfo


def _state_path(state_dir: Path) -> Path:
    return state_dir / "stack.json"


def _read_state(state_dir: Path) -> dict[str, Any]:
    try:
        return json.loads(_state_path(state_dir).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(state_dir: Path, state: dict[str, Any]) -> None:
    path = _state_path(state_dir)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _info_from_state(state: dict[str, Any]) -> StackInfo:
    return StackInfo(bootstrap_servers=(state.get("kafka") or {}).get("bootstrap_servers"),
                     redis_url=(state.get("redis") or {}).get("url"))
