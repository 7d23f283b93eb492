"""Register only the tensor intrinsics a target can use.

TuneContext imports the package tvm.s_tir.tensor_intrin, whose __init__ parses the intrinsics of every
backend (arm, x86, rocm, hexagon, riscv, cuda): 70 s on a 2-core host, 174 s under load. An llvm/x86
tuner needs only x86 (0.7 s), a CUDA tuner only cuda (~31 s). We put the package in sys.modules with
just those submodules loaded, so TuneContext's import finds it and costs nothing.

Most of what is left is not parsing: TVMScript's prim_func decorator calls inspect.stack(), which looks up every
frame's source line, and for a frame of the import machinery (a file named <frozen ...>) inspect.getmodule scans
all of sys.modules each time, finding nothing. Loading the intrinsics under `cheap_stack` (the same frames, the
same lines) takes the CUDA ones from tens of seconds to a few."""
from __future__ import annotations

import dis
import importlib
import inspect
import itertools
import linecache
import os
import platform
import sys
import types
from contextlib import contextmanager

PACKAGE = "tvm.s_tir.tensor_intrin"


def submodules_for(target_kind: str) -> list[str]:
    if target_kind == "cuda":
        return ["cuda"]
    return ["arm_cpu"] if platform.machine().lower() in ("aarch64", "arm64") else ["x86"]


def load_tensor_intrinsics(target_kind: str) -> list[str]:
    """Load the intrinsics for `target_kind`; returns the submodules loaded now. Idempotent."""
    import tvm.s_tir

    pkg = sys.modules.get(PACKAGE)
    if pkg is None:
        pkg = types.ModuleType(PACKAGE)
        pkg.__path__ = [os.path.join(os.path.dirname(tvm.s_tir.__file__), "tensor_intrin")]
        pkg.__package__ = PACKAGE
        sys.modules[PACKAGE] = pkg
    loaded = []
    with cheap_stack():
        for name in submodules_for(target_kind):
            if f"{PACKAGE}.{name}" not in sys.modules:
                importlib.import_module(f"{PACKAGE}.{name}")
                loaded.append(name)
    return loaded


@contextmanager
def cheap_stack():
    """inspect.stack is `stack` while the block runs."""
    original = inspect.stack
    inspect.stack = stack
    try:
        yield
    finally:
        inspect.stack = original


def stack(context: int = 1) -> list[inspect.FrameInfo]:
    """inspect.stack(context), the same frame infos, without the source lookup of a frame whose file has no
    source (named <...> and not in linecache): inspect would scan sys.modules for it and then find no lines."""
    out, frame = [], sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<") and name.endswith(">") and not linecache.getlines(name):
            positions = _positions(frame)
            out.append(inspect.FrameInfo(frame, name, positions.lineno, frame.f_code.co_name, None, None,
                                         positions=positions))
        else:
            tb = inspect.getframeinfo(frame, context)
            out.append(inspect.FrameInfo(frame, *tb, positions=tb.positions))
        frame = frame.f_back
    return out


def _positions(frame) -> dis.Positions:
    """Where in its source the frame is executing, as inspect.getframeinfo reports it."""
    at = (None, None, None, None)
    if frame.f_lasti >= 0:
        at = next(itertools.islice(frame.f_code.co_positions(), frame.f_lasti // 2, None), at)
    return dis.Positions(at[0] if at[0] is not None else frame.f_lineno, *at[1:])
