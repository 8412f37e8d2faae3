"""The deployment files, checked without a Docker engine: ``compose.yaml`` validates with Compose v2
(``make test`` installs it: scripts/docker.sh), every compose service's ``python -m`` command
imports with the installed packages, and the image installs the extra those commands need."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

try:
    import yaml  # PyYAML: installed with transformers/huggingface_hub (the `train` extra)
except ImportError:  # pragma: no cover - the dev install always has it
    yaml = None

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = REPO / "pyproject.toml"
#: Distributions the image must install: the sampler's and the publisher's LoRA stack, and the
#: dense providers' and local judge's sentence-transformers.
IMAGE_NEEDS = ("peft", "transformers", "sentence-transformers")

# Imports the entry module, refuses one that runs without the ``__main__`` guard, then imports every
# module its functions import late (what ``main()`` would load: the app, the worker, uvicorn, ...).
_IMPORT_CHECK = r"""
import ast, importlib, importlib.util, sys
name = sys.argv[1]
spec = importlib.util.find_spec(name)
if spec is None:
    sys.exit(f"no module named {name!r}")
entry = f"{name}.__main__" if spec.submodule_search_locations is not None else name
module = importlib.import_module(entry)
for node in ast.walk(ast.parse(open(module.__file__, encoding="utf-8").read())):
    if isinstance(node, ast.Import):
        for alias in node.names:
            importlib.import_module(alias.name)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
        base = importlib.import_module(node.module)
        for alias in node.names:
            if not hasattr(base, alias.name):
                importlib.import_module(f"{node.module}.{alias.name}")
print(f"imported {entry}")
"""


def _compose() -> dict:
    if yaml is None:
        pytest.fail("PyYAML is not installed; `pip install -e '.[dev]'` (scripts/bootstrap.sh) brings it")
    return yaml.safe_load(COMPOSE.read_text())


def _python_m_commands() -> list[tuple[str, str]]:
    """``(service, module)`` for each compose service whose command is ``python -m <module> ...``."""
    out = []
    for name, svc in (_compose().get("services") or {}).items():
        cmd = svc.get("command")
        argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd or [])
        if len(argv) >= 3 and Path(argv[0]).name.startswith("python") and argv[1] == "-m":
            out.append((name, argv[2]))
    return out


def _compose_v2() -> list[str]:
    """``docker compose`` (v2, the CLI plugin scripts/docker.sh builds from its pinned module)."""
    res = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        pytest.fail("Compose v2 does not answer (`docker compose version`): `make test` builds it "
                    "(bash scripts/docker.sh install)")
    return ["docker", "compose"]


@pytest.mark.parametrize("env_file", [None, "docker/local.env"], ids=["official-images", "local-images"])
def test_compose_yaml_validates_with_compose_v2(env_file):
    """``docker compose config`` (no engine needed) accepts the file with the official images and with the
    offline stand-ins, and the stand-ins really replace every image it names."""
    argv = [*_compose_v2(), "--project-directory", str(REPO), *(["--env-file", env_file] if env_file else []),
            "config", "--format", "json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FANROUTE_")}
    res = subprocess.run(argv, cwd=REPO, env={**env, "HOME": env.get("HOME") or str(Path.home())},
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, f"`docker compose config` rejects compose.yaml:\n{res.stderr}{res.stdout}"
    images = {svc.get("image") for name, svc in json.loads(res.stdout)["services"].items() if name != "vllm"}
    if env_file:
        assert images == {"fanroute/kafka:4.1.1-local", "fanroute/redis:7.0-local", "fanroute:dev"}, images
    else:
        assert images == {"apache/kafka:4.1.1", "redis:7", "fanroute:dev"}, images


def test_compose_has_python_services():
    found = dict(_python_m_commands())
    assert {"gateway", "sampler", "publisher"} <= set(found), f"python -m services in compose.yaml: {found}"


@pytest.mark.parametrize(("service", "module"), _python_m_commands() if yaml is not None else [])
def test_compose_command_imports(service, module):
    res = subprocess.run([sys.executable, "-c", _IMPORT_CHECK, module], cwd=REPO, capture_output=True,
                         text=True, timeout=180, check=False, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, (f"compose service {service!r}: `python -m {module}` does not import "
                                 f"cleanly:\n{res.stdout}{res.stderr[-4000:]}")


def _main_guarded(path: Path) -> bool:
    """Is everything a ``__main__.py`` runs at import time a definition, an import or an assignment,
    with the call inside ``if __name__ == "__main__":``?"""
    tree = ast.parse(path.read_text())
    guard = False
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"':
            guard = True
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        elif not isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef,
                                   ast.ClassDef, ast.Assign, ast.AnnAssign)):
            return False
    return guard


def test_every_main_module_runs_only_under_its_guard():
    mains = sorted(p for top in ("services", "devstack") for p in (REPO / top).rglob("__main__.py"))
    commands = {module for _, module in _python_m_commands()}
    assert commands <= {".".join(p.parent.relative_to(REPO).parts) for p in mains}, \
        f"compose runs modules without a __main__.py: {sorted(commands)}"
    bad = [str(p.relative_to(REPO)) for p in mains if not _main_guarded(p)]
    assert not bad, f"these __main__.py run code on import or lack `if __name__ == \"__main__\":`: {bad}"


def _extras_closure(project: dict, extras: list[str]) -> set[str]:
    """Distribution names an install of ``.[extras]`` brings from pyproject (self-references followed)."""
    optional = project.get("optional-dependencies", {})
    self_name = project["name"].lower()
    names: set[str] = set()
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        if extra not in optional:
            pytest.fail(f"the Dockerfile installs extra {extra!r}, which pyproject.toml does not define")
        seen.add(extra)
        for spec in optional[extra]:
            m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", spec)
            name = m.group(1).lower().replace("_", "-")
            if name == self_name:
                todo.extend(e.strip() for e in (m.group(2) or "").split(",") if e.strip())
            else:
                names.add(name)
    return names


def test_image_installs_what_the_services_need():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    installs = [m.group(1) for line in text.splitlines() if line.lstrip().upper().startswith("RUN ")
                for m in re.finditer(r"""['"]?\.\[([^\]]*)\]['"]?""", line) if "pip install" in line]
    assert installs, "the Dockerfile has no `pip install '.[extra]'` of the project"
    extras = [e.strip() for group in installs for e in group.split(",") if e.strip()]
    brought = _extras_closure(project, extras)
    missing = [n for n in IMAGE_NEEDS if n not in brought]
    assert not missing, (f"the image installs .[{','.join(extras)}], which lacks {missing}: the compose "
                         "sampler/publisher (peft, transformers) or judge (sentence-transformers) would fail")
    copied = {m.group(1).rstrip("/") for m in re.finditer(r"^COPY\s+(\S+)\s+\S+\s*$", text, re.MULTILINE)}
    tops = {module.split(".")[0] for _, module in _python_m_commands()}
    assert tops <= copied, f"the Dockerfile does not COPY {sorted(tops - copied)} into the image"


def test_docker_script_refuses_an_unknown_command_naming_it():
    """scripts/docker.sh with a typo: exit 1, the command named, the valid ones listed, nothing started."""
    res = subprocess.run(["bash", str(REPO / "scripts" / "docker.sh"), "imagez"], capture_output=True, text=True,
                         timeout=30, check=False)
    assert res.returncode == 1
    assert "unknown command 'imagez'" in res.stderr and "images" in res.stderr
