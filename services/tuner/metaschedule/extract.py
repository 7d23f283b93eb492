"""From a Relax model to tuning tasks. Legalize and fuse first (as tune_relax's pipeline does): the raw
frontend module yields no tasks."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from shared.errors import ModelError


@dataclass
class Task:
    name: str
    weight: int
    mod: tvm.IRModule  # the dispatched PrimFunc module MetaSchedule tunes
    flops: float


def fuse(mod: tvm.IRModule) -> tvm.IRModule:
    seq = tvm.transform.Sequential(
        [
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
        ]
    )
    with tvm.transform.PassContext(opt_level=3):
        return seq(mod)


def tuning_tasks(mod: tvm.IRModule, target: tvm.target.Target) -> list:
    """MetaSchedule's tasks of a Relax model (ExtractedTask), fused first, less the kernels a build never launches:
    a fused function that only reshapes (an expand_dims of the input, a ViT's flattening reshape) becomes a view of
    its input in every target's build (RewriteDataflowReshape, in relax's build pipeline after fusion), so tuning
    it would spend trials, and count its time in the estimate, for a kernel the served model does not run."""
    return ms.relax_integration.extract_tasks(relax.transform.RewriteDataflowReshape()(fuse(mod)), target)


def extract(mod: tvm.IRModule, target: tvm.target.Target, pad_convolutions: bool = False,
            fold_norms: bool = False) -> list[Task]:
    """The model's tasks; `pad_convolutions`: its convolutions with awkward output extents computed over padded
    ones (conv_padding); `fold_norms`: its transposed layer norms over the channel axis (norm_folding). A compile
    finds the form again from the records (graph_forms.for_database)."""
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise ModelError("the model has no 'main' function")
    try:
        from services.tuner.metaschedule.graph_forms import rewritten

        extracted = tuning_tasks(rewritten(mod, pad_convolutions, fold_norms), target)
    except Exception as err:  # noqa: BLE001 - name the problem for the user
        raise ModelError(f"cannot lower the model for {target.kind.name}: {type(err).__name__}: {err}") from None
    tasks = []
    for t in extracted:
        sub = t.dispatched[0]
        tasks.append(Task(name=t.task_name, weight=int(t.weight), mod=sub, flops=_flops(sub)))
    if not tasks:
        raise ModelError("the model has no tunable operator (extract_tasks found no task)")
    return tasks


def _flops(mod) -> float:
    try:
        return float(tvm.s_tir.analysis.estimate_tir_flops(mod))
    except Exception:  # noqa: BLE001 - only used to order and report
        return 0.0


def workload_key(mod: tvm.IRModule, target: tvm.target.Target, share: int, scope: str | None = None) -> str:
    """Tasks with equal structure at the same target and share are the same workload, across jobs; `scope` (an
    isolated job's id) makes them a workload of that job alone."""
    shash = tvm_ffi_structural_hash(mod)
    canon = json.dumps(json.loads(str(target)), sort_keys=True)
    return hashlib.sha1(f"{canon}|{share}|{shash}{f'|{scope}' if scope else ''}".encode()).hexdigest()[:20]


def tvm_ffi_structural_hash(mod) -> int:
    try:
        from tvm_ffi import structural_hash
    except ImportError:  # older layouts
        from tvm.ir import structural_hash
    return int(structural_hash(mod))
