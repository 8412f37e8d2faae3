# The fanroute service image (the gateway; every service runs from it with its own command).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# CPU-only torch first (sentence-transformers would otherwise pull the CUDA build, ~GBs);
# pass --build-arg TORCH_INDEX_URL=https://pypi.org/simple for the default build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" torch

COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY services ./services
RUN pip install '.[dense]'

RUN useradd --create-home --uid 10001 fanroute \
    && mkdir -p /cache && chown fanroute /cache
USER fanroute

ENV FANROUTE_HOST=0.0.0.0 \
    FANROUTE_PORT=8000 \
    FANROUTE_CACHE_DIR=/cache
EXPOSE 8000

HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=6 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

CMD ["python", "-m", "services.gateway"]
