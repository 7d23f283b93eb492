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
