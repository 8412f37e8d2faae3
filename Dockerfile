# The fanroute service image: every compose service (gateway, judge, episodes, publisher, sampler,
# relay, rollouts) and the trainer run from it with their own command, so it installs `.[train,sandbox]`
# (dense retrieval and the MiniLM judge, transformers/peft/gguf/accelerate for the sampler, the
# publisher's export and the trainer). The base model is not baked in: the sampler reads the prepared
# directory mounted at /models (`fanroute models prepare` on the host), so the image does not carry it.
#
# Build args (compose passes them from variables; docker/local.env sets them for an offline machine):
#   BASE_IMAGE       python:3.11-slim, or the local stand-in fanroute/python:3.11-local
#   TORCH_INDEX_URL  where torch comes from: the CPU-only index by default. Where only a registry whose
#                    torch is the CUDA build answers (pypi.org), the image carries the CUDA runtime wheels
#                    (several GB): torch does not import without them (libcudart is linked; tried here), so
#                    they cannot be dropped. docs/operations.md#compose has the measured sizes.
# Dependencies are installed from pyproject.toml alone, before the code is copied, with pip's cache
# on a BuildKit cache mount: a code change rebuilds in seconds.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
# Empty packages stand in for the code so pip resolves and installs every dependency in this layer.
RUN --mount=type=cache,target=/root/.cache/pip \
    mkdir -p schemas services devstack && touch schemas/__init__.py services/__init__.py devstack/__init__.py \
    && pip install --index-url "${TORCH_INDEX_URL}" torch \
    && pip install '.[train,sandbox]' \
    && pip uninstall -y -q fanroute \
    && python -c "import torch; assert (torch.ones(3) @ torch.ones(3)).item() == 3.0" \
    && rm -rf schemas services devstack build *.egg-info

COPY schemas ./schemas
COPY services ./services
COPY devstack ./devstack
RUN --mount=type=cache,target=/root/.cache/pip pip install --no-deps . && rm -rf build *.egg-info
# The embedded default's test collections (compose mounts the checkout's copy over it).
COPY data ./data

# The compose volumes' mount points, owned by the service user: a named volume starts as a copy of the
# image's directory (owner included), so the services can write their caches, spool and stores.
RUN useradd --create-home --uid 10001 fanroute \
    && mkdir -p /cache /judge-cache /spool /adapters /adapters-store \
    && chown fanroute /cache /judge-cache /spool /adapters /adapters-store
USER fanroute

ENV FANROUTE_HOST=0.0.0.0 \
    FANROUTE_PORT=8000 \
    FANROUTE_CACHE_DIR=/cache \
    FANROUTE_COLLECTIONS_DIR=/app/data/collections
EXPOSE 8000

# No image-level HEALTHCHECK: every service runs from this image and only some serve HTTP (the judge,
# the episode builder and the rollout runner do not); compose.yaml gives each HTTP service its own.

CMD ["python", "-m", "services.gateway"]
