"""Why two shares' tunings differ, task by task: each tuned task's best schedule (its tuning's kept record)
built on its own, timed in the serving processes placed at each share, and what differs between the two tunings'
schedules (tile sizes and choices from the record's trace; threads, blocks, parallel and vector extents, unroll
from the scheduled code).

    build_kernels(db_dir, out_dir)          # once per tuning (TVM): every workload's best record, kernels.json
    time_kernels({label: dir}, device, rounds)  # in a process placed at a share (model_timing --kernels)
    task_picture(...)                       # pure: per task, its figures and what differs

Generic over lane kinds: a kernel is built for its record's own target (llvm or cuda) and timed on the device its
serving process is placed on. A task whose tuning kept its default schedule (no record beat it) gets that default
built and timed (the tuned model runs it too)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

KERNELS = "kernels.json"


# ---- a schedule's facts (pure) ----------------------------------------------------------------------------


def _extent(text: str) -> int:
    """A loop extent as TVMScript writes it: 64, or T.int64(64)."""
    found = re.findall(r"\d+", text)
    return int(found[-1]) if found else 0


def launch_facts(script: str) -> dict[str, int]:
    """From a scheduled PrimFunc's TVMScript: each thread tag's largest extent (threadIdx.x, blockIdx.x,
    vthread...), `threads` and `blocks` (their products per block and grid), `parallel` (the largest parallel
    loop), `vector` (the longest vectorised loop), `unroll` (the largest auto-unroll step)."""
    facts: dict[str, int] = {}
    for extent, tag in re.findall(r"T\.thread_binding\(([^,]+),\s*thread=\"([\w.]+)\"", script):
        facts[tag] = max(facts.get(tag, 0), _extent(extent))
    for kind, name in (("parallel", "parallel"), ("vectorized", "vector")):
        found = [_extent(e) for e in re.findall(rf"T\.{kind}\(([^,)]+(?:\))?)", script)]
        if found:
            facts[name] = max(found)
    unroll = [int(v) for v in re.findall(r"\"pragma_auto_unroll_max_step\":\s*(\d+)", script)]
    if unroll:
        facts["unroll"] = max(unroll)
    threads = [v for k, v in facts.items() if k.startswith("threadIdx.")]
    blocks = [v for k, v in facts.items() if k.startswith("blockIdx.")]
    if threads:
        facts["threads"] = math.prod(threads)
    if blocks:
        facts["blocks"] = math.prod(blocks)
    return facts


def trace_decisions(trace: list) -> dict:
    """A record's trace (TVM's JSON: [instructions, decisions]) as what its search chose: `sketch` (the sampling
    instructions in order), `tiles` (each SamplePerfectTile's factors), `choices` (each SampleCategorical's chosen
    value, e.g. an unroll step), `locations` (each SampleComputeLocation's)."""
    insts, decisions = trace
    chosen = dict((int(i), d) for i, d in decisions)
    out: dict = {"sketch": [], "tiles": [], "choices": [], "locations": []}
    for i, (kind, _inputs, attrs, _outputs) in enumerate(insts):
        if not kind.startswith("Sample") or i not in chosen:
            continue
        out["sketch"].append(kind)
        if kind == "SamplePerfectTile":
            out["tiles"].append([int(f) for f in chosen[i]])
        elif kind == "SampleCategorical":
            values = attrs[0] if attrs else []
            out["choices"].append(values[chosen[i]] if isinstance(chosen[i], int) and chosen[i] < len(values)
                                  else chosen[i])
        elif kind == "SampleComputeLocation":
            out["locations"].append(chosen[i])
    return out


def schedule_differences(a: dict | None, b: dict | None) -> list[str]:
    """What differs between two kernels' facts ({"launch": launch_facts, "decisions": trace_decisions, or None
    for a default schedule}), in words; ["not built on one side"] when one is missing."""
    if a is None or b is None:
        return [] if a is b else ["not built on one side"]
    out = []
    la, lb = a.get("launch") or {}, b.get("launch") or {}
    for key in sorted(set(la) | set(lb)):
        if la.get(key) != lb.get(key):
            out.append(f"{key} {la.get(key)} vs {lb.get(key)}")
    da, db = a.get("decisions"), b.get("decisions")
    if da is None or db is None:
        return out + (["default schedule vs tuned" if da is None else "tuned vs default schedule"]
                      if da is not db else [])
    if da.get("sketch") != db.get("sketch"):
        out.append("another sketch (sampling steps differ)")
        return out
    for i, (ta, tb) in enumerate(zip(da.get("tiles", []), db.get("tiles", []))):
        if ta != tb:
            out.append(f"tile {i} {ta} vs {tb}")
    for what in ("choices", "locations"):
        for i, (ca, cb) in enumerate(zip(da.get(what, []), db.get(what, []))):
            if ca != cb:
                out.append(f"{what[:-1]} {i} {ca} vs {cb}")
    return out


# ---- the picture (pure) -----------------------------------------------------------------------------------


LAUNCH_KEYS = ("blocks", "threads", "parallel", "vector", "unroll")  # what launch_summary compares


def launch_summary(facts: dict[tuple[int, int, int], dict[str, int]]) -> dict:
    """How a model's tuned kernels launch by tuning share, from each tuned task's launch facts (`facts`: (tuning
    share, seed, workload index) -> launch_facts). Per fact (blocks, threads, ...): `by_share` its geometric mean
    over every tuning of that share; `smallest_vs_largest` the same seed's same task tuned at the smallest share
    over tuned at the largest: geometric mean ratio and how many are fewer, the same, more (the search's luck
    held fixed, so the ratio is the share's)."""
    shares = sorted({k[0] for k in facts})
    out: dict = {"shares": shares}
    for key in LAUNCH_KEYS:
        per = {p: [f[key] for (q, _, _), f in facts.items() if q == p and f.get(key)] for p in shares}
        if not any(per.values()):
            continue
        geo = {str(p): round(math.exp(sum(map(math.log, v)) / len(v)), 1) if v else None for p, v in per.items()}
        lo, hi = shares[0], shares[-1]
        ratios = [facts[(lo, seed, w)][key] / facts[(hi, seed, w)][key] for (p, seed, w) in facts
                  if p == lo and facts[(lo, seed, w)].get(key) and (facts.get((hi, seed, w)) or {}).get(key)]
        pair = {"geo_mean_ratio": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3) if ratios else None,
                "fewer": sum(r < 1 for r in ratios), "same": sum(r == 1 for r in ratios),
                "more": sum(r > 1 for r in ratios)}
        out[key] = {"by_share": geo, "smallest_vs_largest": pair}
    return out


def launch_words(summary: dict) -> str | None:
    """launch_summary in a line: the grid (blocks, else parallel extent) by tuning share and the paired ratio."""
    key = next((k for k in ("blocks", "parallel") if k in summary), None)
    if key is None or len(summary["shares"]) < 2:
        return None
    by, pair = summary[key]["by_share"], summary[key]["smallest_vs_largest"]
    lo, hi = summary["shares"][0], summary["shares"][-1]
    spread = ", ".join(f"{by[str(p)]:g} at {p} %" for p in summary["shares"] if by.get(str(p)) is not None)
    if pair["geo_mean_ratio"] is None:
        return f"tuned kernels' {key} (geometric mean): {spread}"
    return (f"tuned kernels' {key} (geometric mean): {spread}; the same seed's task tuned at {lo} % over at {hi} %: "
            f"{pair['geo_mean_ratio']:.2f}x ({pair['fewer']} fewer, {pair['same']} the same, {pair['more']} more)")


def kept_database(db_dir: str | Path) -> tuple[dict[int, list], list[str]]:
    """A kept tuning's JSON database (at most one record a workload): its records by workload index, and its
    workloads' lines in index order."""
    db_dir = Path(db_dir)
    records = dict(json.loads(line) for line in (db_dir / "database_tuning_record.json").read_text().splitlines()
                   if line.strip())
    return records, (db_dir / "database_workload.json").read_text().splitlines()


def applied(workload, record: list):
    """The workload's module scheduled by a record's trace (TVM's JSON record of that workload)."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    sch = tvm.s_tir.Schedule(workload.mod)
    ms.database.TuningRecord.from_json(record, workload).trace.apply_to_schedule(sch, False)
    return sch.mod


def kept_launch_facts(folders: list[Path]) -> dict[tuple[int, int, int], dict[str, int]]:
    """Each kept tuning's (share_tunings.KeptTunings folder: tuning.json and its database) tuned tasks' launch facts,
    its records' traces applied, nothing built: (share, seed, workload index) -> launch_facts. A folder without
    its files is left out."""
    from tvm.s_tir import meta_schedule as ms

    out = {}
    for db in map(Path, folders):
        if not all((db / name).is_file() for name in ("tuning.json", "database_workload.json",
                                                      "database_tuning_record.json")):
            continue
        tuning = json.loads((db / "tuning.json").read_text())
        records, workloads = kept_database(db)
        for index, line in enumerate(workloads):
            if index in records:
                mod = applied(ms.database.Workload.from_json(json.loads(line)), records[index])
                out[(tuning["share"], tuning["seed"], index)] = launch_facts(mod.script())
    return out


def nearest_tuning(cell: list[list[float]], seeds: list[int]) -> int | None:
    """The seed of the cell's tuning whose median is nearest the cell's figure (the median over its tunings):
    the tuning that stands for its share in the per-task picture."""
    import statistics

    meds = [(statistics.median(r), seed) for r, seed in zip(cell, seeds) if r]
    if not meds:
        return None
    figure = statistics.median(m for m, _ in meds)
    return min(meds, key=lambda m: abs(m[0] - figure))[1]


def task_picture(tasks: list[dict], served: list[int], sides: dict[int, dict], timed: dict[int, dict]) -> list[dict]:
    """Per task of the model, heaviest gap first: for each tuning share (`sides`: share -> {"kernels": its
    kernels.json entries by workload index}) its best schedule's median µs at each served share (`timed`: served
    share -> {tuning share: {workload index: µs}}), the weighted gap between the first two sides at each served
    share (weight x (first - second): > 0 where the first is slower), and what differs between their schedules.
    `tasks`: the first side's tasks (TaskBest dicts) in workload order; workload indices are strings, as in JSON."""
    first, second = list(sides)[:2]
    rows = []
    for i, task in enumerate(tasks):
        kernels = {p: sides[p]["kernels"].get(str(i)) for p in sides}
        us = {str(p): {str(s): timed.get(s, {}).get(p, {}).get(str(i)) for s in served} for p in sides}
        gap = {}
        for s in served:
            a, b = us[str(first)][str(s)], us[str(second)][str(s)]
            gap[str(s)] = task["weight"] * (a - b) if a is not None and b is not None else None
        rows.append({"task": task["name"], "weight": task["weight"], "us": us, "weighted_gap_us": gap,
                     "default_us": task.get("default_us"),
                     "schedule": {str(p): (kernels[p] or {}).get("schedule") for p in sides},
                     "launch": {str(p): (kernels[p] or {}).get("launch") for p in sides},
                     "differs": schedule_differences(kernels[first], kernels[second])})
    key = str(served[0])
    return sorted(rows, key=lambda r: -abs(r["weighted_gap_us"].get(key) or 0.0))


# ---- building and timing kernels (TVM) ----------------------------------------------------------------------


def build_kernels(db_dir: str | Path, out_dir: str | Path, target_json: str, lines: list[int] | None = None) -> dict:
    """Each workload of the JSON database `db_dir` (a kept tuning's: at most one record a workload) built into
    out_dir/w<index>.so for `target_json`: its record's schedule, or its default where it has none (the tuned model
    runs that one too); writes and returns kernels.json: {"kernels": {index: {file, args_info, schedule ("tuned" |
    "default"), launch, decisions, workload}}, "errors": {index: why}}. With `lines` (a database of every record, in
    the order committed): the records on those lines, as r<line>, and every workload's default, as d<index>."""
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.ir_codec import target_from_json

    out_dir, target = Path(out_dir), target_from_json(target_json)
    out_dir.mkdir(parents=True, exist_ok=True)
    out: dict = {"kernels": {}, "errors": {}}
    workloads = (Path(db_dir) / "database_workload.json").read_text().splitlines()
    if lines is None:
        records, _ = kept_database(db_dir)
        todo = [(str(i), i, records.get(i)) for i in range(len(workloads))]
    else:
        every = (Path(db_dir) / "database_tuning_record.json").read_text().splitlines()
        todo = [(f"r{n}", *json.loads(every[n])) for n in sorted(set(lines)) if 0 <= n < len(every)]
        todo += [(f"d{i}", i, None) for i in range(len(workloads))]
    for key, index, record in todo:
        try:
            out["kernels"][key] = _build_one(ms.database.Workload.from_json(json.loads(workloads[index])), record,
                                             target, out_dir / (f"w{key}.so" if lines is None else f"{key}.so"))
            out["kernels"][key]["workload"] = index
        except Exception as err:  # noqa: BLE001 - one task's kernel lost must not lose the others
            out["errors"][key] = f"{type(err).__name__}: {str(err).strip()[-300:]}"
    (out_dir / KERNELS).write_text(json.dumps(out))
    return out


def _build_one(workload, record: list | None, target, path: Path) -> dict:
    """A workload's kernel scheduled by `record` (TVM's JSON record of it), or its default schedule (None), built
    to `path`: its kernels.json entry."""
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.defaults import default_module

    if record is not None:
        mod, args, decisions = applied(workload, record), record[3], trace_decisions(record[0])
    else:
        mod, decisions = default_module(workload.mod, target), None
        args = [a.as_json() for a in ms.arg_info.ArgInfo.from_entry_func(workload.mod, remove_preproc=True)]
    _build(mod, target, path)
    return {"file": path.name, "args_info": args, "decisions": decisions,
            "schedule": "tuned" if decisions else "default", "launch": launch_facts(mod.script())}


def _build(mod, target, path: Path) -> None:
    """A scheduled workload built as the measurer builds a candidate, exported to `path`."""
    from services.measurer.metaschedule.build import build

    build(mod, target).export_library(str(path))


def floor_db(dst: Path) -> Path:
    """A JSON database of the launch floor's workload alone (the kernel the lanes time as the floor,
    defaults.floor_module), no record: build_kernels builds its default schedule, as the lanes time it."""
    import shutil

    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.defaults import floor_module

    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    ms.database.JSONDatabase(work_dir=str(dst)).commit_workload(floor_module())
    return dst


def build_all(databases: dict[str, tuple], out_root: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """Each tuning's kernels (label -> its kept database and target JSON, and optionally the record lines to build,
    comma-separated: build_kernels' `lines`) built in a child process of its own, all at once: ({label: kernels
    folder}, {label: why it has none}). A folder built before is used as it is."""
    from sharetune.experiments.children import run_modules

    folders, todo, errors = {}, {}, {}
    for name, (db, *_) in databases.items():
        folder = out_root / Path(db).name
        if (folder / KERNELS).is_file():
            folders[name] = folder
        else:
            todo[name] = folder
    ran = run_modules({name: [__name__, "--db", str(databases[name][0]), "--target", databases[name][1],
                              "--out", str(folder), *[f"--lines={n}" for n in databases[name][2:3]]]
                       for name, folder in todo.items()}, width=len(todo))
    for name, (code, last) in ran.items():
        if code == 0 and (todo[name] / KERNELS).is_file():
            folders[name] = todo[name]
        else:
            errors[name] = f"kernels not built: {last}"[:400]
    return folders, errors


def _argument(info: list, dev):
    """An argument of a kernel (["TENSOR", dtype, shape]): floats uniform in [-1, 1), integers zero (an index
    read far out of bounds would end the process's CUDA context)."""
    import numpy as np
    import tvm

    _, dtype, shape = info
    data = (np.random.default_rng(0).uniform(-1, 1, shape).astype(dtype) if dtype.startswith(("float", "bfloat"))
            else np.zeros(shape, dtype=dtype))
    return tvm.runtime.tensor(data, dev)


def time_kernels(sets: dict[str, str], device: str = "cpu", rounds: int = 10,
                 min_repeat_ms: int = 20) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Every kernel of every set (label -> a build_kernels folder) timed `rounds` times, interleaved, on this
    process's device: ({label: {workload index: median µs}}, {"label/index": error})."""
    import statistics

    import tvm

    dev = tvm.cuda(0) if device == "gpu" else tvm.cpu(0)
    timers, errors = {}, {}
    for label, folder in sets.items():
        manifest = json.loads((Path(folder) / KERNELS).read_text())
        for index, kernel in manifest["kernels"].items():
            try:
                mod = tvm.runtime.load_module(str(Path(folder) / kernel["file"]))
                args = [_argument(info, dev) for info in kernel["args_info"]]
                timer = mod.time_evaluator(mod.entry_name, dev, number=1, repeat=1, min_repeat_ms=min_repeat_ms)
                timer(*args)  # warm
                timers[(label, index)] = (timer, args, [])
            except Exception as err:  # noqa: BLE001
                errors[f"{label}/{index}"] = f"{type(err).__name__}: {str(err).strip()[-300:]}"
    for _ in range(rounds):
        for (label, index), (timer, args, times) in list(timers.items()):
            try:
                times.append(float(timer(*args).mean) * 1e6)
            except Exception as err:  # noqa: BLE001
                errors[f"{label}/{index}"] = f"{type(err).__name__}: {str(err).strip()[-300:]}"
                del timers[(label, index)]
    out: dict[str, dict[str, float]] = {label: {} for label in sets}
    for (label, index), (_, _, times) in timers.items():
        out[label][index] = statistics.median(times)
    return out, errors


def kernel_experiment_options(ap, samples: int, work: str) -> None:
    """The options of an experiment that draws schedules, builds them and times them side by side on a GPU
    (sharetune.testing.dead_blocks, padded_spaces)."""
    ap.add_argument("--samples", type=int, default=samples)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--work", default=work)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry", action="store_true", help="build only, time nothing (no GPU)")


def _build_main(argv=None) -> int:
    """`python -m sharetune.experiments.task_timing --db DIR --target JSON --out DIR`: build_kernels in a process of
    its own."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True, help="a kept tuning's JSON database (one record a workload)")
    ap.add_argument("--target", required=True, help="the TVM target JSON it was tuned for")
    ap.add_argument("--out", required=True)
    ap.add_argument("--lines", default=None, help="comma-separated record lines of a database of every record")
    args = ap.parse_args(argv)
    lines = [int(n) for n in args.lines.split(",") if n] if args.lines is not None else None
    built = build_kernels(args.db, args.out, args.target, lines)
    print(json.dumps({"kernels": len(built["kernels"]), "errors": built["errors"]}), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_build_main())
