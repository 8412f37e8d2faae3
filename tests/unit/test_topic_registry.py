"""The topic registry's producers and consumers match the code, both ways, so the list cannot rot.

Every call that publishes (``publish``, ``publish_once``, or ``Bus.record_of``: the record an outbox sends
or spools) or reads (``subscribe``, ``read_topic``,
``read_topic_records``, ``read_messages``, ``read_to_end``, ``read_records_to_end``) a registry
topic (``topic("name")`` among its arguments) is found in ``services/`` by parsing the source.
A call in a shared module (``services/common``, or one of ``LIBRARIES``) counts for every service
module that imports that module. Each service module is named by the longest prefix in
``SERVICE_OF``; a module that uses a topic but has no name there fails the test (name it).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from schemas.topics import TOPICS, wire_name
from services.common.settings import KafkaSettings

ROOT = Path(__file__).resolve().parents[2]
PRODUCE = {"publish", "publish_once", "record_of"}
CONSUME = {"subscribe", "read_topic", "read_topic_records", "read_messages", "read_to_end", "read_records_to_end",
           "follow_topic_records"}
#: path prefix (relative to the repo) → the name the registry uses; the longest prefix wins
SERVICE_OF = {
    "services/gateway/": "gateway",
    "services/judge/": "judge",
    "services/judge/cli.py": "calibrate CLI",
    "services/judge/calibrate.py": "calibrate CLI",
    "services/judge/calibration/": "calibrate CLI",
    "services/episodes/": "episodes",
    "services/episodes/cli.py": "episodes CLI",
    "services/publisher/": "publisher",
    "services/sampler/": "sampler",
    "services/relay/": "relay",
    "services/rollouts/": "rollouts",
    "services/trainer/": "trainer",
    "services/console/": "console",
    "services/evaluate/": "evaluate",
    "services/loop/": "loop",
    "services/loop/demo.py": "loop demo",
    "services/tools/demo.py": "demo",
    "services/tools/demo_loop.py": "demo",
    "services/tools/rl_recipes.py": "rl recipes",
    "services/tools/traces.py": "traces CLI",
}
#: modules outside services/common whose topic reads/writes are done on behalf of their importers too
LIBRARIES = ("services/tools/traces.py",)
SHARED = "services/common/"


def _service(rel: str) -> str | None:
    best = max((p for p in SERVICE_OF if rel.startswith(p)), key=len, default=None)
    return SERVICE_OF[best] if best else None


def _name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _topics_in(exprs: list[ast.expr], dynamic: set[str], assigned: dict[str, list[ast.expr]]) -> set[str]:
    """Registry topics named by ``topic("x")`` in ``exprs`` (``topic(var)``: ``dynamic``); a plain
    variable among them is followed to what the module assigns to it."""
    found: set[str] = set()
    for expr in exprs:
        for node in ast.walk(expr):
            if isinstance(node, ast.Call) and _name(node.func) == "topic" and node.args:
                first = node.args[0]
                found |= {first.value} if isinstance(first, ast.Constant) else dynamic
        if isinstance(expr, ast.Name) and expr.id in assigned:
            found |= _topics_in(assigned.pop(expr.id), dynamic, assigned)
    return found


def _uses(tree: ast.AST) -> set[tuple[str, str]]:
    """(direction, topic) of every publish/read call in a module."""
    # topic(topic_name) is resolved to every literal passed as topic_name=... in the module
    dynamic = {k.value.value for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords
               if k.arg == "topic_name" and isinstance(k.value, ast.Constant)}
    assigned: dict[str, list[ast.expr]] = defaultdict(list)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned[target.id].append(node.value)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _name(node.func)
            direction = "produces" if name in PRODUCE else "consumes" if name in CONSUME else None
            if direction:
                args = [*node.args, *(k.value for k in node.keywords)]
                out |= {(direction, t) for t in _topics_in(args, dynamic, dict(assigned))}
    return out


def _imports(tree: ast.AST) -> set[str]:
    """Dotted module names a module imports (``from a.b import c`` gives a.b and a.b.c)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def scan() -> tuple[dict[tuple[str, str, str], list[str]], list[str]]:
    """({(service, direction, topic): [where]}, [modules using topics that no SERVICE_OF entry names])."""
    modules = {}
    for path in sorted((ROOT / "services").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), rel)
        modules[rel] = (tree, _uses(tree), _imports(tree))
    found: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    unnamed = []
    libraries = {rel[:-3].replace("/", "."): (rel, uses) for rel, (_, uses, _) in modules.items()
                 if uses and (rel.startswith(SHARED) or rel in LIBRARIES)}
    for rel, (_, uses, imports) in modules.items():
        service = _service(rel)
        via = [(f"{rel} via {lib_rel}", use) for mod, (lib_rel, lib_uses) in libraries.items()
               if mod in imports and lib_rel != rel for use in lib_uses]
        direct = [(rel, use) for use in uses]
        if service is None:
            if direct and not rel.startswith(SHARED):
                unnamed.append(rel)
            continue
        for where, (direction, t) in direct + via:
            found[(service, direction, t)].append(where)
    return found, unnamed


def test_every_module_that_uses_a_topic_is_named():
    _, unnamed = scan()
    assert unnamed == [], f"add these modules to SERVICE_OF (and the registry): {unnamed}"


def test_code_publishes_and_reads_only_what_the_registry_lists():
    found, _ = scan()
    assert found, "the scan found no topic use at all: the patterns no longer match the code"
    missing = []
    for (service, direction, name), where in sorted(found.items()):
        assert name in TOPICS, f"{where}: topic {name!r} is not in the registry"
        listed = TOPICS[name].producers if direction == "produces" else TOPICS[name].consumers
        if service not in listed:
            missing.append(f"{service} {direction} {name} ({where[0]}) but schemas/topics.py does not list it")
    assert missing == []


def test_every_listed_producer_and_consumer_is_in_the_code():
    found, _ = scan()
    stale = [f"{name}: {service} is listed among its {'producers' if direction == 'produces' else 'consumers'} "
             f"but no code of it {direction} the topic"
             for name, spec in TOPICS.items()
             for direction, names in (("produces", spec.producers), ("consumes", spec.consumers))
             for service in names if (service, direction, name) not in found]
    assert stale == []


def test_each_topic_has_a_producer_and_a_reader_or_a_planned_one():
    for name, spec in TOPICS.items():
        assert spec.producers, name
        assert spec.consumers or spec.planned_consumers, f"{name}: nobody reads it and none is planned"
        assert not set(spec.consumers) & set(spec.planned_consumers), name
        assert spec.description, name
    # the console and `fanroute calibrate mark` write reviews; the console and `calibrate report --source
    # reviews` read them
    assert set(TOPICS["reviews"].consumers) == {"console", "calibrate CLI"}
    assert TOPICS["reviews"].planned_consumers == ()


@pytest.mark.parametrize("ns", ["", "t1."])
def test_the_bus_and_the_reader_share_one_wire_name(ns):
    from services.common.bus import Bus

    settings = KafkaSettings(bootstrap_servers="memory://", topic_namespace=ns)
    for spec in TOPICS.values():
        assert Bus(settings).name(spec) == wire_name(settings, spec) == f"{ns}{spec.name}"
        assert Bus(settings).dlq_name(spec) == f"{ns}{spec.name}.dlq"
