"""The forms of a model this service may tune: as given, its layer norms' transposes folded (norm_folding) and
its awkward convolutions padded (conv_padding), each rewrite chosen by a tuner setting. A rewritten model is
another model to a database, so a compile looks for the form the records were tuned on."""
from __future__ import annotations

import itertools

import tvm
import tvm_ffi
from tvm import relax


def rewritten(mod: tvm.IRModule, pad_convolutions: bool = False, fold_norms: bool = False) -> tvm.IRModule:
    """The model with the rewrites asked for (norms folded first: a padded convolution's slice then still feeds
    the folded layer norm directly)."""
    if fold_norms:
        from services.tuner.metaschedule.norm_folding import fold_norm_transposes

        mod = fold_norm_transposes(mod)[0]
    if pad_convolutions:
        from services.tuner.metaschedule.conv_padding import pad_convolutions as padded

        mod = padded(mod)[0]
    return mod


def rewrite_functions(mod: tvm.IRModule, mutator) -> tvm.IRModule:
    """Every Relax function of `mod` visited by `mutator` (a PyExprMutator made on `mod`), the result normalised
    and the bindings the rewrite left unused dropped."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return relax.transform.DeadCodeElimination()(relax.transform.Normalize()(mutator.builder_.get()))


def for_database(mod: tvm.IRModule, target: tvm.target.Target, database) -> tvm.IRModule:
    """The form of `mod` that `database` was tuned on: of the model as given and each rewritten form that differs
    from it, the one whose tasks the database holds most workloads of (the model as given on a tie)."""
    from services.tuner.metaschedule.extract import tuning_tasks

    forms = [mod]
    for fold, pad in itertools.product((False, True), repeat=2):
        form = rewritten(mod, pad_convolutions=pad, fold_norms=fold)
        if not any(tvm_ffi.structural_equal(form, f) for f in forms):
            forms.append(form)
    if len(forms) == 1:
        return mod
    held = [sum(database.has_workload(t.dispatched[0]) for t in tuning_tasks(f, target)) for f in forms]
    return forms[held.index(max(held))]
