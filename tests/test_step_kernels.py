"""A time-to-quality curve's step kernels (sharetune/experiments/task_timing.py build_kernels with record lines):
the records on the given lines of a database of every record, and each workload's default, built and timed on a CPU
core, keyed as the re-timed curve reads them."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("tvm")

from tvm.s_tir import meta_schedule as ms  # noqa: E402

from services.measurer.metaschedule.targets import cpu_target  # noqa: E402
from services.tuner.metaschedule.context import tune_context  # noqa: E402
from services.tuner.metaschedule.extract import extract  # noqa: E402
from sharetune.intake import to_relax  # noqa: E402
from sharetune.experiments.task_timing import build_kernels, time_kernels  # noqa: E402
from sharetune.experiments.time_to_quality import retimed_kernels  # noqa: E402
from sharetune.zoo import get  # noqa: E402


def test_the_steps_records_and_every_workloads_default_are_built_timed_and_named(tmp_path):
    target = cpu_target(1)
    task = min(extract(to_relax(*get("tiny").build()).mod, target), key=lambda t: t.flops)  # the smallest
    ctx = tune_context(task.mod, target, task.name, cold=True, population=16, rand_state=1, num_threads=1)
    space = ctx.space_generator.generate_design_space(task.mod)[0]
    db_dir = tmp_path / "records_db"
    db_dir.mkdir()
    db = ms.database.JSONDatabase(work_dir=str(db_dir), module_equality="structural")
    wl = db.commit_workload(task.mod)
    args = ms.arg_info.ArgInfo.from_prim_func(task.mod["main"])
    for secs in (3e-6, 2e-6, 4e-6):  # lines 0, 1, 2: the curve stepped on lines 0 and 1
        db.commit_tuning_record(ms.database.TuningRecord(space.trace, wl, [secs], target, args))
    (db_dir / "workload_tasks.json").write_text(json.dumps({task.name: str(wl.as_json()[0])}))
    built = build_kernels(db_dir, tmp_path / "kernels", str(target), lines=[0, 1, 7])
    assert sorted(built["kernels"]) == ["d0", "r0", "r1"]  # a line past the database's end is no kernel
    assert built["kernels"]["r1"]["workload"] == 0 and built["kernels"]["d0"]["schedule"] == "default"
    timed, errors = time_kernels({"run": str(tmp_path / "kernels")}, "cpu", rounds=1, min_repeat_ms=1)
    assert errors == {} and sorted(timed["run"]) == ["d0", "r0", "r1"]
    again = retimed_kernels(timed["run"], tmp_path / "kernels", db_dir, {0: task.name, 1: task.name})
    assert sorted(again["steps"]) == ["0", "1"] and list(again["defaults"]) == [task.name]
    assert all(us > 0 for us in again["steps"].values())


def test_the_serving_process_times_the_launch_floor_beside_the_kernels_and_the_row_says_it(tmp_path):
    """The floor's set is the lanes' floor kernel at its default schedule, named launch_floor; a row whose serve
    timed it carries it in its summary (a light kernel's figure is read against it)."""
    from sharetune.experiments.task_timing import floor_db
    from sharetune.experiments.time_to_quality import FLOOR_SET, kernel_names, summarise_model

    db = floor_db(tmp_path / "floor-db")
    built = build_kernels(db, tmp_path / "kernels", str(cpu_target(1)))
    assert built["errors"] == {} and [k["schedule"] for k in built["kernels"].values()] == ["default"]
    timed, errors = time_kernels({FLOOR_SET: str(tmp_path / "kernels")}, "cpu", rounds=1, min_repeat_ms=1)
    named = kernel_names(timed, {FLOOR_SET: (db / "database_workload.json").read_text().splitlines()}, [])
    assert errors == {} and list(named[FLOOR_SET]) == ["launch_floor"]
    row = {"served": {"latency_us": {"cold": 40.0}, "kernel_us": {FLOOR_SET: {"launch_floor": 2.8}}}}
    summarise_model(row)
    assert row["summary"]["served_launch_floor_us"] == 2.8
