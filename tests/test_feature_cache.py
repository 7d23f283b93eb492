"""The tuner's cost model extracts a schedule's features once: a schedule scored again (a parent in a later round,
a measured candidate sent for training) reuses them, and they equal a fresh extraction."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")


def _candidates(splits):
    from tvm import te
    from tvm.s_tir import meta_schedule as ms

    a = te.placeholder((64, 64), name="a")
    b = te.placeholder((64, 64), name="b")
    k = te.reduce_axis((0, 64), name="k")
    c = te.compute((64, 64), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="c")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b, c])})
    out = []
    for factor in splits:
        sch = tvm.s_tir.Schedule(mod)
        i, _, _ = sch.get_loops(sch.get_sblock("c"))
        sch.split(i, [None, factor])
        out.append(ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_entry_func(sch.mod)))
    return mod, out


class CountingExtractor:
    """The real feature extractor, counting the candidates it is asked for."""

    def __init__(self):
        from tvm.s_tir.meta_schedule.feature_extractor import PerStoreFeature

        self.inner, self.asked = PerStoreFeature(extract_workload=True), 0

    def extract_from(self, context, candidates):
        self.asked += len(candidates)
        return self.inner.extract_from(context, candidates)


def test_a_schedule_scored_again_reuses_its_features():
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.cost_model import FeatureCache, _stacked, _vectors
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    load_tensor_intrinsics("llvm")  # as an llvm tuner does: TuneContext would parse every backend's (~70 s)
    mod, cands = _candidates([2, 4, 8, 16])
    context = ms.TuneContext(mod=mod, target=tvm.target.Target("llvm"), task_name="matmul")
    extractor = CountingExtractor()
    cache = FeatureCache(extractor, size=3)
    first = cache(context, cands[:2])
    assert extractor.asked == 2
    again = cache(context, [cands[1], cands[2], cands[0]])  # two known, one new
    assert extractor.asked == 3
    fresh = _stacked(_vectors(extractor.inner, context, [cands[1], cands[2], cands[0]]))
    np.testing.assert_array_equal(again, fresh)
    np.testing.assert_array_equal(again[2], first[0])
    assert not np.array_equal(again[0], again[1])  # different schedules, different features
    cache(context, [cands[3]])  # a fourth: the least recently used (cands[1]) is let go
    assert len(cache.vectors) == 3
    cache(context, [cands[1]])
    assert extractor.asked == 5
