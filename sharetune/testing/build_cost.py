"""What a sampled CUDA candidate costs a builder's CPU, the way it builds now (services/measurer/metaschedule:
TIR's common-subexpression elimination off, NVRTC's -minimal) against the way it built before (both on TVM's
defaults), on the same candidates: lowering and NVRTC CPU seconds, sources over the size limit, and whether each
kernel's machine code is the same both ways. The candidates are a cold round's (tile draws within the limits, as
a tuner sends them). Run on a host without libcuda, where a CUDA build holds its source and NVRTC runs apart
from it (no GPU needed). bench/valid_sampling.py --builds runs it over tasks; docs/benchmarks.md ("What a build
costs") has the figures."""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

BUILD_MODES = ("now against before",)
SOURCE_LIMIT_KB = 300  # LaneSettings.cuda_compile_source_limit_kb's default


@contextmanager
def built_before():
    """Builds as they were before: TIR's CSE on, NVRTC without -minimal."""
    from services.measurer.metaschedule import cuda_compile

    options, minimal = cuda_compile.options(), cuda_compile.minimal_option
    cuda_compile.configure(options._replace(mode="tvm"))  # TVM's lowering config (no NVRTC runs in a build here)
    cuda_compile.minimal_option = lambda: ()
    try:
        yield
    finally:
        cuda_compile.configure(options)
        cuda_compile.minimal_option = minimal


def _lowered(mod, target) -> tuple[str | None, float]:
    """(CUDA source or None where lowering fails, CPU seconds)."""
    from services.measurer.metaschedule.build import build

    c0 = time.process_time()
    try:
        rt = build(mod, target)
    except Exception:  # noqa: BLE001 - a candidate that fails to lower fails both ways
        return None, time.process_time() - c0
    dev = rt.imports[0]
    if dev.is_runnable():
        raise RuntimeError("this host compiles CUDA inside the build (libcuda is loaded): run it where it does not")
    return dev.inspect_source(), time.process_time() - c0


def _compiled(source: str, arch: str) -> tuple[dict | None, float]:
    """(each kernel's machine code or None where NVRTC fails, CPU seconds)."""
    from services.measurer.metaschedule import cuda_compile

    c0 = time.process_time()
    try:
        return cuda_compile.kernel_code(cuda_compile.nvrtc_compile(cuda_compile.kernel_source(source), arch)), \
            time.process_time() - c0
    except Exception:  # noqa: BLE001
        return None, time.process_time() - c0


def build_round(task, target, mode: str, candidates: int) -> dict:
    """A cold round of `candidates` of `task`, each built now and before (`mode`: BUILD_MODES' one)."""
    from services.measurer.metaschedule import cuda_compile
    from sharetune.testing.sampling_rounds import sampled

    assert mode in BUILD_MODES
    arch = str(target.attrs["arch"])
    cuda_compile.configure(cuda_compile.CompileOptions(cache_mb=0))
    cuda_compile.nvrtc_compile(cuda_compile.PREAMBLE + 'extern "C" __global__ void k() {}', arch)  # NVRTC's load
    cpu = {way: {"lower": 0.0, "nvrtc": 0.0} for way in ("now", "before")}
    refused = {"now": 0, "before": 0}
    refused_lower = {"now": 0.0, "before": 0.0}
    compared = same = failed = 0
    mods = sampled(task, target, candidates)
    for i, mod in enumerate(mods):
        sources = {}
        for way in ("before", "now")[:: 1 if i % 2 else -1]:  # alternately first: neither gains a warm start
            with built_before() if way == "before" else nullcontext():
                sources[way], secs = _lowered(mod, target)
            cpu[way]["lower"] += secs
            if sources[way] is not None and len(sources[way].encode()) / 1024 > SOURCE_LIMIT_KB:
                refused[way] += 1
                refused_lower[way] += secs
        if None in sources.values():
            failed += 1
            continue
        if any(len(s.encode()) / 1024 > SOURCE_LIMIT_KB for s in sources.values()):
            continue
        kernels = {}
        for way in ("before", "now")[:: 1 if i % 2 else -1]:
            with built_before() if way == "before" else nullcontext():
                kernels[way], secs = _compiled(sources[way], arch)
            cpu[way]["nvrtc"] += secs
        before, now = kernels["before"], kernels["now"]
        compared += 1
        same += before is not None and before == now
    total = {way: c["lower"] + c["nvrtc"] for way, c in cpu.items()}
    return {"candidates": len(mods), "failed_to_lower": failed, "compiled": compared, "same_kernels": same,
            "refused_over_limit": refused, "refused_lower_cpu_s": {w: round(s, 3) for w, s in refused_lower.items()},
            "cpu_s": {w: {k: round(v, 3) for k, v in c.items()} for w, c in cpu.items()},
            "build_cpu_saved_frac": round(1 - total["now"] / total["before"], 4) if total["before"] else None,
            "lower_cpu_saved_frac": round(1 - cpu["now"]["lower"] / cpu["before"]["lower"], 4)
            if cpu["before"]["lower"] else None}


def summary(rows: list[dict]) -> dict:
    """Over every task's row: the CPU both ways, the share saved, and the kernels compared and found the same."""
    def tot(way, part):
        return sum(r["cpu_s"][way][part] for r in rows)

    before = tot("before", "lower") + tot("before", "nvrtc")
    now = tot("now", "lower") + tot("now", "nvrtc")
    return {"candidates": sum(r["candidates"] for r in rows), "compiled": sum(r["compiled"] for r in rows),
            "same_kernels": sum(r["same_kernels"] for r in rows),
            "cpu_s": {w: {p: round(tot(w, p), 2) for p in ("lower", "nvrtc")} for w in ("before", "now")},
            "build_cpu_saved_frac": round(1 - now / before, 4) if before else None,
            "lower_cpu_saved_frac": round(1 - tot("now", "lower") / tot("before", "lower"), 4),
            "nvrtc_cpu_saved_frac": round(1 - tot("now", "nvrtc") / tot("before", "nvrtc"), 4),
            "refused_over_limit": {w: sum(r["refused_over_limit"][w] for r in rows) for w in ("before", "now")},
            "refused_lower_cpu_s": {w: round(sum(r["refused_lower_cpu_s"][w] for r in rows), 2)
                                    for w in ("before", "now")}}
