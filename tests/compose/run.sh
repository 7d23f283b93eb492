#!/usr/bin/env bash
# make compose-test: docker-compose.yml built, started, used, scaled and broken as a user would, on this host.
#   installs docker.io + docker-compose (Debian: Docker 20.10, compose 1.29) where apt can, else skips (exit 0);
#   starts dockerd if none runs (and stops only the one it started); builds base images from Debian's archive
#   when Docker Hub's are missing (reused when present); builds the images; up -d; a job through the HTTP API,
#   its results and database; --scale measurer-cpu=2 and a job both lanes measure; a lane container killed
#   mid-job and the job done with every trial recorded; a lane restarted in place back at once; down -v.
# Prints each step's time; leaves nothing running, on failure too (the EXIT trap).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-sharetune-compose-test}
export COMPOSE_FILE=docker-compose.yml  # the project's file alone: a stray docker-compose.override.yml is not read
export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0  # the legacy builder: Debian's docker.io has no buildx
# docker-compose.yml has no default password (every command interpolates it, `build` and `down` too): a random one
export REDIS_PASSWORD=${REDIS_PASSWORD:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
SCRATCH=$(mktemp -d /tmp/sharetune-compose-test.XXXXXX)
STARTED_DOCKERD="" WHEEL_SERVER="" STACK_UP="" STEPS_PASSED="" SKIPPED=""
T0=$(date +%s)

step_start=0
step() { step_start=$(date +%s); echo "== $*"; }
took() { echo "   ($(( $(date +%s) - step_start )) s) $*"; }
skip() { echo "compose-test SKIPPED: $*" >&2; SKIPPED=1; exit 0; }
fail() { echo "compose-test FAILED: $*" >&2; exit 1; }

cleanup() {
  local rc=$?
  if [ -n "$STACK_UP" ]; then
    if [ "$rc" != 0 ]; then
      echo "-- the stack's last logs (failure) --"; docker-compose logs --no-color --tail 30 2>&1 | grep -v "^Attaching" | tail -150 || true
    fi
    docker-compose --profile gpu --profile monitor down -v --remove-orphans >/dev/null 2>&1 || true
  fi
  [ -n "$WHEEL_SERVER" ] && kill "$WHEEL_SERVER" 2>/dev/null && wait "$WHEEL_SERVER" 2>/dev/null
  if [ -n "$STARTED_DOCKERD" ]; then
    kill "$STARTED_DOCKERD" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 1; done
  fi
  rm -rf "$SCRATCH"
  local how; how=$([ "$rc" = 0 ] && echo passed || echo "failed (rc $rc)"); [ -n "$SKIPPED" ] && how=skipped
  echo "compose-test: $how in $(( $(date +%s) - T0 )) s"
  # the plain closing line a CI log reader counts (steps as tests); a skip prints none
  [ "$rc" = 0 ] && [ -n "$STEPS_PASSED" ] && echo "compose-test: $STEPS_PASSED passed, 0 failed"
  [ "$rc" != 0 ] && echo "compose-test: 0 passed, 1 failed"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# the usual port when free, else any free one (another stack, a test server on this host)
free_port() { "$PY" -c $'import socket, sys\ns = socket.socket()\ntry:\n    s.bind((sys.argv[2], int(sys.argv[1])))\nexcept OSError:\n    s.bind((sys.argv[2], 0))\nprint(s.getsockname()[1])' "$1" "${2:-127.0.0.1}"; }
as_user() { PYTHONPATH="$ROOT" "$PY" tests/compose/as_a_user.py "$@"; }
json_field() { "$PY" -c "import json,sys; print(json.loads(sys.stdin.readline())['$1'])"; }

# ---- docker itself ------------------------------------------------------------------------------------------
step "docker: install and start"
if ! command -v docker-compose >/dev/null 2>&1 || ! command -v dockerd >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose >/dev/null) \
      || skip "apt-get could not install docker.io and docker-compose"
  else
    skip "docker-compose or dockerd is missing and apt-get cannot install them here (needs root and apt)"
  fi
fi
if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || skip "no Docker engine runs and only root can start one"
  setsid dockerd >"$SCRATCH/dockerd.log" 2>&1 &
  STARTED_DOCKERD=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { tail -20 "$SCRATCH/dockerd.log" >&2; skip "dockerd could not start here (log above)"; }
fi
took "$(docker version --format 'engine {{.Server.Version}}'), $(docker-compose version --short)"

# ---- base images: Docker Hub's when present or pullable, else stand-ins from Debian's archive --------------
have_image() { docker image inspect "$1" >/dev/null 2>&1 || timeout 60 docker pull -q "$1" >/dev/null 2>&1; }
step "base images"
export PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim-bookworm} REDIS_IMAGE=${REDIS_IMAGE:-redis:7}
if ! have_image "$PYTHON_IMAGE" || ! have_image "$REDIS_IMAGE"; then
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
  if ! have_image "$PYTHON_IMAGE"; then
    PYTHON_IMAGE=sharetune/python-base:3.11-bookworm
    docker image inspect "$PYTHON_IMAGE" >/dev/null 2>&1 || docker build -t "$PYTHON_IMAGE" \
      -f tests/compose/python-base.Dockerfile --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" "$SCRATCH/base" \
      >"$SCRATCH/base-build.log" 2>&1 || { tail -20 "$SCRATCH/base-build.log" >&2; fail "the python base image did not build"; }
  fi
  if ! have_image "$REDIS_IMAGE"; then
    REDIS_IMAGE=sharetune/redis:7-bookworm
    docker image inspect "$REDIS_IMAGE" >/dev/null 2>&1 || docker build -t "$REDIS_IMAGE" \
      -f tests/compose/redis.Dockerfile --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" "$SCRATCH/base" \
      >"$SCRATCH/base-build.log" 2>&1 || { tail -20 "$SCRATCH/base-build.log" >&2; fail "the redis image did not build"; }
  fi
fi
took "python: $PYTHON_IMAGE, redis: $REDIS_IMAGE"

# ---- the project's images --------------------------------------------------------------------------------
step "build images"
# torch's CPU build: from PyTorch's CPU index when it answers, else from a local wheel directory pip already
# uses (PIP_FIND_LINKS / pip.conf find-links), served to the build on the Docker bridge for the run
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
  [ -n "$WHEEL_DIR" ] || fail "download.pytorch.org is out of reach and no local torch 2.13.0+cpu wheel was found; set TORCH_PIP_SOURCE"
  BRIDGE_IP=$(ip -4 -o addr show docker0 | awk '{print $4}' | cut -d/ -f1)
  # a fixed port when free: the address is part of the build argument, so the same one keeps the torch layer cached
  WHEEL_PORT=$(free_port 38457 "$BRIDGE_IP")
  "$PY" -m http.server "$WHEEL_PORT" --bind "$BRIDGE_IP" --directory "$WHEEL_DIR" >"$SCRATCH/wheels.log" 2>&1 &
  WHEEL_SERVER=$!
  export TORCH_PIP_SOURCE="--find-links http://$BRIDGE_IP:$WHEEL_PORT/ --trusted-host $BRIDGE_IP"
fi
# planner and updater share the tuner image; the GPU images need the NVIDIA base (not built here)
docker-compose build --parallel tuner api measurer-cpu >"$SCRATCH/build.log" 2>&1 \
  || { tail -40 "$SCRATCH/build.log" >&2; fail "docker-compose build failed"; }
if [ -n "$WHEEL_SERVER" ]; then kill "$WHEEL_SERVER"; wait "$WHEEL_SERVER" 2>/dev/null || true; WHEEL_SERVER=""; fi
took "$(docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' 'sharetune/*' | grep -v base | tr '\n' ' ')"

# ---- the stack, as a user ------------------------------------------------------------------------------------
export API_PORT=${API_PORT:-$(free_port 8000)} REDIS_PORT=${REDIS_PORT:-$(free_port 6379)}
export API="http://127.0.0.1:$API_PORT" REDIS_URL="redis://:$REDIS_PASSWORD@127.0.0.1:$REDIS_PORT/0"

step "up -d (one CPU lane)"
STACK_UP=1
docker-compose up -d >"$SCRATCH/up.log" 2>&1 || { cat "$SCRATCH/up.log" >&2; fail "docker-compose up failed"; }
as_user lanes 1 >/dev/null
took "api on $API, redis on 127.0.0.1:$REDIS_PORT, 1 lane live"

step "every container healthy (its healthcheck)"
health() { docker inspect -f '{{.Name}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' $(docker-compose ps -q); }
for _ in $(seq 90); do health | grep -vq " healthy$" || break; sleep 1; done
health | grep -v " healthy$" && fail "not every container is healthy (above)"
took "$(health | wc -l) containers healthy"

step "a job through the HTTP API: submit, wait, fetch results and database"
JOB=$(as_user submit 16 | json_field job_id)
as_user wait "$JOB"
as_user fetch "$JOB" "$SCRATCH/results"
as_user account "$JOB"
took "job $JOB"

step "--scale measurer-cpu=2: both lanes measure one job"
docker-compose up -d --no-recreate --scale measurer-cpu=2 >>"$SCRATCH/up.log" 2>&1
as_user lanes 2
JOB=$(as_user submit 32 | json_field job_id)
as_user wait "$JOB"
ACCOUNT=$(as_user account "$JOB"); echo "$ACCOUNT"
echo "$ACCOUNT" | "$PY" -c "import json,sys; a=json.load(sys.stdin); n=sum(1 for v in a['records_per_lane'].values() if v); sys.exit(0 if n>=2 else f'only {n} lane measured: {a}')"
took "job $JOB"

step "docker kill a lane container mid-job: the job finishes, no trial lost"
JOB=$(as_user submit 32 | json_field job_id)
AT_KILL=$(as_user measured "$JOB" 1)
VICTIM=$(docker-compose ps -q measurer-cpu | tail -1)
docker kill "$VICTIM" >/dev/null
echo "killed $(docker inspect -f '{{.Name}} (host {{.Config.Hostname}})' "$VICTIM") when the job was $AT_KILL"
as_user wait "$JOB"
as_user account "$JOB"
took "job $JOB"

step "a lane container restarted in place takes its lane back at once"
# started (again) by hand, a lane's worker says " ready." unless it exits first (a refused claim)
start_lane() {
  local since; since=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  docker start "$1" >/dev/null
  for _ in $(seq 120); do
    docker logs --since "$since" "$1" 2>&1 | grep -q " ready\." && return 0
    [ "$(docker inspect -f '{{.State.Running}}' "$1")" = true ] || break
    sleep 0.5
  done
  docker logs --since "$since" "$1" 2>&1 | tail -5 >&2
  fail "lane container $1 did not start its worker"
}
start_lane "$VICTIM"  # both lanes of the pool held again
# the other lane, killed and started at once: same hostname and pid 1, so the same claimant id, its claim not
# lapsed and the pool's other slot held; it must take its own slot back, not exit as if the pool were full
KEPT=$(docker-compose ps -q measurer-cpu | grep -v "$VICTIM" | head -1)
docker kill "$KEPT" >/dev/null
start_lane "$KEPT"
as_user lanes 2 >/dev/null
took "$(docker inspect -f '{{.Config.Hostname}}' "$KEPT") is its lane's worker again"

step "down -v"
docker-compose down -v --remove-orphans >/dev/null 2>&1
STACK_UP=""
took "stack removed"
STEPS_PASSED=$(grep -c "^step " "$0")
