#!/usr/bin/env bash
# Give this machine a Docker engine and Compose v2, idempotently, with nothing pulled from Docker Hub.
#
#   scripts/docker.sh install   the engine from Debian (docker.io: dockerd, containerd, runc) and Compose v2
#                               built from its pinned Go module (cached; ~5 min the first time)
#   scripts/docker.sh start     start dockerd unless one already answers (log: $STATE/dockerd.log)
#   scripts/docker.sh stop      stop the dockerd this script started (never one it did not start)
#   scripts/docker.sh status    what answers: engine version, compose version
#   scripts/docker.sh compose   only build/install Compose v2 (what CI needs for `docker compose config`)
#   scripts/docker.sh images    build the local stand-in images offline (docker/README.md): a Debian base
#                               from debootstrap, then Python, Redis and Kafka on it; existing tags are kept
#                               (FANROUTE_DOCKER_REBUILD=1 rebuilds them)
#
# Compose v2 is not packaged by Debian (bookworm's docker-compose is v1 1.29, which rejects the Compose
# spec's top-level `name`). `go install` refuses the module (its go.mod has exclude directives), so the
# module is downloaded from the Go proxy, copied out of the read-only module cache and built with
# `go build ./cmd`. The binary is cached under $CACHE and installed as the CLI plugin
# /usr/local/lib/docker/cli-plugins/docker-compose.
# Run as root. Env: FANROUTE_DOCKER_CACHE (default ~/.cache/fanroute/docker), FANROUTE_DOCKER_STATE
# (default .stack/docker in this checkout).
set -euo pipefail

COMPOSE_MODULE=github.com/docker/compose/v2
COMPOSE_VERSION=v2.40.3
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${FANROUTE_DOCKER_CACHE:-${HOME}/.cache/fanroute/docker}"
STATE="${FANROUTE_DOCKER_STATE:-${ROOT}/.stack/docker}"
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins

say() { printf '[docker] %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

need_root() { [[ $(id -u) -eq 0 ]] || die "run as root: $1"; }

engine_installed() { command -v dockerd >/dev/null && command -v containerd >/dev/null && command -v runc >/dev/null; }

install_engine() {
    if engine_installed && command -v docker >/dev/null; then
        say "engine installed: $(dockerd --version)"
        return
    fi
    need_root "apt-get install docker.io"
    say "installing docker.io (apt)"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io iptables
}

compose_ok() { docker compose version >/dev/null 2>&1; }

install_compose() {
    if compose_ok; then
        say "compose: $(docker compose version --short 2>/dev/null)"
        return
    fi
    local bin="$CACHE/compose-$COMPOSE_VERSION/docker-compose"
    if [[ ! -x "$bin" ]]; then
        command -v go >/dev/null || die "Compose v2 is built from source and needs Go 1.24+ (go not on PATH)"
        say "building Compose $COMPOSE_VERSION from $COMPOSE_MODULE (Go module proxy; ~5 min on 2 cores)"
        local t0=$SECONDS dir work
        dir=$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "$COMPOSE_MODULE@$COMPOSE_VERSION" |
              python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
        work=$(mktemp -d)
        cp -r "$dir/." "$work"
        chmod -R u+w "$work"
        mkdir -p "$(dirname "$bin")"
        (cd "$work" && CGO_ENABLED=0 go build -trimpath \
            -ldflags "-s -w -X $COMPOSE_MODULE/internal.Version=$COMPOSE_VERSION" -o "$bin.tmp" ./cmd)
        mv "$bin.tmp" "$bin"
        rm -rf "$work"
        say "built Compose $COMPOSE_VERSION in $((SECONDS - t0)) s ($bin)"
    fi
    need_root "install the Compose plugin into $PLUGIN_DIR"
    mkdir -p "$PLUGIN_DIR"
    install -m 0755 "$bin" "$PLUGIN_DIR/docker-compose"
    compose_ok || die "docker compose does not answer after installing $PLUGIN_DIR/docker-compose"
    say "compose: $(docker compose version --short)"
}

engine_up() { docker info >/dev/null 2>&1; }

start_engine() {
    if engine_up; then
        say "engine answers: $(docker version --format '{{.Server.Version}}' 2>/dev/null)"
        return
    fi
    engine_installed || die "no dockerd: run scripts/docker.sh install"
    need_root "start dockerd"
    mkdir -p "$STATE"
    say "starting dockerd (log $STATE/dockerd.log)"
    nohup dockerd --pidfile "$STATE/dockerd.pid" >"$STATE/dockerd.log" 2>&1 &
    local i
    for ((i = 0; i < 120; i++)); do
        engine_up && { say "engine up in $((i / 2)) s"; return; }
        if ! kill -0 "$!" 2>/dev/null; then
            tail -n 20 "$STATE/dockerd.log" >&2 || true
            die "dockerd exited while starting (log above)"
        fi
        sleep 0.5
    done
    tail -n 20 "$STATE/dockerd.log" >&2 || true
    die "dockerd did not answer within 60 s"
}

stop_engine() {
    local pidfile="$STATE/dockerd.pid" pid
    [[ -f "$pidfile" ]] || { say "no dockerd started by this script"; return; }
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        local i
        for ((i = 0; i < 60; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        say "dockerd ($pid) stopped"
    fi
    rm -f "$pidfile"
}

# Local stand-ins for the official images (never tagged as one); docker/local.env names them for compose.
BASE_IMAGE=fanroute/debian:bookworm-local
PYTHON_IMAGE=fanroute/python:3.11-local
REDIS_IMAGE=fanroute/redis:7.0-local
KAFKA_IMAGE=fanroute/kafka:4.1.1-local

have_image() { [[ "${FANROUTE_DOCKER_REBUILD:-0}" != 1 ]] && docker image inspect "$1" >/dev/null 2>&1; }

debian_mirror() {
    # The machine's own Debian mirror (deb822 or one-line sources), else deb.debian.org.
    local uri
    uri=$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)
    [[ -n "$uri" ]] || uri=$(awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
    printf '%s' "${uri:-http://deb.debian.org/debian}"
}

build_base() {
    if have_image "$BASE_IMAGE"; then say "$BASE_IMAGE present"; return; fi
    command -v debootstrap >/dev/null || { need_root "apt-get install debootstrap"; apt-get install -y -q debootstrap; }
    local root mirror t0=$SECONDS
    root=$(mktemp -d)
    mirror=$(debian_mirror)
    say "debootstrap bookworm (minbase) from $mirror"
    debootstrap --variant=minbase bookworm "$root" "$mirror" >"$STATE/debootstrap.log" 2>&1 ||
        { tail -n 20 "$STATE/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
    cat >"$root/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
SOURCES
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' - "$BASE_IMAGE" >/dev/null
    rm -rf "$root"
    say "$BASE_IMAGE imported in $((SECONDS - t0)) s"
}

build_image() {  # tag, context dir
    local tag=$1 ctx=$2 t0=$SECONDS
    if have_image "$tag"; then say "$tag present"; return; fi
    say "building $tag"
    docker build -q --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$tag" "$ctx" >/dev/null
    say "$tag built in $((SECONDS - t0)) s"
}

build_images() {
    engine_up || die "no engine answers: scripts/docker.sh start"
    mkdir -p "$STATE"
    build_base
    local ctx
    ctx=$(mktemp -d)
    cp -r "$ROOT/docker/python/." "$ctx"
    cp /etc/ssl/certs/ca-certificates.crt "$ctx/ca-certificates.crt"
    build_image "$PYTHON_IMAGE" "$ctx"
    rm -rf "$ctx"
    build_image "$REDIS_IMAGE" "$ROOT/docker/redis"
    if ! have_image "$KAFKA_IMAGE"; then
        local libs
        libs=$(cd "$ROOT" && python3 -m devstack prepare 2>&1 >/dev/null | sed -n 's/.*Kafka jars ready in //p')
        [[ -d "$libs" ]] || die "python -m devstack prepare did not report the Kafka jars"
        ctx=$(mktemp -d)
        cp -r "$ROOT/docker/kafka/." "$ctx"
        cp -r "$libs" "$ctx/libs"
        build_image "$KAFKA_IMAGE" "$ctx"
        rm -rf "$ctx"
    else
        say "$KAFKA_IMAGE present"
    fi
    docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^fanroute/' >&2 || true
}

status() {
    if engine_up; then say "engine $(docker version --format '{{.Server.Version}}')"; else say "engine: not answering"; fi
    if compose_ok; then say "compose $(docker compose version --short)"; else say "compose v2: not installed"; fi
}

case "${1:-install}" in
    install) install_engine; install_compose ;;
    compose) install_compose ;;
    images) build_images ;;
    start) start_engine ;;
    stop) stop_engine ;;
    status) status ;;
    -h | --help | help) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' ;;
    *) die "unknown command '$1' (install | compose | start | stop | status | images)" ;;
esac
