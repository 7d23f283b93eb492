"""Session fixtures: a real Redis server and real worker processes (planner, tuner, updater, two
one-core measurer lanes), started once for the whole run and stopped at the end, by PID."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TVM_NUM_THREADS", "1")
# TEST ONLY: lets a test inject a build that segfaults (services/measurer/metaschedule/sandbox.py); off by
# default everywhere else
os.environ["SHARETUNE_TEST_FAULT_HOOKS"] = "1"
# a 2-core CI host: a small population keeps each evolutionary round cheap (the search itself is the real
# one: sampling, 4 generations of mutation, the cost model's ranking). A round's CPU is about proportional to
# it, and the suite's jobs tune the same few small tasks again and again: at 128 the one tuner client was busy
# for ~9 of the suite's ~16 minutes
os.environ.setdefault("SHARETUNE_SEARCH_POPULATION", "16")
# and the central cost model's XGBoost trains 30 rounds instead of 100 each time records arrive (the training,
# snapshots and their use are the real ones; its accuracy is what bench/ measures)
os.environ.setdefault("SHARETUNE_BOOST_ROUNDS", "30")
# and a candidate's full timing has a 20 ms floor instead of 100 on the suite's CPU lanes (screening, its bar
# and the re-timing of brief bests are unchanged; the tests assert what was measured, not how precisely)
os.environ.setdefault("SHARETUNE_TIMING_FLOOR_MS", "20")
# the suite's jobs are small: with several jobs at once, a client takes turns with a waiting job's shard after
# 5 s instead of 30 (tests/test_multi_job.py)
os.environ.setdefault("SHARETUNE_SHARD_QUANTUM_S", "5")
# the suite runs the session stack and tests' own stacks on this host's two cores at once (it measures
# behaviour, not speed): overlapping cores are reported, not refused, and claimed apart from any real stack's.
# tests/test_hostcores.py checks the refusal itself
os.environ["SHARETUNE_CORE_OVERLAP"] = "warn"
os.environ["SHARETUNE_CORE_LOCK_DIR"] = f"/tmp/sharetune-cores-tests-{os.getpid()}"
# the shared CUDA compile cache of this run only: a binary kept by an earlier run never answers a test
os.environ["SHARETUNE_CUDA_COMPILE_CACHE_DIR"] = f"/tmp/sharetune-cuda-tests-{os.getpid()}"

LANES = ["measure.cpu.c0", "measure.cpu.c1"] if (os.cpu_count() or 1) >= 2 else ["measure.cpu.c0"]


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    from shared.settings import StackSettings
    from sharetune.stack.local import Stack

    work = tmp_path_factory.mktemp("stack")
    os.environ.pop("REDIS_URL", None)  # the tests always use their own embedded Redis
    st = Stack(work, lanes=LANES, log_level="INFO", settings=StackSettings())
    try:
        st.start(wait_lanes_s=300)
        yield st
    finally:
        st.stop()


@pytest.fixture(scope="session")
def figures_out():
    """Where bench/faults.py asks the fault tests to write their figures rows (None: not asked)."""
    from shared.settings import FaultFiguresSettings

    return FaultFiguresSettings().faults_out


@pytest.fixture(scope="session")
def redis_conn(stack):
    from shared import store

    return store.connect(stack.redis_url)


@pytest.fixture(scope="session")
def client(stack):
    from sharetune.client import Client

    return Client(stack.redis_url)


@pytest.fixture(scope="session")
def lane_share(client):
    return client.lanes()[0].share


@pytest.fixture(scope="session")
def tuned_tiny(client, lane_share):
    """One real tuning job of the tiny model (conv + matmul), shared by the end-to-end tests."""
    job = client.submit("tiny", target="llvm", share=lane_share, trials=24, trials_per_iter=8, seed=0,
                        retime_top_k=2)
    final = job.wait(timeout_s=900)
    assert final["state"] == "done", final
    return job


# ---- the order files are handed to the xdist workers ------------------------------------------------------
# `make test` runs with --dist loadfile --no-loadscope-reorder: a whole file goes to one worker, in the order
# collected here. xdist's own order (most tests first) left the long one-test files (the chaos soak, the
# scaling and agent tests) for the end, where one worker ran them while the other sat idle. The longest files
# go first instead (seconds a file took on a 2-core host, whole suite running; a rough guide, refresh it from
# `--durations` when a file grows), the short ones fill in behind them; files not named keep pytest's order.
FILE_SECONDS = {
    "test_faults.py": 170, "test_chaos.py": 110, "test_builders.py": 100, "test_scaling.py": 100,
    "test_sharding.py": 80, "test_poison.py": 75, "test_rounds.py": 70, "test_cli_user.py": 65,
    "test_cli_supervised.py": 60, "test_cli_up.py": 60, "test_validity.py": 60, "test_agent.py": 55,
    "test_matrix_cpu.py": 55, "test_compose.py": 47, "test_e2e.py": 45, "test_multi_job.py": 45,
    "test_store_auth.py": 40, "test_cuda_compile.py": 34, "test_hostcores.py": 30, "test_operator.py": 28,
    "test_cancel_results.py": 21, "test_bad_input.py": 20, "test_lease_under_load.py": 20,
    "test_queue_entries.py": 20, "test_zoo_intake.py": 18, "test_recorded_elsewhere.py": 13,
    "test_time_to_quality.py": 12, "test_warm_seeds.py": 10,
}


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: a file's tests keep their order
