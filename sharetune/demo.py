"""README command 1: tune a built-in model on this CPU, end to end, with no setup.

Starts an embedded Redis (unless REDIS_URL is set), the planner, one tuner client, the cost-model
updater and one measurer lane per core, each a separate process; tunes the model; prints a report;
stops what it started."""
from __future__ import annotations

import os
import time
from pathlib import Path

from shared.messages import JobState

os.environ.setdefault("TVM_NUM_THREADS", "1")  # the report times models as a one-core lane would


def _progress_printer():
    last = {"t": 0.0, "line": ""}

    def show(status: dict) -> None:
        now = time.time()
        line = f"  [{status['state']:>9}] trials {status['trials']:>4}/{status['budget']}" + "".join(
            f"  {t['task'][:18]}:{t['trials']}" for t in status["tasks"][:6]
        )
        if line != last["line"] and now - last["t"] > 2.0:
            print(line, flush=True)
            last.update(t=now, line=line)

    return show


def run_demo(model: str = "small_cnn", trials: int = 40, per_iter: int = 8, work_dir: str = "runs/demo",
             timeout_s: float = 900, settings=None) -> int:
    """Tune `model` on a stack of its own (with the process's StackSettings; None: their defaults) and report."""
    from shared import store
    from sharetune.client import Client
    from sharetune.stack.local import Stack

    t0 = time.time()
    work = Path(work_dir)
    print(f"sharetune demo: model {model}, {trials} trials, work dir {work.resolve()}", flush=True)
    with Stack(work, settings=settings) as stack:
        lanes = Client(stack.redis_url).lanes()
        print(f"stack up in {time.time() - t0:.1f} s: Redis {store.masked_url(stack.redis_url)}, lanes "
              + ", ".join(f"{l.queue} ({l.share} %)" for l in lanes), flush=True)
        share = lanes[0].share
        client = Client(stack.redis_url)
        t_submit = time.time()
        job = client.submit(model, target="llvm", share=share, trials=trials, trials_per_iter=per_iter, seed=0)
        print(f"submitted job {job.job_id} at share {share} %", flush=True)
        final = job.wait(timeout_s=timeout_s, on_progress=_progress_printer())
        if final["state"] != JobState.DONE:
            print(f"job {job.job_id} ended {final['state']}: {final.get('error')}", flush=True)
            return 1
        res = job.result()
        tune_wall = time.time() - t_submit
        report(model, job.status(), res, tune_wall, stack.work_dir)
    print(f"stopped the stack; demo took {time.time() - t0:.1f} s in all", flush=True)
    return 0


def report(model_name: str, status: dict, res, tune_wall: float, work_dir: Path) -> None:
    from sharetune.experiments import model_timing
    from sharetune.zoo import get

    torch_model, example = get(model_name).build()
    inputs = [t.detach().numpy() for t in example]
    print(f"\nJob {res.job_id}: {res.trials} trials over {len(res.tasks)} tasks in {tune_wall:.1f} s "
          f"({60 * res.trials / max(tune_wall, 1e-9):.1f} trials/min)")
    print(f"{'task':<34}{'weight':>7}{'trials':>8}{'best us':>12}")
    for t in sorted(res.tasks, key=lambda t: -(t.best_us or 0) * t.weight):
        best = f"{t.best_us:.2f}" if t.best_us is not None else "-"
        print(f"{t.name[:33]:<34}{t.weight:>7}{t.trials:>8}{best:>12}")
    split = res.time_split_s
    print("time split (s): " + ", ".join(f"{k} {v:.1f}" for k, v in split.items()))
    from sharetune.progress import timing_line

    print(timing_line(res))
    tuned = model_timing.latency_us(res.tuned_module_path, inputs)
    untuned = model_timing.latency_us(res.untuned_module_path, inputs)
    err = model_timing.compare(res.tuned_module_path, torch_model, example)["max_abs_err"]
    import torch

    torch.set_num_threads(1)
    eager = model_timing.torch_latency_us(torch_model, example)
    print(f"\nend-to-end latency on 1 core: tuned {tuned:.1f} us, untuned {untuned:.1f} us "
          f"({untuned / tuned:.2f}x), PyTorch eager {eager:.1f} us")
    print(f"max abs error of the tuned model against PyTorch: {err:.3g}")
    if tuned > eager:
        print("note: a few dozen trials are far too few to beat PyTorch's hand-written CPU kernels; "
              "give the job more trials for that.")
    print(f"records: Redis (st:rec:*), exported TVM database: {res.database_dir}")
    print(f"tuned module: {res.tuned_module_path}\nlogs: {Path(work_dir) / 'logs'}")
