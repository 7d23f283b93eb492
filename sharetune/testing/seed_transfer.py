"""How many warm seeds a panel model's tasks would get from a zoo store, without a GPU: per task of each panel
model, its nearest zoo workload of its operator kind or, for a convolution, of one with more spatial dimensions
(folded: services.tuner.similarity, as SeedSource chooses),
--samples schedules drawn from that workload's design spaces (standing in for its stored records), and how many
of them transfer to the task (services.tuner.metaschedule.seeds.transfer: their decisions replayed in the task's
own design spaces, postprocessed) with the padded spaces off and with the matmuls padded, and how many of those
land in a padded space.

    python -m sharetune.testing.seed_transfer --samples 16 --out bench/results/seed_transfer_cpu.json

Writes {"rows": [{model, task, source, distance, drawn, applied: {mode: n}, padded: {mode: n}, cpu_s: {mode}}],
"summary": {mode: {tasks, with_a_seed, applied, drawn}}}."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PANEL = "efficientnet-mbconv,regnety-stage,vit-s-encoder,wav2vec2-conv"
ZOO = "resnet18,transformer,mobilenetv2"
MODES = ("off", "matmul")


def _tasks(models: list[str], target) -> list[tuple[str, object, object]]:
    """(model, task, its workload shape) of every task of the models whose shapes are static."""
    from bench.panel import relax
    from services.tuner.metaschedule.extract import extract
    from services.tuner.metaschedule.seeds import workload_shape

    out = []
    for model in models:
        for task in extract(relax(model), target):
            shape = workload_shape(task.mod, f"{model}:{task.name}", task.name, str(target), 100)
            if shape is not None:
                out.append((model, task, shape))
    return out


def _drawn(task, target, samples: int) -> list:
    """Traces of `samples` schedules drawn from the task's design spaces that pass its postprocessors."""
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.context import tune_context

    ctx = tune_context(task.mod, target, task.name, True, samples, rand_state=1, num_threads=1, pad_awkward="matmul")
    ctx.pre_tuning(samples * 4, samples, ctx.generate_design_space(), ms.database.MemoryDatabase(),
                   ms.cost_model.RandomModel())
    return [c.sch.trace for c in ctx.generate_measure_candidates() or []]


def measure(panel: list[str], zoo: list[str], samples: int) -> list[dict]:
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.context import tune_context
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from services.tuner.metaschedule.padding import is_padded
    from services.tuner.metaschedule.seeds import transfer
    from services.tuner.similarity import folded_dims, nearest, source_kinds

    load_tensor_intrinsics("cuda")
    target = family_target("cuda.sm_90")
    stored = _tasks(zoo, target)
    by_key = {shape.wkey: task for _, task, shape in stored}
    drawn: dict[str, list] = {}
    rows = []
    for model, task, shape in _tasks(panel, target):
        near = nearest(shape, [s for _, _, s in stored if s.op in source_kinds(shape.op)], 1)
        if not near:
            continue
        dist, source = near[0]
        if source.wkey not in drawn:
            drawn[source.wkey] = _drawn(by_key[source.wkey], target, samples)
        traces = drawn[source.wkey]
        fold = folded_dims(shape.op, source.op)
        row = {"model": model, "task": task.name, "op": shape.op, "source": source.wkey, "folded": fold,
               "distance": round(dist, 3), "drawn": len(traces), "applied": {}, "padded": {}, "cpu_s": {}}
        for mode in MODES:
            ctx = tune_context(task.mod, target, task.name, True, samples, rand_state=1, num_threads=1,
                               pad_awkward=mode)
            spaces = ctx.generate_design_space()
            t = time.process_time()
            seeds = [s for s in (transfer(tr, ctx, spaces, fold) for tr in traces) if s is not None]
            row["cpu_s"][mode] = round(time.process_time() - t, 2)
            row["applied"][mode] = len(seeds)
            row["padded"][mode] = sum(is_padded(s.sch.trace) for s in seeds)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def summarise(rows: list[dict]) -> dict:
    return {mode: {"tasks": len(rows), "with_a_seed": sum(r["applied"][mode] > 0 for r in rows),
                   "applied": sum(r["applied"][mode] for r in rows), "drawn": sum(r["drawn"] for r in rows),
                   "padded": sum(r["padded"][mode] for r in rows)} for mode in MODES}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sharetune.testing.seed_transfer")
    ap.add_argument("--panel", default=PANEL)
    ap.add_argument("--zoo", default=ZOO)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--out", default="/tmp/seed_transfer.json")
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = measure(args.panel.split(","), args.zoo.split(","), args.samples)
    result = {"command": "python -m sharetune.testing.seed_transfer " + " ".join(argv or sys.argv[1:]),
              "what": __doc__.split("\n\n")[0], "wall_s": round(time.time() - t0, 1),
              "summary": summarise(rows), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
