"""CUDA compile that costs what the kernel costs: TVM 0.27's `tvm_callback_cuda_compile`, replaced.

TVM's NVRTC path prepends `<cuda/std/cstdint>` and `<cuda/std/limits>`, and its generated source includes
`<cuda/std/type_traits>` under `__CUDACC_RTC__`: every candidate parses CCCL headers (~0.45 s of its ~0.7 s
median NVRTC time on ResNet-18 convolutions). Kernels TVM generates for tuning use none of them: only the
fixed-width integer names, `asm`/`volatile` spellings and `INFINITY`. This module compiles such sources with
exactly those definitions instead (the same types CCCL gives NVRTC, so the same code), with TVM's own NVRTC
options and ptxas flags, and hands anything else to TVM's path unchanged: a source that uses the `std::`
or `cuda::` names the headers provide, a TMA or NVSHMEM kernel, or one this path fails to compile.
fp16/bf16/mma headers stay (they are cheap without CCCL: ~0.03 s for a whole fp16 kernel, so no
precompiled header is needed).

The kernels are the same: for sampled candidates both paths give byte-identical kernel machine code in
the cubin (`tests/test_cuda_compile.py`); only CCCL's unused constants differ.

`SHARETUNE_CUDA_COMPILE=tvm` keeps TVM's own path (the default is `kernel`): a process's entry point sets its
mode from its settings (LaneSettings.cuda_compile) with `configure`, before its first CUDA build.

A compile on the kernel path also stops at a CPU limit (LaneSettings.cuda_compile_cpu_limit_s; NVRTC's flow
callback cancels it, at points NVRTC chooses: seconds past the limit in a long compile): the build fails with an
error that says so, never a silently different kernel. Kernels that slow to compile are deep unrolls of huge
tiles, no task's best in the panel's stock records (docs/benchmarks.md, "The build tail"). Their sources are
large, so a source over a size limit (LaneSettings.cuda_compile_source_limit_kb) is refused before it is compiled,
whichever path would compile it (a source needing the headers goes to TVM's), with an error that says so: the CPU
limit's seconds are saved too. With SHARETUNE_CUDA_COMPILE=tvm TVM's own callback compiles, and neither limit holds.

Different traces can lower to the same source (~12 % of a job's fully timed builds on the H200, docs/benchmarks.md,
"Duplicate sources"): a process keeps the binaries it compiled, by a hash of the source, its architecture, output
kind, path and NVRTC options, up to LaneSettings.cuda_compile_cache_mb (least recently used first out; 0: none).
A process sees only the candidates it builds (a sixteenth of a job's with 16 builders), so the binaries are also
kept in a folder every build process of the host shares (LaneSettings.cuda_compile_cache_dir, up to
cuda_compile_cache_disk_mb, oldest first out), keyed as above plus NVRTC's version; each file carries its
binary's hash, and one that does not match is dropped, never loaded.
Only successful compiles are kept: an error or a compile cut by the CPU limit is met again."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shlex
import tempfile
import threading
import time
from collections import OrderedDict
from typing import NamedTuple

log = logging.getLogger("sharetune.cuda_compile")

MODES = ("kernel", "tvm")

# The block TVM's CUDA codegen opens every source with: CCCL under NVRTC, the host headers otherwise.
_RTC_BLOCK = re.compile(r"^#ifdef __CUDACC_RTC__$.*?^#else$.*?^#endif$\n?", re.S | re.M)
# What the headers would bring that a kernel may name: then the source goes to TVM's path.
_NEEDS_HEADERS = re.compile(r"\b(std|cuda)::|CUtensorMap|nvshmem")

# Exactly what <cuda/std/cstdint> defines under NVRTC (CUDA 13.0), and TVM's preamble's other definitions.
PREAMBLE = """typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#ifndef __asm__
#define __asm__ asm
#endif
#ifndef __volatile__
#define __volatile__ volatile
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
"""

# TVM 0.27's NVRTC options (tvm/support/nvcc.py, _compile_cuda_nvrtc), less its CCCL include directory.
_DEFINES = [
    "-D__NV_SILENCE_DEPRECATION_BEGIN=", "-D__NV_SILENCE_DEPRECATION_END=",
    "-D__NV_SILENCE_HOST_DEPRECATION_BEGIN=", "-D__NV_SILENCE_HOST_DEPRECATION_END=",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    "--use_fast_math",
]

_stats_lock = threading.Lock()
STATS = {"kernel": 0, "tvm": 0, "fallback_errors": 0}


class CompileOptions(NamedTuple):
    """How a process compiles CUDA (from LaneSettings.cuda_compile, cuda_compile_cpu_limit_s and the
    cuda_compile_cache_* settings): the path, one of MODES, the CPU seconds a kernel-path compile may take (0: no
    limit), the MiB of compiled binaries the process keeps (0: none), and the folder and MiB of the host's shared
    cache ("" or 0: none)."""

    mode: str = "kernel"
    cpu_limit_s: float = 0.0
    cache_mb: float = 64.0
    cache_dir: str = ""
    cache_disk_mb: float = 0.0
    source_limit_kb: float = 0.0


def default_cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"sharetune-cuda-{os.getuid()}")


def options_from(settings) -> CompileOptions:
    """A process's options from its LaneSettings."""
    return CompileOptions(settings.cuda_compile, settings.cuda_compile_cpu_limit_s, settings.cuda_compile_cache_mb,
                          settings.cuda_compile_cache_dir or default_cache_dir(), settings.cuda_compile_cache_disk_mb,
                          settings.cuda_compile_source_limit_kb)


class CompileLimitExceeded(Exception):
    """A compile stopped at the process's CPU limit. Not a RuntimeError: TVM's path must not compile it again."""


class CompileCache:
    """Compiled binaries by key, least recently used dropped once they pass `limit_bytes` (0: keeps nothing)."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes, self.used = limit_bytes, 0
        self.entries: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self.hits = self.misses = 0
        self.lock = threading.Lock()  # TVM may build from several threads of one process

    def get(self, key: str) -> tuple[bytes, str] | None:
        with self.lock:
            found = self.entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self.entries.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: str, binary: bytes, path: str) -> None:
        with self.lock:
            if key in self.entries or len(binary) > self.limit_bytes:
                return
            self.entries[key] = (binary, path)
            self.used += len(binary)
            self._evict()

    def resize(self, limit_bytes: int) -> None:
        with self.lock:
            self.limit_bytes = limit_bytes
            self._evict()

    def _evict(self) -> None:
        while self.entries and self.used > self.limit_bytes:
            _, (old, _) = self.entries.popitem(last=False)
            self.used -= len(old)


class SharedCache:
    """Compiled binaries in a folder that several processes share: one file a key (written whole, then renamed
    into place), holding the binary's SHA-256, its path and the binary. A file whose hash does not match (cut
    short, or written by something else) is removed and counts as a miss. Past `limit_bytes` the oldest files
    go, looked at every CHECK_EVERY writes of this process."""

    CHECK_EVERY = 64

    def __init__(self, folder: str, limit_bytes: int):
        self.folder, self.limit_bytes = folder, limit_bytes
        self.hits = self.misses = self.writes = 0

    def _file(self, key: str) -> str:
        return os.path.join(self.folder, key[:2], key)

    def get(self, key: str) -> tuple[bytes, str] | None:
        try:
            with open(self._file(key), "rb") as f:
                blob = f.read()
        except OSError:
            self.misses += 1
            return None
        digest, path, binary = blob[:64], *blob[65:].partition(b"\n")[::2]
        if blob[64:65] != b"\n" or path not in (b"kernel", b"tvm") or hashlib.sha256(binary).hexdigest().encode() != digest:
            self._remove(self._file(key))
            self.misses += 1
            return None
        self.hits += 1
        return binary, path.decode()

    def put(self, key: str, binary: bytes, path: str) -> None:
        if len(binary) > self.limit_bytes:
            return
        target = self._file(key)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd, part = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".part-")
            with os.fdopen(fd, "wb") as f:
                f.write(hashlib.sha256(binary).hexdigest().encode() + b"\n" + path.encode() + b"\n" + binary)
            os.replace(part, target)
        except OSError as err:  # a full or read-only disk costs the cache, never the build
            log.warning("shared CUDA compile cache: could not keep a binary in %s: %s", self.folder, err)
            return
        self.writes += 1
        if self.writes % self.CHECK_EVERY == 0:
            self.trim()

    def trim(self) -> None:
        """Oldest files out until the folder is within three quarters of its limit, once it is over."""
        files = []
        for root, _, names in os.walk(self.folder):
            for name in names:
                full = os.path.join(root, name)
                try:
                    st = os.stat(full)
                except OSError:
                    continue
                files.append((st.st_mtime, st.st_size, full))
        used = sum(size for _, size, _ in files)
        if used <= self.limit_bytes:
            return
        for _, size, full in sorted(files):
            if used <= 0.75 * self.limit_bytes:
                break
            self._remove(full)
            used -= size

    @staticmethod
    def _remove(full: str) -> None:
        try:
            os.remove(full)
        except OSError:
            pass


_options = CompileOptions()
_cache = CompileCache(int(_options.cache_mb * 2**20))
_shared: SharedCache | None = None
# a process's first NVRTC compile loads NVRTC's built-ins (~4 s of CPU on a 2-core host, then ~0.05 s for a small
# kernel): the CPU limit holds from the second on, so a warm-up build is never cut
_warm = threading.Event()


def configure(options: CompileOptions) -> None:
    """This process's CUDA compile options, from its settings; before its first CUDA build."""
    global _options
    if options.mode not in MODES:
        raise ValueError(f"CUDA compile mode {options.mode!r} is not one of {', '.join(MODES)}")
    if options.cpu_limit_s < 0:
        raise ValueError(f"CUDA compile CPU limit {options.cpu_limit_s} s is negative (0 turns it off)")
    if options.source_limit_kb < 0:
        raise ValueError(f"CUDA source limit {options.source_limit_kb} KB is negative (0 turns it off)")
    if options.cache_mb < 0 or options.cache_disk_mb < 0:
        raise ValueError(f"CUDA compile cache of {min(options.cache_mb, options.cache_disk_mb)} MiB is negative "
                         f"(0 turns it off)")
    global _shared
    _options = options
    _cache.resize(int(options.cache_mb * 2**20))
    _shared = SharedCache(options.cache_dir, int(options.cache_disk_mb * 2**20)) \
        if options.cache_dir and options.cache_disk_mb > 0 else None


def mode() -> str:
    return _options.mode


def options() -> CompileOptions:
    return _options


def kernel_source(code: str) -> str | None:
    """The source with TVM's header block replaced by the preamble, or None when it needs the headers."""
    match = _RTC_BLOCK.search(code)
    if match is None:
        return None
    rest = code[: match.start()] + code[match.end():]
    if _NEEDS_HEADERS.search(rest):
        return None
    return PREAMBLE + "\n".join(line for line in rest.splitlines() if line.strip() != "#include <cuda.h>")


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """The CUDA toolkit's include directories (fp16/bf16/mma headers), as TVM finds them."""
    from tvm.support.nvcc import find_cuda_path

    try:
        cuda = find_cuda_path()
    except (RuntimeError, ValueError):
        return ()
    triple = {"x86_64": "x86_64-linux", "aarch64": "sbsa-linux"}.get(platform.machine(), "")
    dirs = [os.path.join(cuda, "include"), os.path.join(cuda, "targets", triple, "include")]
    return tuple(d for d in dirs if os.path.isdir(d))


def lowering_config() -> dict:
    """The PassContext config a CUDA build lowers under: on the kernel path, TIR's common-subexpression
    elimination off. NVVM eliminates the same subexpressions itself: on 512 sampled candidates of the panel's
    tasks (fp32 and fp16) the kernels' machine code is byte-identical with and without it, and it is a quarter of
    a candidate's lowering, half of a deep unroll's (docs/benchmarks.md, "What a build costs"). The exported
    model is compiled by TVM's own pipeline, to the same kernels."""
    return {"tirx.disable_cse_tir": True} if mode() == "kernel" else {}


@functools.cache
def minimal_option() -> tuple[str, ...]:
    """NVRTC's `-minimal` where this NVRTC knows it: it leaves out the texture, surface and runtime-API
    declarations a generated kernel never uses (~3 % less NVRTC CPU on the panel's sources, the same machine
    code). An NVRTC without it would fail every compile, so it is asked once."""
    try:
        from cuda.bindings import nvrtc

        err, prog = nvrtc.nvrtcCreateProgram(b'extern "C" __global__ void k() {}', b"probe.cu", 0, None, None)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return ()
        try:
            (err,) = nvrtc.nvrtcCompileProgram(prog, 1, [b"-minimal"])
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
        return ("-minimal",) if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else ()
    except Exception:  # noqa: BLE001 - no NVRTC here: nothing compiles on the kernel path anyway
        return ()


def nvrtc_options(arch: str) -> list[bytes]:
    from tvm.support.nvcc import _ptxas_option_flags  # TVM's ptxas flags and their environment variables

    opts = [f"--gpu-architecture={arch}", "-default-device", "--device-int128", *minimal_option(), *_DEFINES]
    opts += [f"-I{d}" for d in include_dirs()]
    opts += [f"--ptxas-options={flag}" for flag in _ptxas_option_flags()]
    opts += shlex.split(os.environ.get("TVM_CUDA_NVRTC_EXTRA_OPTS", ""))
    return [o.encode() for o in opts]


def target_arch(output: str = "cubin") -> str:
    """sm_XX (cubin) or compute_XX (PTX) of the current target, as TVM's callback picks it."""
    from tvm.support.nvcc import get_target_compute_version
    from tvm.target import Target

    digits = "".join(get_target_compute_version(Target.current(allow_none=True)).split("."))
    return f"{'sm' if output == 'cubin' else 'compute'}_{digits}"


def nvrtc_compile(source: str, arch: str, output: str = "cubin", cpu_limit_s: float = 0.0) -> bytes:
    """Compile with NVRTC to a cubin (arch sm_XX) or PTX (compute_XX); RuntimeError with NVRTC's log,
    CompileLimitExceeded past `cpu_limit_s` of this process's CPU (0: no limit)."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"tvm_kernels.cu", 0, None, None)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC could not create the program: {err}")
    try:
        opts = nvrtc_options(arch)
        started = time.process_time()
        with _cpu_limit(nvrtc, prog, started + cpu_limit_s if cpu_limit_s > 0 else None):
            (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err == nvrtc.nvrtcResult.NVRTC_ERROR_CANCELLED:
            raise CompileLimitExceeded(
                f"CUDA compile stopped after {time.process_time() - started:.1f} s of CPU, over its limit of "
                f"{cpu_limit_s:g} s (SHARETUNE_CUDA_COMPILE_CPU_LIMIT_S; 0 turns it off): a kernel this slow to "
                f"compile is a deep unroll of a huge tile, not worth timing")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            text = bytearray(size)
            nvrtc.nvrtcGetProgramLog(prog, text)
            raise RuntimeError(f"NVRTC compilation failed:\n{text.decode(errors='replace')}")
        size_fn, get_fn = ((nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if output == "cubin"
                           else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX))
        _, size = size_fn(prog)
        out = bytearray(size)
        get_fn(prog, out)
        return bytes(out)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


class _cpu_limit:
    """While open, NVRTC's flow callback cancels the program's compile once this process's CPU time passes
    `deadline` (None: no limit). NVRTC asks at points of its own: seconds apart in a long compile."""

    def __init__(self, nvrtc, prog, deadline: float | None):
        self.nvrtc, self.prog, self.deadline, self.callback = nvrtc, prog, deadline, None

    def __enter__(self):
        if self.deadline is None or not hasattr(self.nvrtc, "nvrtcSetFlowCallback"):
            return self
        import ctypes

        deadline = self.deadline

        # once it answers 1 (cancel) it must keep answering 1: the deadline only ever stays passed
        @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
        def past_deadline(_payload, _reserved):
            return int(time.process_time() > deadline)

        self.callback = past_deadline  # kept alive for as long as NVRTC may call it
        (err,) = self.nvrtc.nvrtcSetFlowCallback(self.prog, ctypes.cast(past_deadline, ctypes.c_void_p).value, None)
        if err != self.nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC refused the compile's CPU limit: {err}")
        return self

    def __exit__(self, *_):
        self.callback = None


def tvm_compile(code: str, arch: str, output: str = "cubin") -> bytes:
    """TVM 0.27's own NVRTC path (its preamble, CCCL included)."""
    from tvm.support.nvcc import _compile_cuda_nvrtc

    return bytes(_compile_cuda_nvrtc(code, output, arch))


@functools.cache
def nvrtc_version() -> str:
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}"
    except Exception:  # noqa: BLE001 - no NVRTC here: TVM's path compiles, and its version is in the key anyway
        return "none"


def cache_key(code: str, arch: str, output: str) -> str:
    """What decides the binary: the source, where and what it compiles to, the path, every NVRTC option (TVM's
    ptxas flags and extra options come from the environment) and NVRTC's version (the shared cache outlives a
    process)."""
    parts = [code, arch, output, mode(), nvrtc_version(), *(o.decode() for o in nvrtc_options(arch))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def compile_source(code: str, arch: str | None = None, output: str = "cubin") -> tuple[bytes, str]:
    """One CUDA source to a cubin (or PTX): (binary, path), path "kernel" or "tvm"; a source this process, or
    another build process of the host, compiled before comes from the cache. A source over the size limit is
    refused before anything (CompileLimitExceeded), whichever path would compile it."""
    check_source_size(code)
    arch = arch or target_arch(output)
    if not _cache.limit_bytes and _shared is None:
        return _compile_uncached(code, arch, output)
    key = cache_key(code, arch, output)
    cached = _cache.get(key)
    if cached is None and _shared is not None and (cached := _shared.get(key)) is not None:
        _cache.put(key, *cached)  # kept in memory too (a cache of 0 MiB keeps nothing)
    if cached is not None:
        return cached
    binary, path = _compile_uncached(code, arch, output)  # errors and cut compiles raise: never kept
    _cache.put(key, binary, path)
    if _shared is not None:
        _shared.put(key, binary, path)
    return binary, path


def check_source_size(code: str) -> None:
    """CompileLimitExceeded for a source over the process's size limit (CompileOptions.source_limit_kb)."""
    kb = len(code.encode()) / 1024
    if _options.source_limit_kb and kb > _options.source_limit_kb:
        raise CompileLimitExceeded(
            f"CUDA compile refused: its source is {kb:.0f} KB, over its limit of {_options.source_limit_kb:g} KB "
            f"(SHARETUNE_CUDA_COMPILE_SOURCE_LIMIT_KB; 0 turns it off): a source this large is a deep unroll of a "
            f"large tile, seconds of compile for a kernel that is not worth timing")


def _compile_uncached(code: str, arch: str, output: str) -> tuple[bytes, str]:
    source = kernel_source(code) if mode() == "kernel" else None
    if source is not None:
        try:
            binary = nvrtc_compile(source, arch, output, _options.cpu_limit_s if _warm.is_set() else 0.0)
            _warm.set()
            return binary, "kernel"
        except RuntimeError as err:  # TVM's path decides: it compiles it or gives the real error
            with _stats_lock:
                STATS["fallback_errors"] += 1
            log.warning("kernel-only compile failed, using TVM's path: %s", str(err)[:300])
    return tvm_compile(code, arch, output), "tvm"


def _callback(code):
    binary, path = compile_source(code)
    with _stats_lock:
        STATS[path] += 1
    return bytearray(binary)


_installed: str | None = None


def install() -> str:
    """Make this process's CUDA builds go through `compile_source` (TVM's callback registered first, so
    ours overrides it); once per process. Returns the mode; with `tvm`, TVM's callback stays. TVM's nvcc
    mode (TVM_CUDA_COMPILE_MODE=nvcc) is left as TVM runs it."""
    global _installed
    if _installed is not None:
        return _installed
    import tvm.support.nvcc  # noqa: F401 - registers TVM's callback (and the libdevice lookup)
    import tvm_ffi

    chosen = mode()
    if chosen == "kernel" and os.environ.get("TVM_CUDA_COMPILE_MODE", "nvrtc").lower() == "nvrtc":
        tvm_ffi.register_global_func("tvm_callback_cuda_compile", _callback, override=True)
    _installed = chosen
    return chosen


def elf_sections(blob: bytes) -> dict[str, bytes]:
    """A cubin's sections by name (ELF64, little-endian): `.text.<kernel>` holds a kernel's machine code."""
    import struct

    shoff = struct.unpack_from("<Q", blob, 0x28)[0]
    entsize, count, names_at = struct.unpack_from("<HHH", blob, 0x3A)

    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * entsize)

    strtab = header(names_at)[4]
    out = {}
    for i in range(count):
        name_off, kind, _, _, offset, size = header(i)[:6]
        start = strtab + name_off
        name = blob[start: blob.index(b"\0", start)].decode()
        out[name] = b"" if kind == 8 else blob[offset: offset + size]  # SHT_NOBITS has no bytes
    return out


def kernel_code(cubin: bytes) -> dict[str, bytes]:
    """Each kernel's machine code in a cubin, by kernel name."""
    return {name.removeprefix(".text."): data for name, data in elf_sections(cubin).items()
            if name.startswith(".text.")}


_ENTRY = re.compile(r"^\.visible \.entry (\w+)\(.*?^}", re.S | re.M)


def kernel_ptx(ptx: bytes) -> dict[str, str]:
    """Each kernel's PTX (its `.entry` through its closing brace), by kernel name."""
    return {m.group(1): m.group(0) for m in _ENTRY.finditer(ptx.decode())}
