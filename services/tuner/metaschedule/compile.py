"""Compile the job's model with its tuned records (stock TVM applies the exported JSON database; the model in the
form the records were tuned on, graph_forms.for_database) and without them, and export both as shared
libraries."""
from __future__ import annotations

import tvm
from tvm.s_tir import meta_schedule as ms


def compile_tuned(mod: tvm.IRModule, target: tvm.target.Target, database_dir: str, out_path: str) -> str:
    from services.tuner.metaschedule.graph_forms import for_database

    db = ms.database.JSONDatabase(work_dir=database_dir, module_equality="structural")
    ex = ms.relax_integration.compile_relax(db, for_database(mod, target, db), target, params=None)
    ex.export_library(out_path)
    return out_path


def compile_untuned(mod: tvm.IRModule, target: tvm.target.Target, out_path: str) -> str:
    ex = tvm.compile(mod, target=target)
    ex.export_library(out_path)
    return out_path
