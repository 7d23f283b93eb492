"""Run and time a compiled model (an exported Relax library) on the CPU, and compare it with PyTorch."""
from __future__ import annotations

import numpy as np


def _first(out):
    while isinstance(out, (list, tuple)) or type(out).__name__ in ("Array", "ADT", "Tuple"):
        out = out[0]
    return out.numpy() if hasattr(out, "numpy") else np.asarray(out)


def load_vm(path: str):
    import tvm
    from tvm import relax

    return relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())


def run(path: str, inputs: list[np.ndarray]) -> np.ndarray:
    import tvm

    vm = load_vm(path)
    return _first(vm["main"](*[tvm.runtime.tensor(x) for x in inputs]))


def latency_us(path: str, inputs: list[np.ndarray], repeat: int = 10, min_repeat_ms: int = 200) -> float:
    """Median end-to-end latency of `main`, TVM's time_evaluator, warm."""
    import tvm

    vm = load_vm(path)
    args = [tvm.runtime.tensor(x) for x in inputs]
    vm["main"](*args)  # warm-up
    timer = vm.time_evaluator("main", tvm.cpu(), number=1, repeat=repeat, min_repeat_ms=min_repeat_ms)
    return float(np.median(timer(*args).results)) * 1e6


def torch_latency_us(model, example_inputs, repeat: int = 20) -> float:
    import time

    import torch

    with torch.no_grad():
        model(*example_inputs)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            model(*example_inputs)
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def compare(path: str, model, example_inputs) -> dict:
    """Max abs error of the compiled model against PyTorch on the example inputs."""
    from sharetune.intake import reference_output

    inputs = [t.detach().numpy() for t in example_inputs]
    ours = run(path, inputs)
    ref = reference_output(model, example_inputs)
    return {"max_abs_err": float(np.max(np.abs(ours.astype("float64") - ref.astype("float64")))), "shape": list(ours.shape)}


# ---- serving at a share: one fresh process per share -----------------------------------------------
# A process's share is fixed before its runtime starts (the MPS percentage at CUDA initialisation, the
# CPU affinity and TVM_NUM_THREADS before TVM's thread pool exists), so each serving share gets its own
# process, started by sharetune.experiments.share_matrix, which times every tuned model in it.


def serve_latencies_us(paths: dict[str, str], inputs: list[np.ndarray], device: str = "cpu", rounds: int = 10,
                       min_repeat_ms: int = 50, reference: np.ndarray | None = None):
    """Warm, then time every module `rounds` times, interleaved (a drift of the device hits them all
    alike); each module's figure is the median of its rounds. A module that fails is an error, not a
    crash: (latencies_us, errors, max abs error against `reference` when given, each round's figure in
    µs: the caller bootstraps its interval from them)."""
    import tvm
    from tvm import relax

    dev = tvm.cuda(0) if device == "gpu" else tvm.cpu(0)
    timers, errors, max_err = {}, {}, {}
    for label, path in paths.items():
        try:
            vm = relax.VirtualMachine(tvm.runtime.load_module(path), dev)
            args = [tvm.runtime.tensor(x, dev) for x in inputs]
            out = _first(vm["main"](*args))
            if reference is not None:
                max_err[label] = float(np.max(np.abs(out.astype("float64") - reference.astype("float64"))))
            for _ in range(2):
                vm["main"](*args)
            dev.sync()
            timer = vm.time_evaluator("main", dev, number=1, repeat=1, min_repeat_ms=min_repeat_ms)
            timers[label] = (timer, args, [])
        except Exception as err:  # noqa: BLE001 - one module's failure must not lose the others
            errors[label] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"[:400]
    for _ in range(rounds):
        for label, (timer, args, times) in list(timers.items()):
            try:
                times.append(float(timer(*args).mean))
            except Exception as err:  # noqa: BLE001
                errors[label] = f"{type(err).__name__}: {err}"[:400]
                del timers[label]
    lat = {label: float(np.median(t[2])) * 1e6 for label, t in timers.items()}
    return lat, errors, max_err, {label: [v * 1e6 for v in t[2]] for label, t in timers.items()}


def _serve_main(argv=None) -> int:
    """`python -m sharetune.experiments.model_timing --device cpu|gpu [--cores 0,1] --inputs x.npz --module LABEL=PATH ...
    [--kernels LABEL=DIR ...]`: prints one JSON line, {"latency_us": {...}, "errors": {...}, "max_abs_err": {...},
    "rounds_us": {...}[, "kernel_us": {...}, "kernel_errors": {...}]}. The caller sets the environment
    (TVM_NUM_THREADS; CUDA_VISIBLE_DEVICES and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)."""
    import argparse
    import json
    import os

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--cores", default=None, help="pin to these cores before TVM starts, e.g. 0,1")
    ap.add_argument("--inputs", required=True, help=".npz of the model's inputs, in order")
    ap.add_argument("--reference", default=None, help=".npy of the expected first output")
    ap.add_argument("--module", action="append", default=[], help="LABEL=PATH of a compiled model")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--min-repeat-ms", type=int, default=50)
    ap.add_argument("--kernels", action="append", default=[],
                    help="LABEL=DIR of a tuning's task kernels (task_timing.build_kernels), timed after the modules")
    args = ap.parse_args(argv)
    if args.cores:
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    with np.load(args.inputs, allow_pickle=False) as data:
        inputs = [data[f"arg{i}"] for i in range(len(data.files))]
    paths = dict(m.split("=", 1) for m in args.module)
    ref = np.load(args.reference, allow_pickle=False) if args.reference else None
    lat, errors, max_err, rounds = serve_latencies_us(paths, inputs, args.device, args.rounds, args.min_repeat_ms, ref)
    answer = {"latency_us": lat, "errors": errors, "max_abs_err": max_err, "rounds_us": rounds}
    if args.kernels:
        from sharetune.experiments.task_timing import time_kernels

        answer["kernel_us"], answer["kernel_errors"] = time_kernels(dict(k.split("=", 1) for k in args.kernels),
                                                                    args.device, args.rounds)
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_serve_main())
