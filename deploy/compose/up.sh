#!/usr/bin/env bash
# The compose stack's CPU profile on this host in one command (`make compose-up`; `make compose-down` or
# `deploy/compose/up.sh down [-v]` stops it). Also the first and last steps of `make compose-test`
# (tests/compose/run.sh), so what CI runs is what a user runs.
#   Docker: docker.io + docker-compose installed with apt when missing (root with apt), else the commands printed;
#   dockerd started when none answers (root), else the command printed; base images from Docker Hub, or
#   stand-ins built from Debian's archive where it is out of reach; torch's CPU wheel from PyTorch's index, or
#   from a local wheel directory pip already uses; then the commands tagged `# [doc]` below, as written in
#   docs/operations.md (tests/test_compose.py compares them), and a wait until every container is healthy.
# Exit 3: Docker is missing or not running and this script may not fix it (the fix is printed).
# State lives in SHARETUNE_COMPOSE_STATE, default runs/compose: REDIS_PASSWORD, the dockerd it started, and
# `env`, the variables later docker-compose commands need (`. runs/compose/env`).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PY:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}
STATE=${SHARETUNE_COMPOSE_STATE:-$ROOT/runs/compose}
mkdir -p "$STATE" && chmod 700 "$STATE"
# compose needs the password for every command (it interpolates the file), `down` too: kept, mode 0600
if [ -z "${REDIS_PASSWORD:-}" ]; then
  [ -s "$STATE/redis_password" ] || (umask 077 && od -An -N24 -tx1 /dev/urandom | tr -d ' \n' >"$STATE/redis_password")
  REDIS_PASSWORD=$(cat "$STATE/redis_password")
fi
export REDIS_PASSWORD
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-sharetune}  # [doc] the stack's name (containers, volumes)
export COMPOSE_FILE=docker-compose.yml  # [doc] the project's file alone: a stray docker-compose.override.yml is not read
export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0  # [doc] the legacy builder: Debian's docker.io has no buildx

step_start=0
step() { step_start=$(date +%s); echo "== $*"; }
took() { echo "   ($(( $(date +%s) - step_start )) s) $*"; }
fail() { echo "compose-up FAILED: $*" >&2; exit 1; }
cannot() { echo "compose-up: $*" >&2; exit 3; }

stop_dockerd() {  # only the one this script started (its pid recorded in STATE)
  local pid; pid=$(cat "$STATE/dockerd.pid" 2>/dev/null) || return 0
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  rm -f "$STATE/dockerd.pid"
}

if [ "${1:-up}" = down ]; then
  shift
  [ -f "$STATE/env" ] && . "$STATE/env"  # the project and file `up` used
  if docker info >/dev/null 2>&1; then
    docker-compose --profile gpu --profile monitor down --remove-orphans "$@"  # -v also deletes the volumes (records, results)
  fi
  stop_dockerd
  exit 0
fi
[ "${1:-up}" = up ] || { echo "usage: $0 [up | down [-v]]" >&2; exit 2; }

SCRATCH=$(mktemp -d /tmp/sharetune-compose-up.XXXXXX)
WHEEL_SERVER=""
stop_wheel_server() { if [ -n "$WHEEL_SERVER" ]; then kill "$WHEEL_SERVER" 2>/dev/null || true; wait "$WHEEL_SERVER" 2>/dev/null || true; WHEEL_SERVER=""; fi; }
trap 'stop_wheel_server; rm -rf "$SCRATCH"' EXIT
trap 'exit 130' INT TERM

# ---- docker itself ------------------------------------------------------------------------------------------
step "docker: install and start"
if ! command -v docker-compose >/dev/null 2>&1 || ! command -v dockerd >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose >/dev/null) \
      || cannot "apt-get could not install docker.io and docker-compose"
  else
    cannot "docker-compose or dockerd is missing; install them (Debian/Ubuntu: sudo apt-get install -y docker.io docker-compose) and run this again"
  fi
fi
if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || cannot "no Docker engine answers (or this user may not use it): start one
  (sudo systemctl start docker; without systemd: sudo dockerd >/tmp/dockerd.log 2>&1 &), or add this user to
  the docker group (sudo usermod -aG docker \$USER, then log in again), and run this again"
  # a host without systemd (a container, CI): `service docker start` is refused there, so dockerd itself,
  # detached so that it outlives this script; `down` stops it
  setsid dockerd >"$STATE/dockerd.log" 2>&1 </dev/null &
  echo $! >"$STATE/dockerd.pid"
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { tail -20 "$STATE/dockerd.log" >&2; stop_dockerd; cannot "dockerd could not start here (log above)"; }
fi
took "$(docker version --format 'engine {{.Server.Version}}'), $(docker-compose version --short)"

# ---- base images: Docker Hub's when present or pullable, else stand-ins from Debian's archive --------------
have_image() { docker image inspect "$1" >/dev/null 2>&1 || timeout 60 docker pull -q "$1" >/dev/null 2>&1; }
step "base images"
export PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim-bookworm} REDIS_IMAGE=${REDIS_IMAGE:-redis:7}
if ! have_image "$PYTHON_IMAGE" || ! have_image "$REDIS_IMAGE"; then
  [ "$(id -u)" = 0 ] || fail "$PYTHON_IMAGE or $REDIS_IMAGE cannot be pulled, and building stand-ins needs root (debootstrap); set PYTHON_IMAGE and REDIS_IMAGE to images this host has"
  DEBIAN_IMAGE=local/debian:bookworm
  if ! docker image inspect "$DEBIAN_IMAGE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    # the mirror apt already uses on this host
    MIRROR=$(grep -rhE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
      | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -1 | tr -d ' ' || true)
    debootstrap --variant=minbase bookworm "$SCRATCH/rootfs" "${MIRROR:-http://deb.debian.org/debian}" >"$SCRATCH/debootstrap.log" 2>&1 \
      || { tail -20 "$SCRATCH/debootstrap.log" >&2; fail "debootstrap bookworm failed"; }
    tar -C "$SCRATCH/rootfs" -c . | docker import -c 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$SCRATCH/rootfs"
  fi
  mkdir -p "$SCRATCH/base/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$SCRATCH/base/ca-certificates/" 2>/dev/null || true  # the host's CAs, if any
  stand_in() {  # image dockerfile: built once, reused later
    docker image inspect "$1" >/dev/null 2>&1 || docker build -t "$1" -f "$2" --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" \
      "$SCRATCH/base" >"$SCRATCH/base-build.log" 2>&1 || { tail -20 "$SCRATCH/base-build.log" >&2; fail "$1 did not build"; }
  }
  if ! have_image "$PYTHON_IMAGE"; then PYTHON_IMAGE=sharetune/python-base:3.11-bookworm; stand_in "$PYTHON_IMAGE" tests/compose/python-base.Dockerfile; fi
  if ! have_image "$REDIS_IMAGE"; then REDIS_IMAGE=sharetune/redis:7-bookworm; stand_in "$REDIS_IMAGE" tests/compose/redis.Dockerfile; fi
fi
took "python: $PYTHON_IMAGE, redis: $REDIS_IMAGE"
# what later docker-compose commands need to see the same stack: a stand-in base changes the redis service's
# image, so a command without REDIS_IMAGE would pull redis:7 (out of reach) and recreate it. Mode 0600: the password
(umask 077 && for v in REDIS_PASSWORD COMPOSE_PROJECT_NAME COMPOSE_FILE DOCKER_BUILDKIT COMPOSE_DOCKER_CLI_BUILD \
    PYTHON_IMAGE REDIS_IMAGE API_PORT REDIS_PORT; do if [ -n "${!v:-}" ]; then printf 'export %s=%q\n' "$v" "${!v}"; fi; done >"$STATE/env")

# ---- the project's images --------------------------------------------------------------------------------
step "build images"
# torch's CPU build: from PyTorch's CPU index when it answers, else from a local wheel directory pip already
# uses (PIP_FIND_LINKS / pip.conf find-links), served to the build on the Docker bridge while it runs
if [ -z "${TORCH_PIP_SOURCE:-}" ] && ! curl -sfI --max-time 10 https://download.pytorch.org/whl/cpu/torch/ >/dev/null 2>&1; then
  WHEEL_DIR=$("$PY" - <<'EOF'
import glob, os, subprocess
import sys
dirs = os.environ.get("PIP_FIND_LINKS", "").split()
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
dirs += [v.strip("'") for line in out.splitlines() if ".find-links=" in line for v in line.split("=", 1)[1].split()]
for d in dirs:
    d = d.removeprefix("file://")
    if glob.glob(os.path.join(d, "torch-2.13.0+cpu-cp311-*.whl")):
        print(d)
        break
EOF
)
  [ -n "$WHEEL_DIR" ] || fail "download.pytorch.org is out of reach and no local torch 2.13.0+cpu wheel was found; set TORCH_PIP_SOURCE (pip options naming a source of that wheel)"
  BRIDGE_IP=$(ip -4 -o addr show docker0 | awk '{print $4}' | cut -d/ -f1)
  # a fixed port when free: the address is part of the build argument, so the same one keeps the torch layer cached
  WHEEL_PORT=$("$PY" -c $'import socket, sys\ns = socket.socket()\ntry:\n    s.bind((sys.argv[1], 38457))\nexcept OSError:\n    s.bind((sys.argv[1], 0))\nprint(s.getsockname()[1])' "$BRIDGE_IP")
  "$PY" -m http.server "$WHEEL_PORT" --bind "$BRIDGE_IP" --directory "$WHEEL_DIR" >"$SCRATCH/wheels.log" 2>&1 &
  WHEEL_SERVER=$!
  export TORCH_PIP_SOURCE="--find-links http://$BRIDGE_IP:$WHEEL_PORT/ --trusted-host $BRIDGE_IP"
fi
{
docker-compose build --parallel tuner api measurer-cpu  # [doc] planner and updater share the tuner image
} >"$STATE/build.log" 2>&1 || { tail -40 "$STATE/build.log" >&2; fail "docker-compose build failed (log: $STATE/build.log)"; }
stop_wheel_server
took "$(docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' 'sharetune/*' | grep -v base | tr '\n' ' ')"

# ---- the stack ---------------------------------------------------------------------------------------------
step "up -d, until every container is healthy"
{
docker-compose up -d  # [doc] waits for a healthy Redis; one CPU lane (core 0)
} || fail "docker-compose up failed (above)"
health() { docker inspect -f '{{.Name}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' $(docker-compose ps -q); }
for _ in $(seq 180); do health | grep -vq " healthy$" || break; sleep 1; done
health | grep -v " healthy$" && fail "not every container is healthy (above; docker-compose logs tells why)"
took "$(health | wc -l) containers healthy"

API="http://127.0.0.1:${API_PORT:-8000}"
cat <<EOF

sharetune runs (compose project $COMPOSE_PROJECT_NAME). Submit a job and follow it:
  curl -s -XPOST $API/jobs -H 'Content-Type: application/json' -d '{"model": "tiny", "trials": 16}'
  curl -s $API/jobs/JOB_ID          # state, trials, per-task best, ETA; then /results, /database (zip), /module
From Python: Client("redis://:\$(cat $STATE/redis_password)@127.0.0.1:${REDIS_PORT:-6379}/0")
Before docker-compose commands of your own (--scale, logs, ps): . $STATE/env
Stop it: make compose-down (keeps the volumes) or deploy/compose/up.sh down -v (deletes them too)
EOF
