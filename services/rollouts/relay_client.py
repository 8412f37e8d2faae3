"""The relay's admin routes as the rollout runner uses them: mint and revoke a one-episode credential, end an
episode (its calls folded into datums with the rollout's advantage).

Why HTTP: services never import each other, and the relay owns its credential store and call state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

import httpx

from schemas.call import Call
from schemas.datum import Datum
from services.common.errors import FanrouteError, TransientError


class RelayRefused(FanrouteError):
    """The relay refused an admin call (bad admin token, bad request)."""


@dataclass(frozen=True)
class Ended:
    """What the relay returned for an episode's end."""

    calls: tuple[Call, ...] = ()
    datums: tuple[Datum, ...] = ()
    dispositions: dict[str, int] = field(default_factory=dict)
    segments: int = 0
    note: str = ""


class RelayAdmin:
    """``async with RelayAdmin(url, admin_token)``: the admin calls, 5xx and connection errors transient."""

    def __init__(self, url: str, admin_token: str, timeout_s: float = 60.0, *,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.client = httpx.AsyncClient(base_url=url, timeout=timeout_s, transport=transport,
                                        headers={"authorization": f"Bearer {admin_token}"})

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            r = await self.client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise TransientError(f"relay {path}: {type(exc).__name__}: {exc}") from exc
        if r.status_code >= 500:
            raise TransientError(f"relay {path} answered {r.status_code}: {r.text[:300]}")
        return r

    async def mint(self, trace_id: str, ttl_s: float) -> str:
        """A token that opens ``/tr/<trace_id>/`` and nothing else."""
        r = await self._post("/admin/v1/credentials", {"trace_id": trace_id, "ttl_s": ttl_s})
        if r.status_code != 201:
            raise RelayRefused(f"relay refused to mint a credential for {trace_id}: {r.status_code} {r.text[:300]}")
        return str(r.json()["token"])

    async def revoke(self, token: str) -> None:
        """Revoke ``token`` (an unknown one is already gone: fine)."""
        r = await self._post("/admin/v1/credentials/revoke", {"token": token})
        if r.status_code not in (200, 404):
            raise RelayRefused(f"relay refused to revoke a credential: {r.status_code} {r.text[:300]}")

    async def end(self, trace_id: str, advantage: float) -> Ended:
        """The episode's calls and datums with ``advantage`` on every sampled token; none when it made no call."""
        r = await self._post(f"/admin/v1/episodes/{trace_id}/end", {"advantage": advantage})
        if r.status_code == 404 and r.json().get("error") == "unknown_episode":
            return Ended(note="no relay calls recorded for this rollout")
        if r.status_code == 409:
            return Ended(note=f"the relay could not fold the calls: {r.json().get('reason')}")
        if r.status_code != 200:
            raise RelayRefused(f"relay refused to end episode {trace_id}: {r.status_code} {r.text[:300]}")
        data = r.json()
        return Ended(calls=tuple(Call.model_validate(c) for c in data.get("call_records", ())),
                     datums=tuple(Datum.model_validate(d) for d in data["datums"]),
                     dispositions=dict(data.get("dispositions", {})), segments=int(data.get("segments", 0)))
