"""The kernel-only CUDA compile (services/measurer/metaschedule/cuda_compile.py) gives the kernels TVM's own
NVRTC path gives: same PTX per kernel and the same machine code in the cubin, on sampled ResNet-18 conv
candidates and on an fp16 kernel. NVRTC needs no GPU: it comes from its wheel (requirements.txt); TVM's own
path needs the CUDA toolkit's headers (CCCL), found through CUDA_PATH or /usr/local/cuda*."""
from __future__ import annotations

import glob
import os

import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("cuda.bindings.nvrtc")

H200 = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
        "thread_warp_size": 32}


def _toolkit() -> str | None:
    for path in [os.environ.get("CUDA_PATH", "")] + sorted(glob.glob("/usr/local/cuda*"), reverse=True):
        if path and glob.glob(os.path.join(path, "targets", "*", "include", "cccl", "cuda", "std", "cstdint")):
            return path
    return None


@pytest.fixture(scope="module")
def cuda_path(monkeypatch_module):
    path = _toolkit()
    if path is None:
        pytest.skip("no CUDA toolkit headers (CCCL) here for TVM's own NVRTC path to compare against")
    monkeypatch_module.setenv("CUDA_PATH", path)
    from services.measurer.metaschedule import cuda_compile

    cuda_compile.include_dirs.cache_clear()
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _cuda_source(mod) -> str:
    """The CUDA source TVM generates for a scheduled module (on a host without libcuda the build holds
    the source; with it, the source of the module it compiled)."""
    from services.measurer.metaschedule.build import build

    rt = build(mod, tvm.target.Target(H200))
    return rt.imports[0].inspect_source()


@pytest.fixture(scope="module")
def conv_sources(conv_candidates):
    """Sampled schedules of ResNet-18's heaviest 3x3 convolution, as CUDA source (the small ones: deep
    unrolls of 500+ KB take seconds to compile either way)."""
    sources = [src for src in map(_cuda_source, conv_candidates) if len(src) < 200_000][:2]
    assert sources, "no candidate of a usable size was sampled"
    return sources


@pytest.fixture(scope="module")
def conv_candidates():
    """Sampled schedules of ResNet-18's heaviest 3x3 convolution (scheduled modules)."""
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.extract import extract
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from sharetune import intake

    load_tensor_intrinsics("cuda")  # as a CUDA tuner does: only CUDA's (16 s here), not every backend's (38 s)
    target = tvm.target.Target(H200)
    tasks = sorted(extract(intake.to_relax("resnet18").mod, target), key=lambda t: -t.flops * t.weight)
    task = next(t for t in tasks if t.name.startswith("conv2d"))
    ctx = ms.TuneContext(mod=task.mod, target=target, space_generator="post-order-apply",
                         search_strategy=ms.search_strategy.ReplayTrace(), task_name=task.name, rand_state=1,
                         num_threads=1)
    ctx.pre_tuning(4, 4, ctx.generate_design_space(), None, None)
    mods = [cand.sch.mod for cand in ctx.generate_measure_candidates() or []]
    ctx.post_tuning()
    return mods


def test_a_kernel_path_build_lowers_without_tirs_cse_to_the_same_kernels(conv_candidates):
    """NVVM eliminates the common subexpressions TIR's pass would: the kernel path skips the pass (a quarter of
    the lowering) and compiles to the same machine code; NVRTC's -minimal, where it is known, changes none."""
    from services.measurer.metaschedule import cuda_compile as cc
    from services.measurer.metaschedule.build import build

    target = tvm.target.Target(H200)
    assert cc.lowering_config() == {"tirx.disable_cse_tir": True}
    assert all(o.encode() in cc.nvrtc_options("sm_90") for o in cc.minimal_option())
    compared = 0
    for mod in conv_candidates:
        ours = build(mod, target).imports[0].inspect_source()
        with target, tvm.transform.PassContext(config={"tirx.disable_cse_tir": False}):
            theirs = tvm.build(mod, target=target).imports[0].inspect_source()
        assert "cse_v" not in ours
        if len(theirs) > 200_000 or "cse_v" not in theirs:
            continue
        assert cc.kernel_code(cc.nvrtc_compile(cc.kernel_source(ours), "sm_90")) == \
            cc.kernel_code(cc.nvrtc_compile(cc.kernel_source(theirs), "sm_90"))
        compared += 1
    assert compared, "no sampled candidate had a common subexpression to compare"


def test_tvms_path_keeps_tirs_lowering():
    from services.measurer.metaschedule import cuda_compile as cc

    before = cc.options()
    try:
        cc.configure(cc.CompileOptions(mode="tvm"))
        assert cc.lowering_config() == {}
    finally:
        cc.configure(before)


def test_kernel_only_path_gives_the_same_kernels_as_tvms(cuda_path, conv_sources):
    from services.measurer.metaschedule import cuda_compile as cc

    for src in conv_sources:
        assert cc.kernel_source(src) is not None  # the conv kernels need no header
        ours, path = cc.compile_source(src, "compute_90", "ptx")
        assert path == "kernel"
        theirs = cc.tvm_compile(src, "compute_90", "ptx")
        assert b"cuda3std" in theirs and b"cuda3std" not in ours  # CCCL's constants: only on TVM's path
        assert cc.kernel_ptx(ours) == cc.kernel_ptx(theirs) and cc.kernel_ptx(ours)
        cubin, _ = cc.compile_source(src, "sm_90")
        assert cc.kernel_code(cubin) == cc.kernel_code(cc.tvm_compile(src, "sm_90"))


def test_an_fp16_kernel_compiles_with_its_header_and_the_same_code(cuda_path):
    from tvm import te

    from services.measurer.metaschedule import cuda_compile as cc

    a = te.placeholder((1024,), "float16", name="a")
    b = te.compute((1024,), lambda i: a[i] * a[i], name="b")
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": te.create_prim_func([a, b])}))
    bx, tx = sch.split(sch.get_loops(sch.get_sblock("b"))[0], [None, 32])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    src = _cuda_source(sch.mod)
    assert "#include <cuda_fp16.h>" in src and "#include <cuda_fp16.h>" in cc.kernel_source(src)
    cubin, path = cc.compile_source(src, "sm_90")
    assert path == "kernel"
    assert cc.kernel_code(cubin) == cc.kernel_code(cc.tvm_compile(src, "sm_90"))


def test_sources_that_need_the_headers_go_to_tvms_path(cuda_path, monkeypatch):
    from services.measurer.metaschedule import cuda_compile as cc

    header = ("#ifdef __CUDACC_RTC__\n#include <cuda/std/type_traits>\n#else\n#include <type_traits>\n#endif\n")
    uses_traits = header + ('extern "C" __global__ void k(float* a) {\n'
                            '  if (std::is_same<float, float>::value) a[threadIdx.x] = 1.0f;\n}\n')
    assert cc.kernel_source(uses_traits) is None
    assert cc.kernel_source("no TVM header block here") is None
    plain = header + 'extern "C" __global__ void k(float* a) { a[threadIdx.x] = -INFINITY; }\n'
    assert cc.compile_source(plain, "sm_90")[1] == "kernel"
    monkeypatch.setattr(cc, "_options", cc.options())  # the process's options come back after the test
    cc.configure(cc.CompileOptions("tvm"))
    assert cc.compile_source(plain, "sm_90")[1] == "tvm"
    with pytest.raises(ValueError, match="'fast' is not one of kernel, tvm"):
        cc.configure(cc.CompileOptions("fast"))


def test_a_source_the_kernel_path_cannot_compile_falls_back_to_tvms_error(cuda_path):
    from services.measurer.metaschedule import cuda_compile as cc

    bad = "#ifdef __CUDACC_RTC__\n#else\n#endif\n" + 'extern "C" __global__ void k(float* a) { a[0] = undefined_name; }\n'
    before = cc.STATS["fallback_errors"]
    with pytest.raises(RuntimeError, match="undefined_name"):
        cc.compile_source(bad, "sm_90")
    assert cc.STATS["fallback_errors"] == before + 1


def _dependent_chain(n: int) -> str:
    """A kernel of n dependent multiply-adds: its compile's CPU grows with n (~0.65 s at 300, ~4.7 s at 1000 on
    a 2-core host)."""
    body = "".join(f"  acc = acc * a[(threadIdx.x + {i}) % 97] + {i}.5f;\n" for i in range(n))
    return ("#ifdef __CUDACC_RTC__\n#else\n#endif\n" + 'extern "C" __global__ void k(float* a, float* b) {\n'
            "  float acc = 0.0f;\n" + body + "  b[threadIdx.x] = acc;\n}\n")


def test_a_compile_past_its_cpu_limit_stops_with_an_error_that_says_so(monkeypatch):
    """The limit cancels the compile (NVRTC's flow callback) and says why; it is never handed to TVM's path to
    compile again; a process's first compile (NVRTC's start-up) has no limit; 0 turns it off."""
    from services.measurer.metaschedule import cuda_compile as cc

    monkeypatch.setattr(cc, "_options", cc.options())
    cc.configure(cc.CompileOptions("kernel", 0.1))
    assert cc.compile_source(_dependent_chain(5), "sm_90")[1] == "kernel"  # the first (warm-up) or a quick one
    assert cc._warm.is_set()
    before = dict(cc.STATS)
    with pytest.raises(cc.CompileLimitExceeded, match=r"over its limit of 0.1 s \(SHARETUNE_CUDA_COMPILE_CPU_LIMIT_S"):
        cc.compile_source(_dependent_chain(1000), "sm_90")
    assert cc.STATS == before  # no fallback to TVM's path
    cc.configure(cc.CompileOptions("kernel", 0.0))
    assert cc.compile_source(_dependent_chain(150), "sm_90")[1] == "kernel"
    with pytest.raises(ValueError, match="negative"):
        cc.configure(cc.CompileOptions("kernel", -1.0))


def test_a_source_over_its_size_limit_is_refused_before_it_compiles(counted_nvrtc):
    """Refused whichever path would compile it, before the cache (the same source always gets the same answer), with an error
    that names the size, the limit and the setting; 0 turns it off."""
    from services.measurer.metaschedule import cuda_compile as cc

    big = _dependent_chain(400)  # ~20 KB
    kb = len(big) / 1024
    for mode in cc.MODES:
        cc.configure(cc.CompileOptions(mode, 0.0, source_limit_kb=kb / 2))
        with pytest.raises(cc.CompileLimitExceeded,
                           match=rf"source is {kb:.0f} KB, over its limit of {kb / 2:g} KB "
                                 r"\(SHARETUNE_CUDA_COMPILE_SOURCE_LIMIT_KB"):
            cc.compile_source(big, "sm_90")
    assert counted_nvrtc == []
    cc.configure(cc.CompileOptions("kernel", 0.0, source_limit_kb=kb / 2))
    assert cc.compile_source(_dependent_chain(5), "sm_90")[1] == "kernel"  # a small one compiles
    cc.configure(cc.CompileOptions("kernel", 0.0, source_limit_kb=0))
    assert cc.compile_source(big, "sm_90")[1] == "kernel"
    with pytest.raises(ValueError, match="negative"):
        cc.configure(cc.CompileOptions("kernel", 0.0, source_limit_kb=-1))


def test_the_settings_give_the_source_limit():
    from services.measurer.metaschedule.cuda_compile import options_from
    from shared.settings import LaneSettings

    assert options_from(LaneSettings()).source_limit_kb == 300
    assert options_from(LaneSettings(cuda_compile_source_limit_kb=0)).source_limit_kb == 0


@pytest.fixture
def counted_nvrtc(monkeypatch):
    """NVRTC compiles counted through the module's own seam (its nvrtc_compile), the process's options and cache
    restored after the test."""
    from services.measurer.metaschedule import cuda_compile as cc

    monkeypatch.setattr(cc, "_options", cc.options())
    monkeypatch.setattr(cc, "_cache", cc.CompileCache(cc._cache.limit_bytes))
    monkeypatch.setattr(cc, "_shared", cc._shared)
    calls = []
    real = cc.nvrtc_compile

    def counting(source, *args, **kwargs):
        calls.append(source)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(cc, "nvrtc_compile", counting)
    return calls


def test_a_source_compiled_before_comes_from_the_cache(counted_nvrtc):
    from services.measurer.metaschedule import cuda_compile as cc

    cc.configure(cc.CompileOptions("kernel", 0.0, cache_mb=64))
    first = cc.compile_source(_dependent_chain(5), "sm_90")
    assert cc.compile_source(_dependent_chain(5), "sm_90") == first and len(counted_nvrtc) == 1
    cc.compile_source(_dependent_chain(6), "sm_90")  # another source misses
    cc.compile_source(_dependent_chain(5), "compute_90", "ptx")  # so does another output
    assert len(counted_nvrtc) == 3 and (cc._cache.hits, cc._cache.misses) == (1, 3)


def test_no_cache_at_0_and_the_bound_evicts_the_least_recently_used(counted_nvrtc):
    from services.measurer.metaschedule import cuda_compile as cc

    cc.configure(cc.CompileOptions("kernel", 0.0, cache_mb=0))
    cc.compile_source(_dependent_chain(5), "sm_90")
    cc.compile_source(_dependent_chain(5), "sm_90")
    assert len(counted_nvrtc) == 2 and not cc._cache.entries
    size = len(cc.compile_source(_dependent_chain(5), "sm_90")[0])
    cc.configure(cc.CompileOptions("kernel", 0.0, cache_mb=2.5 * size / 2**20))  # room for two such cubins
    for n in (5, 6, 5, 7):  # 5 used again after 6: 6 is the least recently used when 7 comes
        cc.compile_source(_dependent_chain(n), "sm_90")
    assert len(counted_nvrtc) == 6 and cc._cache.used <= cc._cache.limit_bytes
    cc.compile_source(_dependent_chain(5), "sm_90")
    assert len(counted_nvrtc) == 6
    cc.compile_source(_dependent_chain(6), "sm_90")
    assert len(counted_nvrtc) == 7
    with pytest.raises(ValueError, match="negative"):
        cc.configure(cc.CompileOptions("kernel", 0.0, cache_mb=-1))


def test_errors_and_compiles_cut_by_the_limit_are_not_cached(cuda_path, counted_nvrtc):
    from services.measurer.metaschedule import cuda_compile as cc

    cc.configure(cc.CompileOptions("kernel", 0.1, cache_mb=64))
    cc.compile_source(_dependent_chain(5), "sm_90")  # NVRTC's start-up (no limit), if it is still to come
    for _ in range(2):
        with pytest.raises(cc.CompileLimitExceeded):
            cc.compile_source(_dependent_chain(1000), "sm_90")
    bad = "#ifdef __CUDACC_RTC__\n#else\n#endif\n" + 'extern "C" __global__ void k(float* a) { a[0] = nope; }\n'
    for _ in range(2):
        with pytest.raises(RuntimeError, match="nope"):
            cc.compile_source(bad, "sm_90")
    assert len(counted_nvrtc) == 5 and len(cc._cache.entries) == 1


def test_build_processes_of_a_host_share_what_they_compiled(counted_nvrtc, monkeypatch, tmp_path):
    """One process compiles; another (its own empty memory cache) finds the binary in the shared folder; a file
    cut short is dropped and compiled again, never loaded."""
    from services.measurer.metaschedule import cuda_compile as cc

    shared = cc.CompileOptions("kernel", 0.0, cache_mb=64, cache_dir=str(tmp_path), cache_disk_mb=64)
    cc.configure(shared)
    first = cc.compile_source(_dependent_chain(5), "sm_90")
    monkeypatch.setattr(cc, "_cache", cc.CompileCache(cc._cache.limit_bytes))  # another process
    cc.configure(shared)
    assert cc.compile_source(_dependent_chain(5), "sm_90") == first and len(counted_nvrtc) == 1
    assert cc._shared.hits == 1
    (kept,) = [p for p in tmp_path.rglob("*") if p.is_file()]
    kept.write_bytes(kept.read_bytes()[:-16])  # a write cut short
    monkeypatch.setattr(cc, "_cache", cc.CompileCache(cc._cache.limit_bytes))  # a third process
    cc.configure(shared)
    assert cc.compile_source(_dependent_chain(5), "sm_90") == first and len(counted_nvrtc) == 2
    assert cc._shared.misses == 1 and kept.read_bytes().endswith(first[0])  # compiled again and kept whole
    with pytest.raises(ValueError, match="negative"):
        cc.configure(shared._replace(cache_disk_mb=-1))


def test_the_shared_folder_keeps_within_its_bound_oldest_out(tmp_path):
    import os

    from services.measurer.metaschedule.cuda_compile import SharedCache

    cache = SharedCache(str(tmp_path), limit_bytes=10_000)
    for i in range(8):  # 8 x ~2 kB: over the bound
        cache.put(f"{i:02d}" + "k" * 62, bytes([i]) * 2000, "kernel")
        path = tmp_path / f"{i:02d}" / (f"{i:02d}" + "k" * 62)
        os.utime(path, (1000 + i, 1000 + i))  # written in this order
    cache.trim()
    left = sorted(p.name[:2] for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["05", "06", "07"]  # the newest, within three quarters of the bound
    assert cache.get("07" + "k" * 62) == (bytes([7]) * 2000, "kernel") and cache.get("00" + "k" * 62) is None
    assert SharedCache(str(tmp_path / "none"), 10).get("x" * 64) is None  # an empty folder: a miss, no error


def test_the_build_cost_kit_builds_as_before_and_restores_the_kernel_path():
    from services.measurer.metaschedule import cuda_compile as cc
    from sharetune.testing.build_cost import built_before

    with built_before():
        assert cc.lowering_config() == {} and cc.minimal_option() == ()
        assert b"-minimal" not in cc.nvrtc_options("sm_90")
    assert cc.lowering_config() == {"tirx.disable_cse_tir": True} and cc.mode() == "kernel"
