"""Loading a target's tensor intrinsics (services/tuner/metaschedule/intrinsics.py): only that target's, and under
a cheaper inspect.stack that reports the same frames as Python's."""
from __future__ import annotations

import inspect
import sys

from services.tuner.metaschedule.intrinsics import cheap_stack, stack


def _both():
    return inspect.stack(), stack()


def _fields(info):
    return (info.frame, info.filename, info.lineno, info.function, info.code_context, info.index, info.positions)


def test_the_cheap_stack_reports_what_inspect_stack_does_with_and_without_source():
    scope: dict = {"both": _both}
    exec("def from_a_string():\n    return both()\n", scope)  # a frame whose file (<string>) has no source
    theirs, ours = scope["from_a_string"]()
    assert len(theirs) == len(ours) > 3
    assert any(f.filename == "<string>" and f.code_context is None for f in ours)
    assert any(f.filename == __file__ and f.code_context for f in ours)
    # the innermost frame is the same, only the call's column differs (two calls on one line)
    assert _fields(theirs[0])[:6] == _fields(ours[0])[:6]
    assert [_fields(f) for f in theirs[1:]] == [_fields(f) for f in ours[1:]]


def test_cheap_stack_is_undone_after_its_block_even_on_error():
    original = inspect.stack
    try:
        with cheap_stack():
            assert inspect.stack is stack
            raise KeyError("inside")
    except KeyError:
        pass
    assert inspect.stack is original


def test_the_cuda_intrinsics_load_once_and_are_registered():
    import pytest

    pytest.importorskip("tvm")
    from tvm.s_tir import TensorIntrin

    from services.tuner.metaschedule.intrinsics import PACKAGE, load_tensor_intrinsics

    load_tensor_intrinsics("cuda")
    assert f"{PACKAGE}.cuda" in sys.modules
    assert TensorIntrin.get("wmma_load_16x16x16_f16_a_shared") is not None
    assert load_tensor_intrinsics("cuda") == []  # once a process
