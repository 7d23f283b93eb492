"""The CPU fault scenarios, with figures: runs the fault tests (real Redis, real Celery workers, real
SIGKILLs, real crashing and hanging TVM programs) and the bad-input tests, then writes
bench/results/faults.json: one row per scenario (scenario, jobs_completed, candidates_lost,
trials_respent, recovery_s), the tests' outcomes and the git state.

    .venv/bin/python -m bench.faults          # ~10-15 min on a 2-core host

The tests compute the figures themselves (sharetune.testing.faults.record_row); this script only gathers them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.harness.common import REPO, child_env, results_path, write_results

TESTS = ["tests/test_faults.py", "tests/test_poison.py", "tests/test_bad_input.py", "tests/test_security.py",
         "tests/test_sharding.py"]

# bad-input tests -> the scenario they answer (each must end with a clear error, not a lost job)
BAD_INPUTS = {
    "test_corrupt_onnx": "bad input: corrupt ONNX",
    "test_unsupported_onnx_operator": "bad input: unsupported operator",
    "test_share_outside_range[0]": "bad input: share 0",
    "test_share_outside_range[150]": "bad input: share 150",
    "test_unknown_target": "bad input: unknown target",
    "test_a_100_mb_model_is_refused_at_submit": "bad input: a 100 MB model at submit",
    "test_a_100_mb_message_on_a_lane_queue_is_refused_before_parsing": "bad input: a 100 MB message on a queue",
    "test_a_pickled_message_on_a_lane_queue_is_refused_not_unpickled": "bad input: a pickled message on a queue",
    "test_malformed_message_on_a_lane_queue_is_answered": "bad input: a message that fails validation (lane)",
    "test_malformed_message_on_the_plan_queue_is_dead_lettered": "bad input: a message that fails validation (plan)",
    "test_model_with_no_tunable_operator_fails_the_job_clearly": "bad input: no tunable operator",
}


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="sharetune-faults-"))
    rows_path, junit = tmp / "rows.jsonl", tmp / "junit.xml"
    env = child_env(SHARETUNE_FAULTS_OUT=str(rows_path))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp / 'pt'}",
                           f"--junitxml={junit}", *TESTS], cwd=REPO, env=env)
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        outcomes[case.get("name")] = "skipped" if case.find("skipped") is not None else "failed" if failed else "passed"
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    for test, scenario in BAD_INPUTS.items():
        rows.append({"scenario": scenario, "jobs_completed": None, "candidates_lost": 0, "trials_respent": 0,
                     "recovery_s": None, "answered_with_clear_error": outcomes.get(test) == "passed", "test": test})
    result = {"rows": rows, "tests": outcomes, "pytest_exit": proc.returncode, "wall_s": round(time.time() - t0, 1),
              "load_avg_1m_at_end": os.getloadavg()[0],
              "note": "CPU only; recovery_s: kill -9 -> lane live again; Redis down -> up; poison -> the lane's "
                      "answer for the poison candidate (both attempts and respawns). The GPU row comes from "
                      "bench/gpu_fault.py on the GPU machine."}
    out = write_results(result, results_path("faults.json"), "bench.faults")
    print(f"{'scenario':62} {'done':>4} {'lost':>4} {'respent':>7} {'recovery_s':>10}")
    for r in rows:
        print(f"{r['scenario'][:62]:62} {str(r.get('jobs_completed')):>4} {r['candidates_lost']:>4} "
              f"{r['trials_respent']:>7} {str(r.get('recovery_s')):>10}")
    print(f"wrote {out} (pytest exit {proc.returncode})")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
