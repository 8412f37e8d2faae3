"""An episode as a Harbor ATIF trajectory (Agent Trajectory Interchange Format, ATIF-v1.7).

Field names follow Harbor's RFC 0001 (``rfcs/0001-trajectory-format.md``): a root with
``schema_version``, ``session_id``, ``agent`` {name, version, model_name}, ordered ``steps``
(``step_id`` from 1, ``source`` system/user/agent, ``message``) and ``final_metrics``.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

from schemas.base import canonical_json
from schemas.episode import ChatMessage, Episode

ATIF_VERSION = "ATIF-v1.7"
DEFAULT_AGENT_NAME = "fanroute-router"
_SOURCES = {"system": "system", "user": "user", "assistant": "agent"}
_NOTES = ("Assistant turns are the judge's ordering distilled from a verdict (the training label), "
          "not a live sample of the router; final_metrics.extra.rewards holds the episode's rewards.")


def _package_version() -> str:
    """fanroute's installed version, the agent version a trajectory records."""
    try:
        return metadata.version("fanroute")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _step(step_id: int, message: ChatMessage) -> dict[str, Any]:
    """One ATIF step from one chat turn (assistant -> source ``agent``)."""
    return {"step_id": step_id, "source": _SOURCES[message.role], "message": message.content}


def _agent(name: str, version: str, model_name: str | None) -> dict[str, Any]:
    """The ATIF ``agent`` object; ``model_name`` is optional in the spec and omitted when unknown."""
    agent: dict[str, Any] = {"name": name, "version": version}
    if model_name is not None:
        agent["model_name"] = model_name
    return agent


def _root_extra(episode: Episode) -> dict[str, Any]:
    """Provenance the ATIF core fields have no place for."""
    extra: dict[str, Any] = {"episode_id": episode.episode_id,
                             "created_at": episode.created_at.isoformat()}
    if episode.trace_id is not None:
        extra["trace_id"] = episode.trace_id
    if episode.token_ids is not None:
        extra["token_ids"] = list(episode.token_ids)
    return extra


def episode_to_atif(episode: Episode, *, agent_name: str = DEFAULT_AGENT_NAME,
                    model_name: str | None = None, agent_version: str | None = None) -> dict[str, Any]:
    """The ATIF-v1.7 trajectory of ``episode``: one step per turn, rewards in ``final_metrics.extra``."""
    steps = [_step(i, m) for i, m in enumerate(episode.messages, start=1)]
    return {
        "schema_version": ATIF_VERSION,
        "session_id": episode.episode_id,
        "agent": _agent(agent_name, agent_version or _package_version(), model_name),
        "steps": steps,
        "notes": _NOTES,
        "final_metrics": {
            "total_steps": len(steps),
            "extra": {"rewards": {r.name: r.value for r in episode.rewards},
                      "reward_sources": {r.name: r.source for r in episode.rewards}},
        },
        "extra": _root_extra(episode),
    }


def write_atif(episode: Episode, directory: Path | str, *, agent_name: str = DEFAULT_AGENT_NAME,
               model_name: str | None = None, agent_version: str | None = None) -> Path:
    """Write ``<episode_id>.json`` (canonical JSON, sorted keys) under ``directory``; return its path."""
    if Path(episode.episode_id).name != episode.episode_id or episode.episode_id.startswith("."):
        raise ValueError(f"episode id {episode.episode_id!r} is not a plain file name")
    path = Path(directory) / f"{episode.episode_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    trajectory = episode_to_atif(episode, agent_name=agent_name, model_name=model_name,
                                 agent_version=agent_version)
    path.write_bytes(canonical_json(trajectory))
    return path
