"""``fanroute credentials mint TRACE_ID`` / ``fanroute credentials revoke TOKEN``: one-episode credentials, written to
Redis directly (``FANROUTE_REDIS__URL``, ``FANROUTE_KAFKA__TOPIC_NAMESPACE``), for whoever launches a
rollout. The relay's admin routes do the same over HTTP when ``FANROUTE_ADMIN_TOKEN`` is set."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``fanroute credentials mint|revoke``."""
    p = sub.add_parser("credentials", help="relay credentials: mint or revoke a one-episode token")
    actions = p.add_subparsers(dest="action", required=True)
    m = actions.add_parser("mint", help="mint a token that opens /tr/<trace_id>/ and nothing else")
    m.add_argument("trace_id")
    m.add_argument("--ttl", type=float, default=None, help="seconds (default FANROUTE_CREDENTIAL_TTL_S)")
    m.add_argument("--base-url", default=None,
                   help="the relay's public URL: also print the env a harness needs (OpenAI and Anthropic)")
    r = actions.add_parser("revoke", help="revoke a token")
    r.add_argument("token")


def harness_env(base_url: str, trace_id: str, token: str, model: str = "policy") -> dict[str, str]:
    """The variables a harness finds in its sandbox: both SDKs' base URL and key, pointed at the relay."""
    root = f"{base_url.rstrip('/')}/tr/{trace_id}"
    return {"FANROUTE_BASE_URL": root, "FANROUTE_TRACE_TOKEN": token, "FANROUTE_MODEL": model,
            "OPENAI_BASE_URL": f"{root}/v1", "OPENAI_API_KEY": token,
            "ANTHROPIC_BASE_URL": root, "ANTHROPIC_API_KEY": token}


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from services.relay.credentials import credential_store
    from services.relay.settings import RelaySettings

    try:
        settings = RelaySettings()
    except ValidationError as exc:
        print(f"fanroute credentials: invalid settings: {exc}", file=sys.stderr)
        return 2
    from schemas.call import TRACE_ID_PATTERN

    async def go() -> int:
        store = credential_store(settings.redis.url, settings.kafka.topic_namespace)
        try:
            if args.action == "mint":
                import re

                if not re.match(TRACE_ID_PATTERN, args.trace_id):
                    print(f"fanroute credentials mint: trace id must match {TRACE_ID_PATTERN}", file=sys.stderr)
                    return 2
                ttl = args.ttl if args.ttl is not None else settings.credential_ttl_s
                token = await store.mint(args.trace_id, ttl, settings.credential_tombstone_s)
                if args.base_url:
                    print(json.dumps(harness_env(args.base_url, args.trace_id, token), indent=1))
                else:
                    print(token)
                return 0
            if not await store.revoke(args.token, settings.credential_tombstone_s):
                print("fanroute credentials revoke: no such credential", file=sys.stderr)
                return 1
            print("revoked")
            return 0
        finally:
            await store.close()

    return asyncio.run(go())
