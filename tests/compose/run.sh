#!/usr/bin/env bash
# make compose-test: docker-compose.yml built, started, used, scaled and broken as a user would, on this host.
#   deploy/compose/up.sh first, the user's own command (make compose-up): installs docker.io + docker-compose
#   (Debian: Docker 20.10, compose 1.29) where apt can, else this test skips (exit 0); starts dockerd if none
#   runs (up.sh down stops only the one it started); builds base images from Debian's archive when Docker Hub's
#   are missing (reused when present); builds the images; up -d until healthy. Then: a job through the HTTP API,
#   its results and database; --scale measurer-cpu=2 and a job both lanes measure; a lane container killed
#   mid-job and the job done with every trial recorded; a lane restarted in place back at once; down -v.
# Prints each step's time; leaves nothing running, on failure too (the EXIT trap).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export PY=${PY:-$ROOT/.venv/bin/python}  # up.sh uses it too
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-sharetune-compose-test}
export COMPOSE_FILE=docker-compose.yml  # the project's file alone: a stray docker-compose.override.yml is not read
SCRATCH=$(mktemp -d /tmp/sharetune-compose-test.XXXXXX)
export SHARETUNE_COMPOSE_STATE=$SCRATCH/state  # up.sh's (the dockerd it starts): this run's, not a user's stack
# docker-compose.yml has no default password (every command interpolates it, `build` and `down` too): a random one
export REDIS_PASSWORD=${REDIS_PASSWORD:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
STACK_UP="" STEPS_PASSED="" SKIPPED=""
T0=$(date +%s)

step_start=0
step() { step_start=$(date +%s); echo "== $*"; }
took() { echo "   ($(( $(date +%s) - step_start )) s) $*"; }
skip() { echo "compose-test SKIPPED: $*" >&2; SKIPPED=1; exit 0; }
fail() { echo "compose-test FAILED: $*" >&2; exit 1; }

cleanup() {
  local rc=$?
  if [ -n "$STACK_UP" ]; then
    if [ "$rc" != 0 ] && docker info >/dev/null 2>&1; then
      echo "-- the stack's last logs (failure) --"; docker-compose logs --no-color --tail 30 2>&1 | grep -v "^Attaching" | tail -150 || true
    fi
    bash deploy/compose/up.sh down -v >/dev/null 2>&1 || true  # the stack, and the dockerd up.sh started
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

# ---- docker, base images, the images, up -d and healthy: what a user runs (make compose-up) ---------------
export API_PORT=${API_PORT:-$(free_port 8000)} REDIS_PORT=${REDIS_PORT:-$(free_port 6379)}
export API="http://127.0.0.1:$API_PORT" REDIS_URL="redis://:$REDIS_PASSWORD@127.0.0.1:$REDIS_PORT/0"
STACK_UP=1  # from here on the cleanup takes down what up.sh started, the dockerd too
rc=0; bash deploy/compose/up.sh up || rc=$?
[ "$rc" = 3 ] && skip "Docker cannot be installed or started here (above)"
[ "$rc" = 0 ] || fail "deploy/compose/up.sh failed (rc $rc)"
. "$SHARETUNE_COMPOSE_STATE/env"  # the base images up.sh chose: the later commands see the same stack

step "one CPU lane live"
as_user lanes 1 >/dev/null
took "api on $API, redis on 127.0.0.1:$REDIS_PORT, 1 lane live"

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
bash deploy/compose/up.sh down -v >/dev/null 2>&1
STACK_UP=""
took "stack removed"
STEPS_PASSED=$(cat "$0" deploy/compose/up.sh | grep -c "^step ")
