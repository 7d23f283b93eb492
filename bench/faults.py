"""The CPU fault scenarios, with figures: runs the fault tests (real Redis, real Celery workers, real
SIGKILLs, real crashing and hanging TVM programs) and the bad-input tests, then writes
bench/results/faults.json: one row per scenario (scenario, jobs_completed, candidates_lost,
trials_respent, recovery_s), the tests' outcomes and the git state.

    .venv/bin/python -m bench.faults          # ~10-15 min on a 2-core host

The tests compute the figures themselves (sharetune.testing.faults.record_row); this script only gathers them.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.common import REPO, child_env, results_path, write_results
from sharetune.testing.faults import fault_rows, fault_table, junit_outcomes

TESTS = ["tests/test_faults.py", "tests/test_poison.py", "tests/test_bad_input.py", "tests/test_security.py",
         "tests/test_sharding.py"]  # with the bad-input tests of sharetune.testing.faults.BAD_INPUTS


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="sharetune-faults-"))
    rows_path, junit = tmp / "rows.jsonl", tmp / "junit.xml"
    env = child_env(SHARETUNE_FAULTS_OUT=str(rows_path))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp / 'pt'}",
                           f"--junitxml={junit}", *TESTS], cwd=REPO, env=env)
    outcomes = junit_outcomes(junit)
    rows = fault_rows(rows_path, outcomes)
    result = {"rows": rows, "tests": outcomes, "pytest_exit": proc.returncode, "wall_s": round(time.time() - t0, 1),
              "load_avg_1m_at_end": os.getloadavg()[0],
              "note": "CPU only; recovery_s: kill -9 -> lane live again; Redis down -> up; poison -> the lane's "
                      "answer for the poison candidate (both attempts and respawns). The GPU row comes from "
                      "bench/gpu_fault.py on the GPU machine."}
    out = write_results(result, results_path("faults.json"), "bench.faults")
    print(fault_table(rows))
    print(f"wrote {out} (pytest exit {proc.returncode})")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
