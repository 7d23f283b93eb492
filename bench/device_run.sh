#!/usr/bin/env bash
# On the GPU machine, after ../shared/device/stage.sh's install step (PYTHONPATH=/tmp/site:$PWD), writes under $OUT:
#   bash bench/device_run.sh smoke|gputest|matrix-bg|matrix-wait|gpufault|scale1|scale1-wait|ab|ab-wait|plan|plan-wait
# (retired, `git show C:bench/device_run.sh`: stock, ours, sharding, searchq* at b7de8c6, scale B at fb8195c, matrix, scale at e5392c3; ttq-bg, ttq-wait at f0e7e9f: a plan line runs the same)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# The logs of a run, small enough to come back (16 MiB a file): every *.log under SRC, its last 200 KB each.
keep_logs() {  # SRC NAME
  local tmp; tmp=$(mktemp -d)
  (cd "$1" 2>/dev/null && find . -name '*.log' -print0 | while IFS= read -r -d '' f; do
     mkdir -p "$tmp/$(dirname "$f")"; tail -c 200000 "$f" > "$tmp/$f"; done)
  tar czf "$OUT/$2.tgz" -C "$tmp" . 2>/dev/null; rm -rf "$tmp"
}
# A background run's JSON: wait until it says "phase": "done", its log shows ERROR_RE, or WAIT_S pass; then copy it.
wait_for_background() {  # JSON LOG ERROR_RE WAIT_S
  local t0; t0=$(date +%s)
  while [ $(( $(date +%s) - t0 )) -lt "$4" ]; do
    grep -q '"phase": "done"' "$1" 2>/dev/null && break
    grep -q "$3" "$2" 2>/dev/null && { echo "driver error: stopped waiting"; break; }; sleep 5; done
  cp "$1" "$OUT/" 2>/dev/null; tail -c 20000 "$2"
}
case "${1:-smoke}" in
  smoke)
    nvidia-smi --query-gpu=index,uuid,name,clocks.sm,utilization.gpu --format=csv | tee "$OUT/nvidia-smi.csv"
    which nvcc nvidia-cuda-mps-control; nproc
    python3 - <<'PY' 2>&1 | tee "$OUT/smoke.log"
import json, time, sys, os
from pathlib import Path
from services.measurer.observers import make_observer
from sharetune.stack.local import Stack
from sharetune.client import Client
obs = make_observer(); inv = obs.inventory(); print("inventory", inv, flush=True)
u8 = inv[0].uuid.lower().removeprefix("gpu-")[:8]
t = time.time()
with Stack(Path("/tmp/smoke"), lanes=[f"measure.{u8}.p50"] * 2, log_level="INFO") as st:
    print("stack up", round(time.time() - t, 1), flush=True)
    c = Client(st.redis_url)
    for l in c.lanes(): print(l.model_dump_json(), flush=True)
    job = c.submit("tiny", target="cuda", share=50, trials=16, trials_per_iter=8, seed=0)
    print(job.wait(timeout_s=300, on_progress=None), flush=True)
    print(json.dumps(job.status(), indent=1), flush=True)
    try: print(job.result().model_dump_json(indent=1), flush=True)
    except Exception as e: print("no result", e)
PY
    tar czf "$OUT/smoke_logs.tgz" -C /tmp/smoke logs mps 2>/dev/null
    ;;
  gputest) python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -30 ;;
  # issue 23, one GPU, the full matrix (> one call): in the background from a copy outside the working tree;
  # `matrix-wait` (the next calls, back to back) waits and collects. Issue 40, a run over several sessions: what an
  # earlier session left in $OUT, carried in as runs/matrix_carry/ (matrix_kept.tgz: its finished tunings;
  # share_matrix_*.json: its models served; runs/ is ignored and stage.sh leaves it alone), is put back first;
  # run with --resume to tune only the missing tunings
  matrix-bg) M=${MATRIX_DIR:-/tmp/matrix}; C=${MATRIX_CARRY:-runs/matrix_carry}
          mkdir -p "$M" && rm -rf "$M/repo" "$M/DONE" && cp -r . "$M/repo"
          [ -f "$C/matrix_kept.tgz" ] && mkdir -p "$M/work/tunings" \
              && tar xzf "$C/matrix_kept.tgz" --skip-old-files -C "$M/work/tunings"
          for f in "$C"/share_matrix_*.json; do [ -f "$f" ] && [ ! -e "$M/$(basename "$f")" ] && cp "$f" "$M/"; done
          nvidia-smi --query-gpu=index,uuid,name --format=csv,noheader
          (cd "$M/repo" && PYTHONPATH="/tmp/site:$M/repo" OUT="$M" setsid nohup bash -c \
              "python3 -m bench.share_matrix --work-dir $M/work $(printf '%q ' "${@:2}"); touch $M/DONE" \
              > "$M/driver.log" 2>&1 < /dev/null &)
          bash "$0" matrix-wait ;;
  matrix-wait) M=${MATRIX_DIR:-/tmp/matrix}
    t0=$(date +%s); while [ $(( $(date +%s) - t0 )) -lt "${MATRIX_WAIT_S:-560}" ] && [ ! -e "$M/DONE" ]; do
      grep -q '^Traceback' "$M/driver.log" 2>/dev/null && { echo "driver error: stopped waiting"; break; }; sleep 5; done
    [ -e "$M/DONE" ] && echo "matrix run finished"
    cp "$M"/share_matrix_*.json "$M"/share_matrix_*.png "$OUT/" 2>/dev/null
    tail -c 20000 "$M/driver.log"
    # the finished tunings (each one's best records and facts, ~1 MB): the next session carries them back in
    [ -d "$M/work/tunings" ] && tar czf "$OUT/matrix_kept.tgz" -C "$M/work/tunings" --exclude='.*.part' .
    keep_logs "$M/work" matrix_logs ;;
  # issue 22, one GPU: 4x25 % lanes (job A; illegal-address, hung-kernel and launch-failure culprits) and a
  # CPU lane (the bystander job): rows in $OUT/gpu_fault_h200.json (<= 340 s; the script stops waiting at 300 s)
  # issue 21, one GPU: stock's windows, then the service's configurations, in the background (setsid) from a
  # copy outside the working tree; `scale1-wait` (the next calls, back to back) waits and collects the JSON
  # SCALE_RESUME_FROM=<a results JSON of the same models and budget>: its rows and stocks are kept, the rest runs
  scale1) rm -rf /tmp/scale1 && mkdir -p /tmp/scale1 && cp -r . /tmp/scale1/repo
          (cd /tmp/scale1/repo && PYTHONPATH=/tmp/site:/tmp/scale1/repo OUT=/tmp/scale1 setsid nohup python3 \
              -m bench.scale_h200 --work-dir /tmp/scale1/work ${SCALE_RESUME_FROM:+--resume-from "$SCALE_RESUME_FROM"} \
              "${@:2}" > /tmp/scale1/driver.log 2>&1 < /dev/null &)
          bash "$0" scale1-wait ;;
  scale1-wait)
    wait_for_background /tmp/scale1/scale_partA.json /tmp/scale1/driver.log '^Traceback' ${SCALE_WAIT_S:-560}
    keep_logs /tmp/scale1/work scale1_logs
    (cd /tmp/scale1 && tar czf "$OUT/scale1_png.tgz" timeline-*.png 2>/dev/null)
    # each row's records as TVM's JSON database, for offline analysis (a few MB compressed)
    (cd /tmp/scale1/work && find . -type d -name records_db -print0 | tar czf "$OUT/scale1_records.tgz" --null -T -) ;;
  # issue 38, A/B of two code trees: `ab MODELS ARGS`, control .dev/control.tgz (`git archive C -- services shared sharetune
  # bench/*.py bench/harness pyproject.toml | gzip`); per model its row, then this tree's, in the background; `ab-wait`
  ab) rm -rf /tmp/ab && mkdir -p /tmp/ab/control-tree && tar xzf .dev/control.tgz -C /tmp/ab/control-tree && cp -r . /tmp/ab/new-tree
      (setsid nohup bash -c 'for m in ${0//,/ }; do for s in control new; do mkdir -p /tmp/ab/$s-$m && (cd /tmp/ab/$s-tree \
          && OUT=/tmp/ab/$s-$m PYTHONPATH=/tmp/site:$PWD python3 -m bench.scale_h200 --work-dir /tmp/ab/work-$s-$m \
          --models $m "$@" > /tmp/ab/$s-$m/driver.log 2>&1); done; done; touch /tmp/ab/DONE' "$2" "${@:3}" > /tmp/ab/driver.log 2>&1 < /dev/null &); bash "$0" ab-wait ;;
  ab-wait) t0=$(date +%s); while [ $(( $(date +%s) - t0 )) -lt "${AB_WAIT_S:-560}" ] && [ ! -e /tmp/ab/DONE ]; do sleep 5; done
      tail -n 2 /tmp/ab/*/driver.log | cut -c1-300
      (cd /tmp/ab && tar czf "$OUT/ab.tgz" --exclude='*-tree' --exclude='work-*' .) ;;
  # one lease's plan (issue 35's A/Bs and panel runs), in the background from a copy outside the tree: `plan FILE`, FILE's
  # lines "NEED_S COMMAND" run in order while RUN_S (default 1200) leaves NEED_S, each with OUT=/tmp/plan/out/<line>
  # and LEFT (seconds left) in its environment, the panel's JSON of this card in /tmp/plan/ttq for --resume; `plan-wait`
  plan) rm -rf /tmp/plan && mkdir -p /tmp/plan/out /tmp/plan/ttq && cp -r . /tmp/plan/repo && cp "$2" /tmp/plan/plan.txt
        card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$card"
        case "$card" in *H100*) panel=time_to_quality_h100.json ;; *) panel=time_to_quality_h200.json ;; esac
        [ -f "bench/results/$panel" ] && cp "bench/results/$panel" /tmp/plan/ttq/time_to_quality_h200.json
        (cd /tmp/plan/repo && PYTHONPATH=/tmp/site:/tmp/plan/repo setsid nohup bash -c '
           end=$(( $(date +%s) + ${RUN_S:-1200} )); n=0
           while read -r need cmd; do
             case "$need" in ""|\#*) continue ;; esac; n=$((n+1)); left=$(( end - $(date +%s) ))
             if [ "$left" -lt "$need" ]; then echo "[$(date +%T)] step $n skipped: needs $need s, $left left: $cmd"; continue; fi
             echo "[$(date +%T)] step $n ($left s left): $cmd"; mkdir -p /tmp/plan/out/$n
             OUT=/tmp/plan/out/$n LEFT=$left timeout $(( left - 10 )) bash -c "$cmd" > /tmp/plan/out/$n/driver.log 2>&1
             echo "[$(date +%T)] step $n exit $?"
           done < /tmp/plan/plan.txt; touch /tmp/plan/DONE' > /tmp/plan/driver.log 2>&1 < /dev/null &)
        bash "$0" plan-wait ;;
  plan-wait) t0=$(date +%s); while [ $(( $(date +%s) - t0 )) -lt "${PLAN_WAIT_S:-560}" ] && [ ! -e /tmp/plan/DONE ]; do sleep 5; done
        [ -e /tmp/plan/DONE ] && echo "plan finished"; cat /tmp/plan/driver.log; tail -n 3 /tmp/plan/out/*/driver.log | cut -c1-400
        # every step's JSON and PNG (not the zoo store), the panel's, and its kept databases, in one archive; the logs in another
        (cd /tmp/plan && tar czf "$OUT/plan_out.tgz" --exclude='zoo_store.tgz' --exclude='*-*/*/cuda-cache' driver.log \
            $(cd /tmp/plan && find out ttq -maxdepth 3 \( -name '*.json' -o -name '*.png' -o -name 'driver.log' \
              -o -name 'cold-*' -o -name 'warm-*' \) 2>/dev/null | grep -v '/zoo/')); keep_logs /tmp/plan plan_logs ;;
  gpufault) nvidia-smi --query-gpu=index,uuid,name --format=csv,noheader
    timeout 340 python3 -m bench.gpu_fault "${@:2}" 2>&1 | tail -60
    keep_logs /tmp/gpu_fault gpu_fault_logs ;;
esac
