"""The layout rules of the tree, checked on every test run: who may import whom, which files a service
package has, where commands live, and how long a module may grow.

Layers, lowest first: ``schemas`` (messages; imports nothing from ``services``) → ``services/common``
(the runtime library) → the shared packages (:data:`SHARED`) → the services → the composing packages
(:data:`COMPOSING`), which alone may import several services. ``devstack`` is developer tooling: only
the composing packages may use it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Packages below the services that several of them share, and what each holds.
SHARED = {
    "common": "the runtime library: bus, settings, errors, the router prompt, adapter files and stamps, gates",
    "providers": "search providers, collections, markets, fan-out, fusion and trace signals",
    "router": "the student as a router: the client of the sampler, the tolerant ordering parser, call order, "
              "the decision (scores, top-tier tables)",
    "models": "the base model: prepare it from the GGUF, load it",
}
#: Packages that compose services (and the top-level ``services/cli.py``).
COMPOSING = {"tools", "evaluate", "loop", "cli"}
#: Long-running services: parse settings in ``__main__``, then serve an ``app`` or run a ``worker``.
LONG_RUNNING = {"gateway", "judge", "episodes", "publisher", "sampler", "relay", "rollouts", "console", "loop"}
#: Modules allowed over :data:`MAX_LINES`, with the reason.
LONG_MODULES: dict[str, str] = {}
MAX_LINES = 450


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute module an import statement names (at any depth), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def _package(rel: Path) -> str:
    """``services/gateway/app.py`` → ``gateway``; ``services/cli.py`` → ``cli``."""
    return rel.parts[1] if len(rel.parts) > 2 else rel.stem


def import_violations(root: Path) -> list[str]:
    """Each import that crosses the layers the wrong way, as ``path:line imports module (why)``."""
    bad = []
    for path in sorted((root / "schemas").rglob("*.py")):
        for line, mod in _imports(path):
            if mod.split(".")[0] in ("services", "devstack"):
                bad.append(f"{path.relative_to(root)}:{line} imports {mod} (schemas import nothing above them)")
    for path in sorted((root / "services").rglob("*.py")):
        rel = path.relative_to(root)
        own = _package(rel)
        for line, mod in _imports(path):
            parts = mod.split(".")
            if parts[0] == "devstack" and own not in COMPOSING:
                bad.append(f"{rel}:{line} imports {mod} (developer tooling; only {sorted(COMPOSING)} may)")
            if parts[0] != "services" or len(parts) < 2 or parts[1] in (own, "common") or own in COMPOSING:
                continue
            target = parts[1]
            if own == "common":
                why = "services/common imports only itself and schemas"
            elif own in SHARED:
                why = f"shared package {own!r} imports only services.common"
            elif target in SHARED:
                continue
            else:
                why = (f"service {own!r} may import only services.common and the shared packages "
                       f"{sorted(SHARED)}; move the contract there")
            bad.append(f"{rel}:{line} imports {mod} ({why})")
    return bad


def file_set_violations(root: Path) -> list[str]:
    """Service packages missing their files, and commands outside a ``cli.py``."""
    bad = []
    services = root / "services"
    for name in sorted(LONG_RUNNING):
        have = {p.name for p in (services / name).glob("*.py")}
        missing = [f for f in ("__main__.py", "settings.py") if f not in have]
        missing += [] if have & {"app.py", "worker.py"} else ["app.py or worker.py"]
        if missing:
            bad.append(f"services/{name}: missing {', '.join(missing)}")
    for folder in sorted({p.parent for p in services.rglob("*.py")}):
        if not (folder / "__init__.py").is_file():
            bad.append(f"{folder.relative_to(root)}: no __init__.py (every package says what it is)")
    for path in sorted(services.rglob("*.py")):
        rel = path.relative_to(root)
        defines = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
        if "add_parser" in defines and path.name != "cli.py":
            bad.append(f"{rel}: defines add_parser; a package's commands live in its cli.py")
        if path.name == "__main__.py" and _package(rel) not in LONG_RUNNING and "add_parser" in defines:
            bad.append(f"{rel}: a command's parser belongs in cli.py, __main__ only calls it")
    return bad


def long_modules(root: Path) -> list[str]:
    """Modules over :data:`MAX_LINES` lines that :data:`LONG_MODULES` does not list."""
    out = []
    for top in ("services", "schemas", "devstack", "bench", "tests"):
        for path in sorted((root / top).rglob("*.py")):
            rel = str(path.relative_to(root))
            n = len(path.read_text().splitlines())
            if n > MAX_LINES and rel not in LONG_MODULES:
                out.append(f"{rel}: {n} lines (split it, or list it in LONG_MODULES with a reason)")
    return out


def test_no_import_crosses_the_layers() -> None:
    assert import_violations(REPO) == []


def test_every_service_has_its_files_and_commands_live_in_cli() -> None:
    assert file_set_violations(REPO) == []


def test_no_module_is_over_the_limit() -> None:
    assert long_modules(REPO) == []


def test_the_long_module_list_names_real_files() -> None:
    assert [p for p in LONG_MODULES if not (REPO / p).is_file()] == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(("rel", "text", "why"), [
    ("services/gateway/x.py", "from services.judge.worker import run\n", "service 'gateway'"),
    ("services/trainer/x.py", "def f():\n    import services.episodes.build\n", "service 'trainer'"),
    ("services/common/x.py", "from services.providers.config import BM25Config\n", "services/common imports only"),
    ("services/providers/x.py", "from services.router.policy import call_order\n", "shared package 'providers'"),
    ("schemas/x.py", "from services.common.errors import SchemaError\n", "schemas import nothing"),
    ("services/sampler/x.py", "import devstack\n", "developer tooling"),
])
def test_a_new_cross_layer_import_is_caught(tmp_path: Path, rel: str, text: str, why: str) -> None:
    root = _tree(tmp_path, {rel: text, "services/tools/ok.py": "from services.judge.worker import run\n",
                            "services/gateway/ok.py": "from services.providers.config import BM25Config\n"})
    found = import_violations(root)
    assert len(found) == 1 and found[0].startswith(f"{rel}:") and why in found[0], found


def test_a_missing_service_file_and_a_stray_parser_are_caught(tmp_path: Path) -> None:
    files = {f"services/{n}/{f}": "" for n in LONG_RUNNING
             for f in ("__init__.py", "__main__.py", "settings.py", "app.py")}
    del files["services/judge/settings.py"]
    files["services/trainer/__init__.py"] = ""
    files["services/trainer/__main__.py"] = "def add_parser(sub):\n    pass\n"
    files["services/trainer/loose/x.py"] = ""
    found = file_set_violations(_tree(tmp_path, files))
    assert found[0] == "services/judge: missing settings.py"
    assert "services/trainer/loose: no __init__.py (every package says what it is)" in found
    assert any(f.startswith("services/trainer/__main__.py: defines add_parser") for f in found), found
    assert len(found) == 4, found  # the stray parser is also a __main__ that holds a command's parser


def test_a_long_module_is_caught(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"services/x/big.py": "x = 1\n" * (MAX_LINES + 1), "schemas/a.py": "", "devstack/b.py": ""})
    assert long_modules(root) == [f"services/x/big.py: {MAX_LINES + 1} lines (split it, or list it in "
                                  "LONG_MODULES with a reason)"]
