"""``fanroute adapters export ...`` / ``python -m services.publisher export ...``: a version as a PEFT
directory, or merged into its base model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.publisher.export import export_merged, export_peft
from services.publisher.store import BlobStore, ManifestStore


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``fanroute adapters export ...``."""
    ad = sub.add_parser("adapters", help="published adapters: export as a PEFT dir or a merged model")
    add_export(ad.add_subparsers(dest="action", required=True))


def add_export(sub: argparse._SubParsersAction) -> None:
    """``export peft ...`` / ``export merged ...`` (``python -m services.publisher export``)."""
    e = sub.add_parser("export", help="export an adapter version (PEFT directory or merged checkpoint)")
    kinds = e.add_subparsers(dest="kind", required=True)
    p = kinds.add_parser("peft", help="the version's PEFT directory, as published")
    p.add_argument("model_id")
    p.add_argument("version", type=int)
    p.add_argument("out", type=Path, help="new directory to write")
    p.add_argument("--url", default=None,
                   help="a running publisher's base URL (default: read FANROUTE_STORAGE_DIR directly)")
    m = kinds.add_parser("merged", help="merge a PEFT directory into its base model (full checkpoint)")
    m.add_argument("base_model", type=Path, help="base model directory or .gguf file")
    m.add_argument("adapter_dir", type=Path, help="PEFT adapter directory (e.g. from `export peft`)")
    m.add_argument("out", type=Path, help="new directory to write")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``export`` command; a refused export is a message and exit 2."""
    from services.common.errors import FanrouteError

    try:
        if args.kind == "merged":
            out = export_merged(args.base_model, args.adapter_dir, args.out, dtype=args.dtype)
        elif args.url:
            from services.common.publisher_client import PublisherClient

            with PublisherClient(args.url) as client:
                out = client.fetch_version(args.model_id, args.version, args.out)
        else:
            from services.publisher.settings import PublisherSettings

            root = PublisherSettings().storage_dir
            out = export_peft(ManifestStore(root).get(args.model_id, args.version), BlobStore(root), args.out)
    except (FanrouteError, OSError) as exc:
        print(f"fanroute export: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
