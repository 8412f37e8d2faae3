"""``fanroute asyncapi`` and ``fanroute topology``: the topics as an AsyncAPI document and as a picture."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _arguments(p: argparse.ArgumentParser) -> None:
    from services.common.asyncapi import DEFAULT_OUT

    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"where to write the JSON document, '-' for stdout (default {DEFAULT_OUT})")
    p.add_argument("--yaml", type=Path, default=None, help="also write it as YAML here")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if --out differs from what would be written")


def add_parser(sub) -> None:
    a = sub.add_parser("asyncapi", help="write the AsyncAPI document of every topic (producers, consumers, "
                                        "message schemas) to docs/asyncapi.json")
    _arguments(a)
    t = sub.add_parser("topology", help="draw the services and topics (Mermaid, from the topic registry) into "
                                        "README.md and docs/architecture.md")
    t.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page holds an old picture")
    t.add_argument("--print", dest="show", action="store_true", help="print the Mermaid block instead")


def run(args: argparse.Namespace) -> int:
    if args.cmd == "topology":
        return _topology(args)
    return _asyncapi(args)


def _topology(args: argparse.Namespace) -> int:
    from services.common import topology

    if args.show:
        print(topology.block())
        return 0
    if args.check:
        stale = topology.stale_pages()
        for page in stale:
            print(f"{page} holds an old architecture picture: run `fanroute topology`", file=sys.stderr)
        return 1 if stale else 0
    changed = topology.write_pages()
    print("updated " + ", ".join(map(str, changed)) if changed else "every page is current")
    return 0


def _asyncapi(args: argparse.Namespace) -> int:
    from services.common.asyncapi import document, render_json, render_yaml

    doc = document()
    text = render_json(doc)
    if args.check:
        current = args.out.read_text() if args.out.is_file() else None
        if current != text:
            print(f"{args.out} is not current: run `fanroute asyncapi --out {args.out}`", file=sys.stderr)
            return 1
        print(f"{args.out} is current")
        return 0
    if str(args.out) == "-":
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"AsyncAPI {doc['asyncapi']}: {len(doc['channels'])} channels, {len(doc['operations'])} "
              f"operations -> {args.out}")
    if args.yaml is not None:
        args.yaml.parent.mkdir(parents=True, exist_ok=True)
        args.yaml.write_text(render_yaml(doc))
        print(f"-> {args.yaml}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m services.common.asyncapi``."""
    p = argparse.ArgumentParser(prog="python -m services.common.asyncapi", description=__doc__)
    _arguments(p)
    return _asyncapi(p.parse_args(argv))
